"""Target cost curve (forward time vs number of new tree tokens at a fixed context) and plain
greedy decoding tokens/s of our runtime vs Hugging Face ``generate``, measured alternately."""

from __future__ import annotations

import statistics
import time

import torch

TREE_SIZES = (1, 2, 4, 8, 16, 32, 64)
PROMPT = "Write a detailed, step by step explanation of how a refrigerator keeps food cold."


def _median_ms(fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def forward_costs(target, context: int, repeats: int, sizes=TREE_SIZES) -> dict[int, float]:
    """Median ms of one forward over n new tokens (a chain-shaped tree mask) after ``context``
    cached tokens."""
    gen = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    cache = target.new_cache(context, scratch=max(sizes))
    target(torch.randint(0, vocab, (context,), generator=gen), cache, logits_rows=slice(-1, None))
    cache.commit(context)
    costs = {}
    for n in sizes:
        ids = torch.randint(0, vocab, (n,), generator=gen)
        mask = torch.ones(n, n, dtype=torch.bool).tril_()
        positions = torch.arange(context, context + n)
        costs[n] = _median_ms(lambda: target(ids, cache, positions, mask if n > 1 else None), repeats)
    return costs


def run_cost_curve(target_path: str | None, cache_dir: str | None, context: int, repeats: int,
                   new_tokens: int, rounds: int) -> dict:
    from transformers import AutoModelForCausalLM

    from ..api import load

    jk = load(target_path, cache_dir=cache_dir)
    costs = forward_costs(jk.target, context, repeats)
    engine = jk.engine("ar")
    ids = engine.encode(PROMPT)
    hf = AutoModelForCausalLM.from_pretrained(jk.target_path, dtype=torch.float32).eval()
    ours_tps, hf_tps, same = [], [], True
    engine.generate(ids, 8)  # warm-up
    with torch.inference_mode():
        hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
        for _ in range(rounds):
            res = engine.generate(ids, new_tokens)
            ours_tps.append(res.metrics.tokens_per_s)
            t0 = time.perf_counter()
            out = hf.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)
            hf_ids = out[0, len(ids):].tolist()
            hf_tps.append(len(hf_ids) / (time.perf_counter() - t0))
            same &= hf_ids == res.token_ids
    ours, theirs = statistics.median(ours_tps), statistics.median(hf_tps)
    return {
        "target": jk.target_path,
        "threads": torch.get_num_threads(),
        "context": context,
        "forward_ms": {str(n): round(ms, 2) for n, ms in costs.items()},
        "plain_decoding": {
            "new_tokens": new_tokens, "rounds": rounds,
            "ours_tokens_per_s": round(ours, 2), "hf_generate_tokens_per_s": round(theirs, 2),
            "ratio": round(ours / theirs, 3), "same_tokens": same,
        },
    }
