"""Draft checkpoints: round trip, and clear errors for a mismatched or corrupted draft."""

import json
import os

import pytest
import torch

from helpers import make_tiny_target
from jakiro.draft import DraftConfig, DraftModel, load_draft, save_draft
from jakiro.errors import JakiroError
from jakiro.models import smallgemm
from jakiro.models.target import TargetModel


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    return TargetModel.from_folder(tiny_llama_dir)


def saved(tmp_path, target, method="jakiro", **kw):
    cfg = DraftConfig.for_target(target.config, target.hf_config, method, **kw)
    model = DraftModel(cfg)
    if cfg.draft_vocab_size:
        model.set_draft_vocab(torch.arange(cfg.draft_vocab_size).flip(0))
    save_draft(model, str(tmp_path))
    return model, str(tmp_path)


def test_round_trip_keeps_weights_and_vocab_map(tmp_path, target):
    model, folder = saved(tmp_path, target, num_experts=4, experts_per_token=3, draft_vocab_size=40)
    loaded = load_draft(folder, target)
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v)
    assert loaded.config.num_experts == 4 and loaded.config.experts_per_token == 3
    assert loaded.d2t[:3].tolist() == [39, 38, 37]
    cfg = json.load(open(os.path.join(folder, "config.json")))
    assert cfg["num_hidden_layers"] == 1 and cfg["jakiro"]["method"] == "jakiro"
    from safetensors.torch import load_file
    assert not any("embed" in k or "lm_head" in k for k in load_file(os.path.join(folder, "model.safetensors")))


def test_draft_for_another_target_is_refused(tmp_path, target):
    _, folder = saved(tmp_path / "d", target)
    wide = TargetModel.from_folder(make_tiny_target(str(tmp_path / "wide"), "llama", hidden_size=96))
    with pytest.raises(JakiroError, match="draft does not match the target: hidden size 64 != target's 96"):
        load_draft(folder, wide)


def test_corrupted_weights_are_refused(tmp_path, target):
    _, folder = saved(tmp_path, target)
    path = os.path.join(folder, "model.safetensors")
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    with pytest.raises(JakiroError, match="corrupted draft weights"):
        load_draft(folder, target)


def test_missing_and_unexpected_weights_are_refused(tmp_path, target):
    from safetensors.torch import load_file, save_file
    _, folder = saved(tmp_path, target)
    path = os.path.join(folder, "model.safetensors")
    state = load_file(path)
    state.pop("router.weight")
    state["extra.weight"] = torch.zeros(2)
    save_file(state, path)
    with pytest.raises(JakiroError, match="missing router.weight; unexpected extra.weight"):
        load_draft(folder, target)


def test_bad_configs_are_refused(tmp_path, target):
    with pytest.raises(JakiroError, match="at least 2 activated experts"):
        DraftConfig.for_target(target.config, target.hf_config, "jakiro", experts_per_token=1)
    with pytest.raises(JakiroError, match="num_experts .* must be >= experts_per_token"):
        DraftConfig.for_target(target.config, target.hf_config, "jakiro", num_experts=2, experts_per_token=3)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(JakiroError, match="not a jakiro draft config"):
        load_draft(str(tmp_path), target)


@pytest.mark.skipif(not smallgemm.available(), reason="small-batch kernel unavailable here")
@pytest.mark.parametrize("method", ["eagle2", "jakiro"])
def test_fused_draft_step_matches_torch_operations(tmp_path, target, method):
    """A draft step in one kernel call (fusion layer, attention over the context and the tree
    ancestors) against the same step in torch operations: outputs and the KV entries written."""
    model, folder = saved(tmp_path, target, method)
    draft = load_draft(folder, target)
    with torch.no_grad():
        for p in draft.parameters():  # a trained draft's weights are far from the initial ones
            p.add_(torch.randn_like(p) * 0.05)
    gen = torch.Generator().manual_seed(0)
    feats, toks = torch.randn(1, 14, 64, generator=gen), torch.randint(0, 256, (1, 14), generator=gen)
    mask = torch.zeros(4, 14, dtype=torch.bool)
    mask[:, :10] = True
    mask[torch.arange(4), 10 + torch.arange(4)] = True
    mask[3, 11] = True  # the fourth row's parent is the second
    results = []
    for fused in (True, False):
        if not fused:
            draft._fused_step = lambda *args: None
        cache = draft.new_cache(32)
        with torch.inference_mode():
            draft(feats[:, :10], toks[:, :10], torch.arange(10), cache)
            cache.commit(10)
            out = draft(feats[:, 10:], toks[:, 10:], torch.tensor([10, 10, 11, 11]), cache, mask)
        results.append((out.blend, out.features, cache.data[..., :14, :].clone()))
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["eagle2", "jakiro"])
def test_catch_up_without_attention_for_all_but_the_newest_row(tmp_path, target, method):
    """A long catch-up (a prompt) writes the keys and values of every row but attends only from
    the newest: the same cache entries and the same draft output there as a full forward."""
    from jakiro.decoding.proposers import TreeBudget
    from jakiro.decoding.draft_proposer import DraftProposer
    model, folder = saved(tmp_path, target, method)
    draft = load_draft(folder, target)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    gen = torch.Generator().manual_seed(1)
    T = 50  # beyond the small-batch rows: the catch-up takes the keys-and-values-only path
    feats, toks = torch.randn(T, 64, generator=gen), torch.randint(0, 256, (T,), generator=gen)
    with torch.inference_mode():
        full = draft.new_cache(64)
        expected = draft(feats.unsqueeze(0), toks.unsqueeze(0), torch.arange(T), full)
        full.commit(T)
        proposer = DraftProposer(draft, TreeBudget(2, 2, 4))
        proposer.start(T + 8)
        proposer.observe(feats, toks)
        assert proposer.pending_rows == T
        got = draft.heads(proposer._catch_up())
    assert proposer.cache.length == T and proposer.pending_rows == 0
    torch.testing.assert_close(proposer.cache.data[..., :T, :], full.data[..., :T, :], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.blend[0, -1], expected.blend[0, -1], atol=1e-5, rtol=1e-5)
