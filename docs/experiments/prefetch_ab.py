"""The integer kernels' weight prefetch, side by side in one process: every linear layer of a
GGUF target (its own blocks, int8 inputs) and its whole forward (after a short context, no
logits) for a few row counts, with each setting of the prefetch distances in turn, round after
round; medians per setting. One process for all settings: the same pages and the same memory
placement, which separate processes on a shared VM do not share (there one-token forwards moved
by a third from one process to the next).

    python docs/experiments/prefetch_ab.py --target qwen2.5-coder-1.5b --settings 2048:0,2048:16384 \
        --rows 1,8,32 --rounds 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--settings", default="0:0,2048:0,2048:16384",
                    help="L1:L2 distances in bytes, comma-separated (the default's last is the kernels' own)")
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import jakiro
    from jakiro.decoding.costs import prefilled_cache
    from jakiro.models import smallgemm

    target = jakiro.load(target=args.target, prompt_cache=False,
                         runtime=jakiro.Runtime(threads=args.threads, int8_activations=True)).target
    if not smallgemm.int8_enabled():
        raise SystemExit("no int8 kernel here (it needs AVX-512 VNNI): nothing to compare")
    settings = [tuple(int(v) for v in s.split(":")) for s in args.settings.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    linears = [lin for layer in target.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    linears.append(target.lm_head)
    runs = {}
    for n in rows:
        xs = {k: torch.randn(n, k) for k in {lin.in_features for lin in linears}}
        runs[f"linears, {n} rows"] = lambda xs=xs: [lin(xs[lin.in_features]) for lin in linears]
        cache, ids = prefilled_cache(target, 8, n), torch.arange(7, 7 + n)
        runs[f"forward, {n} rows"] = lambda c=cache, t=ids: target(t, c, logits_rows=slice(0, 0))
    times = {(name, s): [] for name in runs for s in settings}
    default = smallgemm.set_prefetch(*settings[0])
    with torch.inference_mode():
        for round_ in range(args.rounds + 1):  # the first round primes and is dropped
            for name, run in runs.items():
                for s in settings:
                    smallgemm.set_prefetch(*s)
                    t0 = time.perf_counter()
                    run()
                    if round_:
                        times[(name, s)].append(time.perf_counter() - t0)
    smallgemm.set_prefetch(*default)
    out = {"target": args.target, "threads": args.threads, "kernel": smallgemm.status(), "rounds": args.rounds,
           "ms": {name: {f"{a}:{b}": round(1e3 * statistics.median(times[(name, (a, b))]), 1) for a, b in settings}
                  for name in runs}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
