"""What the target's forwards and a draft's proposals cost on this machine: the timing helpers
shared by cost-aware drafting, ``jakiro bench-cost`` and ``jakiro tune``, and the cost table
cost-aware drafting decides by (measured at load, its rounds kept per setup on disk)."""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from ..models.linear import SMALL_ROWS

if TYPE_CHECKING:
    from .draft_proposer import DraftProposer

TREE_SIZES = (1, 2, 4, 8, 16, 32, 64)
PRIMING_CALLS = 3  # untimed forwards of the same size ahead of each timed one (``forward_costs``)


def median_ms(fn, repeats: int, warmup: int = 2, before=None) -> float:
    """Median wall time of ``fn`` in milliseconds, after ``warmup`` untimed calls; ``before``,
    if given, runs untimed ahead of every call (e.g. a target forward that evicts a draft's
    weights from the caches, as in decoding)."""
    return interleaved_ms({None: fn}, repeats, warmup, before)[None]


@torch.inference_mode()
def forward_costs(target, context: int, repeats: int, sizes=TREE_SIZES) -> dict[int, float]:
    """Median ms of one forward over n new tokens (a chain-shaped tree mask) after ``context``
    cached tokens, each timed right after ``PRIMING_CALLS`` untimed forwards of the same size: the
    steady state of plain decoding, which repeats one forward (on the development CPU, 2 threads,
    a one-token forward measured 5.41 ms right after a 32-token one and 4.58 ms right after
    another one-token forward; one priming call left it at 5.1)."""
    return forward_ms(target, prefilled_cache(target, context, max(sizes)), repeats, sizes, primed=PRIMING_CALLS)


@torch.inference_mode()
def prefilled_cache(target, context: int, scratch: int):
    """A KV cache holding ``context`` random tokens, with room for ``scratch`` more."""
    gen = torch.Generator().manual_seed(0)
    cache = target.new_cache(context, scratch=scratch)
    target(torch.randint(0, target.config.vocab_size, (context,), generator=gen), cache, logits_rows=slice(0, 0))
    cache.commit(context)
    return cache


@torch.inference_mode()
def forward_ms(target, cache, repeats: int, sizes, before=None, warmup: int = 2,
               primed: int = 0) -> dict[int, float]:
    """``forward_costs`` on a prefilled ``cache`` (left as it was); ``before``, ``primed``: see
    ``interleaved_ms``.

    Forwards of up to ``SMALL_ROWS`` tokens (trees) and longer ones (prompts, through the float32
    copy of the weights) are timed in rounds of their own: in shared rounds the longer ones
    slowed the tree forwards after them (one token 5.44 -> 6.25 ms with a 64-token forward in
    the rounds, on the development CPU), a cost decoding never pays between tree forwards."""
    gen = torch.Generator().manual_seed(1)
    context, calls = cache.length, {}
    for n in sizes:
        ids = torch.randint(0, target.config.vocab_size, (n,), generator=gen)
        mask = torch.ones(n, n, dtype=torch.bool).tril_()
        positions = torch.arange(context, context + n)
        calls[n] = (lambda ids=ids, mask=mask, positions=positions, n=n:
                    target(ids, cache, positions, mask if n > 1 else None))
    times = {}
    for group in ([n for n in calls if n <= SMALL_ROWS], [n for n in calls if n > SMALL_ROWS]):
        if group:
            times.update(interleaved_ms({n: calls[n] for n in group}, repeats, warmup, before, primed))
    return {n: times[n] for n in sizes}


def interleaved_ms(calls: dict, repeats: int, warmup: int = 2, before=None, primed: int = 0) -> dict:
    """Median ms of each of ``calls`` (key -> function), timed in rounds that call each once in
    turn, so that a slow moment of a shared machine lands on every key alike instead of on one.
    ``before``: untimed, ahead of every timed call; ``primed``: each timed call comes right after
    that many untimed calls of the same function (after ``before``)."""
    times: dict = {key: [] for key in calls}
    for i in range(warmup + repeats):
        for key, fn in calls.items():
            if before is not None:
                before()
            for _ in range(primed):
                fn()
            t0 = time.perf_counter()
            fn()
            if i >= warmup:
                times[key].append(time.perf_counter() - t0)
    return {key: statistics.median(v) * 1000 for key, v in times.items()}


def monotone(table: dict) -> dict:
    """The closest non-decreasing values in key order (least squares: adjacent violators pooled):
    what a cost table keeps of noisy timings, since a bigger forward never costs less."""
    keys = sorted(table)
    blocks: list[list] = []  # [mean, count]
    for k in keys:
        blocks.append([table[k], 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, c2), (m1, c1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    out = []
    for mean, count in blocks:
        out += [mean] * count
    return dict(zip(keys, out))


CYCLE_SHARE = 0.1  # what a cycle costs outside the target's forward and the draft (verification, the
# commit, detokenising), as a share of a one-token forward: on the development CPU (Zen 4 EPYC, 2
# threads) a plain decoding cycle took 0.31 ms beside its 5.14 ms forward and the loop around it
# 0.26 ms more per cycle. The same for every cycle, it makes a cycle that commits more relatively cheaper


@dataclass
class CostTable:
    """Milliseconds on this machine: target forward over n tree tokens (root included) and one
    proposal of depth d, both after ``context`` cached tokens; and what each costs more per
    further cached token (``target_slope`` by n, ``draft_slope`` by depth; interpolated like the
    costs), so that a long prompt's dearer attention enters the choice.

    ``drafted_ms``: the target's forward over n tokens right after a draft proposal, which pushed
    part of the target's weights out of the caches (measured on SmolLM2-135M: 0.4 ms more than
    after another target forward with a float32 draft, none with the int8 draft kernel);
    ``catch_up_ms``: what a proposal costs more when it first catches up on n committed positions
    instead of the two of a typical cycle (after a run of plain steps the draft reads dozens, at
    its first proposal the whole prompt), by n."""
    target_ms: dict[int, float]
    draft_ms: dict[int, float]
    context: int = 0
    target_slope: dict[int, float] = field(default_factory=dict)
    draft_slope: dict[int, float] = field(default_factory=dict)
    drafted_ms: dict[int, float] = field(default_factory=dict)
    catch_up_ms: dict[int, float] = field(default_factory=dict)
    cycle_ms: float = 0.0  # a cycle's cost outside the target's forward and the draft (``CYCLE_SHARE``)

    def target(self, n: int, context: int | None = None, drafted: bool = False) -> float:
        """A forward over ``n`` tree tokens; ``drafted``: right after a draft proposal."""
        extra = _at(self.target_slope, n) * (context - self.context) if context is not None else 0.0
        return _at(self.drafted_ms if drafted and self.drafted_ms else self.target_ms, n) + extra

    def cycle(self, n: int, context: int | None = None, drafted: bool = False) -> float:
        """A whole cycle verifying ``n`` tree tokens, the draft's proposal aside."""
        return self.target(n, context, drafted) + self.cycle_ms

    def draft(self, depth: int, context: int | None = None, pending: int = 2) -> float:
        """A proposal of ``depth`` that first catches up on ``pending`` committed positions."""
        if not self.draft_ms:
            return 0.0
        base = self.draft_ms.get(depth, max(self.draft_ms.values()))
        slope = self.draft_slope.get(depth, max(self.draft_slope.values())) if self.draft_slope else 0.0
        return base + (slope * (context - self.context) if context is not None else 0.0) + self.catch_up(pending)

    def catch_up(self, pending: int) -> float:
        """What a proposal costs more when it first catches up on ``pending`` committed positions
        instead of the two of a typical cycle."""
        return _at(self.catch_up_ms, pending) if pending > 2 and self.catch_up_ms else 0.0

    def beside(self, rows: int) -> "CostTable":
        """What one request adds to a batched forward that verifies ``rows`` tokens of other
        requests (``decoding.batch``): each target entry becomes the cost of n more rows, so that
        a draft pays only where its tokens beat a plain step's share of the batch. The draft's
        proposal is the request's own and costs what it costs."""
        if rows <= 0:
            return self
        base = self.target(rows)
        return replace(self, target_ms={n: self.target(rows + n) - base for n in self.target_ms}, drafted_ms={})

    def as_dict(self) -> dict:
        def rounded(table: dict, digits: int) -> dict:
            return {str(k): round(v, digits) for k, v in table.items()}
        return {"context": self.context, "target_ms": rounded(self.target_ms, 3),
                "target_ms_after_draft": rounded(self.drafted_ms, 3),
                "draft_ms": rounded(self.draft_ms, 3), "target_ms_per_context_token": rounded(self.target_slope, 5),
                "draft_ms_per_context_token": rounded(self.draft_slope, 5),
                "draft_ms_more_by_caught_up_tokens": rounded(self.catch_up_ms, 3),
                "cycle_ms_beside_forwards": round(self.cycle_ms, 3)}


def _at(table: dict[int, float], n: int) -> float:
    """``table`` at ``n``: linear between the known sizes; beyond them, the slope over the table's
    last half (from its largest size to the largest at most half of it). Not the last two sizes':
    those are often a step apart and pooled flat (``monotone``), and a flat end priced every
    forward past the table the same, so that in a batch (``beside``) a tree of any size beside
    seven other requests looked free."""
    if not table:
        return 0.0
    if n in table:
        return table[n]
    known = sorted(table)
    lo = max((k for k in known if k < n), default=known[0])
    hi = min((k for k in known if k > n), default=known[-1])
    if hi == lo:  # beyond the table
        b = known[-1]
        a = max((k for k in known if k <= b / 2), default=known[0])
        slope = (table[b] - table[a]) / (b - a) if b != a else 0.0
        return table[hi] + slope * (n - hi)
    w = (n - lo) / (hi - lo)
    return table[lo] * (1 - w) + table[hi] * w


MEASURE_ROUNDS = 5  # rounds of ``measure_costs``: medians of 5 paired samples per entry
STORE_ROUNDS = 30  # rounds a cost store keeps (the newest: its medians follow a machine whose pace drifts)
STORED_ENOUGH = 10  # with this many rounds stored, a load measures ``FEW_ROUNDS`` more instead of ``MEASURE_ROUNDS``
FEW_ROUNDS = 2


def cost_store_path(target, proposer: DraftProposer | None, max_tree_tokens: int, cache: str | None = None) -> str:
    """Where ``measure_costs`` keeps its rounds for this setup on this machine: one file per kernel
    build (which names the CPU), thread count, target (its shape and how its weights stream)
    and draft shape (layers, vocabulary and tree budget: what a proposal costs, not its weights)."""
    import hashlib
    from ..models import smallgemm
    from ..models.hub import cache_dir
    setup = {"build": smallgemm.build_id() if smallgemm.available() else "torch",
             "threads": torch.get_num_threads(), "target": repr(target.config),
             "streams": [target.quantized_matrices, target.input_bytes, str(target.dtype)],
             "tree_tokens": max_tree_tokens}
    if getattr(target, "kv_dtype", target.dtype) != target.dtype:  # a float16 cache: cheaper long contexts
        setup["kv_cache"] = str(target.kv_dtype)
    if proposer is not None:
        setup["draft"] = [repr(proposer.draft.config), proposer.head_vocab, repr(proposer.budget), proposer.mode,
                          proposer.parallel, proposer.static is not None, proposer.draft.quantized]
    digest = hashlib.sha256(json.dumps(setup, sort_keys=True).encode()).hexdigest()[:20]
    return os.path.join(cache_dir(cache), "costs", f"{digest}.json")


def _stored_rounds(store: str | None, keys: dict) -> list[dict]:
    """The rounds kept in ``store`` (each: quantity -> {size: ms}), if they measured the same
    quantities at the same sizes (``keys``); an unreadable or different file counts as none."""
    if store is None or not os.path.exists(store):
        return []
    try:
        with open(store) as f:
            rounds = json.load(f)["rounds"]
        rounds = [{q: {int(k): float(v) for k, v in r[q].items()} for q in keys} for r in rounds]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []
    return [r for r in rounds if all(sorted(r[q]) == sorted(keys[q]) for q in keys)]


def _store_rounds(store: str, rounds: list[dict]) -> None:
    """Write ``rounds`` to ``store`` atomically (a failed write leaves the table of this load as is)."""
    try:
        os.makedirs(os.path.dirname(store), exist_ok=True)
        tmp = f"{store}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"rounds": [{q: {str(k): v for k, v in r[q].items()} for q in r} for r in rounds]}, f)
        os.replace(tmp, store)
    except OSError:
        pass


BATCH_ROUNDS = 3  # rounds of a batch's forward costs (``batch_costs``)


@torch.inference_mode()
def batch_costs(table: CostTable, target, rows: int, rounds: int = BATCH_ROUNDS) -> CostTable:
    """``table`` with the target's forwards measured anew up to ``rows`` tokens (at most
    ``SMALL_ROWS``; past that ``_at`` extends the slope of the table's last half), every size in
    the same rounds, for pricing trees beside other requests (``CostTable.beside``). A table
    measured for one request's trees ends where a few rows cost little more than one, and past
    its sizes that slope priced a batch's extra rows at less than half of what they cost once the
    forward is bound by the arithmetic: prompt lookup's table went to 7 tokens and priced a row
    beside 7 requests at 2.7 ms where it cost 6.2 (Qwen2.5-Coder-1.5B, int8, two Zen 4 cores).
    Sizes measured at another time cannot be joined to it: on a shared machine the newer ones
    came out cheaper than the table's largest, a flat stretch that priced extra rows at nothing.
    The request's own proposal (``draft_ms``) is kept as it was."""
    want = min(rows, SMALL_ROWS)
    sizes = sorted({n for n in (2 ** k for k in range(6)) if n < want} | {want})
    cache = prefilled_cache(target, max(table.context, 1), want)
    runs = [forward_ms(target, cache, 1, sizes, warmup=2 if r == 0 else 1, primed=1) for r in range(max(1, rounds))]
    return replace(table, target_ms=monotone({n: statistics.median(run[n] for run in runs) for n in sizes}),
                   drafted_ms={})


@torch.inference_mode()
def measure_costs(target, proposer: DraftProposer | None, context: int = 128, long_context: int = 768,
                  rounds: int = MEASURE_ROUNDS, max_tree_tokens: int | None = None,
                  store: str | None = None) -> CostTable:
    """Measure the cost table once (about three seconds for SmolLM2-135M on two cores; without
    a draft, for prompt lookup alone, only the target's forwards up to ``max_tree_tokens``).

    As in decoding, every draft proposal is timed right after a target forward (which pushes
    the draft's weights out of the caches: timed alone, a draft step looks twice as cheap as it
    is) and catches up on two committed positions (and on each of ``CATCH_UP_ROWS``: what more
    that costs), and the target's tree forwards are timed both after another forward and
    right after a draft proposal. Target forwards are measured for every tree size after
    ``context`` tokens and, for the smallest and largest, after ``long_context`` tokens too: the
    difference, per token, is how the cost grows with the prompt.

    Every quantity is sampled once per round, in ``rounds`` rounds, and what the table keeps of
    a difference (after a proposal vs after a forward, long vs short context, a catch-up vs a
    typical proposal) is the median of the differences within each round: on a shared machine
    whose pace moves within seconds, measuring each quantity in a phase of its own made the
    table's ratios swing (a forward after a proposal 0.89-1.43 x one after a forward, between
    loads of one draft on the development CPU), and with them the choice between drafting and
    not.

    ``store`` (a file, ``cost_store_path``): the rounds of earlier loads of the same setup on this
    machine are kept there, the newest ``STORE_ROUNDS``, and the table is the medians over them
    and this load's rounds (only ``FEW_ROUNDS`` once ``STORED_ENOUGH`` are kept): five rounds at
    one load still left a four-token forward at 1.19 x one token in one load and 1.75 x in the
    next (Zen 4 EPYC, 2 threads, int8 activations), and with it whether EAGLE-2 drafted at all."""
    max_n = proposer.max_tree_tokens if proposer is not None else max_tree_tokens
    deepest = proposer.budget.depth if proposer is not None else 0
    context, long_context, keys = _plan(target, proposer, context, long_context, max_n, deepest)
    span = long_context - context
    sizes, ends, depths, catch_rows = keys["short"], keys["long"], keys.get("draft"), keys.get("caught")
    short_cache = prefilled_cache(target, context, max_n)
    long_cache = prefilled_cache(target, long_context, max_n)
    stored = _stored_rounds(store, keys)
    if len(stored) >= STORED_ENOUGH:
        rounds = min(rounds, FEW_ROUNDS)
    measured = []
    for r in range(max(1, rounds)):
        one = {"short": forward_ms(target, short_cache, 1, sizes, warmup=2 if r == 0 else 1, primed=1),
               "long": forward_ms(target, long_cache, 1, ends, warmup=2 if r == 0 else 1, primed=1)}
        if proposer is not None:
            one.update(_draft_round(target, short_cache, proposer, context, long_context, keys))
        measured.append(one)
    kept = (stored + measured)[-STORE_ROUNDS:]
    if store is not None:
        _store_rounds(store, kept)
    median = _round_medians({key: [r[key] for r in kept] for key in keys})
    target_ms = monotone(median("short", sizes))
    target_slope = {n: max(0.0, v / span) for n, v in median("long", ends, "short").items()}
    cycle_ms = CYCLE_SHARE * target_ms[1]
    if proposer is None:
        return CostTable(target_ms, {}, context, target_slope, cycle_ms=cycle_ms)
    short = monotone(median("draft", depths))
    slope = max(0.0, median("far", [deepest], "draft")[deepest] / span)
    draft_slope = {d: slope * d / deepest for d in short}
    catch_up = monotone({2: 0.0, **{rows: max(0.0, v) for rows, v in
                                    median("caught", catch_rows, "draft", minus_key=1).items()}})
    drafted = monotone({n: target_ms[n] + v for n, v in median("after", sizes, "short").items()})
    return CostTable(target_ms, short, context, target_slope, draft_slope, drafted, catch_up, cycle_ms)


def _plan(target, proposer, context: int, long_context: int, max_n: int, deepest: int) -> tuple[int, int, dict]:
    """``measure_costs``' two contexts (within what the target and the proposals leave room for)
    and what it samples each round: key -> its entries (tree sizes, depths, catch-up rows)."""
    # each sampling call starts the draft afresh: room for its committed rows and proposals
    room = target.config.max_context - max_n - (deepest + 1) * 2 * 4 - 8
    context = max(1, min(context, room // 2))
    long_context = max(context + 1, min(long_context, room))
    sizes = sorted({n for n in (1, 2, 4, 8, 16, 32, 64) if n < max_n} | {max_n})
    keys = {"short": sizes, "long": sorted({1, max_n})}
    if proposer is not None:
        keys.update(draft=list(range(1, deepest + 1)), far=[deepest], after=sizes,
                    caught=[rows for rows in CATCH_UP_ROWS if context + rows * 4 < room])
    return context, long_context, keys


def _draft_round(target, cache, proposer: DraftProposer, context: int, long_context: int, keys: dict) -> dict:
    """One round of ``measure_costs``' draft quantities (``keys`` names each one's entries)."""
    deepest = keys["far"][0]
    return {"draft": _draft_costs(target, cache, proposer, context, keys["draft"], 1),
            "far": _draft_costs(target, cache, proposer, long_context, [deepest], 1),
            "caught": {rows: _draft_costs(target, cache, proposer, context, [1], 1, rows=rows)[1]
                       for rows in keys["caught"]},
            "after": _forwards_after_proposals(target, cache, proposer, keys["after"], 1)}


def _round_medians(samples: dict):
    """``median(key, entries, minus=None, minus_key=None)`` over the rounds of ``samples`` (key ->
    one dict per round): per entry the median over rounds, of the difference to ``minus``'s
    entry (or its ``minus_key`` entry) in the same round."""
    def median(key: str, entries, minus: str | None = None, minus_key=None) -> dict:
        out = {}
        for k in entries:
            values = [s[k] - (m[k if minus_key is None else minus_key] if minus else 0.0)
                      for s, m in zip(samples[key], samples[minus] if minus else samples[key])]
            out[k] = statistics.median(values)
        return out
    return median


CATCH_UP_ROWS = (34, 258)  # proposals after a run of plain steps or a prompt: what catching up on them costs more
# (the first pays the attention of every position, the second mostly keys and values: far less per position)


def _prepared(target, proposer: DraftProposer, context: int, calls: int, rows: int = 2):
    """Start ``proposer`` on ``context`` random committed tokens (features included) with room
    for ``calls`` proposals; returns the context and a function that commits ``rows`` more
    positions for the draft to catch up on."""
    gen = torch.Generator().manual_seed(0)
    vocab, width = target.config.vocab_size, proposer.draft.feature_width
    ids = torch.randint(0, vocab, (context,), generator=gen).tolist()
    proposer.start(context + (calls + 1) * rows + proposer.budget.depth + 8, prompt_vocab=False)
    proposer.observe(torch.randn(context, width, generator=gen), torch.tensor(ids[1:] + [ids[0]]))
    proposer.propose(ids, depth=1)
    def commit():
        proposer.observe(torch.randn(rows, width, generator=gen), torch.randint(0, vocab, (rows,), generator=gen))
    return ids, commit


def _draft_costs(target, cache, proposer: DraftProposer, context: int, depths, repeats: int,
                 rows: int = 2) -> dict[int, float]:
    """Median ms of a proposal of each depth after ``context`` committed tokens, each right after
    a one-token target forward on ``cache``, catching up on ``rows`` committed positions (two:
    as after a typical cycle)."""
    ids, commit = _prepared(target, proposer, context, len(depths) * (repeats + 1), rows)
    step = torch.tensor(ids[-1:])
    def after_a_cycle():
        target(step, cache)  # evicts the draft's weights from the caches, as verification does
        commit()
    calls = {depth: (lambda depth=depth: proposer.propose(ids, depth=depth)) for depth in depths}
    return interleaved_ms(calls, repeats, warmup=1, before=after_a_cycle)


def _forwards_after_proposals(target, cache, proposer: DraftProposer, sizes, repeats: int) -> dict[int, float]:
    """``forward_ms`` for tree sizes ``sizes``, each forward right after a one-level proposal."""
    if not sizes:
        return {}
    ids, commit = _prepared(target, proposer, cache.length, len(sizes) * (repeats + 2))
    def a_proposal():
        commit()
        proposer.propose(ids, depth=1)
    return forward_ms(target, cache, repeats, sizes, before=a_proposal)
