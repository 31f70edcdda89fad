"""Time the small-batch kernel alone on every linear layer of the default target (its GGUF
blocks, as decoding streams them) for a few row counts: the matrices' share of a forward over
n new tokens, without attention, norms or framework calls. Run it on two builds (e.g. a
``git worktree`` of the previous commit with ``PYTHONPATH`` pointing there) to compare kernels.

    python docs/experiments/kernel_rows.py --threads 2 --rows 1,2,3,4,8,16 --repeats 15
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,3,4,8,16")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import jakiro
    from jakiro.models import smallgemm

    target = jakiro.load().target
    linears = [lin for layer in target.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    linears.append(target.lm_head)
    if any(lin.quantized is None for lin in linears):
        raise SystemExit("the target does not stream GGUF blocks here (a float32 target, or no kernel)")
    mb = sum(lin.streamed_bytes for lin in linears) / 1e6
    out = {"kernel": smallgemm.status(), "threads": args.threads, "weights_mb": round(mb, 1), "ms": {}}
    with torch.inference_mode():
        for rows in map(int, args.rows.split(",")):
            xs = {k: torch.randn(rows, k) for k in {lin.in_features for lin in linears}}
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                for lin in linears:
                    lin(xs[lin.in_features])
                times.append(time.perf_counter() - t)
            out["ms"][rows] = round(1e3 * statistics.median(times), 2)
    one = out["ms"].get(1)
    if one:
        out["x_one_row"] = {r: round(ms / one, 2) for r, ms in out["ms"].items()}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
