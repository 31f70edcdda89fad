"""The linear kernels: every row count gives x @ W^T (+ b) within float32 rounding, the
small-batch kernel computes a row the same whatever rows come with it, and the runtime falls back
to torch's kernels with one clear message where the kernel cannot be built."""

import os
import subprocess
import sys

import pytest
import torch

from jakiro.models import smallgemm
from jakiro.models.linear import SMALL_ROWS, FastLinear

needs_kernel = pytest.mark.skipif(not smallgemm.available(), reason="small-batch kernel unavailable here")


@pytest.mark.parametrize("out_features, bias", [(1000, True), (40, False), (96 * 3, False)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, SMALL_ROWS, SMALL_ROWS + 1, 70])
def test_every_row_count_matches_f_linear(out_features, bias, rows):
    # 1000 = 62 sub-panels of 16 + 8 columns; 40 = less than one group; 288 = whole groups
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(out_features, 576, generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    x = torch.randn(rows, 576, generator=g)
    got = FastLinear(w, b)(x)
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double()).float()
    assert got.shape == (rows, out_features)
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-5)


@needs_kernel
def test_a_row_is_bitwise_the_same_alone_and_in_any_batch():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(1000, 1536, generator=g), torch.randn(1000, generator=g)
    lin = FastLinear(w, b)
    x = torch.randn(SMALL_ROWS, 1536, generator=g)
    alone = torch.cat([lin(x[i:i + 1]) for i in range(SMALL_ROWS)])
    for rows in (2, 5, 8, SMALL_ROWS):
        assert torch.equal(lin(x[:rows]), alone[:rows]), rows


def test_the_kernel_can_be_switched_off_and_says_so(tmp_path):
    code = ("from jakiro.models import smallgemm; from jakiro.models.linear import FastLinear; import torch; "
            "print(smallgemm.status()); print(FastLinear(torch.eye(3))(torch.ones(2, 3)).tolist())")
    env = dict(os.environ, JAKIRO_NO_EXT="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["off (disabled by JAKIRO_NO_EXT)", "[[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]"]


@pytest.mark.slow
def test_a_failed_build_falls_back_with_one_message(tmp_path, monkeypatch, capsys):
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(smallgemm, "SOURCE", str(broken))
    monkeypatch.setattr(smallgemm, "_state", {})
    monkeypatch.setenv("JAKIRO_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("JAKIRO_NO_EXT", raising=False)
    assert smallgemm.available() is False
    assert smallgemm.available() is False  # decided once
    err = capsys.readouterr().err
    assert err.count("small-batch linear kernel unavailable") == 1 and "using torch's kernels" in err
    assert smallgemm.status().startswith("off (")
    w = torch.randn(20, 8)
    torch.testing.assert_close(FastLinear(w)(torch.ones(3, 8)), torch.ones(3, 8) @ w.t())


@needs_kernel
def test_side_by_side_kernel_comparison_builds_a_torch_copy_and_restores_the_kernel(tmp_path):
    from helpers import make_tiny_target
    from jakiro.bench.cost_curve import kernel_comparison
    from jakiro.models.target import TargetModel
    w = torch.randn(40, 16)
    with smallgemm.disabled():
        assert FastLinear(w).small is None and smallgemm.status() == "off (disabled for comparison)"
    assert FastLinear(w).small is not None and smallgemm.status().startswith("on")
    folder = make_tiny_target(str(tmp_path), "llama")
    report = kernel_comparison(TargetModel.from_folder(folder), folder, context=8, repeats=1, rounds=1)
    assert set(report) == {"small_batch", "torch", "torch_over_small_batch"}
    assert set(report["torch"]) == {"1", "2", "4", "8", "16", "32", "64"}


@pytest.mark.parametrize("method", ["eagle2", "jakiro"])
def test_draft_inference_layers_match_training_and_follow_weight_updates(tiny, method):
    from test_speculative_greedy import random_draft
    root, target, tok, prompts, reference = tiny
    draft = random_draft(root, target, method, {}, f"fast-layers-{method}")
    g = torch.Generator().manual_seed(0)
    features = torch.randn(1, 5, draft.config.hidden_size, generator=g)
    tokens = torch.randint(0, draft.config.vocab_size, (1, 5), generator=g)
    positions = torch.arange(5)

    def both():
        draft.train()
        with torch.no_grad():
            reference_ = draft(features, tokens, positions)  # torch's layers
        draft.eval()
        with torch.inference_mode():
            fast = draft(features, tokens, positions)  # the runtime's kernels
        for name in ("features", "blend", "contrastive"):
            if getattr(reference_, name) is not None:
                torch.testing.assert_close(getattr(fast, name), getattr(reference_, name), atol=1e-4, rtol=1e-4)
        return fast

    before = both()
    with torch.no_grad():  # an optimiser step, in place
        draft.gate_up.mul_(1.5)
        draft.q_proj.weight.mul_(0.5)
        draft.fc.bias.add_(0.1)
    after = both()  # the inference copies were rebuilt from the new weights
    assert not torch.allclose(after.blend, before.blend, atol=1e-3)
