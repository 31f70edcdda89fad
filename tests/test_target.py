"""Our target forward against Hugging Face transformers, tree attention and KV compaction."""

import json
import os

import pytest
import torch

from helpers import make_tiny_target
from jakiro.decoding.tree import build_tree
from jakiro.errors import JakiroError
from jakiro.models import smallgemm
from jakiro.models.kv_cache import KVCache
from jakiro.models.target import TargetModel


def hf_logits(folder, ids):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids[None]).logits[0]


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_logits_match_hf_tiny(tmp_path, model_type):
    folder = make_tiny_target(str(tmp_path), model_type)
    ids = torch.randint(0, 256, (37,), generator=torch.Generator().manual_seed(1))
    ref = hf_logits(folder, ids)
    model = TargetModel.from_folder(folder)
    cache = model.new_cache(64)
    a, _ = model(ids[:20], cache)  # prefill, then the rest on top of the cache
    cache.commit(20)
    b, _ = model(ids[20:], cache)
    torch.testing.assert_close(torch.cat((a, b)), ref, atol=1e-4, rtol=1e-4)


def test_logits_match_hf_llama3_rope(tmp_path):
    folder = make_tiny_target(str(tmp_path), "llama", rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    ids = torch.randint(0, 256, (90,), generator=torch.Generator().manual_seed(2))
    model = TargetModel.from_folder(folder)
    logits, _ = model(ids, model.new_cache(90))
    torch.testing.assert_close(logits, hf_logits(folder, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_logits_and_features_match_hf_smollm2(smol):
    from jakiro.models.gguf_file import hugging_face_model
    hf = hugging_face_model(smol.target_path)
    ids = torch.tensor(smol.engine().encode("Tell me about the history of Rome."))
    with torch.no_grad():
        out = hf(ids[None], output_hidden_states=True)
    model = smol.target
    cache = model.new_cache(len(ids))
    logits, feats = model(ids, cache)
    # the prompt runs the GGUF blocks with three-byte inputs (float32 accuracy, another rounding
    # than float32 products): logits of about 25 within 5e-4, as the tile kernel's own test allows
    torch.testing.assert_close(logits, out.logits[0], atol=5e-4, rtol=1e-5)
    torch.testing.assert_close(feats, out.hidden_states[-1][0], atol=2e-4, rtol=1e-4)


def prefilled(model, prefix, **kw):
    cache = model.new_cache(64, **kw)
    model(prefix, cache)
    cache.commit(len(prefix))
    return cache


def test_tree_branches_match_decoding_each_branch_alone(tiny_llama_dir):
    """Each root-to-leaf path of a tree forward against the path forwarded alone, and, with the
    one-call decoder stack, against decoding the path one token at a time: bitwise the same
    logits (rows never share arithmetic, a row's attention visits its keys in order), which is
    what greedy equivalence rests on."""
    model = TargetModel.from_folder(tiny_llama_dir)
    prefix = torch.arange(2, 30)
    # root 7 with two branches: 7 -> 9 -> 11 and 7 -> 12 -> 13 -> 14, plus 7 -> 9 -> 15
    tree = build_tree(torch.tensor([7, 9, 12, 11, 13, 15, 14]), torch.tensor([-1, 0, 0, 1, 2, 1, 4]))
    cache = prefilled(model, prefix, scratch=8)
    logits, feats = model(tree.tokens, cache, cache.length + tree.depths, tree.tree_mask)
    for path in tree.retrieve_paths:
        path = path[path >= 0]
        ref_logits, ref_feats = model(tree.tokens[path], prefilled(model, prefix))
        torch.testing.assert_close(logits[path], ref_logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(feats[path], ref_feats, atol=1e-5, rtol=1e-5)
        if model._fused is not None:
            alone = prefilled(model, prefix)
            for index in path.tolist():
                step, _ = model(tree.tokens[index:index + 1], alone)
                alone.commit(1)
                assert torch.equal(step[0], logits[index])


needs_kernel = pytest.mark.skipif(not smallgemm.available(), reason="small-batch kernel unavailable here")


@needs_kernel
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_fused_decoder_stack_matches_torch_operations(tmp_path, model_type):
    """The one-call decoder stack (trees and decoding steps) against the same model in torch
    operations: logits, features and the KV entries it writes."""
    model = TargetModel.from_folder(make_tiny_target(str(tmp_path), model_type))
    assert model._fused is not None
    tree = build_tree(torch.tensor([7, 9, 12, 11, 13, 15, 14]), torch.tensor([-1, 0, 0, 1, 2, 1, 4]))
    outputs = []
    for fused in (model._fused, None):
        model._fused = fused
        cache = model.new_cache(64, scratch=8)
        model(torch.arange(2, 30), cache)
        cache.commit(28)
        logits, feats = model(tree.tokens, cache, cache.length + tree.depths, tree.tree_mask)
        step, _ = model(torch.tensor([3]), cache)
        outputs.append((logits, feats, step, cache.data[:, :, :, :, :36].clone()))
    for got, expected in zip(*outputs):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(3, 1, 64), (6, 2, 64), (4, 1, 64), (2, 1, 128)])
def test_tree_rows_match_decoding_alone_with_real_head_layouts(tmp_path, heads, kv_heads, head_dim):
    """The head layouts of real models, which take the attention kernels that score several keys
    and heads at once (SmolLM2: nine heads of 64 over three KV heads): every tree row's logits
    bitwise those of decoding its path one token at a time, for trees of 2 to 11 tokens, and the
    same as the torch operations."""
    model = TargetModel.from_folder(make_tiny_target(
        str(tmp_path), hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, tie_word_embeddings=True))
    assert model._fused is not None
    prefix = torch.arange(2, 40)
    tokens = torch.tensor([7, 9, 12, 11, 13, 15, 14, 20, 21, 22, 23])
    parents = torch.tensor([-1, 0, 0, 1, 2, 1, 4, 6, 7, 3, 9])
    for n in (2, 3, 5, 11):
        sub = build_tree(tokens[:n], parents[:n])
        cache = prefilled(model, prefix, scratch=16)
        logits, _ = model(sub.tokens, cache, cache.length + sub.depths, sub.tree_mask)
        for path in sub.retrieve_paths:
            path = path[path >= 0]
            alone = prefilled(model, prefix)
            for index in path.tolist():
                step, _ = model(sub.tokens[index:index + 1], alone)
                alone.commit(1)
                assert torch.equal(step[0], logits[index]), (n, index)
        fused, model._fused = model._fused, None
        cache = prefilled(model, prefix, scratch=16)
        reference, _ = model(sub.tokens, cache, cache.length + sub.depths, sub.tree_mask)
        model._fused = fused
        torch.testing.assert_close(logits, reference, atol=1e-4, rtol=1e-4)


def test_keep_compacts_accepted_path_and_next_forward_matches(tiny_llama_dir):
    model = TargetModel.from_folder(tiny_llama_dir)
    prefix = torch.arange(2, 20)
    tree = build_tree(torch.tensor([7, 9, 12, 11, 13]), torch.tensor([-1, 0, 0, 2, 2]))
    cache = model.new_cache(64)
    model(prefix, cache)
    cache.commit(len(prefix))
    model(tree.tokens, cache, cache.length + tree.depths, tree.tree_mask)
    cache.keep(torch.tensor([0, 2, 4]))  # accept 7 -> 12 -> 13
    assert cache.length == len(prefix) + 3
    after, _ = model(torch.tensor([5]), cache)
    ref_cache = model.new_cache(64)
    ref, _ = model(torch.cat((prefix, torch.tensor([7, 12, 13, 5]))), ref_cache)
    torch.testing.assert_close(after[0], ref[-1], atol=1e-5, rtol=1e-5)


def test_kv_cache_keep_moves_exactly_the_chosen_entries():
    cache = KVCache(num_layers=2, num_kv_heads=1, head_dim=1, max_len=16)
    for layer in range(2):
        cache.write(layer, torch.arange(4.).view(1, 1, 4, 1), torch.arange(4.).view(1, 1, 4, 1) + 10)
    cache.commit(4)
    for layer in range(2):
        new = torch.arange(100., 106.).view(1, 1, 6, 1)
        cache.write(layer, new, new + 100)
    cache.keep(torch.tensor([0, 3, 5]))
    assert cache.length == 7
    for layer in range(2):
        k = cache.data[layer, 0, 0, 0, :7, 0].tolist()
        v = cache.data[layer, 1, 0, 0, :7, 0].tolist()
        assert k == [0, 1, 2, 3, 100, 103, 105]
        assert v == [10, 11, 12, 13, 200, 203, 205]


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 8}))
    with pytest.raises(JakiroError, match="unsupported architecture 'gpt2'"):
        TargetModel.from_folder(str(tmp_path))


def test_missing_weight_is_a_clear_error(tmp_path, tiny_llama_dir):
    from safetensors.torch import load_file, save_file
    state = load_file(os.path.join(tiny_llama_dir, "model.safetensors"))
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(open(os.path.join(tiny_llama_dir, "config.json")).read())
    with pytest.raises(JakiroError, match="missing weight 'model.layers.1.mlp.down_proj.weight'"):
        TargetModel.from_folder(str(tmp_path))


def test_weight_bytes_counts_each_streamed_weight_once(tmp_path):
    from transformers import AutoModelForCausalLM

    from jakiro.bench.cost_curve import weight_bytes
    for model_type in ("llama", "qwen2"):  # tied head; untied head with q/k/v biases
        folder = make_tiny_target(str(tmp_path / model_type), model_type)
        hf = AutoModelForCausalLM.from_pretrained(folder)
        params = sum(p.numel() for p in hf.parameters())  # tied weights are one parameter
        if model_type == "qwen2":
            params -= hf.model.embed_tokens.weight.numel()  # only gathered from, never streamed
        assert weight_bytes(TargetModel.from_folder(folder)) == params * 4


def test_kv_bytes_is_what_one_forward_reads_from_the_cache(tiny_llama_dir):
    from jakiro.bench.cost_curve import kv_bytes
    model = TargetModel.from_folder(tiny_llama_dir)
    cache = model.new_cache(100)
    per_position = cache.data[:, :, :, :, :1].numel() * cache.data.element_size()  # keys and values, every layer
    assert kv_bytes(model, 100) == 100 * per_position
