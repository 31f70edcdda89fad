"""The EAGLE-3 layout: trained like the other drafts, lossless in decoding, exported to the folder
vLLM, SGLang and SpecForge load and to llama.cpp's GGUF, and loaded back from a checkpoint in
the public layout; a reference forward written from the public loaders' layout
(``eagle3_reference``) checks both directions."""

import json
import os

import numpy as np
import pytest
import torch

from eagle3_reference import ReferenceEagle3, write_reference_checkpoint
from helpers import CharTokenizer, make_tiny_target, spec_bench_prompts
from jakiro.decoding.engine import Engine
from jakiro.decoding.proposers import TreeBudget
from jakiro.decoding.draft_proposer import DraftProposer
from jakiro.draft import DraftConfig, DraftModel, load_draft, save_draft
from jakiro.draft.checkpoint import draft_method
from jakiro.draft.eagle3_format import export, export_eagle3
from jakiro.errors import JakiroError
from jakiro.models.target import TargetModel
from jakiro.train.losses import carried_feature, unroll
from jakiro.train.trainer import Trainer
from test_train import config, make_feature_dataset, weights

LAYERS = (2, 4, 5)  # the default streams 2, L/2, L-3 of an eight-layer target


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """An eight-layer tiny target (no EOS), its plain greedy continuations of a few prompts, and a
    dataset holding the three default streams."""
    root = tmp_path_factory.mktemp("eagle3")
    folder = make_tiny_target(str(root / "target"), "llama", num_hidden_layers=8, eos_token_id=None)
    target = TargetModel.from_folder(folder)
    tok = CharTokenizer()
    tok.eos_token_id = None
    prompts = [tok(p).input_ids[:120] for p in spec_bench_prompts(4)]
    reference = [Engine(target, tok).generate(p, 64).token_ids for p in prompts]
    data = make_feature_dataset(str(root / "data"), folder, aux_layers=LAYERS)
    return root, folder, target, tok, prompts, reference, data


def _draft(root, target, name, vocab=64, seed=3):
    cfg = DraftConfig.for_target(target.config, target.hf_config, "eagle3", draft_vocab_size=vocab)
    assert cfg.aux_layers == list(LAYERS)
    torch.manual_seed(seed)
    model = DraftModel(cfg)
    model.reset_parameters(std=0.2)
    with torch.no_grad():
        for name_ in ("input_norm", "hidden_norm", "post_norm", "norm"):
            getattr(model, name_).add_(0.1 * torch.randn(cfg.hidden_size))
    if vocab:
        model.set_draft_vocab(torch.randperm(target.config.vocab_size)[:vocab])
    save_draft(model, str(root / name))
    return load_draft(str(root / name), target)


def _features(target, ids):
    with torch.inference_mode():
        _, f = target(ids, target.new_cache(len(ids) + 1), aux_layers=LAYERS)
    return f.clone()


def _ours(draft, feats, ids, n, chain):
    """Our draft on a prompt of n committed rows then ``chain`` steps on its own features:
    logits over its vocabulary per row."""
    out_logits = []
    with torch.no_grad():
        cache = draft.new_cache(64)
        g = draft.input_features(feats[:n])
        out = draft(g[None], ids[None, 1:n + 1], torch.arange(n), cache)
        cache.commit(n)
        out_logits.append(draft.head_logits(out.blend[0]))
        for s in range(chain):
            carried = carried_feature(draft, out)[0, -1]
            out = draft(carried.view(1, 1, -1), ids[None, n + 1 + s:n + 2 + s], torch.tensor([n + s]), cache)
            cache.commit(1)
            out_logits.append(draft.head_logits(out.blend[0]))
    return torch.cat(out_logits)


def _reference(ref, target, feats, ids, n, chain):
    d = target.config.hidden_size
    emb = target.embed
    logits, prenorm = ref.step(emb[ids[1:n + 1]], feats[:n, d:], list(range(n)))
    rows = [logits]
    for s in range(chain):
        logits, prenorm = ref.step(emb[ids[n + 1 + s:n + 2 + s]], prenorm[-1:], [n + s])
        rows.append(logits)
    return torch.cat(rows)


def test_exported_folder_gives_our_logits_in_a_reference_forward(deep, tmp_path):
    root, _, target, *_ = deep
    draft = _draft(root, target, "e3-export")
    ids = torch.randint(2, 256, (24,), generator=torch.Generator().manual_seed(5))
    feats = _features(target, ids)
    files = export_eagle3(draft, str(tmp_path / "hf"))
    assert sorted(os.path.basename(f) for f in files) == ["config.json", "model.safetensors"]
    cfg = json.load(open(tmp_path / "hf" / "config.json"))
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 64
    assert cfg["eagle_aux_hidden_state_layer_ids"] == list(LAYERS) and cfg["target_hidden_size"] == 64
    ref = ReferenceEagle3(str(tmp_path / "hf"))
    ours = _ours(draft, feats, ids, 16, 3)
    theirs = _reference(ref, target, feats, ids, 16, 3)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    best = ours.argmax(-1)
    assert torch.equal(ref.target_ids(best), draft.to_target_ids(best))
    from safetensors.torch import load_file
    state = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert state["t2d"].dtype == torch.bool and int(state["t2d"].sum()) == 64
    assert torch.equal(torch.nonzero(state["t2d"])[:, 0], draft.d2t.sort().values)


@pytest.mark.parametrize("prefix, layers", [("midlayer.", None), ("model.layers.0.", [2, 4, 5])])
def test_a_checkpoint_in_the_public_layout_loads_as_a_draft(deep, tmp_path, prefix, layers):
    """A checkpoint saved the way EAGLE-3 trainers save theirs (bfloat16, d2t offsets, with or
    without the layer ids) drafts as the reference forward computes, and losslessly."""
    root, folder, target, tok, prompts, reference, _ = deep
    ck = write_reference_checkpoint(str(tmp_path / "ck"), 64, 256, 48, 4, 2, 96, layers, prefix=prefix)
    assert draft_method(ck) == "eagle3"
    draft = load_draft(ck, target)
    assert draft.config.aux_layers == list(LAYERS) and draft.config.draft_vocab_size == 48
    ids = torch.randint(2, 256, (24,), generator=torch.Generator().manual_seed(6))
    feats = _features(target, ids)
    torch.testing.assert_close(_ours(draft, feats, ids, 12, 2),
                               _reference(ReferenceEagle3(ck), target, feats, ids, 12, 2), rtol=1e-5, atol=1e-5)
    engine = Engine(target, tok, DraftProposer(draft, TreeBudget(4, 3, 10)))
    for p, ref in zip(prompts[:2], reference):
        assert engine.generate(p, 64).token_ids == ref


def test_a_checkpoint_written_by_speculators_gives_its_logits():
    """A draft written by another implementation (speculators 0.9.0, Red Hat's EAGLE-3 trainer:
    ``Eagle3Speculator``, ``layers.0.`` names, its config nested, the target's embedding saved with
    it; tests/data/eagle3-speculators/make.py) loads and gives the logits that implementation's
    own forward gave for the same target streams and tokens."""
    from safetensors.torch import load_file
    folder = os.path.join(os.path.dirname(__file__), "data", "eagle3-speculators")
    assert draft_method(folder) == "eagle3"
    draft = load_draft(folder)
    assert draft.config.aux_layers == [2, 4, 5] and draft.config.draft_vocab_size == 48
    ref = load_file(os.path.join(folder, "reference_logits.safetensors"))
    embed = load_file(os.path.join(folder, "model.safetensors"))["embed_tokens.weight"]
    draft.attach_target(embed, torch.zeros(256, 64))
    T = ref["input_ids"].shape[0]
    features = torch.cat((torch.zeros(T, 64), ref["hidden_states"]), -1)  # [final feature (unread), streams]
    with torch.no_grad():
        cache = draft.new_cache(T)
        out = draft(draft.input_features(features)[None], ref["input_ids"][None], torch.arange(T), cache)
        logits = draft.head_logits(out.blend[0])
    torch.testing.assert_close(logits, ref["logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("budget", [TreeBudget(1, 1, 1), TreeBudget(5, 1, 5), TreeBudget(4, 4, 16)])
def test_eagle3_decoding_equals_plain_greedy(deep, budget):
    root, _, target, tok, prompts, reference, _ = deep
    draft = _draft(root, target, "e3-greedy")
    engine = Engine(target, tok, DraftProposer(draft, budget))
    for p, ref in zip(prompts, reference):
        res = engine.generate(p, 64)
        assert res.token_ids == ref


def test_unrolled_training_steps_equal_drafting(deep):
    root, _, target, *_ = deep
    draft = _draft(root, target, "e3-unroll").eval()
    ids = torch.randint(2, 256, (1, 14), generator=torch.Generator().manual_seed(2))
    feats = _features(target, ids[0])[None]
    mask = torch.ones(1, 14, dtype=torch.bool)
    with torch.no_grad():
        steps = {r.step: r for r in unroll(draft, ids, draft.input_features(feats), mask, 3)}
        for root_ in (0, 6):
            ours = _ours(draft, feats[0], ids[0], root_ + 1, 2)
            for s in (1, 2, 3):
                rows = steps[s]
                at = int(torch.nonzero((rows.b == 0) & (rows.j == root_))[0])
                torch.testing.assert_close(draft.head_logits(rows.out.blend[at]), ours[root_ + s - 1],
                                           rtol=1e-4, atol=1e-4)


def test_training_lowers_the_loss_and_saves_a_loadable_draft(deep, tmp_path):
    root, folder, target, *_, data = deep
    trainer = Trainer(config(tmp_path / "t", data, method="eagle3", unroll=2, steps=8), folder, progress=False)
    assert torch.equal(trainer.model.lm_head, trainer.model.head_weight)  # its head starts as the target's rows
    before = weights(trainer)
    batch = trainer.batch_indices(0)
    first = trainer.train_step(batch)["loss"]
    for _ in range(5):
        last = trainer.train_step(batch)["loss"]
    assert last < first
    assert not torch.equal(before["fc.weight"], weights(trainer)["fc.weight"])
    trainer.run()
    draft = load_draft(str(tmp_path / "t"), target)
    assert draft.config.method == "eagle3" and draft.config.aux_layers == list(LAYERS)
    with pytest.raises(JakiroError, match="differs in: method"):
        Trainer(config(tmp_path / "u", data, method="eagle2", aux_layers="2,4,5", init_from=str(tmp_path / "t")),
                folder, progress=False)


def test_gguf_export_is_what_llama_cpp_loads(tmp_path):
    """The GGUF for llama.cpp's draft-eagle3: its architecture and keys, q/k rows in llama.cpp's
    RoPE order, d2t as target ids, the target's tokenizer."""
    import gguf
    from gguf_models import MIXED, T, write_model
    from jakiro.models.hub import resolve_target
    path = write_model(str(tmp_path / "t.gguf"), arch="llama", types={n: T.Q8_0 for n in MIXED}, embed=T.Q8_0,
                       layers=8, hidden=64, inter=128, vocab=272)
    target = TargetModel.from_folder(resolve_target(path, str(tmp_path / "cache")))
    draft = _draft(tmp_path, target, "e3-gguf", vocab=32)
    out = export(str(tmp_path / "e3-gguf"), "gguf", str(tmp_path / "draft.gguf"), path, str(tmp_path / "cache"),
                 "float32")
    r = gguf.GGUFReader(out[0])
    f = {k: v.contents() for k, v in r.fields.items()}
    assert f["general.architecture"] == "eagle3" and f["eagle3.block_count"] == 1
    assert f["eagle3.target_layers"] == list(LAYERS) and f["eagle3.target_hidden_size"] == 64
    assert f["eagle3.rope.freq_base"] == pytest.approx(10000.0)
    src = {k: v.contents() for k, v in gguf.GGUFReader(path).fields.items() if k.startswith("tokenizer.")}
    assert src and all(f[k] == v for k, v in src.items())
    t = {x.name: x for x in r.tensors}
    assert set(t) == {"fc.weight", "output_norm.weight", "output.weight", "d2t"} | {
        f"blk.0.{n}.weight" for n in ("attn_norm", "attn_norm_2", "attn_q", "attn_k", "attn_v", "attn_output",
                                      "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")}
    assert list(t["fc.weight"].shape) == [192, 64]  # ggml order: 3·H inputs, H outputs
    assert np.array_equal(np.asarray(t["d2t"].data), draft.d2t.numpy())
    c = draft.config
    q = torch.from_numpy(np.asarray(t["blk.0.attn_q.weight"].data).copy())
    # llama.cpp's NORM RoPE pairs (2i, 2i+1); Hugging Face's rotate-half pairs (i, i + D/2)
    D = c.head_dim
    unperm = q.view(c.num_attention_heads, D // 2, 2, -1).transpose(1, 2).reshape(q.shape)
    assert torch.equal(unperm, draft.q_proj.weight.detach())
    k = torch.from_numpy(np.asarray(t["blk.0.attn_k.weight"].data).copy())
    assert torch.equal(k.view(c.num_key_value_heads, D // 2, 2, -1).transpose(1, 2).reshape(k.shape),
                       draft.k_proj.weight.detach())
    gate = torch.from_numpy(np.asarray(t["blk.0.ffn_gate.weight"].data).copy())
    assert torch.equal(gate, draft.gate_up[0, :c.intermediate_size].detach())
    # the default: matrices in Q8_0 (as our runtime streams a draft), norms in float32
    q8 = gguf.GGUFReader(export(str(tmp_path / "e3-gguf"), "gguf", str(tmp_path / "q8.gguf"), path,
                                str(tmp_path / "cache"))[0])
    types = {x.name: x.tensor_type for x in q8.tensors}
    assert types["fc.weight"] == types["output.weight"] == types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert types["blk.0.attn_norm_2.weight"] == gguf.GGMLQuantizationType.F32
    x = next(x for x in q8.tensors if x.name == "fc.weight")
    fc = gguf.quants.dequantize(np.asarray(x.data), x.tensor_type)
    want = draft.fc.weight.detach().numpy()
    assert fc.shape == want.shape and np.abs(fc - want).max() <= np.abs(want).max() / 127 + 1e-6


def test_layouts_without_a_slot_are_refused_with_what_has_none(deep, tmp_path):
    root, folder, target, *_ = deep
    for method, extra, words in [("eagle2", {}, "input norm"), ("eagle2", {"aux_layers": [2, 4]}, "projection"),
                                 ("jakiro", {}, "2 experts and their router and the contrastive branch")]:
        cfg = DraftConfig.for_target(target.config, target.hf_config, method, **extra)
        save_draft(DraftModel(cfg), str(tmp_path / method))
        for fmt in ("eagle3", "gguf", "eagle"):
            with pytest.raises(JakiroError, match=words):
                export(str(tmp_path / method), fmt, str(tmp_path / "out"), folder)
    _draft(tmp_path, target, "e3")
    with pytest.raises(JakiroError, match="reads one feature, not three streams"):
        export(str(tmp_path / "e3"), "eagle", str(tmp_path / "out"), folder)
    with pytest.raises(JakiroError, match="needs the target as a GGUF file"):
        export(str(tmp_path / "e3"), "gguf", str(tmp_path / "x.gguf"), folder)
    with pytest.raises(JakiroError, match="unknown export format"):
        export(str(tmp_path / "e3"), "onnx", str(tmp_path / "out"), folder)
    assert not os.path.exists(tmp_path / "out")


def test_eagle3_checkpoints_the_engine_cannot_run_are_refused(deep, tmp_path):
    root, folder, target, *_ = deep
    ck = write_reference_checkpoint(str(tmp_path / "ck"), 64, 256, 48, 4, 2, 96, [2, 4])
    with pytest.raises(JakiroError, match="2 target streams"):
        load_draft(ck, target)
    ck = write_reference_checkpoint(str(tmp_path / "ck2"), 64, 256, 48, 4, 2, 96, [2, 4, 9])
    with pytest.raises(JakiroError, match="after layer 9, the target has 8 decoder layers"):
        load_draft(ck, target)
    from safetensors.torch import load_file, save_file
    ck = write_reference_checkpoint(str(tmp_path / "ck3"), 64, 256, 48, 4, 2, 96, None)
    state = load_file(os.path.join(ck, "model.safetensors"))
    state["embed_tokens.weight"] = target.embed.to(torch.bfloat16)  # the target's, as trainers save it: runs
    save_file(state, os.path.join(ck, "model.safetensors"))
    assert load_draft(ck, target).config.method == "eagle3"
    state["embed_tokens.weight"] = torch.zeros(256, 64)
    save_file(state, os.path.join(ck, "model.safetensors"))
    with pytest.raises(JakiroError, match="its own token embedding differs from the target's"):
        load_draft(ck, target)
    del state["embed_tokens.weight"], state["norm.weight"]
    save_file(state, os.path.join(ck, "model.safetensors"))
    with pytest.raises(JakiroError, match="missing norm.weight"):
        load_draft(ck, target)
    with open(os.path.join(ck, "model.safetensors"), "wb") as f:
        f.write(b"not safetensors")
    with pytest.raises(JakiroError, match="corrupted EAGLE-3 weights"):
        load_draft(ck, target)


@pytest.mark.llamacpp
def test_llama_cpp_runs_the_shipped_draft_as_our_runtime_does(tmp_path):
    """llama.cpp (scripts/build_llama_cpp.sh) loads the shipped SmolLM2 EAGLE-3 draft exported to
    GGUF: greedy, its answers are those it gives with the target drafting for itself (its
    speculative output does not depend on the draft), and it accepts drafted tokens at our
    runtime's rate for the same chain, within 0.05. Opt-in: pytest -m llamacpp."""
    from jakiro.bench.runner import BenchConfig, run_bench
    q = tmp_path / "q.jsonl"
    q.write_text("".join(json.dumps({"question_id": i, "category": "test", "turns": [t]}) + "\n"
                         for i, t in enumerate(["Write a Python function that reverses a string.",
                                                "List three uses of a hash map."])))
    cfg = BenchConfig(questions=str(q), methods=["ar", "eagle3", "llamacpp-eagle3", "llamacpp-draft"],
                      draft_model="smollm2-135m", max_new_tokens=64, depth=3, tree_top_k=1, total_tokens=3,
                      out=str(tmp_path / "out"))
    summary = run_bench(cfg, progress=False)
    answers = {}
    for line in open(tmp_path / "out" / "progress.jsonl"):
        for m, rec in json.loads(line).items():
            answers.setdefault(m, []).extend(t["token_ids"] for t in rec["turns"])
    assert answers["llamacpp-eagle3"] == answers["llamacpp-draft"]
    ours, theirs = (summary["methods"][m]["all"]["acceptance"] for m in ("eagle3", "llamacpp-eagle3"))
    assert theirs > 0.1 and abs(theirs - ours) <= 0.05, (ours, theirs)
