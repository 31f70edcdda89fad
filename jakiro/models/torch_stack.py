"""The decoder stack in torch operations, for prompts longer than the one-call kernels take and
where those kernels are unavailable: a mixin of ``TargetModel`` (its ``config``, ``layers``,
rotary tables and attention scale)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kv_cache import KVCache
from .target_weights import Layer


def attention_inputs(cfg, x: torch.Tensor, input_norm: torch.Tensor, qkv, q_norm: torch.Tensor | None,
                     k_norm: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor):
    """A decoder layer's attention inputs, the one definition of them in torch (the C++ stack's
    tests compare against it): x [..., d] -> rotated q [..., H, D], rotated k and v [..., Hkv, D].
    ``qkv``: the fused projection (a callable); ``q_norm``, ``k_norm``: Qwen3's per-head norms or
    None; cos, sin broadcast against [..., 1, D]."""
    H, Hkv, D, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    lead = x.shape[:-1]
    out = qkv(F.rms_norm(x, (x.shape[-1],), input_norm, eps))  # [..., (H + 2 Hkv) D]
    q = out[..., : H * D].view(*lead, H, D)
    k = out[..., H * D: (H + Hkv) * D].view(*lead, Hkv, D)
    v = out[..., (H + Hkv) * D:].view(*lead, Hkv, D)
    if q_norm is not None:
        q, k = F.rms_norm(q, (D,), q_norm, eps), F.rms_norm(k, (D,), k_norm, eps)
    return _rotated(q, cos, sin), _rotated(k, cos, sin), v


def _rotated(v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE."""
    half = v.shape[-1] // 2
    return v * cos + torch.cat((-v[..., half:], v[..., :half]), -1) * sin


def attention_output_and_mlp(cfg, x: torch.Tensor, o: torch.Tensor, o_proj, post_norm: torch.Tensor, gate_up,
                             down) -> torch.Tensor:
    """The rest of a decoder layer: the residual stream x [..., d] after the attention output
    o [..., H D] (through ``o_proj``) and the gated MLP (``gate_up``, ``down``: callables)."""
    x = x + o_proj(o)
    gate, up = gate_up(F.rms_norm(x, (x.shape[-1],), post_norm, cfg.rms_norm_eps)).chunk(2, dim=-1)
    return x + down(F.silu(gate) * up)


class TorchStack:
    """``TargetModel``'s layers as torch operations."""

    def _stack(self, run, x: torch.Tensor, aux_layers: tuple[int, ...]) -> torch.Tensor:
        """``run(x, a, b)`` (layers a..b-1 in torch) over the decoder layers, cut after each of
        ``aux_layers``: the last residual stream, then (with ``aux_layers``) the streams at the
        cuts, [n, 1 + A, d], as the fused stack returns them (``keep_after``)."""
        if not aux_layers:
            return run(x, 0, self.config.num_layers)
        streams, start = [], 0
        for end in (*aux_layers, self.config.num_layers):
            x = run(x, start, end)
            streams.append(x)
            start = end
        return torch.stack([streams[-1], *streams[:-1]], 1)

    def _layers(self, x: torch.Tensor, cache: KVCache, position_ids: torch.Tensor,
                tree_mask: torch.Tensor | None, aux_layers: tuple[int, ...] = ()) -> torch.Tensor:
        """The decoder stack in torch operations (prefills, and where the fused one is unavailable);
        see ``_stack`` for ``aux_layers``."""
        n, past = x.shape[0], cache.length
        cos = self.cos[position_ids].unsqueeze(1)  # [n, 1, D]
        sin = self.sin[position_ids].unsqueeze(1)
        attn_mask, is_causal = None, False
        if n > 1:
            if tree_mask is None and past == 0:
                is_causal = True
            else:
                new_mask = tree_mask if tree_mask is not None else torch.ones(n, n, dtype=torch.bool).tril_()
                attn_mask = torch.cat((torch.ones(n, past, dtype=torch.bool), new_mask), 1)

        def run(h, a, b):
            for i in range(a, b):
                layer = self.layers[i]
                q, k, v = self._attention_inputs(layer, h, cos, sin)
                k_all, v_all = cache.write(i, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0))
                h = self._attention_output_and_mlp(layer, h, self._attend(q, k_all, v_all, attn_mask, is_causal))
            return h
        return self._stack(run, x, aux_layers)

    def _attend(self, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor,
                attn_mask: torch.Tensor | None, is_causal: bool) -> torch.Tensor:
        """q [n, H, D] over the cache's k, v [1, Hkv, L, D] -> [n, H D]. Outside the causal prefill
        the query heads sharing a KV head run as one head with g n rows (the mask repeated per
        group): the same products as grouped-query attention, each K/V row read once instead of
        g times, which is most of the cost of one token's attention over a long context."""
        cfg = self.config
        n, H, D = q.shape
        Hkv = cfg.num_kv_heads
        g = H // Hkv
        if is_causal or g == 1:
            o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k_all, v_all, is_causal=is_causal,
                                               attn_mask=attn_mask, scale=self.scale, enable_gqa=g > 1)
            return o[0].transpose(0, 1).reshape(n, H * D)
        grouped = q.transpose(0, 1).reshape(1, Hkv, g * n, D)  # heads h = j g + i share KV head j
        mask = attn_mask.repeat(g, 1) if attn_mask is not None else None
        o = F.scaled_dot_product_attention(grouped, k_all, v_all, attn_mask=mask, scale=self.scale)
        return o.view(H, n, D).transpose(0, 1).reshape(n, H * D)

    def _attention_inputs(self, layer: Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [n, d] -> rotated q [n, H, D], rotated k [n, Hkv, D], v [n, Hkv, D]."""
        return attention_inputs(self.config, x, layer.input_norm, layer.qkv, layer.q_norm, layer.k_norm, cos, sin)

    def _attention_output_and_mlp(self, layer: Layer, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Residual stream after the attention output o [n, H D] and the MLP block."""
        return attention_output_and_mlp(self.config, x, o, layer.o, layer.post_norm, layer.gate_up, layer.down)
