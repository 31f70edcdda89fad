"""The prompt cache: what a finished request leaves in its KV cache for the next request to start
from. A conversation's next turn, or a request sharing a system prompt, then prefills only what
follows the longest start it shares with the last sequence.

Reuse is exact: the answer is bitwise what a whole prefill gives, greedy or seeded. That holds
where the target runs every forward through the one-call kernels (``TargetModel.fused_rows``): a
row is computed the same whatever rows share its forward and wherever a prompt is cut into
pieces, so the kept keys and values are the ones a whole prefill would write. A request's entries
count as kept only up to its first forward that did not go through those kernels (a Hugging Face
folder's, a long prompt on float32 weights), and a prompt is taken from the cache only where its
whole prefill would go through them too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Retained:
    """A finished request's cache contents that a later request may start from: the ids whose keys
    and values its cache holds, first to last, and (for drafts fed by them) the target's features
    at those positions."""

    tokens: list[int]
    features: torch.Tensor | None = None

    def shared(self, ids: list[int]) -> int:
        """How many of ``ids``' first tokens these entries serve: their common start, less the
        last prompt token (whose forward gives the first new token)."""
        limit = min(len(self.tokens), len(ids) - 1)
        n = 0
        while n < limit and self.tokens[n] == ids[n]:
            n += 1
        return n


def reusable(retained: Retained | None, ids: list[int], decoder) -> int:
    """Cached tokens a request for ``ids`` to ``decoder`` (a ``Decoder``) can start from (0:
    prefill it whole)."""
    if (retained is None or not decoder.prompt_cache or not decoder.target.fused_rows(len(ids), tree=False)
            or (decoder.proposer.needs_features and retained.features is None)):
        return 0
    return retained.shared(ids)
