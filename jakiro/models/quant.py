"""GGUF blocks as the small-batch kernels take them.

A GGUF target is run from its file's own blocks (``gguf_file``, ``linear.BlockLinear``): each
matrix laid out once for the kernels (``lay_out``): Q4_1 and Q8_0 as blocks of 32 values
w = d * q + m with d and m in float32 (``pack_blocks``; the AMX and int8 kernels lay them out
further), the other block types (Q4_0, Q5_0, Q5_1, Q2_K..Q6_K) in ``csrc/kquants.cpp``'s layout.
Every kernel dequantizes in registers to the very values of GGUF's reference dequantization, so
only the order of the additions differs from a float32 model (``--float32``,
``Runtime(quantized=False)``, runs such a copy).

Int8 activations (the default where the CPU has AVX-512 VNNI or AMX; ``--float32-inputs``,
``Runtime(int8_activations=False)``, turns them off): the kernels
take each input row as one byte per block of 32 values, as llama.cpp's Q8
activations, and multiply bytes by bytes (``csrc/int8.cpp`` and ``csrc/kquants.cpp`` with
AVX-512 VNNI, ``csrc/amx.cpp`` with AMX tiles): plain decoding and every tree forward cost less,
and an extra tree token costs about half as much, for a rounding of each input to 2^-7 of its
block's largest value. The target is then that computation: plain decoding and every speculative
method share it (and stay exactly equal to each other), but its greedy text is no longer the
float32 weights' token for token.
"""
from __future__ import annotations

import numpy as np
import torch

KERNEL_OF = {"Q4_1": "q4_1", "Q8_0": "q8_0"}  # GGUF types the float32 / AMX / int8 kernels take as blocks


def int8_activations_default() -> bool:
    """Whether a GGUF target takes its inputs as int8 blocks when its ``Runtime`` leaves it open:
    wherever the CPU has the kernels for it (AVX-512 VNNI or AMX), as llama.cpp computes these
    files (on two cores a 1.5B target's one-token forward 0.69 x the float32-accurate one's, a
    tree of 8 tokens 1.4 x one token instead of 4 x)."""
    from . import smallgemm
    return smallgemm.available() and smallgemm.int8_activations_usable()


def pack_blocks(raw: np.ndarray, kind: str, rows: int, cols: int) -> torch.Tensor:
    """GGUF blocks (Q4_1: fp16 d, fp16 m, 16 bytes; Q8_0: fp16 d, 32 bytes) of a [rows, cols]
    matrix -> the kernel's [rows, cols / 32, 8 + payload] bytes: float32 d and m, then q."""
    nb = cols // 32
    width = 20 if kind == "q4_1" else 34
    blocks = np.ascontiguousarray(raw).reshape(rows, nb, width)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)
    if kind == "q4_1":
        m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
        payload = blocks[..., 4:]
    else:
        m = np.zeros_like(d)
        payload = blocks[..., 2:]
    out = np.concatenate((d.view(np.uint8), m.view(np.uint8), payload), axis=-1)
    return torch.from_numpy(np.ascontiguousarray(out))


def dequantize(packed: torch.Tensor, kind: str) -> torch.Tensor:
    """The float32 matrix a packed one stands for (as GGUF's reference dequantization computes it)."""
    raw = packed.numpy()
    rows, nb, _ = raw.shape
    d = raw[..., 0:4].copy().view(np.float32)
    m = raw[..., 4:8].copy().view(np.float32)
    if kind == "q4_1":
        qs = raw[..., 8:]
        q = np.concatenate((qs & 0x0F, qs >> 4), axis=-1).astype(np.float32)
        w = d * q + m
    else:
        w = raw[..., 8:].view(np.int8).astype(np.float32) * d
    return torch.from_numpy(np.ascontiguousarray(w.reshape(rows, nb * 32)))


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """A float32 [rows, cols] matrix (cols a multiple of 32) rounded to Q8_0 blocks, packed for
    the kernel: per block d = max|w| / 127, q = round(w / d). For weights the runtime owns rather
    than reads from a GGUF file, a draft's: rounding them changes what a draft proposes, never
    what verification accepts."""
    rows, cols = weight.shape
    blocks = weight.detach().float().reshape(rows, cols // 32, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, blocks / torch.where(d > 0, d, 1), 0).round().clamp_(-127, 127).to(torch.int8)
    head = torch.cat((d, torch.zeros_like(d)), -1).contiguous().view(torch.uint8)
    return torch.cat((head, q.view(torch.uint8)), -1).contiguous()


def row_width(rows: torch.Tensor) -> int:
    """Values per row of a matrix as a GGUF file holds it ([rows, blocks, bytes] or [rows, cols])."""
    if rows.dtype != torch.uint8:
        return int(rows.shape[1])
    from gguf import GGML_QUANT_SIZES
    per_block = {size: block for block, size in GGML_QUANT_SIZES.values()}
    return int(rows.shape[1]) * per_block[int(rows.shape[2])]


def lay_out(kind: str, rows: torch.Tensor) -> torch.Tensor:
    """A matrix's rows as a GGUF file holds them (``kind`` its type: 'Q4_K', 'F16', ...) in the
    layout the small-batch kernels read: Q4_1 and Q8_0 blocks as ``pack_blocks`` and
    ``smallgemm.tile_layout`` lay them out, the other block types as ``smallgemm.kq_pack`` does,
    float matrices in float32 as ``smallgemm.pack`` does."""
    from . import smallgemm
    kind = kind.upper()
    if rows.dtype != torch.uint8:
        return smallgemm.pack(rows.to(torch.float32).contiguous())
    if kind in KERNEL_OF:
        n, nb, _ = rows.shape
        return smallgemm.tile_layout(pack_blocks(rows.numpy(), KERNEL_OF[kind], n, nb * 32))
    return smallgemm.kq_pack(rows.contiguous())
