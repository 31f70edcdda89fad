"""Measuring what the target's forwards cost on this machine: the timing helpers shared by
cost-aware drafting, ``jakiro bench-cost`` and ``jakiro tune``."""

from __future__ import annotations

import statistics
import time

import torch

TREE_SIZES = (1, 2, 4, 8, 16, 32, 64)


def median_ms(fn, repeats: int, warmup: int = 2, before=None) -> float:
    """Median wall time of ``fn`` in milliseconds, after ``warmup`` untimed calls; ``before``,
    if given, runs untimed ahead of every call (e.g. a target forward that evicts a draft's
    weights from the caches, as in decoding)."""
    times = []
    for i in range(warmup + repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


@torch.inference_mode()
def forward_costs(target, context: int, repeats: int, sizes=TREE_SIZES) -> dict[int, float]:
    """Median ms of one forward over n new tokens (a chain-shaped tree mask) after ``context``
    cached tokens."""
    return forward_ms(target, prefilled_cache(target, context, max(sizes)), repeats, sizes)


@torch.inference_mode()
def prefilled_cache(target, context: int, scratch: int):
    """A KV cache holding ``context`` random tokens, with room for ``scratch`` more."""
    gen = torch.Generator().manual_seed(0)
    cache = target.new_cache(context, scratch=scratch)
    target(torch.randint(0, target.config.vocab_size, (context,), generator=gen), cache, logits_rows=slice(0, 0))
    cache.commit(context)
    return cache


@torch.inference_mode()
def forward_ms(target, cache, repeats: int, sizes) -> dict[int, float]:
    """``forward_costs`` on a prefilled ``cache`` (left as it was)."""
    gen = torch.Generator().manual_seed(1)
    context, costs = cache.length, {}
    for n in sizes:
        ids = torch.randint(0, target.config.vocab_size, (n,), generator=gen)
        mask = torch.ones(n, n, dtype=torch.bool).tril_()
        positions = torch.arange(context, context + n)
        costs[n] = median_ms(lambda: target(ids, cache, positions, mask if n > 1 else None), repeats)
    return costs
