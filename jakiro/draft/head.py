"""The rows of the target's LM head a draft scores (``DraftHead``): built on first use, laid out
once for the small-batch kernels, a request's head extending its vocabulary head's layout."""

from __future__ import annotations

import torch

from ..models import quant, smallgemm
from ..models.linear import SMALL_ROWS, BlockLinear, FastLinear
from ..models.target import embedding_rows

# the tile kernel takes a draft's inputs as one byte per value and block of 32 (int8, as
# llama.cpp's Q8 activations) rather than the target's three: a draft step's rows then cost a
# third as much, and its proposals change slightly, never what is accepted
INPUT_BYTES = 1


class DraftHead:
    """The rows of the target's LM head that a draft scores: their target token ids [V'] in row
    order (a draft's top-k indices map to tokens through them), their float32 weight (training,
    and inference without the kernels) and their GGUF blocks as the small-batch kernels read
    them. Each is built on first use: a request's head (the draft vocabulary plus its prompt's
    tokens) extends the vocabulary head's laid-out blocks by its new rows instead of gathering
    and laying out every row again (a request's first proposal took 25 ms, now 4-10)."""

    def __init__(self, ids: torch.Tensor, lm_head: torch.Tensor, head_blocks: tuple[str, torch.Tensor] | None,
                 weight: torch.Tensor | None = None, base: "DraftHead | None" = None):
        """``lm_head``: the target's head [V, d] (``ids`` index it), ``head_blocks`` its blocks;
        ``weight``: the rows' float32 weight where already at hand; ``base``: a head whose rows
        are this one's first rows."""
        self.ids, self._lm_head, self._head_blocks, self._base = ids, lm_head, head_blocks, base
        self._weight = weight
        self._layer: FastLinear | None = None
        self._kernel: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return int(self.ids.shape[0])

    @property
    def weight(self) -> torch.Tensor:
        if self._weight is None:
            self._weight = embedding_rows(self._lm_head, self.ids).contiguous()
        return self._weight

    @property
    def kernel_weight(self) -> torch.Tensor | None:
        """The rows as the small-batch kernel reads them (see ``FastLinear``): their GGUF blocks
        laid out for it, or their float32 weight packed; None without the kernel."""
        if self._kernel is None and smallgemm.available() and (
                self._lm_head.dtype == torch.float32 or self._head_blocks is not None):
            base, start = self._base, 0
            if base is not None and base.size % 16 == 0 and base.kernel_weight is not None:
                n = min(base.size, self.size)
                differ = (base.ids[:n] != self.ids[:n]).nonzero()
                start = (n if len(differ) == 0 else int(differ[0])) // 16 * 16
            # the layouts keep groups of 16 rows whole, one after the other: a head keeps the
            # groups it shares with its base and lays out only the rows after them
            new = self._lay_out(self.ids[start:])
            if start:
                kept = base.kernel_weight[:base.kernel_weight.shape[0] * start // base.size]
                new = torch.cat((kept, new))
            self._kernel = new
        return self._kernel

    def _lay_out(self, ids: torch.Tensor) -> torch.Tensor:
        if self._head_blocks is not None:
            return quant.lay_out(self._head_blocks[0], self._head_blocks[1][ids])
        return smallgemm.pack(self.weight if self._base is None else self._lm_head[ids].contiguous())

    @property
    def layer(self) -> FastLinear:
        """The rows as a ``FastLinear`` (for more rows than the small-batch kernel takes, or
        without it)."""
        if self._layer is None:
            rows = None if self._head_blocks is None else self._head_blocks[1][self.ids]
            self._layer = (FastLinear(self.weight) if self._head_blocks is None else
                           BlockLinear([(self._head_blocks[0], rows)], input_bytes=INPUT_BYTES, keep=rows))
        return self._layer

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, d] -> logits over the rows [n, V']."""
        kernel = self.kernel_weight if x.shape[0] <= SMALL_ROWS else None
        if kernel is None:
            return self.layer(x)
        if self._head_blocks is None:
            return smallgemm.linear(x, kernel, self.size, None)
        return smallgemm.quantized_linear(x, kernel, self.size, INPUT_BYTES)
