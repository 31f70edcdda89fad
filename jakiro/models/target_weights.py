"""A target's weights as the forward takes them: a Hugging Face folder's float32 tensors
(``state_layers``) or a GGUF file's own blocks laid out for the kernels (``gguf_layers``)."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

import torch

from ..errors import JakiroError
from .linear import BlockLinear, FastLinear

if TYPE_CHECKING:
    from .target_config import TargetConfig


class Layer:
    __slots__ = ("input_norm", "post_norm", "qkv", "o", "gate_up", "down", "q_norm", "k_norm")


def load_state_dict(folder: str) -> dict[str, torch.Tensor]:
    """A model folder's weights in float32 under their Hugging Face names: its safetensors, or for
    a GGUF file's folder (``gguf_file``) the file's tensors dequantized."""
    from . import gguf_file
    if gguf_file.is_gguf_folder(folder):
        from transformers import AutoConfig
        hf_config = AutoConfig.from_pretrained(folder)
        heads = hf_config.num_attention_heads
        return gguf_file.GGUFWeights(folder).state_dict(heads, getattr(hf_config, "num_key_value_heads", heads))
    from safetensors.torch import load_file
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(p for p in os.listdir(folder) if p.endswith(".safetensors"))
    if not files:
        raise JakiroError(f"no .safetensors weights found in {folder}")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            state.update(load_file(os.path.join(folder, name)))
        except Exception as exc:  # corrupted / truncated file
            raise JakiroError(f"cannot read weights {os.path.join(folder, name)}: {exc}") from None
    return state


def state_layers(cfg: TargetConfig, state: dict[str, torch.Tensor], dtype: torch.dtype):
    """(embedding, layers, final norm, LM head) from a float state dict, every key used once."""
    prefix = "model." if any(k.startswith("model.") for k in state) else ""
    used: set[str] = set()

    def take(key: str) -> torch.Tensor:
        full = prefix + key if not key.startswith("lm_head") else key
        if full not in state:
            raise JakiroError(f"missing weight {full!r} in target checkpoint")
        used.add(full)
        return state[full].to(dtype)

    embed = take("embed_tokens.weight").contiguous()  # [vocab, d]
    if embed.shape != (cfg.vocab_size, cfg.hidden_size):
        raise JakiroError(f"embedding shape {tuple(embed.shape)} does not match config "
                          f"({cfg.vocab_size}, {cfg.hidden_size})")
    layers: list[Layer] = []
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        layer = Layer()
        layer.input_norm = take(p + "input_layernorm.weight")
        layer.post_norm = take(p + "post_attention_layernorm.weight")
        qkv_b = (torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"], 0) if cfg.qkv_bias else None)
        layer.qkv = FastLinear(torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"], 0), qkv_b)
        layer.o = FastLinear(take(p + "self_attn.o_proj.weight"))
        layer.gate_up = FastLinear(torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], 0))
        layer.down = FastLinear(take(p + "mlp.down_proj.weight"))
        layer.q_norm = take(p + "self_attn.q_norm.weight") if cfg.qk_norm else None
        layer.k_norm = take(p + "self_attn.k_norm.weight") if cfg.qk_norm else None
        layers.append(layer)
    norm = take("norm.weight")
    if "lm_head.weight" in state and not cfg.tie_word_embeddings:
        head = take("lm_head.weight")
    else:
        used.add("lm_head.weight")
        head = embed
    unexpected = [k for k in state if k not in used and "rotary_emb" not in k]
    if unexpected:
        raise JakiroError(f"unexpected weights in target checkpoint: {', '.join(unexpected[:5])}"
                          + (" ..." if len(unexpected) > 5 else ""))
    return embed, layers, norm, FastLinear(head, keep_weight=True)


def gguf_layers(cfg: TargetConfig, weights, input_bytes: int):
    """(embedding rows as the file holds them, layers, final norm, LM head) streamed from a GGUF
    file's own blocks (``linear.BlockLinear``): each matrix read from the file once and laid out
    for the kernels; the embedding stays memory-mapped (only the rows used become resident)."""
    from .gguf_file import llama_row_order

    def vector(name: str) -> torch.Tensor:
        return weights.raw(name, copy=True).to(torch.float32)

    def rows_order(name: str, heads: int):  # Llama files hold Q and K rows in llama.cpp's rotary order
        if weights.architecture != "llama":
            return None
        return torch.from_numpy(llama_row_order(weights.shape(name)[0], heads))

    def linear(names: list[str], orders=None, bias=None, keep=False) -> BlockLinear:
        parts = [(weights.type(n), weights.raw(n, copy=True)) for n in names]
        return BlockLinear(parts, bias, input_bytes, orders, keep=weights.raw(names[0]) if keep else None)

    layers = []
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        layer = Layer()
        layer.input_norm = vector(p + "attn_norm.weight")
        layer.post_norm = vector(p + "ffn_norm.weight")
        orders = [rows_order(p + "attn_q.weight", cfg.num_heads), rows_order(p + "attn_k.weight", cfg.num_kv_heads),
                  None]
        bias = None
        if cfg.qkv_bias:
            biases = [vector(p + f"attn_{n}.bias") for n in "qkv"]
            bias = torch.cat([b if o is None else b[o] for b, o in zip(biases, orders)])
        layer.qkv = linear([p + f"attn_{n}.weight" for n in "qkv"], orders, bias)
        layer.o = linear([p + "attn_output.weight"])
        layer.gate_up = linear([p + "ffn_gate.weight", p + "ffn_up.weight"])
        layer.down = linear([p + "ffn_down.weight"])
        layer.q_norm = vector(p + "attn_q_norm.weight") if cfg.qk_norm else None
        layer.k_norm = vector(p + "attn_k_norm.weight") if cfg.qk_norm else None
        layers.append(layer)
    head = "output.weight" if "output.weight" in weights else "token_embd.weight"
    return weights.raw("token_embd.weight"), layers, vector("output_norm.weight"), linear([head], keep=True)
