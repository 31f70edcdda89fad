"""Block-quantized weights for the small-batch kernel.

A target converted from a GGUF file was stored there in blocks of 32 values w = d * q + m
(Q4_1: 4-bit q; Q8_0: 8-bit q, m = 0) and dequantized to float32 once. Streaming those blocks
instead of the float32 copy reads a fifth of the bytes per forward; the kernel dequantizes in
registers to the very same float32 values (``csrc/smallgemm.cpp``), so only the order of the
additions differs from the float32 path, as between any two kernels.

The packed blocks are built once from the GGUF file named in the converted folder, each matrix
checked to dequantize bitwise to the float32 weight it stands for (a matrix that does not, or
whose type the kernel does not know, stays float32), and cached next to the weights in
``QUANT_FILE``. On by default; ``JAKIRO_QUANTIZED=0`` (or ``--float32``) streams the float32 copy.

Int8 activations (``JAKIRO_INT8_ACTIVATIONS=1`` or ``--int8-activations``; off by default): the
kernel also takes each input row as one byte per block of 32 values, as llama.cpp's Q8
activations, and multiplies bytes by bytes (``csrc/int8.cpp`` with AVX-512 VNNI, ``csrc/amx.cpp``
with AMX tiles): plain decoding and every tree forward cost less, and an extra tree token costs
about half as much, for a rounding of each input to 2^-7 of its block's largest value. The target
is then that computation: plain decoding and every speculative method share it (and stay exactly
equal to each other), but its greedy text is no longer the float32 weights' token for token.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import torch

QUANT_FILE = "jakiro-quantized.blocks"  # safetensors format; not *.safetensors, which are the weights
SOURCE_FILE = "jakiro-source.json"
KERNEL_OF = {"Q4_1": "q4_1", "Q8_0": "q8_0"}  # GGUF type -> packed kind
_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}


def enabled() -> bool:
    """Whether targets converted from GGUF files stream their blocks (the default)."""
    return os.environ.get("JAKIRO_QUANTIZED", "1") not in ("", "0")


def int8_activations() -> bool:
    """Whether targets take their inputs as int8 blocks (``JAKIRO_INT8_ACTIVATIONS=1``; off by default)."""
    return os.environ.get("JAKIRO_INT8_ACTIVATIONS", "0") not in ("", "0")


def record_source(folder: str, gguf_path: str) -> None:
    """Note which GGUF file a converted folder came from (its blocks are read from there)."""
    with open(os.path.join(folder, SOURCE_FILE), "w") as f:
        json.dump({"gguf": os.path.abspath(gguf_path)}, f)


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face state-dict key of a GGUF tensor name (None for tensors not handled)."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.weight"
    return None


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


def _llama_row_order(rows: int, heads: int) -> np.ndarray:
    """Row order GGUF's Llama converter gives Q and K (undone by transformers on loading)."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(2, 1).reshape(rows)


def build(gguf_path: str, state: dict[str, torch.Tensor], hf_config, log=None) -> dict[str, torch.Tensor]:
    """{"<hf key>::<kind>": packed blocks} for every matrix whose blocks reproduce ``state``."""
    from gguf import GGUFReader
    reader = GGUFReader(gguf_path)
    heads = getattr(hf_config, "num_attention_heads", None)
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    out, skipped = {}, []
    for t in reader.tensors:
        key, kind = hf_name(t.name), KERNEL_OF.get(t.tensor_type.name)
        if key is None or kind is None or key not in state:
            continue
        weight = state[key].to(torch.float32)
        rows, cols = weight.shape
        if cols % 32:
            continue
        packed = pack_blocks(np.asarray(t.data), kind, rows, cols)
        orders = [None]
        if heads and (".attn_q." in t.name or ".attn_k." in t.name):
            orders.append(_llama_row_order(rows, heads if ".attn_q." in t.name else kv_heads))
        for order in orders:
            candidate = packed if order is None else packed[torch.from_numpy(order)].contiguous()
            if torch.equal(dequantize(candidate, kind), weight):
                out[f"{key}::{kind}"] = candidate
                break
        else:
            skipped.append(key)
    if skipped and log:
        log(f"{len(skipped)} quantized matrices do not reproduce the float32 weights and stay float32 "
            f"(first: {skipped[0]})")
    return out


def load_blocks(folder: str, state: dict[str, torch.Tensor], hf_config, log=None) -> dict[str, tuple[str, torch.Tensor]]:
    """{hf key: (kind, packed blocks)} for a converted folder (built and cached on first use);
    empty where the folder did not come from a GGUF file."""
    from safetensors.torch import load_file, save_file
    cached = os.path.join(folder, QUANT_FILE)
    if not os.path.exists(cached):
        source = os.path.join(folder, SOURCE_FILE)
        if not os.path.exists(source):
            return {}
        with open(source) as f:
            gguf_path = json.load(f).get("gguf", "")
        if not os.path.exists(gguf_path):
            if log:
                log(f"the GGUF file this model came from is gone ({gguf_path}): float32 weights only")
            return {}
        blocks = build(gguf_path, state, hf_config, log)
        save_file(blocks, cached + ".tmp")
        os.replace(cached + ".tmp", cached)
    else:
        blocks = load_file(cached)
    return {name.split("::")[0]: (name.split("::")[1], t) for name, t in blocks.items()}


def concatenated(parts: list[tuple[str, torch.Tensor] | None]) -> tuple[str, torch.Tensor] | None:
    """Blocks of matrices stacked along their rows (q, k, v; gate, up), if all share one kind."""
    if any(p is None for p in parts) or len({p[0] for p in parts}) != 1:
        return None
    return parts[0][0], torch.cat([p[1] for p in parts], 0)
