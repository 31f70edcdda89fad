"""The decode core on token ids, shared by every method: prefill, then draft -> verify -> commit
cycles until EOS, the length limit or the caller's stop rule, with per-request metrics. Text
(chat templates, detokenisation, stop strings) lives at the edges (``engine``, ``text``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from ..errors import JakiroError
from ..settings import check_max_new_tokens
from .prompt_cache import Retained, reusable
from .proposers import Proposer
from .sampling import SamplingParams, next_token
from .tree import DRAFT, LOOKUP
from . import verify as _verify

# after each commit: the answer's ids so far -> how many of them to keep to end it there, or None
StopRule = Callable[[list[int]], "int | None"]


@dataclass
class Metrics:
    """One request's counts and times, or the sum of many (``merge``): the one definition of τ,
    acceptance per depth and tokens/s used by the CLI, the benchmark, the server, chat and tune."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens taken from the prompt cache instead of prefilled
    new_tokens: int = 0
    target_forwards: int = 0  # verification forwards (prefill excluded)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    target_s: float = 0.0
    total_s: float = 0.0
    committed: int = 0  # tokens committed by verification forwards (bonus included)
    plain_steps: int = 0  # verification forwards with no draft token (cost-aware drafting backed off)
    drafted: int = 0  # draft tokens verified (a tree's nodes but its root)
    accepted_from: dict = field(default_factory=lambda: {"draft": 0, "lookup": 0, "both": 0})
    depth_tried: list[int] = field(default_factory=list)  # cycles whose tree reached depth d+1 ...
    depth_accepted: list[int] = field(default_factory=list)  # ... and the path got past depth d+1

    @property
    def tau(self) -> float:
        """Tokens committed per target verification forward, bonus token included."""
        return self.committed / self.target_forwards if self.target_forwards else 0.0

    @property
    def acceptance(self) -> float:
        """Draft tokens accepted per draft token verified (llama.cpp's n_accept / n_drafted)."""
        return (self.committed - self.target_forwards) / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def accept_rate_per_depth(self) -> list[float]:
        return [a / t if t else 0.0 for a, t in zip(self.depth_accepted, self.depth_tried)]

    def record_cycle(self, tree_depth: int, accept_length: int) -> None:
        while len(self.depth_tried) < tree_depth:
            self.depth_tried.append(0)
            self.depth_accepted.append(0)
        for d in range(min(tree_depth, accept_length + 1)):
            self.depth_tried[d] += 1
            if accept_length > d:
                self.depth_accepted[d] += 1

    def merge(self, other: "Metrics") -> "Metrics":
        """Add ``other``'s counts and times to these (in place; returns self)."""
        for name in ("prompt_tokens", "cached_tokens", "new_tokens", "target_forwards", "prefill_s", "draft_s",
                     "target_s", "total_s", "committed", "plain_steps", "drafted"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for src, n in other.accepted_from.items():
            self.accepted_from[src] = self.accepted_from.get(src, 0) + n
        for mine, theirs in ((self.depth_tried, other.depth_tried), (self.depth_accepted, other.depth_accepted)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for d, n in enumerate(theirs):
                mine[d] += n
        return self

    @classmethod
    def total(cls, many) -> "Metrics":
        out = cls()
        for m in many:
            out.merge(m)
        return out

    def as_dict(self) -> dict:
        """Every count and time (enough to rebuild the object with ``from_dict``) and the derived
        rates."""
        return {
            "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
            "new_tokens": self.new_tokens,
            "tokens_per_s": self.tokens_per_s, "tau": self.tau, "committed": self.committed,
            "target_forwards": self.target_forwards, "plain_steps": self.plain_steps, "drafted": self.drafted,
            "acceptance": self.acceptance,
            "accepted_from": dict(self.accepted_from),
            "accept_rate_per_depth": self.accept_rate_per_depth,
            "depth_tried": list(self.depth_tried), "depth_accepted": list(self.depth_accepted),
            "prefill_s": self.prefill_s, "draft_s": self.draft_s, "target_s": self.target_s,
            "total_s": self.total_s,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Metrics":
        names = cls.__dataclass_fields__
        return cls(**{k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v)
                      for k, v in d.items() if k in names})


@dataclass
class Decoded:
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or the stop rule) or "length"
    metrics: Metrics


class Sequence:
    """One request's state in the decode core: its proposer and KV cache, the ids committed so far
    and its metrics. ``Decoder`` runs one; ``batch.BatchDecoder`` runs many side by side, their
    trees verified in one target forward. With ``retain`` it keeps what the prompt cache needs to
    hand its cache to a later request (``retained``)."""

    def __init__(self, decoder: "Decoder", ids: list[int], max_new_tokens: int, sampling: SamplingParams | None,
                 stop: StopRule | None, proposer: Proposer, cache, retain: bool = False):
        self.decoder, self.proposer, self.cache = decoder, proposer, cache
        self.slot = 0  # its slot of a batch's cache (``batch``)
        self.params = sampling or SamplingParams()
        self.ids = [int(t) for t in ids]
        if not self.ids:
            raise JakiroError("the prompt is empty")
        decoder.check_length(len(self.ids), max_new_tokens)
        self.max_new_tokens, self.stop = max_new_tokens, stop
        self.generator = self.params.generator()
        self.metrics = Metrics(prompt_tokens=len(self.ids))
        self.t_start = time.perf_counter()
        self.context = list(self.ids)
        self.generated: list[int] = []
        self.sources: list[str | None] = []  # per generated token: which proposal it was accepted from
        self.pending: list[tuple[int, str | None]] = []
        self.finish: str | None = None
        self.prefilled = 0  # prompt tokens in the cache
        self._prompt_feats: list[torch.Tensor] = []
        self.retain = retain
        self.exact = 0  # leading cache entries a whole prefill would write bitwise (``prompt_cache``)
        self._inexact = False  # a forward did not go through the one-call kernels: no entry after is exact
        self._kept_feats: list[torch.Tensor] = []  # with ``retain``: the features of the cache's entries
        proposer.set_sampling(None if self.params.greedy else self.params, self.generator)
        proposer.start(len(self.ids) + max_new_tokens)

    def prefill(self, piece: int | None = None) -> bool:
        """Take in the next ``piece`` prompt tokens (all of them with None); True once the whole
        prompt is in and the first new token is pending."""
        target, proposer, ids = self.decoder.target, self.proposer, self.ids
        end = len(ids) if piece is None else min(len(ids), self.prefilled + piece)
        last = end == len(ids)
        logits, feats = target(torch.tensor(ids[self.prefilled:end]), self.cache,
                               logits_rows=slice(-1, None), chunked=True,
                               aux_layers=proposer.aux_layers)
        self.cache.commit(end - self.prefilled)
        self._kept(target.fused_rows(end - self.prefilled, tree=False), feats)
        self.prefilled = end
        if proposer.needs_features:
            self._prompt_feats.append(feats)
        if not last:
            return False
        first = next_token(logits[0], self.params, self.generator)
        if proposer.needs_features:
            proposer.observe(torch.cat(self._prompt_feats), torch.tensor(ids[1:] + [first]))
        self._prompt_feats = []
        self.metrics.prefill_s = time.perf_counter() - self.t_start
        self.pending = [(first, None)]
        return True

    def resume(self, retained: Retained, n: int) -> None:
        """Start from the first ``n`` entries a finished request left in this sequence's cache
        (``prompt_cache``): its prompt's first ``n`` tokens, taken in without a forward."""
        self.cache.truncate(n)
        self.prefilled = self.exact = n
        self.metrics.cached_tokens = n
        if self.proposer.needs_features:
            self._prompt_feats.append(retained.features[:n])
        if self.retain and retained.features is not None:
            self._kept_feats.append(retained.features[:n])

    def _kept(self, exact: bool, feats: torch.Tensor | None) -> None:
        """The cache gained entries from one forward (``exact``: through the one-call kernels),
        ``feats`` their features (None where the proposer takes none)."""
        self._inexact = self._inexact or not exact
        if not self._inexact:
            self.exact = self.cache.length
        if self.retain and self.proposer.needs_features and not self._inexact:
            self._kept_feats.append(feats)

    def retained(self) -> Retained | None:
        """What this request's cache offers the next one: its exact entries' ids and features."""
        n = min(self.exact, len(self.context))
        if n == 0:
            return None
        # the kept features cover every exact entry (``_kept`` adds them as the entries grow)
        feats = torch.cat(self._kept_feats)[:n] if self.proposer.needs_features else None
        return Retained(self.context[:n], feats)

    def advance(self) -> list[int]:
        """Commit the pending (token, source) pairs one by one, so that EOS and the length limit
        cut at the exact token, then apply the stop rule; the ids this added (``finish`` is set
        when the answer ended)."""
        generated, before = self.generated, len(self.generated)
        for tok, src in self.pending:
            generated.append(tok)
            self.sources.append(src)
            self.context.append(tok)
            if tok in self.decoder.eos_ids:
                self.finish = "stop"
            elif len(generated) >= self.max_new_tokens:
                self.finish = "length"
            if self.finish:
                break
        self.pending = []
        kept = self.stop(generated) if self.stop is not None else None
        if kept is not None:
            self.finish = "stop"
            del generated[kept:]  # the answer ends where the stop rule says
            del self.sources[kept:]
        return generated[before:]

    def propose(self):
        """This cycle's draft tree (rooted at the last committed token)."""
        t0 = time.perf_counter()
        tree = self.proposer.propose(self.context)
        self.metrics.draft_s += time.perf_counter() - t0
        return tree

    def settle(self, tree, logits: torch.Tensor, feats: torch.Tensor, target_s: float) -> None:
        """Verify ``tree`` against the target's logits for its nodes, keep the accepted path in
        the cache and make it (with the bonus token) pending."""
        proposer, metrics = self.proposer, self.metrics
        t0 = time.perf_counter()
        verdict = _verify.verify(tree, logits, self.params, self.generator)
        proposer.feedback(tree, verdict)
        self.cache.keep(verdict.accepted)
        kept_feats = feats[verdict.accepted] if proposer.needs_features else None
        self._kept(self.decoder.target.fused_rows(tree.size), kept_feats)
        metrics.target_s += target_s + time.perf_counter() - t0
        metrics.target_forwards += 1
        metrics.plain_steps += tree.size == 1
        metrics.drafted += tree.size - 1
        metrics.record_cycle(int(tree.depths.max()), verdict.accept_length)
        tokens = tree.tokens[verdict.accepted[1:]].tolist() + [verdict.bonus]
        if proposer.needs_features:
            proposer.observe(kept_feats, torch.tensor(tokens))
        names = ([_SOURCE_NAMES[s] for s in tree.sources[verdict.accepted[1:]].tolist()]
                 if tree.sources is not None else [None] * verdict.accept_length) + [None]
        self.pending = list(zip(tokens, names))

    def verify_alone(self, tree) -> None:
        """``settle`` after the target's own forward over ``tree`` on this sequence's cache."""
        target, cache = self.decoder.target, self.cache
        t0 = time.perf_counter()
        if tree.size > 1:
            logits, feats = target(tree.tokens, cache, position_ids=cache.length + tree.depths,
                                   tree_mask=tree.tree_mask, aux_layers=self.proposer.aux_layers)
        else:
            logits, feats = target(tree.tokens, cache, aux_layers=self.proposer.aux_layers)
        self.settle(tree, logits, feats, time.perf_counter() - t0)

    def result(self) -> Decoded:
        metrics = self.metrics
        metrics.new_tokens = len(self.generated)
        # every kept token but the prefill's first came from a verification cycle: τ counts those
        # (not tokens verified past EOS, the length limit or the stop rule)
        metrics.committed = max(0, len(self.generated) - 1)
        for src in self.sources:
            if src is not None:
                metrics.accepted_from[src] += 1
        metrics.total_s = time.perf_counter() - self.t_start
        return Decoded(list(self.generated), self.finish or "stop", metrics)


class Decoder:
    """One request at a time for a target and a proposer, on token ids: ``run`` yields the ids
    each cycle commits and returns the whole answer with its metrics. With ``prompt_cache`` a
    request starts from what the last finished one left in the cache (``prompt_cache``)."""

    def __init__(self, target, proposer: Proposer | None, eos_ids: set[int], prompt_cache: bool = False):
        self.target = target
        self.proposer = proposer or Proposer()
        self.eos_ids = set(eos_ids)
        self.prompt_cache = prompt_cache
        self._cache = None  # the last request's KV cache (with the prompt cache) ...
        self._retained: Retained | None = None  # ... and what of it a next request may start from

    @property
    def method(self) -> str:
        return self.proposer.name

    def check_length(self, prompt_len: int, max_new_tokens: int) -> None:
        check_max_new_tokens(max_new_tokens)
        ctx = self.target.config.max_context
        if prompt_len + max_new_tokens > ctx:
            raise JakiroError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) "
                              f"exceeds the model's context length ({ctx})")

    def forget(self) -> None:
        """Drop what the prompt cache holds (the next request prefills its whole prompt)."""
        self._cache = self._retained = None

    def decode(self, ids: list[int], max_new_tokens: int, sampling: SamplingParams | None = None,
               stop: StopRule | None = None) -> Decoded:
        run = self.run(ids, max_new_tokens, sampling, stop)
        while True:
            try:
                next(run)
            except StopIteration as done:
                return done.value

    @torch.inference_mode()
    def run(self, ids: list[int], max_new_tokens: int, sampling: SamplingParams | None = None,
            stop: StopRule | None = None) -> Iterator[list[int]]:
        """Yield the token ids each cycle commits (after ``stop`` has cut them); the generator's
        return value is the ``Decoded`` answer."""
        seq = Sequence(self, ids, max_new_tokens, sampling, stop, self.proposer, None, retain=self.prompt_cache)
        retained, self._retained = self._retained, None  # a request that fails leaves nothing behind
        self._start(seq, retained)
        seq.prefill()
        while True:
            new = seq.advance()
            if new:
                yield new
            if seq.finish:
                if self.prompt_cache:  # the cache goes back for the next request only now: a run
                    # interleaved with this one (two streams of one engine) gets a cache of its own
                    self._cache, self._retained = seq.cache, seq.retained()
                return seq.result()
            seq.verify_alone(seq.propose())

    def _start(self, seq: Sequence, retained: Retained | None) -> None:
        """Give ``seq`` its cache: a new one, or with the prompt cache the last request's, starting
        from what it shares with this prompt (copied into a larger cache where it lacks room)."""
        room = len(seq.ids) + seq.max_new_tokens
        scratch = self.proposer.max_tree_tokens
        old, self._cache = self._cache, None
        n = reusable(retained, seq.ids, self)
        if old is not None and old.max_len >= room + scratch:
            seq.cache = old
        else:
            seq.cache = self.target.new_cache(room, scratch=scratch)
            if n:
                seq.cache.copy_prefix(old, n)
        if n:
            seq.resume(retained, n)
        else:
            seq.cache.truncate(0)


_SOURCE_NAMES = {DRAFT: "draft", LOOKUP: "lookup", DRAFT | LOOKUP: "both"}
