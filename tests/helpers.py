"""Shared test helpers: tiny random Hugging Face models and a character tokenizer, so the engine
is tested without downloading anything."""

from __future__ import annotations

import pytest
import torch

from jakiro.decoding.proposers import Proposer
from jakiro.models import smallgemm

needs_int8_activations = pytest.mark.skipif(not (smallgemm.int8_enabled() or smallgemm.tiles_enabled()),
                                            reason="int8 activations need AVX-512 VNNI or AMX tiles")


def write_conversations(path, conversations: list[list[tuple[str, str]]]) -> None:
    """A ShareGPT-style JSONL source: one line per conversation of (from, value) turns."""
    import json
    with open(path, "w") as f:
        for turns in conversations:
            f.write(json.dumps({"conversations": [{"from": who, "value": text} for who, text in turns]}) + "\n")


def spec_bench_prompts(n: int) -> list[str]:
    """n first-turn questions spread round-robin over the categories of the Spec-Bench file
    (../shared/data/spec_bench/question.jsonl, or MT-bench from its package when absent)."""
    from jakiro.data.questions import development_questions
    by_cat: dict[str, list[str]] = {}
    for q in development_questions():
        by_cat.setdefault(q["category"], []).append(q["turns"][0])
    out: list[str] = []
    for i in range(max(len(v) for v in by_cat.values())):
        for cat in sorted(by_cat):
            if i < len(by_cat[cat]) and len(out) < n:
                out.append(by_cat[cat][i])
    return out


def tiny_hf_config(model_type: str = "llama", vocab_size: int = 256, **overrides):
    from transformers import AutoConfig
    kwargs = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, tie_word_embeddings=model_type in ("llama", "qwen3"),
                  bos_token_id=0, eos_token_id=1, pad_token_id=0)
    if model_type == "qwen3":
        kwargs["head_dim"] = 32
    kwargs.update(overrides)
    return AutoConfig.for_model(model_type, **kwargs)


def make_tiny_target(folder: str, model_type: str = "llama", seed: int = 0, std: float = 0.2,
                     **overrides) -> str:
    """Save a random model to ``folder``. A large init std makes its distributions peaky, which
    is closer to a trained model than near-uniform logits."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    config = tiny_hf_config(model_type, **overrides)
    config.initializer_range = std
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random norm weights and biases too, so their handling is tested
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    return folder


class CharTokenizer:
    """Bytes mapped onto a small vocabulary: id 0 = BOS, id 1 = EOS, 2.. = bytes modulo."""

    chat_template = None

    def __init__(self, vocab_size: int = 256):
        self.vocab_size = vocab_size
        self.eos_token_id = 1

    def __call__(self, text: str, add_special_tokens: bool = True):
        ids = [2 + b % (self.vocab_size - 2) for b in text.encode("utf-8")]

        class _Enc:
            input_ids = ([0] if add_special_tokens else []) + ids
        return _Enc()

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(32 + (i - 2) % 95) for i in ids if i > 1 or not skip_special_tokens)


class TargetTreeProposer(Proposer):
    """A deterministic 'oracle' draft for tests: the target's own top-``width`` tokens at every
    node, ``depth`` levels deep, optionally corrupted at some nodes so that verification also
    rejects. Any deterministic proposal must leave the output distribution unchanged."""

    name = "oracle"
    needs_features = False

    def __init__(self, target, depth: int = 2, width: int = 2, corrupt_every: int = 0):
        self.target, self.depth, self.width, self.corrupt_every = target, depth, width, corrupt_every
        self.max_tree_tokens = sum(width ** d for d in range(depth + 1))

    def start(self, max_len):
        pass

    def observe(self, features, next_tokens):
        pass

    def propose(self, context):
        from jakiro.decoding.tree import build_tree
        target = self.target
        cache = target.new_cache(len(context) + self.max_tree_tokens)
        target(torch.tensor(context[:-1]), cache)
        cache.commit(len(context) - 1)
        tokens, parents, frontier = [context[-1]], [-1], [0]
        with torch.inference_mode():
            for _ in range(self.depth):
                tree = build_tree(torch.tensor(tokens), torch.tensor(parents))
                logits, _ = target(tree.tokens, cache, cache.length + tree.depths, tree.tree_mask)
                new = []
                for node in frontier:
                    for rank, tok in enumerate(torch.topk(logits[node], self.width).indices.tolist()):
                        if self.corrupt_every and (len(context) + len(tokens)) % self.corrupt_every == 0:
                            tok = (tok + 1) % logits.shape[-1]
                            if tok in [tokens[i] for i in range(len(tokens)) if parents[i] == node]:
                                continue
                        tokens.append(tok)
                        parents.append(node)
                        new.append(len(tokens) - 1)
                frontier = new
        return build_tree(torch.tensor(tokens), torch.tensor(parents))

    def stats(self):
        return {}
