"""The small-batch linear kernel (``csrc/smallgemm.cpp``): y = x @ W^T for the 1-32 rows of a
decoding step, a verification tree or a draft step, streaming each weight once.

Built on first use (and by ``setup.sh``) with the machine's C++ compiler for its own CPU, cached
under the jakiro cache folder. Where it cannot be built (no compiler, no ninja) or where
``JAKIRO_NO_EXT=1``, the runtime says so once and uses torch's kernels: results stay within
float32 rounding of each other (the logits tests hold either way).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import sys

import torch

CSRC = os.path.join(os.path.dirname(__file__), "csrc")
SOURCE = os.path.join(CSRC, "smallgemm.cpp")
# the fused decoder stack (``decoder_layers``) and the AMX kernel for GGUF blocks
MORE_SOURCES = tuple(os.path.join(CSRC, f) for f in ("decoder.cpp", "amx.cpp", "int8.cpp", "kquants.cpp"))
HEADERS = (os.path.join(CSRC, "kernels.h"),)
FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp"]
_state: dict = {}
Q8_0_BLOCK_BYTES = 40  # a Q8_0 block as the kernels take it: d and m (0) as float32, 32 q bytes
Q4_1_BLOCK_BYTES = 24  # a Q4_1 block: d and m as float32, 16 bytes of nibbles


def _build_dir() -> str:
    from .hub import cache_dir
    return os.path.join(cache_dir(), "ext", f"smallgemm-{build_id()}")


def build_id() -> str:
    """Identifies the kernels' sources, compiler flags, torch and CPU: measurements taken with
    one build (tuned trees, cost curves) are not reused with another."""
    key = hashlib.sha256()
    for path in (SOURCE, *MORE_SOURCES, *HEADERS):
        with open(path, "rb") as f:
            key.update(f.read())
    key.update(" ".join([torch.__version__, sys.version, platform.machine(), *FLAGS, _cpu_flags()]).encode())
    return key.hexdigest()[:12]


def _cpu_flags() -> str:
    """The CPU's feature flags: a kernel built with -march=native is only reused on a CPU that
    has the same ones."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def available() -> bool:
    """Build (once per machine) and load the kernel; False, with one message, where impossible."""
    if "ok" in _state:
        return _state["ok"]
    _state["ok"] = False
    if os.environ.get("JAKIRO_NO_EXT"):
        _state["reason"] = "disabled by JAKIRO_NO_EXT"
        return False
    try:
        from torch.utils.cpp_extension import load
        build = _build_dir()
        os.makedirs(build, exist_ok=True)
        library = os.path.join(build, "jakiro_smallgemm.so")
        if os.path.exists(library):
            torch.ops.load_library(library)
        else:
            print("[jakiro] building the small-batch linear kernel for this CPU (once, ~20 s)", file=sys.stderr)
            load(name="jakiro_smallgemm", sources=[SOURCE, *MORE_SOURCES], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                 build_directory=build, is_python_module=False, verbose=False)
        _state["ok"] = True
        kq_int8()  # the kernel's switch follows JAKIRO_INT8
    except Exception as exc:  # no compiler, no ninja, a failed build: torch's kernels still work
        _state["reason"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        print(f"[jakiro] small-batch linear kernel unavailable ({_state['reason']}); using torch's kernels",
              file=sys.stderr)
    return _state["ok"]


@contextlib.contextmanager
def disabled():
    """Layers built inside use torch's kernels (for side-by-side measurements)."""
    available()
    saved = dict(_state)
    _state.update(ok=False, reason="disabled for comparison")
    try:
        yield
    finally:
        _state.clear()
        _state.update(saved)


@contextlib.contextmanager
def _switched_off(key: str, enabled):
    """Inside, ``enabled()`` (which caches its answer in ``_state[key]``) says False."""
    enabled()
    saved = _state[key]
    _state[key] = False
    try:
        yield
    finally:
        _state[key] = saved


def tiles_disabled():
    """Layers built inside stream GGUF blocks with the portable kernel, not the AMX one (for
    side-by-side measurements)."""
    return _switched_off("amx", tiles_enabled)


def status() -> str:
    """'on', 'on, AMX tiles for GGUF blocks', 'on, int8 kernel (AVX-512 VNNI)' or 'off (why)': reported by
    ``jakiro bench-cost``."""
    if not available():
        return f"off ({_state.get('reason', 'unavailable')})"
    if tiles_enabled():
        return "on, AMX tiles for GGUF blocks"
    return "on, int8 kernel (AVX-512 VNNI)" if int8_enabled() else "on"


def pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.jakiro_smallgemm.pack(weight)


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.jakiro_smallgemm.linear(x, packed, out_features, bias)


def quantized_linear(x: torch.Tensor, blocks: torch.Tensor, out_features: int, input_bytes: int = 3) -> torch.Tensor:
    """x @ W^T for W in GGUF blocks, packed by ``quant.pack_blocks`` or by ``tile_layout``. The
    tile kernel takes each input as ``input_bytes`` bytes per block of 32 values: 3 keeps float32
    accuracy, 1 (int8 inputs, as llama.cpp's Q8 activations) costs a third per row and is for
    drafts, whose proposals need not be exact; the portable kernel always computes in float32."""
    return torch.ops.jakiro_smallgemm.quantized_linear(x, blocks, out_features, input_bytes)


def set_prefetch(l1: int, l2: int) -> tuple[int, int]:
    """Set how far ahead (bytes) the integer kernels prefetch their weights into L1 and L2 (0:
    not at all), for this process; returns the previous distances. For side-by-side
    measurements (docs/experiments/prefetch_ab.py): results do not depend on them."""
    available()
    return tuple(torch.ops.jakiro_smallgemm.set_prefetch(l1, l2))


def weight_buffer(n: int) -> torch.Tensor:
    """``n`` float32 zeros on the memory pages the kernels' weights are laid out in (2 MiB pages
    where the OS allows them): a buffer timed against the weights reads memory as they do."""
    return torch.ops.jakiro_smallgemm.weight_buffer(n)


def tiles_enabled() -> bool:
    """Whether GGUF blocks go through the AMX tile kernel: on CPUs that have it (Sapphire
    Rapids and later, where the kernel was built for one), unless ``JAKIRO_AMX=0``."""
    if "amx" not in _state:
        _state["amx"] = (os.environ.get("JAKIRO_AMX", "1") not in ("", "0") and available()
                         and bool(torch.ops.jakiro_smallgemm.amx_usable()))
    return _state["amx"]


def int8_enabled() -> bool:
    """Whether GGUF blocks go through the int8 kernel (``csrc/int8.cpp``: integer dot products
    of the weights' bytes and the inputs' one byte, drafts and int8 activations, or three, float32
    accuracy): on CPUs with AVX-512 VNNI and without AMX tiles (Zen 4 and later, Ice Lake and
    later), unless ``JAKIRO_INT8=0``."""
    if "int8" not in _state:
        _state["int8"] = (os.environ.get("JAKIRO_INT8", "1") not in ("", "0") and available()
                          and not tiles_enabled() and bool(torch.ops.jakiro_smallgemm.int8_usable()))
    return _state["int8"]


@contextlib.contextmanager
def int8_disabled():
    """Layers built inside stream GGUF blocks (a target's, a draft's) through the float32 kernel,
    not the int8 one, and the packed layout of the other block types (``kq_pack``) goes through the
    portable kernel meanwhile (for side-by-side measurements)."""
    on = kq_int8()
    with _switched_off("int8", int8_enabled), _switched_off("kq_int8", kq_int8):
        torch.ops.jakiro_smallgemm.set_kq_int8(False)
        try:
            yield
        finally:
            torch.ops.jakiro_smallgemm.set_kq_int8(on)


def kq_pack(raw: torch.Tensor) -> torch.Tensor:
    """GGUF blocks [rows, blocks, bytes] of Q4_0, Q5_0, Q5_1 or a K-quant -> the layout both of
    their kernels read (``csrc/kquants.cpp``): int8 [ceil(rows / 16), blocks, bytes'], about the
    blocks' own size."""
    return torch.ops.jakiro_smallgemm.kq_pack(raw)


def gguf_rows(src: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Float32 rows [n, d] of an embedding held as GGUF holds it (raw blocks [V, blocks, bytes]
    of any supported type, or float32 / float16 / bfloat16 [V, d]) for token ids [n]."""
    return torch.ops.jakiro_smallgemm.gguf_rows(src, ids)


def tile_layout(blocks: torch.Tensor) -> torch.Tensor:
    """GGUF blocks [out, in / 32, bytes] in the AMX kernel's layout where that kernel or the int8
    (AVX-512 VNNI) one runs here (out a multiple of 16), else unchanged. Both take the inputs as
    1 or 3 bytes (``quantized_linear``'s ``input_bytes``) with bitwise the same outputs."""
    if blocks.shape[0] % 16:
        return blocks
    int8 = blocks.shape[2] in (Q8_0_BLOCK_BYTES, Q4_1_BLOCK_BYTES) and int8_enabled()
    if not (tiles_enabled() or int8):
        return blocks
    return torch.ops.jakiro_smallgemm.amx_pack(blocks)


def integer_layout(weight: torch.Tensor) -> bool:
    """Whether a kernel weight goes through integer dot products (the AMX or the int8 kernel:
    the tile layout of Q4_1 / Q8_0, or the other block types' layout where the int8 kernel runs)."""
    if weight.dtype == torch.int8:
        return kq_int8()
    return weight.dtype == torch.uint8 and weight.shape[2] in (_TILE_Q4_1, _TILE_Q8_0)


def kq_int8() -> bool:
    """Whether the block types other than Q4_1 and Q8_0 (``kq_pack``) go through the int8 kernel:
    on CPUs with AVX-512 VNNI (AMX CPUs have it too), unless ``JAKIRO_INT8=0``; else the portable
    float32 kernel reads their layout."""
    if "kq_int8" not in _state:
        on = os.environ.get("JAKIRO_INT8", "1") not in ("", "0") and available()
        if on:  # the integer kernel (AVX-512 VNNI, else AVX2) reads their layout, else the float32 one
            torch.ops.jakiro_smallgemm.set_kq_int8(True)
        elif available():
            torch.ops.jakiro_smallgemm.set_kq_int8(False)
        _state["kq_int8"] = on and bool(torch.ops.jakiro_smallgemm.int8_usable())
    return _state["kq_int8"]


def int8_activations_usable() -> bool:
    """Whether targets can take their inputs as int8: the AMX or the int8 kernel for Q4_1 / Q8_0,
    and the int8 kernel for the other block types."""
    return (tiles_enabled() or int8_enabled()) and kq_int8()


_TILE_Q4_1, _TILE_Q8_0 = 384, 576  # bytes per 16 columns and block in the tile layout (csrc/kernels.h)


def decoder_layers(x, weights, out_features, kv, past, cos, sin, tree_mask, num_heads, num_kv_heads, eps, scale,
                   keep_after=(), input_bytes=3):
    """The whole decoder stack for a few new tokens in one call (``csrc/decoder.cpp``); see
    ``TargetModel.forward``. ``keep_after``: also return the residual stream after these many
    layers ([n, 1 + A, d], the last stream first)."""
    return torch.ops.jakiro_smallgemm.decoder_layers(x, weights, out_features, kv, past, cos, sin, tree_mask,
                                                     num_heads, num_kv_heads, eps, scale, list(keep_after),
                                                     input_bytes)


def decoder_layers_batch(x, weights, out_features, kv, lengths, cos, sin, num_heads, num_kv_heads, eps, scale,
                         keep_after=(), input_bytes=3):
    """One new token for each of a batch of independent sequences through the whole decoder stack
    (``csrc/decoder.cpp``); see ``TargetModel.decode_batch`` and ``decoder_layers``."""
    return torch.ops.jakiro_smallgemm.decoder_layers_batch(x, weights, out_features, kv, lengths, cos, sin,
                                                           num_heads, num_kv_heads, eps, scale, list(keep_after),
                                                           input_bytes)


def decoder_layers_ragged(x, weights, out_features, kv, seq, at, prefix, mask, cos, sin, num_heads, num_kv_heads, eps,
                          scale, keep_after=(), input_bytes=3):
    """Several sequences' draft trees through the whole decoder stack in one call
    (``csrc/decoder.cpp``); see ``TargetModel.verify_batch``."""
    return torch.ops.jakiro_smallgemm.decoder_layers_ragged(x, weights, out_features, kv, seq, at, prefix, mask, cos,
                                                            sin, num_heads, num_kv_heads, eps, scale, list(keep_after),
                                                            input_bytes)


def draft_attend(features, tokens, embed, fc, fc_bias, norm, qkv, o, kv, past, cos_table, sin_table, positions,
                 mask, num_heads, num_kv_heads, eps, scale, input_bytes=3):
    """A draft step's fusion layer and attention block in one call (``csrc/decoder.cpp``): the
    rows' token embeddings and rotary angles are gathered from ``embed`` and the tables there;
    see ``DraftModel.attend``."""
    return torch.ops.jakiro_smallgemm.draft_attend(features, tokens, embed, fc, fc_bias, norm, qkv, o, kv, past,
                                                   cos_table, sin_table, positions, mask, num_heads, num_kv_heads,
                                                   eps, scale, input_bytes)


def draft_mlp_head(r, norm, gate_up, down, inter, head, vocab, k, eps, input_bytes=3):
    """The MLP, the head and its top-k of an EAGLE-2 draft step in one call (``csrc/decoder.cpp``);
    see ``DraftModel.mlp_head_topk``."""
    return torch.ops.jakiro_smallgemm.draft_mlp_head(r, norm, gate_up, down, inter, head, vocab, k, eps, input_bytes)


def draft_chain(features, tokens, steps, embed, fc, fc_bias, in_norm, qkv, o, kv, past, cos_table, sin_table,
                num_heads, num_kv_heads, scale, post_norm, gate_ups, downs, inter, router, con_router, head, head_ids,
                eps, input_bytes=3, draws=None, temperature=1.0):
    """A draft's whole chain proposal in one call (``csrc/decoder.cpp``): the catch-up's attention
    over the rows committed since the last proposal, then ``steps`` times its MLP or first-ranked
    expert, the head's best row (or, with ``draws``, a row drawn from softmax(logits / temperature))
    and the next step's attention; with ``con_router`` also the contrastive branch's token.
    Returns (rows, log-probs, the distributions drawn from [steps, V] or empty). See ``DraftModel.chain``."""
    return torch.ops.jakiro_smallgemm.draft_chain(features, tokens, steps, embed, fc, fc_bias, in_norm, qkv, o, kv,
                                                  past, cos_table, sin_table, num_heads, num_kv_heads, scale,
                                                  post_norm, gate_ups, downs, inter, router, con_router, head,
                                                  head_ids, eps, input_bytes, draws, temperature)


def draft_experts_topk(r, norm, gate_ups, downs, inter, head, vocab, router, quotas, eps, input_bytes=3):
    """A decoupled Jakiro draft step's router, experts, head and per-expert top-k in one call
    (``csrc/decoder.cpp``); see ``DraftModel.experts_topk``."""
    return torch.ops.jakiro_smallgemm.draft_experts_topk(r, norm, gate_ups, downs, inter, head, vocab, router, quotas,
                                                         eps, input_bytes)
