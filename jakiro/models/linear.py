"""A linear layer tuned for this runtime's CPU hot path.

Three kernels, chosen per call by the number of input rows (measured with one thread on the
development CPU, a 2-vCPU AVX-512 Xeon; the LM head, 576 -> 49152, at 1 / 2 / 8 rows):

- up to ``SMALL_ROWS`` rows: the small-batch kernel (``smallgemm``; 10.3 / 9.9 / 11.9 ms), which
  streams the weight at the read bandwidth for a handful of rows, where oneDNN's prepacked
  kernel (- / 14.3 / 17.8 ms) and ``torch.mm`` (9.2 / 16.6 / 31.9 ms) slow down from two rows;
- more rows (a prompt's prefill): oneDNN's prepacked weights (``mkldnn._linear_pointwise``);
- without either: ``torch.mm`` on a pre-transposed weight (the fastest torch kernel for one row).
"""

from __future__ import annotations

import torch

from . import smallgemm

SMALL_ROWS = 32  # beyond this oneDNN's blocking wins (measured: about even at 32 rows)


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    if weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 8)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(2, weight.shape[1]), packed, None, "none", [], "")
        return packed
    except (RuntimeError, AttributeError):
        return None


class FastLinear:
    """y = x @ W^T (+ b) for x [rows, in]."""

    __slots__ = ("weight", "weight_t", "packed", "small", "quantized", "blocks", "bias", "out_features",
                 "in_features", "element_size", "input_bytes")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, keep_weight: bool = False,
                 quantized: tuple[str, torch.Tensor] | None = None, input_bytes: int = 3):
        """``quantized``: (kind, blocks) of the same matrix in GGUF blocks (``models.quant``),
        streamed instead of the float32 weight for up to ``SMALL_ROWS`` rows; ``input_bytes``:
        how the tile kernel takes the inputs for them (``smallgemm.quantized_linear``: 3 keeps
        float32 accuracy, 1 is int8: drafts, and targets with int8 activations)."""
        if input_bytes not in (1, 3):
            raise ValueError(f"input_bytes must be 1 or 3, not {input_bytes}")
        self.input_bytes = input_bytes
        # the plain [out, in] matrix is kept only where a caller needs it (the LM head, which
        # drafts reuse); a layer keeps two layouts of its weight, one per kernel it uses
        self.weight = weight if keep_weight else None
        self.out_features, self.in_features = weight.shape
        self.element_size = weight.element_size()
        use_small = weight.dtype == torch.float32 and smallgemm.available()
        self.quantized = quantized if use_small else None
        # what the kernel reads: the blocks, in the AMX kernel's layout where it or the int8 kernel runs
        self.blocks = smallgemm.tile_layout(quantized[1]) if self.quantized is not None else None
        self.small = smallgemm.pack(weight) if use_small and quantized is None else None
        self.packed = _pack(weight)
        small_path = self.small is not None or self.quantized is not None
        self.weight_t = None if small_path and self.packed is not None else weight.t().contiguous()
        self.bias = None if bias is None else bias.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.quantized is not None and rows <= SMALL_ROWS:
            y = smallgemm.quantized_linear(x, self.blocks, self.out_features, self.input_bytes)
            return y if self.bias is None else y.add_(self.bias)
        if self.small is not None and rows <= SMALL_ROWS:
            return smallgemm.linear(x, self.small, self.out_features, self.bias)
        if rows > 1 and self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)

    @property
    def kernel_weight(self) -> torch.Tensor | None:
        """The weight as the small-batch kernel reads it (packed float32 or GGUF blocks), if any."""
        return self.blocks if self.quantized is not None else self.small

    @property
    def tiles(self) -> bool:
        """Whether the blocks go through the AMX kernel, or with one-byte inputs through the int8
        kernel (``smallgemm.tile_layout``)."""
        return self.quantized is not None and self.blocks is not self.quantized[1]

    @property
    def streamed_bytes(self) -> int:
        """Bytes of weight (and bias) a forward of a few rows reads."""
        if self.quantized is None:
            return self.numel * self.element_size
        return self.blocks.numel() + (self.bias.numel() * self.element_size if self.bias is not None else 0)

    @property
    def numel(self) -> int:
        """Parameters of the layer (weight and bias)."""
        return self.out_features * self.in_features + (self.bias.numel() if self.bias is not None else 0)


class BlockLinear:
    """y = x @ W^T (+ b) for a matrix held only as a GGUF file's blocks (``gguf_file``), laid out
    once for the kernels (``quant.lay_out``), for any number of rows. A layer whose parts the file
    holds in different block types (q, k and v; gate and up) keeps one layout per part, applied
    one after another. ``quantized`` keeps (type, rows as the file holds them) of a one-part
    matrix, from which drafts lay out the head rows they score."""

    __slots__ = ("parts", "rows", "bias", "out_features", "in_features", "input_bytes", "quantized", "weight")

    def __init__(self, parts: list[tuple[str, torch.Tensor]], bias: torch.Tensor | None = None,
                 input_bytes: int = 3, permutations: list | None = None, keep: torch.Tensor | None = None):
        """``parts``: (GGUF type, the file's tensor: [rows, blocks, bytes] or float [rows, cols]);
        ``permutations``: per part, the order to take its rows in (None: as stored); ``keep``: the
        one part's rows to keep as ``quantized`` (an LM head: a memory-mapped view of them)."""
        from . import quant
        if input_bytes not in (1, 3):
            raise ValueError(f"input_bytes must be 1 or 3, not {input_bytes}")
        self.input_bytes = input_bytes
        self.weight = None  # no float32 copy: see ``float_rows``
        permutations = permutations or [None] * len(parts)
        taken = [(kind, rows if order is None else rows[order]) for (kind, rows), order in zip(parts, permutations)]
        # one layout for the leading parts of one type (q and k, or all three; gate and up); the
        # rest one each
        lead = next((i for i, (kind, _) in enumerate(taken) if kind != taken[0][0]), len(taken))
        if lead > 1:
            taken = [(taken[0][0], torch.cat([rows for _, rows in taken[:lead]]))] + taken[lead:]
        self.parts = [quant.lay_out(kind, rows) for kind, rows in taken]
        self.rows = [int(rows.shape[0]) for _, rows in taken]
        self.quantized = (taken[0][0], keep) if keep is not None and len(taken) == 1 else None
        self.out_features = sum(self.rows)
        self.in_features = quant.row_width(taken[0][1])
        self.bias = None if bias is None else bias.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ys = [_apply(part, x, rows, self.input_bytes) for part, rows in zip(self.parts, self.rows)]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, 1)
        return y if self.bias is None else y.add_(self.bias)

    @property
    def kernel_weight(self) -> torch.Tensor:
        return self.parts[0]

    @property
    def tiles(self) -> bool:
        """Whether the parts go through the AMX or the int8 (AVX-512 VNNI) kernel."""
        return all(smallgemm.integer_layout(part) for part in self.parts)

    @property
    def streamed_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parts) + (
            self.bias.numel() * 4 if self.bias is not None else 0)

    @property
    def numel(self) -> int:
        return self.out_features * self.in_features + (self.bias.numel() if self.bias is not None else 0)


def _apply(weight: torch.Tensor, x: torch.Tensor, rows: int, input_bytes: int) -> torch.Tensor:
    if weight.dtype == torch.float32:
        return smallgemm.linear(x, weight, rows, None)
    return smallgemm.quantized_linear(x, weight, rows, input_bytes)
