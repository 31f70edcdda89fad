"""How a new prompt should enter its regeneration slot on this machine: prefilled by a forward of
its own (``--regen-prompts prefill``) or fed one token per batch forward (``feed``).

Prints what one prefill of n tokens and one batch forward of B rows cost here, then runs
``jakiro data --regenerate greedy`` on the same conversations in both modes, interleaved, and
prints each run's answer tokens/s and forward counts (the answers are the same either way).

    python docs/experiments/regen_prompts_ab.py --threads 2 \
        --source data/self-distilled/smollm2-135m-instruct-own-greedy.jsonl.gz --records 96
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

KEYS = ("generated_tokens", "fed_prompt_tokens", "reused_prompt_tokens", "batch_forwards", "prefill_forwards",
        "seconds", "generated_tokens_per_s")


def _ms(fn, reps: int = 15) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(1e3 * statistics.median(times), 2)


def forward_costs(threads: int, context: int = 200) -> dict:
    import jakiro
    torch.set_num_threads(threads)
    target = jakiro.load(method="ar").target
    costs = {"batch_forward_ms": {}, "prefill_ms": {}}
    for rows in (16, 32, 48):
        cache = target.new_batch_cache(rows, context + 1)
        for b in range(rows):
            cache.set_length(b, context)
        ids = torch.randint(0, 1000, (rows,))
        costs["batch_forward_ms"][rows] = _ms(lambda: target.decode_batch(ids, cache))
    cache = target.new_batch_cache(1, context + 65)
    for n in (1, 4, 8, 16, 32, 64):
        ids = torch.randint(0, 1000, (n,))

        def prefill():
            slot = cache.slot(0)
            slot.length = context
            target(ids, slot, logits_rows=slice(-1, None), chunked=True)
        costs["prefill_ms"][n] = _ms(prefill)
    return costs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--source", required=True, help="a JSONL source with its own user turns")
    ap.add_argument("--records", type=int, default=96)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    print(json.dumps(forward_costs(args.threads)), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for mode in ("prefill", "feed"):
                out = os.path.join(tmp, f"{mode}-{r}")
                subprocess.run([sys.executable, "-m", "jakiro", "data", "--threads", str(args.threads), "--out", out,
                                "--source", args.source, "--regenerate", "greedy", "--max-records", str(args.records),
                                "--max-len", "512", "--regen-max-tokens", "128", "--regen-batch", str(args.batch),
                                "--tokens-only", "--no-eval-filter", "--regen-prompts", mode],
                               check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                with open(os.path.join(out, "state.json")) as f:
                    run = json.load(f)["regeneration_runs"][-1]
                print(json.dumps({"mode": mode, "round": r + 1, **{k: run[k] for k in KEYS}}), flush=True)


if __name__ == "__main__":
    main()
