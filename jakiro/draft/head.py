"""The rows of the target's LM head a draft scores (``DraftHead``): built on first use, laid out
once for the small-batch kernels, a request's head extending its vocabulary head's layout; and
the draft's methods choosing them (``HeadRows``: its vocabulary, a request's head with the
prompt's tokens, logits over them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

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


class HeadRows:
    """Mixed into ``DraftModel``: its draft vocabulary and heads."""

    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Restrict the draft head to these target token ids (most frequent first)."""
        if token_ids.numel() != self.config.draft_vocab_size:
            raise ValueError(f"expected {self.config.draft_vocab_size} ids, got {token_ids.numel()}")
        self.d2t.copy_(token_ids.to(torch.long))

    def _vocab_order(self) -> torch.Tensor:
        """Target token ids of the draft vocabulary, most frequent first (every token without one)."""
        return self.d2t if self.config.draft_vocab_size is not None else torch.arange(self._lm_head.shape[0])

    def head_ids(self, limit: int | None = None, extra: torch.Tensor | None = None) -> torch.Tensor:
        """Target token ids of ``head``'s rows, in row order: the draft vocabulary (or its first
        ``limit`` entries), then the tokens of ``extra`` it lacks in the order given, padded with
        the next most frequent tokens to a multiple of 16 rows (the tile kernel's unit)."""
        order = self._vocab_order()
        base = order[:limit]
        if extra is None or self.config.method == "eagle3":  # its own head has its vocabulary's rows only
            return base
        V = self._lm_head.shape[0]
        present = torch.zeros(V, dtype=torch.bool)
        present[base] = True
        extra = extra[(extra >= 0) & (extra < V)]
        first = torch.tensor(list(dict.fromkeys(extra.tolist())), dtype=torch.long)  # repeats dropped, order kept
        new = first[~present[first]]
        if len(new) == 0:
            return base
        present[new] = True
        pad = (-(len(base) + len(new))) % 16
        if pad:
            spare = order[~present[order]]
            if len(spare) < pad:
                spare = torch.cat((spare, torch.arange(V)[~present]))
            new = torch.cat((new, spare[:pad]))
        return torch.cat((base, new))

    def head(self, limit: int | None = None, extra: torch.Tensor | None = None) -> DraftHead:
        """The head over ``head_ids(limit, extra)``: the draft vocabulary (or its first ``limit``,
        most frequent, entries), plus the target tokens of ``extra`` it lacks (a request's
        prompt: tokens a prompt holds are far likelier in its answer than their overall frequency
        says, and the target's head scores every token, so the draft's predicted feature scores
        them too). The plain vocabulary heads are built once and kept (an EAGLE-3 head, whose rows
        are its own weights, again whenever training changed them)."""
        own = self.config.method == "eagle3"
        stamp = (self.lm_head.data_ptr(), self.lm_head._version) if own else None
        entry = self._heads.get(limit)
        if entry is None or entry[0] != stamp:
            weight = self._rows_weight().detach()[:limit]
            base = (DraftHead(self._vocab_order()[:limit], weight, None, weight=weight) if own else
                    DraftHead(self._vocab_order()[:limit], self._lm_head, self._head_blocks, weight=weight))
            entry = self._heads[limit] = (stamp, base)
        base = entry[1]
        if extra is None:
            return base
        ids = self.head_ids(limit, extra)  # an EAGLE-3 head takes in no extra tokens: ``base``'s ids
        return base if len(ids) == base.size else DraftHead(ids, self._lm_head, self._head_blocks, base=base)

    def _rows_weight(self) -> torch.Tensor:
        """The weight of the draft vocabulary's rows in vocabulary order: EAGLE-3's own head, else
        the target's head rows."""
        return self.lm_head if self.config.method == "eagle3" else self.head_weight

    def extend_head(self, head: DraftHead, extra: torch.Tensor, limit: int | None = None) -> DraftHead:
        """``head(limit, extra)`` for a request whose head ``head`` was built from the first
        entries of ``extra``: the groups of 16 rows the two share keep their layout, only the
        rows after them (the new tokens and the padding) are laid out."""
        ids = self.head_ids(limit, extra)
        if torch.equal(ids, head.ids):
            return head
        grown = DraftHead(ids, self._lm_head, self._head_blocks, base=head)
        grown.kernel_weight  # laid out now, so that the request's earlier heads can go
        grown._base = None
        return grown

    def _head_of(self, head: "DraftHead | int | None") -> DraftHead:
        return head if isinstance(head, DraftHead) else self.head(head)

    def head_logits(self, features: torch.Tensor, head: "DraftHead | int | None" = None) -> torch.Tensor:
        """[..., d] -> [..., V'] logits over ``head``'s rows: a ``DraftHead``, or the draft
        vocabulary (its first ``head`` most frequent entries for an int). EAGLE-3 scores its own
        final norm of the features with its own head."""
        if self.config.method == "eagle3":
            features = F.rms_norm(features, (features.shape[-1],), self.norm, self.config.rms_norm_eps)
        if self.training or torch.is_grad_enabled():
            weight = head.weight if isinstance(head, DraftHead) else self._rows_weight()[:head]
            return F.linear(features, weight)
        flat = features.reshape(-1, features.shape[-1])
        return self._head_of(head)(flat).view(*features.shape[:-1], -1)

    def to_target_ids(self, draft_ids: torch.Tensor, head: "DraftHead | None" = None) -> torch.Tensor:
        """Target token ids of head rows (of ``head``, default the draft vocabulary)."""
        if head is not None:
            return head.ids[draft_ids]
        return draft_ids if self.config.draft_vocab_size is None else self.d2t[draft_ids]
