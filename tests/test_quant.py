"""Quantized weights: GGUF blocks packed for the small-batch kernel dequantize bitwise to GGUF's
own float32 values, the kernel computes x @ W^T with them for every row count (a row the same
alone or in a batch), matrices that do not reproduce the float32 model stay float32, and the
default target's decoding steps give the float32 path's logits."""

from types import SimpleNamespace

import numpy as np

import pytest
import torch

from helpers import needs_int8_activations
from jakiro.models import quant, smallgemm
from jakiro.models.linear import SMALL_ROWS, FastLinear
from jakiro.settings import Runtime

needs_kernel = pytest.mark.skipif(not smallgemm.available(), reason="small-batch kernel unavailable here")
needs_tiles = pytest.mark.skipif(not smallgemm.tiles_enabled(), reason="no AMX tile unit (or kernel) here")
needs_tile_layout = pytest.mark.skipif(not (smallgemm.tiles_enabled() or smallgemm.int8_enabled()),
                                       reason="neither AMX tiles nor AVX-512 VNNI (or their kernels) here")
gguf = pytest.importorskip("gguf")
TYPES = {"q4_1": gguf.GGMLQuantizationType.Q4_1, "q8_0": gguf.GGMLQuantizationType.Q8_0}


def quantized_matrix(kind: str, rows: int, cols: int, seed: int = 0):
    """GGUF blocks of a random matrix and GGUF's own dequantization of them."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    raw = gguf.quants.quantize(w, TYPES[kind])
    return raw, torch.from_numpy(gguf.quants.dequantize(raw, TYPES[kind]).astype(np.float32))


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_packed_blocks_dequantize_bitwise_to_ggufs_values(kind):
    raw, reference = quantized_matrix(kind, 40, 96)
    packed = quant.pack_blocks(raw, kind, 40, 96)
    assert packed.shape == (40, 3, 24 if kind == "q4_1" else 40) and packed.dtype == torch.uint8
    assert torch.equal(quant.dequantize(packed, kind), reference)


@needs_kernel
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 9, 11, 16, 17, SMALL_ROWS, SMALL_ROWS + 3])
# 70 outputs: the portable kernel's six spans of 12 rows, the last two groups one row short;
# 112: seven tile groups (AMX tiles or the int8 kernel), on AMX two or three in flight and a remainder
@pytest.mark.parametrize("out", [70, 112])
def test_quantized_kernel_matches_the_dequantized_matrix(kind, rows, out):
    cols = 576
    raw, reference = quantized_matrix(kind, out, cols, seed=rows)
    packed = quant.pack_blocks(raw, kind, out, cols)
    bias = torch.randn(out)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
    layer = FastLinear(reference, bias, quantized=(kind, packed))
    assert layer.tiles == (out % 16 == 0 and (smallgemm.tiles_enabled() or smallgemm.int8_enabled()))
    got = layer(x)
    expected = torch.nn.functional.linear(x.double(), reference.double(), bias.double()).float()
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-5)
    assert layer.streamed_bytes == layer.blocks.numel() + out * 4  # Q8_0 tiles drop the blocks' zero offsets
    assert layer.blocks.numel() == packed.numel() - (0 if kind == "q4_1" or not layer.tiles else out * cols // 8)
    if rows <= SMALL_ROWS:  # a row's result does not depend on the rows that come with it (with
        # the tile unit and 4-bit weights, from 6 rows on its three bytes go in as two 12-bit digits)
        assert torch.equal(layer(x[-1:]), got[-1:])


@needs_tile_layout
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_tile_kernel_keeps_float32_accuracy_on_hard_inputs(kind):
    """Inputs go through the tile unit (or the int8 kernel) as three bytes per value, scaled per block of 32 (each
    rounded by at most 2^-22 of its block's largest value): blocks with one huge value, of tiny
    or zero values, and values at the rounding boundaries of the byte split stay within that
    rounding plus float32 arithmetic; a non-finite input gives a non-finite output."""
    out, cols = 48, 256
    raw, reference = quantized_matrix(kind, out, cols, seed=7)
    packed = quant.pack_blocks(raw, kind, out, cols)
    tiles = smallgemm.tile_layout(packed)
    assert tiles.shape[0] == out // 16 and not torch.equal(tiles.flatten()[:64], packed.flatten()[:64])
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, cols, generator=gen)
    x[0, 5] = 3e4  # one value dwarfs its block
    x[1, :32] = 0  # an all-zero block
    x[2, 32:64] *= 1e-20  # tiny values
    x[3] = torch.ldexp(torch.ones(cols), torch.randint(-30, 30, (cols,), generator=gen)).neg_()  # powers of two
    x[4, :64] = 2.0 ** -20 * torch.arange(64)  # exact multiples of the byte split's smallest step
    expected = (x.double() @ reference.double().T)
    w = reference.double().abs().T
    arithmetic = 2e-6 * (x.double().abs() @ w)  # float32 sums of these terms
    block_max = x.double().abs().reshape(6, -1, 32).amax(-1, keepdim=True).expand(-1, -1, 32).reshape(6, cols)
    rounding = 2.0 ** -22 * (block_max @ w)
    got = smallgemm.quantized_linear(x, tiles, out).double()
    assert bool(((got - expected).abs() <= arithmetic + rounding).all())
    assert bool(((got - expected).abs()[1:] <= arithmetic[1:]).all())  # no block with a wide range
    portable = smallgemm.quantized_linear(x, packed, out).double()
    assert bool(((portable - expected).abs() <= arithmetic).all())
    x[5, 40] = float("nan")
    assert bool(smallgemm.quantized_linear(x, tiles, out)[5].isnan().all())


def one_byte_case(reference: torch.Tensor, cols: int):
    """Inputs for one-byte kernels (11 rows, one with a value that dwarfs its block, one with an
    all-zero block), x @ W^T in float64, and the bound of one-byte rounding (each value within
    2^-6 of its block's largest) plus float32 arithmetic."""
    x = torch.randn(11, cols, generator=torch.Generator().manual_seed(1))
    x[0, 7] = 50.0  # one value dwarfs its block
    x[1, :32] = 0
    expected = x.double() @ reference.double().T
    w = reference.double().abs().T
    block_max = x.double().abs().reshape(11, -1, 32).amax(-1, keepdim=True).expand(-1, -1, 32).reshape(11, cols)
    return x, expected, 2.0 ** -6 * (block_max @ w) + 2e-6 * (x.double().abs() @ w)


@needs_tile_layout
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_one_byte_inputs_stay_within_their_rounding_and_keep_rows_independent(kind):
    """A draft's rows go through the tile unit (or the int8 kernel) as one byte per value (int8 scaled per block of
    32: each value rounded by at most 2^-6 of its block's largest), at a third of the per-row
    cost; a row's result still does not depend on the rows that come with it. Input widths other
    than one or three bytes are refused."""
    out, cols = 48, 256
    raw, reference = quantized_matrix(kind, out, cols, seed=9)
    tiles = smallgemm.tile_layout(quant.pack_blocks(raw, kind, out, cols))
    x, expected, bound = one_byte_case(reference, cols)
    got = smallgemm.quantized_linear(x, tiles, out, 1)
    assert bool(((got.double() - expected).abs() <= bound).all())
    exact = smallgemm.quantized_linear(x, tiles, out, 3)
    assert not torch.equal(got, exact)  # the one-byte path ran
    for i in (0, 5, 10):
        assert torch.equal(smallgemm.quantized_linear(x[i:i + 1], tiles, out, 1), got[i:i + 1])
    with pytest.raises(RuntimeError, match="1 or 3 bytes"):
        smallgemm.quantized_linear(x, tiles, out, 2)
    with pytest.raises(ValueError, match="input_bytes"):
        FastLinear(reference, quantized=(kind, quant.pack_blocks(raw, kind, out, cols)), input_bytes=2)


needs_int8 = pytest.mark.skipif(not smallgemm.int8_enabled(), reason="no AVX-512 VNNI int8 kernel here")


@needs_int8
def test_int8_kernel_for_draft_blocks_stays_within_one_byte_rounding():
    """On CPUs with AVX-512 VNNI and no tiles, a draft's Q8_0 blocks (one byte per input) go
    through the int8 kernel: within the same rounding bound as the tile unit's one-byte inputs,
    a row's result independent of the rows with it, zero and non-finite blocks handled; the
    target's blocks (three bytes per input, float32 accuracy) go through it too."""
    out, cols = 48, 256
    raw, reference = quantized_matrix("q8_0", out, cols, seed=9)
    packed = quant.pack_blocks(raw, "q8_0", out, cols)
    layer = FastLinear(reference, quantized=("q8_0", packed), input_bytes=1)
    assert layer.tiles and layer.blocks.shape[0] == out // 16
    assert FastLinear(reference, quantized=("q8_0", packed)).tiles
    x, expected, bound = one_byte_case(reference, cols)
    got = layer(x)
    assert bool(((got.double() - expected).abs() <= bound).all())
    assert not torch.equal(got, smallgemm.quantized_linear(x, packed, out))  # the int8 path ran
    for i in (0, 5, 10):
        assert torch.equal(layer(x[i:i + 1]), got[i:i + 1])
    x[5, 40] = float("nan")
    assert bool(layer(x)[5].isnan().all()) and not bool(layer(x)[4].isnan().any())


@needs_int8
@pytest.mark.parametrize("rows", [1, 3, 7, 8, 11, SMALL_ROWS])
def test_int8_kernel_for_q4_1_blocks_stays_within_one_byte_rounding(rows):
    """Q4_1 blocks taken with one byte per input (int8 activations) go through the int8 kernel,
    the unsigned 4-bit q against the signed input bytes, plus each block's offset m times the
    input block's sum: within one-byte rounding of x @ W^T, a row's result independent of the
    rows with it (for every register block and remainder), zero and non-finite blocks handled."""
    out, cols = 48, 576
    raw, reference = quantized_matrix("q4_1", out, cols, seed=4)
    packed = quant.pack_blocks(raw, "q4_1", out, cols)
    layer = FastLinear(reference, quantized=("q4_1", packed), input_bytes=1)
    assert layer.tiles and layer.blocks.shape == (out // 16, cols // 32, 384)
    x, expected, bound = one_byte_case(reference, cols)
    x, expected, bound = (t.repeat(3, 1)[:rows] for t in (x, expected, bound))
    got = layer(x)
    assert bool(((got.double() - expected).abs() <= bound).all())
    exact = FastLinear(reference, quantized=("q4_1", packed))(x)
    assert not torch.equal(got, exact)  # the int8 path ran
    for i in range(rows):
        assert torch.equal(layer(x[i:i + 1]), got[i:i + 1])
    if rows > 5:
        x[5, 40] = float("nan")
        assert bool(layer(x)[5].isnan().all()) and not bool(layer(x)[4].isnan().any())


def test_tile_kernel_can_be_switched_off(tmp_path):
    """JAKIRO_AMX=0 and JAKIRO_INT8=0 keep GGUF blocks in the float32 kernel's layout, whether
    taken with three bytes per input (a target) or one (a draft)."""
    import os
    import subprocess
    import sys
    code = ("from jakiro.models import smallgemm; import torch; "
            "print(smallgemm.tiles_enabled(), smallgemm.int8_enabled(), "
            "smallgemm.tile_layout(torch.zeros(16, 2, 24, dtype=torch.uint8)).shape, "
            "smallgemm.tile_layout(torch.zeros(16, 2, 40, dtype=torch.uint8)).shape)")
    env = dict(os.environ, JAKIRO_AMX="0", JAKIRO_INT8="0")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split("\n")[-2] == "False False torch.Size([16, 2, 24]) torch.Size([16, 2, 40])"
    if smallgemm.tiles_enabled() or smallgemm.int8_enabled():  # and here, on, they lay them out
        assert smallgemm.tile_layout(torch.zeros(16, 2, 24, dtype=torch.uint8)).shape[0] == 1


@pytest.mark.slow
@needs_kernel
def test_default_target_quantized_decoding_steps_match_float32(smol):
    from jakiro.models.target import TargetModel
    model = TargetModel.from_folder(smol.target_path, Runtime.from_env(quantized=True))
    assert model.quantized_matrices == 7 * model.config.num_layers + 1  # every matrix and the tied head
    assert smol.target.quantized_matrices == model.quantized_matrices  # the default
    smol = SimpleNamespace(target=TargetModel.from_folder(smol.target_path, Runtime.from_env(quantized=False)),
                           target_path=smol.target_path, engine=smol.engine)
    ids = torch.tensor(smol.engine().encode("Tell me about the history of Rome."))
    caches = [m.new_cache(len(ids) + 16, scratch=8) for m in (smol.target, model)]
    for m, cache in zip((smol.target, model), caches):
        m(ids, cache)  # the prompt's prefill: the float32 copy's weights, and the blocks
        cache.commit(len(ids))
    token = torch.tensor([int(ids[-1])])
    for _ in range(12):
        (a, fa), (b, fb) = (m(token, c) for m, c in zip((smol.target, model), caches))
        torch.testing.assert_close(b, a, atol=5e-4, rtol=1e-5)  # logits of about 25, as the tile test allows
        torch.testing.assert_close(fb, fa, atol=1e-4, rtol=1e-4)
        assert int(b.argmax()) == int(a.argmax())
        token = a.argmax(-1)
        for c in caches:
            c.commit(1)
    tree = torch.tensor([int(token), 5, 6, 7])
    mask = torch.ones(4, 4, dtype=torch.bool).tril_()
    positions = torch.arange(caches[0].length, caches[0].length + 4)
    (a, _), (b, _) = (m(tree, c, positions, mask) for m, c in zip((smol.target, model), caches))
    torch.testing.assert_close(b, a, atol=5e-4, rtol=1e-5)
    # bench-cost --quantized --compare-kernels: the quantized, float32 and torch kernels side by side
    from jakiro.bench.cost_curve import kernel_comparison, weight_bytes
    report = kernel_comparison(model, smol.target_path, context=8, repeats=1, rounds=1)
    tiles = {"quantized_portable", "portable_over_tiles"} if model.tile_matrices else set()
    assert set(report) == {"quantized", "small_batch", "torch", "torch_over_small_batch",
                           "small_batch_over_quantized"} | tiles
    tile_kernel = smallgemm.tiles_enabled() or smallgemm.int8_enabled()
    assert model.tile_matrices == (4 * model.config.num_layers + 1 if tile_kernel else 0)
    assert weight_bytes(model) < weight_bytes(smol.target) / 4  # Q4_1 layers and a Q8_0 head


@needs_tiles
def test_prompts_run_the_tile_kernel_in_pieces(smol):
    """With the AMX kernel a prompt of up to CHUNKED_PREFILL_MAX tokens (forward(chunked=True), as
    decoding prefills) runs through the one-call stack in pieces of SMALL_ROWS: the features are
    bitwise those of feeding the tokens one at a time, within float32 accuracy of the float32
    weights on oneDNN (features 1e-4; logits, ~25 in size, 1e-5 of that), with the same greedy
    token everywhere."""
    from jakiro.models.target import CHUNKED_PREFILL_MAX, TargetModel
    model = smol.target
    assert model.tile_matrices > 0
    reference = TargetModel.from_folder(smol.target_path, Runtime.from_env(quantized=False))
    ids = torch.tensor(smol.engine().encode("Tell me about the history of Rome. " * 8))
    assert SMALL_ROWS * 2 < len(ids) <= CHUNKED_PREFILL_MAX
    cache = model.new_cache(len(ids))
    logits, feats = model(ids, cache, chunked=True)
    one = model.new_cache(len(ids))
    singles = []
    for i in range(len(ids)):
        singles.append(model(ids[i:i + 1], one)[1])
        one.commit(1)
    assert torch.equal(feats, torch.cat(singles))
    ref_logits, ref_feats = reference(ids, reference.new_cache(len(ids)))
    torch.testing.assert_close(feats, ref_feats, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits, ref_logits, atol=5e-4, rtol=1e-5)
    assert torch.equal(logits.argmax(-1), ref_logits.argmax(-1))
    # a GGUF target has no float32 copy to run a prompt on: without chunked=True it goes in pieces too
    assert torch.equal(model(ids, model.new_cache(len(ids)))[1], feats)


@needs_int8_activations
def test_int8_activations_target(smol, monkeypatch):
    """``int8_activations``: every matrix takes its inputs as int8 blocks (prompts in pieces through
    the same kernel); a token's logits are bitwise the same alone and in a tree (what keeps every
    method's greedy text that of plain decoding); the logits stay near the float32 weights' (one
    byte per input: within 2^-6 of each block's largest value); a target without GGUF blocks, or
    a CPU without the kernels, is refused with a clear message."""
    from jakiro.errors import JakiroError
    from jakiro.models.target import TargetModel
    model = TargetModel.from_folder(smol.target_path, Runtime.from_env(int8_activations=True))
    assert model.input_bytes == 1 and model.tile_matrices == 4 * model.config.num_layers + 1
    ids = torch.tensor(smol.engine().encode("Tell me about the history of Rome. Then list three emperors."))
    cache = model.new_cache(len(ids) + 8, scratch=8)
    logits, _ = model(ids, cache, chunked=True)
    cache.commit(len(ids))
    reference, _ = smol.target(ids, smol.target.new_cache(len(ids)), chunked=True)
    cosine = torch.nn.functional.cosine_similarity(logits, reference, dim=-1)
    assert float(cosine.median()) > 0.98 and float(cosine.min()) > 0.5
    assert float((logits.argmax(-1) == reference.argmax(-1)).float().mean()) >= 0.8
    chain = torch.tensor([int(logits[-1].argmax()), 5, 6, 7])
    positions = torch.arange(cache.length, cache.length + 4)
    tree, _ = model(chain, cache, positions, torch.ones(4, 4, dtype=torch.bool).tril_())
    for i in range(4):
        single, _ = model(chain[i:i + 1], cache)
        assert torch.equal(single[0], tree[i])
        cache.commit(1)
    with pytest.raises(JakiroError, match="from a GGUF file, streamed as its blocks"):
        TargetModel.from_folder(smol.target_path, Runtime.from_env(quantized=False, int8_activations=True))
    with smallgemm.int8_disabled(), smallgemm.tiles_disabled():
        with pytest.raises(JakiroError, match="AVX-512 VNNI or AMX"):
            TargetModel.from_folder(smol.target_path, Runtime.from_env(int8_activations=True))
    monkeypatch.setenv("JAKIRO_INT8_ACTIVATIONS", "1")
    assert TargetModel.from_folder(smol.target_path).input_bytes == 1


@needs_int8_activations
def test_int8_activations_prompts_of_any_length_run_in_pieces(smol):
    """A GGUF target's prompt of any length (beyond CHUNKED_PREFILL_MAX, the float32 folders'
    limit) runs through the one-call stack in pieces, on the AMX kernel as on the int8 one: its
    last tokens get bitwise the features of feeding them one at a time after the rest (and the
    last one its logits, as decoding prefills); without ``chunked`` too (no float32 copy to run)."""
    from jakiro.models.target import CHUNKED_PREFILL_MAX, TargetModel
    model = TargetModel.from_folder(smol.target_path, Runtime.from_env(int8_activations=True))
    ids = torch.tensor(smol.engine().encode("Tell me about the history of Rome. " * 70))
    tail = 24
    assert len(ids) - tail > CHUNKED_PREFILL_MAX
    logits, feats = model(ids, model.new_cache(len(ids)), logits_rows=slice(-1, None), chunked=True)
    cache = model.new_cache(len(ids))
    model(ids[:-tail], cache, chunked=True)
    cache.commit(len(ids) - tail)
    for i in range(len(ids) - tail, len(ids)):
        one_logits, one_feats = model(ids[i:i + 1], cache)
        cache.commit(1)
        assert torch.equal(one_feats[0], feats[i])
    assert torch.equal(one_logits[0], logits[0])
    assert torch.equal(model(ids, model.new_cache(len(ids)))[1], feats)


def test_q8_0_rounding_of_runtime_weights():
    weight = torch.randn(40, 96, generator=torch.Generator().manual_seed(3))
    weight[3, 32:64] = 0  # an all-zero block
    packed = quant.quantize_q8_0(weight)
    assert packed.shape == (40, 3, 40) and packed.dtype == torch.uint8
    restored = quant.dequantize(packed, "q8_0")
    step = weight.reshape(40, 3, 32).abs().amax(-1, keepdim=True) / 127
    assert bool(((restored - weight).reshape(40, 3, 32).abs() <= step / 2 + 1e-7).all())
    assert bool((restored[3, 32:64] == 0).all())


@needs_kernel
def test_draft_on_a_quantized_target_streams_blocks(smol):
    """With a quantized target the draft head reads the target's head blocks (the same weights)
    and the draft's layers are rounded to Q8_0: proposals stay close to the float32 draft's."""
    from jakiro.draft import load_draft
    from jakiro.models.target import TargetModel
    model = TargetModel.from_folder(smol.target_path, Runtime.from_env(quantized=False))
    from jakiro.api import shipped_draft
    drafts = [load_draft(shipped_draft("eagle2"), t) for t in (model, smol.target)]
    assert not drafts[0].quantized and drafts[1].quantized
    gen = torch.Generator().manual_seed(0)
    feats, toks = torch.randn(1, 6, 576, generator=gen), torch.randint(0, 40000, (1, 6), generator=gen)
    outs = []
    for draft in drafts:
        cache = draft.new_cache(16)
        with torch.inference_mode():
            out = draft(feats, toks, torch.arange(6), cache)
            outs.append(draft.head_logits(out.blend[0], 2048))
    assert drafts[1].head(2048).layer.quantized is not None
    # logits span ~30; the quantized draft's rows go to the tile or int8 kernel as int8 (about
    # 1 % of a block's largest input per value), which may swap a near tie (here one of the six
    # rows with the int8 kernel: its top two 0.08 apart)
    torch.testing.assert_close(outs[1], outs[0], atol=0.5, rtol=0.02)
    assert int((outs[1].argmax(-1) == outs[0].argmax(-1)).sum()) >= 5


@needs_kernel
def test_a_request_head_lays_out_only_its_new_rows(smol):
    """A request's head (the draft vocabulary plus its prompt's tokens) extends the vocabulary
    head's kernel layout by its own rows: bitwise the layout of all its rows built at once, on a
    quantized target (GGUF blocks) and on a float32 one (packed weight), scoring as those rows."""
    from jakiro.api import shipped_draft
    from jakiro.draft import load_draft
    from jakiro.draft.head import DraftHead
    from jakiro.models.target import TargetModel
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(0))
    for target, tol in ((smol.target, 0.5), (TargetModel.from_folder(smol.target_path, Runtime.from_env(quantized=False)), 1e-3)):
        draft = load_draft(shipped_draft("eagle2"), target)
        head = draft.head(2048, extra=torch.tensor([40000, 40001, 45000, 7]))
        assert head.size > 2048 and head.size % 16 == 0 and head._base is draft.head(2048)
        whole = DraftHead(head.ids, draft._lm_head, draft._head_blocks)
        assert torch.equal(head.kernel_weight, whole.kernel_weight)
        with torch.inference_mode():
            torch.testing.assert_close(head(x), x @ target.dense_head()[head.ids].T, atol=tol, rtol=0.02)
