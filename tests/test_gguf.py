"""GGUF files run from their own blocks: every block type's rows dequantize bitwise as GGUF's
reference does, the packed layout's kernels reproduce the reference weights exactly and compute
x @ W^T within float32 (three-byte inputs) or one-byte rounding, each row the same alone or with
others; tiny Llama, Qwen2 and Qwen3 files give Hugging Face's logits for the same file, a token's
logits are bitwise the same alone and in a tree, and a file the runtime cannot run is refused in
one line."""

import os

import numpy as np
import pytest
import torch

from gguf_models import PACKED, QUANTIZED, random_blocks, random_tensor, reference, write_model
from gguf import GGMLQuantizationType as T
from jakiro.errors import JakiroError
from jakiro.models import smallgemm

needs_kernel = pytest.mark.skipif(not smallgemm.available(), reason="small-batch kernel unavailable here")
needs_kq_int8 = pytest.mark.skipif(not (smallgemm.available() and smallgemm.kq_int8()),
                                   reason="no AVX-512 VNNI int8 kernel here")


@needs_kernel
@pytest.mark.parametrize("kind", QUANTIZED + (T.F32, T.F16), ids=lambda k: k.name)
def test_rows_dequantize_bitwise_as_ggufs_reference(kind):
    raw = random_tensor(kind, 24, 512, seed=3, scale=0.05)
    rows = torch.from_numpy(raw)
    ids = torch.tensor([5, 0, 23, 5])
    got = smallgemm.gguf_rows(rows, ids)
    assert torch.equal(got, torch.from_numpy(reference(raw, kind))[ids])
    with pytest.raises(RuntimeError, match="outside the embedding"):
        smallgemm.gguf_rows(rows, torch.tensor([24]))


def _linear(x, packed, n, mode):
    if mode == "portable":
        with smallgemm.int8_disabled():
            return smallgemm.quantized_linear(x, packed, n, 3)
    return smallgemm.quantized_linear(x, packed, n, 1 if mode == "int8" else 3)


# the integer kernel (AVX-512 VNNI, or AVX2) with one- or three-byte inputs, and the float32 one;
# where no integer kernel is built the first two run the float32 one too (within the same bounds)
MODES = ["portable", "int8", "three_bytes"]


@needs_kernel
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", PACKED, ids=lambda k: k.name)
def test_packed_layout_reproduces_the_reference_weights(kind, mode):
    """Identity inputs read each weight back: exactly GGUF's value, in every kernel (70 rows: the
    last group of 16 columns padded)."""
    rows, cols = 70, 512
    raw = random_blocks(kind, rows, cols, seed=1)
    packed = smallgemm.kq_pack(torch.from_numpy(raw))
    assert packed.dtype == torch.int8 and packed.shape[0] == 5
    got = _linear(torch.eye(cols), packed, rows, mode)
    assert torch.equal(got.T.contiguous(), torch.from_numpy(reference(raw, kind)))


@needs_kernel
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", PACKED, ids=lambda k: k.name)
def test_packed_kernels_stay_within_their_rounding_and_keep_rows_independent(kind, mode):
    """Three-byte inputs round each value by at most 2^-22 of its block's largest, one byte by
    2^-6, the portable kernel not at all: within that plus float32 arithmetic of x @ W^T, for
    every register block and remainder of rows; a row's result does not depend on the rows with
    it; a block of zeros gives zeros, a non-finite input non-finite outputs."""
    out, cols = 48, 768
    raw = random_blocks(kind, out, cols, seed=2)
    w = torch.from_numpy(reference(raw, kind)).double()
    packed = smallgemm.kq_pack(torch.from_numpy(raw))
    x = torch.randn(19, cols, generator=torch.Generator().manual_seed(0))
    x[0, 7] = 300.0  # one value dwarfs its block
    x[1, :32] = 0
    got = _linear(x, packed, out, mode).double()
    expected = x.double() @ w.T
    block_max = x.double().abs().reshape(19, -1, 32).amax(-1, keepdim=True).expand(-1, -1, 32).reshape(19, cols)
    rounding = {"portable": 0.0, "int8": 2.0 ** -6, "three_bytes": 2.0 ** -22}[mode]
    bound = rounding * (block_max @ w.abs().T) + 4e-6 * (x.double().abs() @ w.abs().T)
    assert bool(((got - expected).abs() <= bound).all())
    for rows in (1, 3, 8, 11):
        assert torch.equal(_linear(x[rows - 1:rows + 8], packed, out, mode).double(), got[rows - 1:rows + 8])
        assert torch.equal(_linear(x[rows:rows + 1], packed, out, mode).double(), got[rows:rows + 1])
    x[4, 40] = float("nan")
    bad = _linear(x, packed, out, mode)
    assert bool(bad[4].isnan().all()) and not bool(bad[5].isnan().any())


@needs_kernel
@pytest.mark.parametrize("mode", ["int8", "three_bytes"])
def test_prefetch_distances_change_no_result(mode):
    """How far ahead the integer kernels prefetch their weights (``set_prefetch``) is timing only:
    K-quant and Q8_0/Q4_1 blocks give bitwise the same outputs with no prefetch, the near stream
    alone or both; distances that are not whole cache lines are refused."""
    from jakiro.models import quant
    from test_quant import quantized_matrix
    x = torch.randn(11, 512, generator=torch.Generator().manual_seed(5))
    kq = smallgemm.kq_pack(torch.from_numpy(random_blocks(T.Q4_K, 48, 512, seed=6)))
    raw, _ = quantized_matrix("q4_1", 48, 512, seed=7)
    q41 = smallgemm.tile_layout(quant.pack_blocks(raw, "q4_1", 48, 512)) if smallgemm.int8_enabled() else None
    default = smallgemm.set_prefetch(0, 0)
    try:
        outputs = {}
        for setting in ((0, 0), (2048, 0), (2048, 16384), (64, 1 << 20)):
            smallgemm.set_prefetch(*setting)
            outputs[setting] = [_linear(x, w, 48, mode) for w in (kq, q41) if w is not None]
        first = outputs[(0, 0)]
        assert all(torch.equal(a, b) for out in outputs.values() for a, b in zip(out, first))
        with pytest.raises(RuntimeError, match="multiples of 64"):
            smallgemm.set_prefetch(100, 0)
    finally:
        smallgemm.set_prefetch(*default)
    assert default == (2048, 16384)


@needs_kernel
def test_the_packed_layout_holds_about_the_files_bytes():
    for kind, most in ((T.Q4_K, 1.03), (T.Q6_K, 1.0), (T.Q5_0, 1.34), (T.Q2_K, 1.0), (T.Q3_K, 1.04), (T.Q5_K, 1.03)):
        raw = random_blocks(kind, 64, 1024)
        assert smallgemm.kq_pack(torch.from_numpy(raw)).numel() <= most * raw.size, kind.name


# ------------------------------------------------------------------ tiny models
ARCH_SHAPES = {"llama": {}, "qwen2": {}, "qwen3": dict(hidden=256, heads=2, kv_heads=1, head_dim=128)}


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    return root, {arch: write_model(str(root / f"tiny-{arch}.gguf"), arch, **shape)
                  for arch, shape in ARCH_SHAPES.items()}


def _load(path, cache, **runtime):
    from jakiro.models.hub import resolve_target
    from jakiro.models.target import TargetModel
    from jakiro.settings import Runtime
    return TargetModel.from_folder(resolve_target(path, cache=str(cache)), Runtime.from_env(**runtime))


def _prompt_steps_tree(model, ids):
    """The logits of 70 tokens: a prompt of 60, four decoding steps, a causal tree of 6."""
    cache = model.new_cache(80, scratch=8)
    logits, _ = model(ids[:60], cache, chunked=True)
    cache.commit(60)
    steps = []
    for i in range(60, 64):
        steps.append(model(ids[i:i + 1], cache)[0])
        cache.commit(1)
    tree, _ = model(ids[64:70], cache, torch.arange(64, 70), torch.ones(6, 6, dtype=torch.bool).tril_())
    return torch.cat((logits, *steps, tree))


@needs_kernel
@pytest.mark.parametrize("arch", ARCH_SHAPES)
def test_tiny_gguf_models_give_hugging_faces_logits(tiny_files, arch):
    """A prompt, decoding steps after it and a tree: Hugging Face's float32 model of the same file
    (its own GGUF loading: dequantized, Llama's Q and K rows reordered) within float32 accuracy;
    the model holds no float32 copy of its matrices."""
    from transformers import AutoModelForCausalLM
    from jakiro.models.linear import BlockLinear
    root, files = tiny_files
    model = _load(files[arch], root)
    assert model.blocks_only and all(isinstance(layer.qkv, BlockLinear) for layer in model.layers)
    assert [len(layer.qkv.parts) for layer in model.layers] == [2, 2]  # q and k in one layout, v (Q6_K) apart
    hf = AutoModelForCausalLM.from_pretrained(str(root), gguf_file=os.path.basename(files[arch]), dtype=torch.float32)
    ids = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref32 = hf(ids[None]).logits[0]
        ref = hf.double()(ids[None]).logits[0]  # the same model in float64
    ours = _prompt_steps_tree(model, ids).double()
    # float32 accuracy: no farther from the float64 model than Hugging Face's float32 one (twice its
    # largest error: random weights make small differences grow from layer to layer)
    hf_error = float((ref32.double() - ref).abs().max())
    assert float((ours - ref).abs().max()) <= 2 * hf_error + 1e-6 * float(ref.abs().max())
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@needs_kernel
@pytest.mark.parametrize("kv_cache", ["float32", "float16"])
@pytest.mark.parametrize("int8", [False, pytest.param(True, marks=needs_kq_int8)])
def test_a_tokens_logits_are_bitwise_the_same_alone_and_in_a_tree(tiny_files, int8, kv_cache):
    root, files = tiny_files
    model = _load(files["qwen2"], root, int8_activations=int8, kv_cache=kv_cache)
    assert model.input_bytes == (1 if int8 else 3)
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(2))
    cache = model.new_cache(64, scratch=40)
    assert cache.data.dtype == (torch.float16 if kv_cache == "float16" else torch.float32)
    model(ids, cache, chunked=True)
    cache.commit(40)
    chain = torch.randint(0, 256, (36,), generator=torch.Generator().manual_seed(3))
    tree, _ = model(chain, cache, torch.arange(40, 76), torch.ones(36, 36, dtype=torch.bool).tril_())
    for i in range(36):
        single, _ = model(chain[i:i + 1], cache)
        assert torch.equal(single[0], tree[i])
        cache.commit(1)


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_float16_cache_stays_within_its_rounding_of_the_float32_one(tiny_files, arch):
    """Keys and values held as float16 (half the bytes a token of context takes): a prompt, steps
    after it and a tree give the float32 cache's logits within what rounding every cached key and
    value to float16 (relative 2^-11) moves them through these random layers (measured: 0.6-1e-3
    of the largest logit; a misplaced or misread entry moves them by its whole size), and the next
    tokens greedy picks (float32-accurate inputs: int8 ones make any rounding a different
    computation)."""
    root, files = tiny_files
    logits = {}
    for kind in ("float32", "float16"):
        model = _load(files[arch], root, kv_cache=kind, int8_activations=False)
        assert model.runtime.kv_cache == kind
        assert model.new_cache(8).data.element_size() == (2 if kind == "float16" else 4)
        logits[kind] = _prompt_steps_tree(model, torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(5)))
    exact, half = logits["float32"], logits["float16"]
    assert not torch.equal(exact, half)  # the float16 entries were read
    assert float((half - exact).abs().max()) <= 5e-3 * float(exact.abs().max())
    assert torch.equal(half.argmax(-1), exact.argmax(-1))


@needs_kernel
@pytest.mark.parametrize("int8, asked, held", [
    (False, None, torch.float32), (False, "float16", torch.float16),
    pytest.param(True, None, torch.float16, marks=needs_kq_int8),
    pytest.param(True, "float32", torch.float32, marks=needs_kq_int8)])
def test_the_kv_cache_is_float16_with_int8_inputs_unless_asked(tiny_files, int8, asked, held):
    """By default keys and values are float16 where the inputs are int8 (llama.cpp's computation)
    and float32 where they are float32-accurate (Hugging Face's logits within float32 rounding)."""
    root, files = tiny_files
    model = _load(files["llama"], root, int8_activations=int8, kv_cache=asked)
    assert model.new_cache(16).data.dtype == held and model.new_batch_cache(2, 16).data.dtype == held
    assert model.runtime.kv_cache == str(held).removeprefix("torch.")


def test_a_float16_cache_needs_a_target_run_from_its_blocks(tiny_files, tiny_llama_dir):
    """Only the kernels read float16 entries: a float32 copy of a GGUF file or a Hugging Face
    folder is refused in one line, as is a cache type that does not exist."""
    from jakiro.settings import Runtime
    root, files = tiny_files
    with pytest.raises(JakiroError, match="float16 KV cache needs a GGUF target run from its own blocks"):
        _load(files["llama"], root, quantized=False, kv_cache="float16")
    with pytest.raises(JakiroError, match="float16 KV cache needs a GGUF target"):
        _load(tiny_llama_dir, root, kv_cache="float16")
    with pytest.raises(JakiroError, match="KV cache holds float32 or float16, not 'int4'"):
        Runtime(kv_cache="int4")


@needs_kernel
def test_prompts_up_to_a_4k_context_run_in_pieces(tmp_path):
    """A 4,096-token context: the prompt runs through the kernels in pieces, its last logits as
    Hugging Face's, and the cache refuses one token more."""
    from transformers import AutoModelForCausalLM
    path = write_model(str(tmp_path / "long.gguf"), "llama", layers=1, heads=2, kv_heads=1, context=4096)
    model = _load(path, tmp_path)
    ids = torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(4))
    cache = model.new_cache(4096)
    logits, _ = model(ids, cache, logits_rows=slice(-1, None), chunked=True)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="long.gguf", dtype=torch.float32)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0, -1:]
    torch.testing.assert_close(logits, ref, atol=1e-5 * float(ref.abs().max()), rtol=0)
    with pytest.raises(JakiroError, match="context length is 4096"):
        model.new_cache(4097)


# ------------------------------------------------------------------ refusals
def _write_raw(path, arch="qwen2", tensors=()):
    import gguf
    w = gguf.GGUFWriter(str(path), arch)
    for name, data, kind in tensors:
        w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_files_the_runtime_cannot_run_are_refused_in_one_line(tmp_path, tiny_files):
    from jakiro.models.gguf_file import describe
    root, files = tiny_files
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(open(files["qwen2"], "rb").read()[:-5000])
    with pytest.raises(JakiroError, match="not a readable GGUF file: truncated or corrupted"):
        describe(str(truncated))
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(os.urandom(4096))
    with pytest.raises(JakiroError, match="not a readable GGUF file"):
        describe(str(garbage))
    emb = np.zeros((16, 64), dtype=np.float32)
    with pytest.raises(JakiroError, match="architecture 'gemma3' is not supported"):
        describe(_write_raw(tmp_path / "gemma.gguf", "gemma3", [("token_embd.weight", emb, T.F32)]))
    iq = np.zeros((16, 2 * 18), dtype=np.uint8)  # IQ4_NL blocks: no kernel
    with pytest.raises(JakiroError, match="token_embd.weight is IQ4_NL, which jakiro has no kernel for"):
        describe(_write_raw(tmp_path / "iq.gguf", "qwen2", [("token_embd.weight", iq, T.IQ4_NL)]))
    with pytest.raises(JakiroError, match="'blk.0.ssm_in.weight' has no place"):
        describe(_write_raw(tmp_path / "odd.gguf", "qwen2", [("token_embd.weight", emb, T.F32),
                                                              ("blk.0.ssm_in.weight", emb, T.F32)]))


def test_cli_reports_a_bad_gguf_file_in_one_line(tmp_path, capsys):
    from jakiro.cli import main
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(100))
    assert main(["generate", "--target", str(bad), "--prompt", "hi", "--cache-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) >= 1 and err[-1].startswith("jakiro: error: ") and "not a readable GGUF file" in err[-1]
    assert main(["generate", "--target", "qwen2.5-coder-1.5b", "--prompt", "hi", "--cache-dir", str(tmp_path)]) == 2
    assert "run `jakiro models pull qwen2.5-coder-1.5b`" in capsys.readouterr().err


@needs_kernel
def test_a_changed_file_is_read_anew(tmp_path):
    """The cached description is keyed by the file: a file rewritten with other weights in place
    gets a new description rather than stale offsets."""
    from jakiro.models.hub import resolve_target
    path = str(tmp_path / "m.gguf")
    write_model(path, "qwen2", layers=1)
    first = resolve_target(path, cache=str(tmp_path))
    write_model(path, "qwen2", layers=2)
    second = resolve_target(path, cache=str(tmp_path))
    assert first != second and len(_load(path, tmp_path).layers) == 2
