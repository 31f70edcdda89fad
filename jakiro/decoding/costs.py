"""Measuring what the target's forwards cost on this machine: the timing helpers shared by
cost-aware drafting, ``jakiro bench-cost`` and ``jakiro tune``."""

from __future__ import annotations

import statistics
import time

import torch

from ..models.linear import SMALL_ROWS

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
