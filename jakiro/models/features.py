"""The target's features for padded batches of whole sequences, on any device.

Training a draft on a GPU is cheaper with the features computed on the fly than stored: a forward
of a 135M-parameter target over a batch costs about what one unrolled draft step's training does,
where the stored features of nine million tokens with two mid-layer streams take 30 GB. This is
the same decoder stack as ``TargetModel`` (float32 weights, rotate-half RoPE, grouped-query
attention, RMSNorm, SwiGLU), written for [batch, tokens] inputs with plain torch operations and no
cache: sequences are padded on the right, so causal attention keeps every real token's features
independent of the padding after it.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ..errors import JakiroError
from .target_config import TargetConfig, rope_tables
from .torch_stack import attention_inputs, attention_output_and_mlp
from .target_weights import load_state_dict


class FeatureModel(torch.nn.Module):
    """features(ids [B, T]) -> [B, T, (1 + A) d]: the final norm's output, then the residual
    stream after each of ``aux_layers`` decoder layers, the layout ``TargetModel.forward`` gives."""

    def __init__(self, folder: str, aux_layers: tuple[int, ...] = (), device: str | torch.device = "cpu",
                 with_head: bool = False):
        """``with_head``: also keep the LM head as ``head`` (the embedding where they are tied), for
        generation (``DeviceTarget``)."""
        super().__init__()
        from transformers import AutoConfig
        hf_config = AutoConfig.from_pretrained(folder)
        self.config = cfg = TargetConfig.from_hf(hf_config, os.path.basename(os.path.normpath(folder)))
        cfg.check_aux_layers(aux_layers)
        self.aux_layers = tuple(aux_layers)
        state = load_state_dict(folder)
        prefix = "model." if any(k.startswith("model.") for k in state) else ""

        def take(key: str) -> torch.Tensor:
            if prefix + key not in state:
                raise JakiroError(f"missing weight {prefix + key!r} in target checkpoint {folder}")
            return state[prefix + key].float()

        self.embed = torch.nn.Parameter(take("embed_tokens.weight"), requires_grad=False)
        self.weights = torch.nn.ParameterList()  # per layer, in the order ``_layer`` reads them
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            qkv = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"], 0)
            bias = (torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"], 0) if cfg.qkv_bias
                    else torch.zeros(qkv.shape[0]))
            norms = ((take(p + "self_attn.q_norm.weight"), take(p + "self_attn.k_norm.weight")) if cfg.qk_norm
                     else (torch.ones(cfg.head_dim), torch.ones(cfg.head_dim)))
            for w in (take(p + "input_layernorm.weight"), qkv, bias, *norms, take(p + "self_attn.o_proj.weight"),
                      take(p + "post_attention_layernorm.weight"),
                      torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], 0),
                      take(p + "mlp.down_proj.weight")):
                self.weights.append(torch.nn.Parameter(w, requires_grad=False))
        self.norm = torch.nn.Parameter(take("norm.weight"), requires_grad=False)
        self.head: torch.Tensor | torch.nn.Parameter | None = None
        if with_head:
            untied = "lm_head.weight" in state and not cfg.tie_word_embeddings
            self.head = (torch.nn.Parameter(state["lm_head.weight"].float(), requires_grad=False) if untied
                         else self.embed)
        cos, sin = rope_tables(hf_config, cfg.head_dim, cfg.max_context)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.to(device)

    @property
    def width(self) -> int:
        return (1 + len(self.aux_layers)) * self.config.hidden_size

    def attention_inputs(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Layer i's rotated q [B, T, H, D], k and v [B, T, Hkv, D] of x [B, T, d]; cos, sin
        broadcast against [B, T, 1, D]."""
        in_norm, qkv_w, qkv_b, q_norm, k_norm = self.weights[9 * i: 9 * i + 5]
        qk_norms = (q_norm, k_norm) if self.config.qk_norm else (None, None)
        return attention_inputs(self.config, x, in_norm, lambda h: F.linear(h, qkv_w, qkv_b), *qk_norms, cos, sin)

    def attention_output_and_mlp(self, i: int, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """The rest of layer i after attention: x [B, T, d], the heads' outputs o [B, H, T, D]."""
        cfg = self.config
        o_w, post_norm, gate_up, down = self.weights[9 * i + 5: 9 * i + 9]
        B, T, _ = x.shape
        return attention_output_and_mlp(cfg, x, o.transpose(1, 2).reshape(B, T, cfg.num_heads * cfg.head_dim),
                                        lambda h: F.linear(h, o_w), post_norm, lambda h: F.linear(h, gate_up),
                                        lambda h: F.linear(h, down))

    def _layer(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        q, k, v = self.attention_inputs(i, x, cos, sin)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, scale=cfg.head_dim ** -0.5,
                                           enable_gqa=cfg.num_heads != cfg.num_kv_heads)
        return self.attention_output_and_mlp(i, x, o)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """``lengths`` [B]: each sequence's real length (features past it are then zero). On the
        CPU each sequence then runs on its own, without its padding (on one Zen 4 thread 1.37x the
        real tokens a second for batches of 8 self-distilled conversations, 74 % of them real:
        docs/experiments/train_throughput.py --features); a GPU runs the padded batch at once."""
        B, T = ids.shape
        if T > self.config.max_context:
            raise JakiroError(f"{T} tokens exceed the target's context of {self.config.max_context}")
        if lengths is None or ids.device.type != "cpu":
            out = self._padded(ids)
            if lengths is not None:
                out = out * (torch.arange(T, device=ids.device) < lengths.to(ids.device)[:, None])[..., None]
            return out
        out = torch.zeros(B, T, self.width)
        for b, n in enumerate(lengths.tolist()):
            if n > 0:
                out[b, :n] = self._padded(ids[b:b + 1, :n])[0]
        return out

    def _padded(self, ids: torch.Tensor) -> torch.Tensor:
        B, T = ids.shape
        cos, sin = self.cos[:T].view(1, T, 1, -1), self.sin[:T].view(1, T, 1, -1)
        x = self.embed[ids]
        streams = []
        for i in range(self.config.num_layers):
            x = self._layer(i, x, cos, sin)
            if i + 1 in self.aux_layers:
                streams.append(x)
        final = F.rms_norm(x, (x.shape[-1],), self.norm, self.config.rms_norm_eps)
        return torch.cat((final, *streams), -1)
