"""Preallocated, slot-indexed key/value cache with in-place compaction of an accepted tree path.

A forward writes the keys/values of its ``n`` new tokens into slots ``[length, length + n)``
without advancing ``length``; the caller then commits either all of them (plain decoding,
prefill) or an arbitrary subset (the accepted path of a verified tree), which is moved down to
``[length, length + m)``. Anything beyond ``length`` is scratch and is simply overwritten later.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype = torch.float32, data: torch.Tensor | None = None):
        # [layers, 2 (k/v), 1 (batch), kv_heads, max_len, head_dim]; ``data`` may be a view into
        # a larger buffer (one slot of a BatchKVCache)
        if data is None:
            data = torch.zeros(num_layers, 2, 1, num_kv_heads, max_len, head_dim, dtype=dtype)
        self.data = data
        self.max_len = data.shape[4]
        self.length = 0

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [1, kv_heads, n, head_dim] after the committed prefix; return views over
        the prefix plus the new entries ([1, kv_heads, length + n, head_dim])."""
        n = k.shape[2]
        end = self.length + n
        self.check_room(n)
        layer_kv = self.data[layer]
        layer_kv[0, :, :, self.length:end] = k
        layer_kv[1, :, :, self.length:end] = v
        return layer_kv[0, :, :, :end], layer_kv[1, :, :, :end]

    def check_room(self, n: int) -> None:
        """Raise unless ``n`` new entries fit after the committed prefix."""
        if self.length + n > self.max_len:
            raise ValueError(f"KV cache overflow: {self.length + n} entries > capacity {self.max_len}")

    def commit(self, n: int) -> None:
        """Keep all n entries written by the last forward."""
        self.length += n

    def keep(self, indices: torch.Tensor) -> None:
        """Keep only the new entries at ``indices`` (relative to the last forward, ascending),
        moving them in place right after the committed prefix."""
        m = int(indices.numel())
        if m == 0:
            return
        if int(indices[-1]) != m - 1:  # ascending: anything but the first m entries moves
            src = indices.to(torch.long) + self.length
            self.data[:, :, :, :, self.length:self.length + m] = self.data.index_select(4, src)
        self.length += m

    def truncate(self, length: int) -> None:
        """Drop committed entries beyond ``length`` (e.g. to reuse a shared prompt prefix)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length

    def copy_prefix(self, other: "KVCache", n: int) -> None:
        """Take ``other``'s first ``n`` committed entries as this cache's prefix."""
        if not 0 <= n <= min(other.length, self.max_len):
            raise ValueError(f"cannot take {n} entries of a cache of length {other.length}")
        self.data[:, :, :, :, :n] = other.data[:, :, :, :, :n]
        self.length = n


class BatchKVCache:
    """Independent sequences in one buffer, for batched decoding (one new token per sequence and
    step). Slot ``b`` is prefilled through ``slot(b)``, a KVCache over the same memory; every
    sequence then has its own length, and attention masks each slot past its own end."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, batch: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        # [layers, 2 (k/v), batch, kv_heads, max_len, head_dim] on ``device``
        self.data = torch.zeros(num_layers, 2, batch, num_kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.max_len = max_len
        self.lengths = torch.zeros(batch, dtype=torch.long)  # [batch], on the CPU (the caller's bookkeeping;
        # changed only through ``slot``, ``set_length`` and ``advance``)
        self._on_device: tuple[torch.Tensor, int] | None = None
        self._rows = torch.arange(batch, device=device)

    @property
    def batch(self) -> int:
        return self.data.shape[2]

    def slot(self, b: int, keep: int = 0) -> KVCache:
        """A single-sequence cache over slot ``b``, holding its first ``keep`` entries (0: emptied)."""
        self.set_length(b, keep)
        cache = KVCache(0, 0, 0, 0, data=self.data[:, :, b:b + 1])
        cache.length = keep
        return cache

    def set_length(self, b: int, length: int) -> None:
        self.lengths[b] = length
        self._on_device = None

    def device_lengths(self) -> tuple[torch.Tensor, int]:
        """The lengths on the cache's device and max(lengths) + 1, copied once per step (every
        layer's write and the mask ask for them; on a GPU each copy is a transfer)."""
        if self._on_device is None:
            self._on_device = (self.lengths.to(self.data.device), int(self.lengths.max()) + 1)
        return self._on_device

    def check_room(self) -> None:
        """Every slot must have room for one more entry."""
        if self.device_lengths()[1] > self.max_len:
            raise ValueError(f"KV cache overflow: a slot is full ({self.max_len} entries)")

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store one new entry per slot, k, v [batch, kv_heads, head_dim], at each slot's length;
        return views [batch, kv_heads, max(lengths) + 1, head_dim]."""
        self.check_room()
        lengths, end = self.device_lengths()
        layer_kv = self.data[layer]
        layer_kv[0, self._rows, :, lengths] = k
        layer_kv[1, self._rows, :, lengths] = v
        return layer_kv[0, :, :, :end], layer_kv[1, :, :, :end]

    def attention_mask(self) -> torch.Tensor:
        """[batch, 1, 1, max(lengths) + 1] bool: each slot sees its prefix and its new entry."""
        lengths, end = self.device_lengths()
        return (torch.arange(end, device=lengths.device) <= lengths[:, None]).view(self.batch, 1, 1, end)

    def advance(self) -> None:
        self.lengths += 1
        self._on_device = None
