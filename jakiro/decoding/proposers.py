"""Proposers: what builds the draft tree each cycle. One decode loop serves them all.

The interface has four calls: ``start`` (a new request), ``observe`` (the target's features for
newly committed positions with the token that follows each), ``propose`` (a tree rooted at the
last committed token) and ``feedback`` (what verification accepted of it). The draft model's
proposer is ``draft_proposer.DraftProposer``, a small model's ``draft_model.DraftModelProposer``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from .sampling import SamplingParams
from .tree import LOOKUP, Tree, chain_tree


class Proposer:
    name = "ar"
    needs_features = False
    max_tree_tokens = 1  # the most nodes (root included) a proposed tree can have
    max_tree_depth = 0  # the deepest draft level a proposed tree can reach
    aux_layers: tuple[int, ...] = ()  # mid-layer streams ``observe`` wants with the target's features

    def start(self, max_len: int) -> None:
        """Prepare for a request whose sequence will not exceed ``max_len`` tokens."""

    def in_batch(self, rows: int) -> None:
        """The next proposal will be verified beside ``rows`` tokens of other requests in one
        forward (``batch``; 0: alone): a proposer that sizes its trees by cost prices them so."""

    def for_batch(self, slots: int) -> None:
        """A batch of up to ``slots`` requests will fork this proposer (``batch``): a proposer
        that prices its trees by cost makes its table cover the batch's forwards."""

    def fork(self) -> "Proposer":
        """A proposer for another request decoded alongside this one's (``batch``): the same
        weights, tables and settings, its own request state. Proposers inside it are forked
        too and containers copied; ``start`` makes the rest (caches) anew."""
        twin = copy.copy(self)
        for name, value in vars(twin).items():
            if isinstance(value, Proposer):
                setattr(twin, name, value.fork())
            elif isinstance(value, (list, dict, set)):
                setattr(twin, name, copy.copy(value))
        return twin

    def set_sampling(self, params: SamplingParams | None, generator: torch.Generator | None = None) -> None:
        """The next request's sampling (None: greedy). A draft chain is then drawn from the
        draft's own distribution, processed as the target's is, with ``generator``."""

    def observe(self, features: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """features [m, d] at newly committed positions t (wider with ``aux_layers``, as the
        target's forward returns them); next_tokens [m] = x_{t+1}."""

    def propose(self, context: list[int]) -> Tree:
        """A tree whose root is context[-1]. The base proposer drafts nothing (plain decoding)."""
        return chain_tree(context[-1], [])

    def feedback(self, tree: Tree, verdict) -> None:
        """What verification made of ``tree`` (a ``verify.Verdict``: accepted nodes, bonus token)."""


class PromptLookupProposer(Proposer):
    """Draft-free baseline: find the latest earlier occurrence of the context's last n-gram
    (n = max_ngram .. min_ngram) and propose the tokens that followed it, as a chain."""

    name = "pld"

    def __init__(self, num_tokens: int = 6, max_ngram: int = 3, min_ngram: int = 1):
        if num_tokens < 1 or not 1 <= min_ngram <= max_ngram:
            raise ValueError("prompt lookup needs num_tokens >= 1 and 1 <= min_ngram <= max_ngram")
        self.num_tokens, self.max_ngram, self.min_ngram = num_tokens, max_ngram, min_ngram
        self.max_tree_tokens, self.max_tree_depth = num_tokens + 1, num_tokens
        self._indexed: list[int] = []  # the context the index covers
        self._latest: dict[tuple, int] = {}  # n-gram -> start of its latest occurrence with a continuation

    def propose(self, context: list[int]) -> Tree:
        tree = chain_tree(context[-1], self.lookup(context))
        tree.sources = torch.tensor([0] + [LOOKUP] * (tree.size - 1))
        return tree

    def lookup(self, context: list[int]) -> list[int]:
        """The tokens that followed the latest earlier occurrence of the longest matching n-gram."""
        return self.match(context)[0]

    def match(self, context: list[int]) -> tuple[list[int], int]:
        """``lookup``'s chain and the length n of the n-gram it was found by (0: none found).
        A chain found by a longer match is far more often right (on Spec-Bench answers its first
        token matches about 0.2 / 0.55 / 0.8 of the time for n = 1 / 2 / 3)."""
        self._index(context)
        length = len(context)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            start = self._latest.get(tuple(context[length - n:]))
            if start is not None:
                return context[start + n: start + n + self.num_tokens], n
        return [], 0

    def _index(self, context: list[int]) -> None:
        """Index the n-grams that have a continuation (all but the context's own last ones),
        adding only what the context gained since the last cycle: a lookup costs the same after
        2,000 tokens as after 20."""
        done = len(self._indexed)
        if done > len(context) or context[:done] != self._indexed:  # another request: start over
            self._latest, done = {}, 0
        length = len(context)
        for n in range(self.min_ngram, self.max_ngram + 1):
            for start in range(max(0, done - n), length - n):  # n-grams ending before the last token
                self._latest[tuple(context[start:start + n])] = start
        self._indexed = list(context)

@dataclass
class TreeBudget:
    depth: int = 4
    top_k: int = 4
    total_tokens: int = 8  # draft tokens verified per cycle, root excluded

    def __post_init__(self):
        if self.depth < 1 or self.top_k < 1 or self.total_tokens < 1:
            raise ValueError(f"tree budget must be positive: {self}")
