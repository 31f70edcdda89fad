"""The target for batched generation on any device: what a GPU regenerates training data with.

``TargetModel`` runs on the CPU through the small-batch kernels; on a GPU the same decoder stack
in plain torch operations (``FeatureModel``'s, float32 weights) serves the regeneration loop
(``data.regenerate.Regenerator``) through the same three calls: ``new_batch_cache``, a prefill
of one sequence into a slot (calling the model) and ``decode_batch`` (one new token for every
slot). Logits and features stay on the device; token ids and lengths are the caller's, on the
CPU. On the CPU it runs as well (slower than ``TargetModel``), which is how it is tested.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .features import FeatureModel
from .kv_cache import BatchKVCache, KVCache


class DeviceTarget:
    """``TargetModel``'s generation interface over a ``FeatureModel`` on ``device``."""

    def __init__(self, folder: str, device: str | torch.device):
        self.model = FeatureModel(folder, (), device, with_head=True).eval()
        self.config = self.model.config
        self.device = torch.device(device)
        self.dtype = torch.float32

    def check_aux_layers(self, aux_layers: tuple[int, ...]) -> None:
        self.config.check_aux_layers(aux_layers)

    def new_batch_cache(self, batch: int, max_len: int) -> BatchKVCache:
        cfg = self.config
        cfg.check_length(max_len)
        return BatchKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, batch, max_len, self.dtype, self.device)

    def _stack(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend, aux_layers) -> torch.Tensor:
        """x [B, T, d] through every layer, ``attend(i, q, k, v)`` -> o [B, H, T, D]; returns the
        features [B, T, (1 + A) d] (final norm's output, then the streams after ``aux_layers``)."""
        m, streams = self.model, []
        for i in range(self.config.num_layers):
            q, k, v = m.attention_inputs(i, x, cos, sin)
            x = m.attention_output_and_mlp(i, x, attend(i, q, k, v))
            if i + 1 in aux_layers:
                streams.append(x)
        final = F.rms_norm(x, (x.shape[-1],), m.norm, self.config.rms_norm_eps)
        return torch.cat((final, *streams), -1)

    def _attend(self, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [B, T, H, D] over the cached keys and values [B, Hkv, L, D] -> o [B, H, T, D]."""
        cfg = self.config
        return F.scaled_dot_product_attention(q.transpose(1, 2), k_all, v_all, attn_mask=mask,
                                              scale=cfg.head_dim ** -0.5, enable_gqa=cfg.num_heads != cfg.num_kv_heads)

    @torch.inference_mode()
    def decode_batch(self, input_ids: torch.Tensor, cache: BatchKVCache,
                     aux_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """One new token per slot at position ``cache.lengths[b]``: input_ids [batch] -> (logits
        [batch, vocab], features [batch, width]), both on the device; ``cache.advance()`` commits."""
        cfg = self.config
        self.check_aux_layers(aux_layers)
        if input_ids.shape[0] != cache.batch:
            raise ValueError(f"{input_ids.shape[0]} tokens for a cache of {cache.batch} sequences")
        cache.check_room()
        m, dev = self.model, self.device
        positions = cache.device_lengths()[0]
        cos, sin = m.cos[positions].unsqueeze(1).unsqueeze(1), m.sin[positions].unsqueeze(1).unsqueeze(1)
        mask = cache.attention_mask()  # [B, 1, 1, end]

        def attend(i, q, k, v):
            return self._attend(q, *cache.write(i, k[:, 0], v[:, 0]), mask)

        features = self._stack(m.embed[input_ids.to(dev)].unsqueeze(1), cos, sin, attend, aux_layers)[:, 0]
        return F.linear(features[:, :cfg.hidden_size], m.head), features

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, cache: KVCache, logits_rows: slice | None = None,
                 chunked: bool = False, aux_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """``TargetModel.forward`` for a slot's prefill: ``n`` tokens after the cache's committed
        prefix (written, not committed) -> (logits of ``logits_rows`` [r, vocab], features [n, width])."""
        cfg = self.config
        self.check_aux_layers(aux_layers)
        m, dev = self.model, self.device
        n, start = input_ids.shape[0], cache.length
        cache.check_room(n)
        cos, sin = (t[start:start + n].view(1, n, 1, -1) for t in (m.cos, m.sin))
        # new token j sees the prefix and the new tokens up to itself
        mask = (torch.arange(start + n, device=dev)[None] <= torch.arange(start, start + n, device=dev)[:, None])

        def attend(i, q, k, v):
            return self._attend(q, *cache.write(i, k.transpose(1, 2), v.transpose(1, 2)), mask)

        features = self._stack(m.embed[input_ids.to(dev)].unsqueeze(0), cos, sin, attend, aux_layers)[0]
        rows = features[logits_rows if logits_rows is not None else slice(None), :cfg.hidden_size]
        return F.linear(rows, m.head), features

