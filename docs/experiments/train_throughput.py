"""Training throughput of `jakiro train` on this machine: tokens/s of full optimiser steps (loss,
backward, gradient clip, AdamW) on the same batches, per method and unroll depth, with the
floating-point work per position and the share of the step spent in matrix products.

The batches are built once (a tokens-only dataset's features computed by the target beforehand,
outside the timing) and each configuration times ``--rounds`` passes over them after two warm-up
steps; tokens/s counts every position of the batch, as the trainer's log does. The first batch's
step is then counted (floating-point operations per position, and per second of one more step)
and profiled (the share of its time in matrix products). To compare two
versions, run it with ``PYTHONPATH`` pointing at a ``git worktree`` of the other one (one that has
``Trainer.step_on``, the trainer's own optimiser step on a built batch).

    python docs/experiments/train_throughput.py --threads 1 --data runs/tok2/own-greedy \\
        --aux-layers 3,15 --methods eagle2,jakiro --unrolls 1,4 [--features | --trainer-steps 6]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch


def _trainer(args, method: str, unroll: int, out: str):
    from jakiro.train.config import TrainConfig
    from jakiro.train.trainer import Trainer

    cfg = TrainConfig(data=args.data, out=out, method=method, unroll=unroll, jakiro_loss=args.jakiro_loss,
                      steps=100, warmup=5, aux_layers=args.aux_layers, batch_size=args.batch_size)
    return Trainer(cfg, progress=False)


def _batches(args, trainer) -> list:
    """The first ``--batches`` training batches, features computed (outside any timing)."""
    from jakiro.train.batches import make_batch

    cfg = trainer.cfg
    return [make_batch(trainer.ds, trainer.train_idx[k * cfg.batch_size:(k + 1) * cfg.batch_size], cfg.seq_len,
                       trainer.device, cfg.noise, 7, trainer.featurizer) for k in range(args.batches)]


def feature_rates(args) -> dict | None:
    """For a tokens-only dataset: real tokens a second of the target's features over the same
    batches, padded (one forward per batch) and by length (one per conversation, the CPU's way)."""
    from jakiro.models.hub import resolve_target
    from jakiro.train.feature_dataset import FeatureDataset

    ds = FeatureDataset(args.data)
    model = ds.featurizer(resolve_target())
    if model is None:
        return None
    batches = []
    for k in range(args.batches):
        recs = [ds.record(i)[0][:512] for i in range(k * args.batch_size, (k + 1) * args.batch_size)]
        lengths = torch.tensor([len(r) for r in recs])
        ids = torch.zeros(len(recs), int(lengths.max()), dtype=torch.long)
        for b, r in enumerate(recs):
            ids[b, :len(r)] = r
        batches.append((ids, lengths))
    real = sum(int(n.sum()) for _, n in batches)
    out = {"real_share": round(real / sum(ids.numel() for ids, _ in batches), 3)}
    for name, by_length in (("padded", False), ("by_length", True)):
        start = time.perf_counter()
        for _ in range(args.rounds):
            for ids, lengths in batches:
                model(ids, lengths if by_length else None)
        out[f"{name}_real_tokens_per_s"] = round(args.rounds * real / (time.perf_counter() - start), 1)
    return out


def trainer_rate(args, method: str, unroll: int) -> dict:
    """Loss tokens a second of ``--trainer-steps`` steps as `jakiro train` runs them (its batches in
    its order, a tokens-only dataset's features included), after one warm-up step."""
    with tempfile.TemporaryDirectory() as out:
        trainer = _trainer(args, method, unroll, out)
        trainer.train_step(trainer.batch_indices(0))
        tokens, start = trainer.tokens, time.perf_counter()
        for step in range(1, args.trainer_steps + 1):
            trainer.train_step(trainer.batch_indices(step))
        seconds = time.perf_counter() - start
    return {"method": method, "unroll": unroll, "loss_tokens_per_s": round((trainer.tokens - tokens) / seconds, 1),
            "seconds_per_step": round(seconds / args.trainer_steps, 2)}


def measure(args, method: str, unroll: int) -> dict:
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.flop_counter import FlopCounterMode

    with tempfile.TemporaryDirectory() as out:
        trainer = _trainer(args, method, unroll, out)
        batches = _batches(args, trainer)
        for batch in batches[:2]:
            trainer.step_on(batch)
        seconds, positions = 0.0, 0
        for _ in range(args.rounds):
            for batch in batches:
                start = time.perf_counter()
                trainer.step_on(batch)
                seconds += time.perf_counter() - start
                positions += batch[0].numel()
        counter = FlopCounterMode(display=False)
        with counter:
            trainer.step_on(batches[0])
        flops = counter.get_total_flops()
        start = time.perf_counter()
        trainer.step_on(batches[0])
        step_s = time.perf_counter() - start
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            trainer.step_on(batches[0])
        products = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in ("aten::mm", "aten::addmm", "aten::bmm"))
        total = sum(e.self_cpu_time_total for e in prof.key_averages())
    return {"method": method, "unroll": unroll, "tokens_per_s": round(positions / seconds, 1),
            "mflop_per_position": round(flops / batches[0][0].numel() / 1e6, 2),
            "gflop_per_s": round(flops / step_s / 1e9, 1), "matmul_share": round(products / max(total, 1), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--data", required=True, help="a dataset folder (jakiro data), tokens-only or with features")
    ap.add_argument("--aux-layers", default="", help="as the dataset holds them, e.g. 3,15")
    ap.add_argument("--methods", default="eagle2,jakiro")
    ap.add_argument("--unrolls", default="1,4")
    ap.add_argument("--jakiro-loss", default="separate")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--trainer-steps", type=int, default=0, help="instead: time this many of the trainer's own "
                    "steps (its batches, features included) per method and unroll")
    ap.add_argument("--features", action="store_true", help="also time a tokens-only dataset's features, "
                    "padded batches against one conversation at a time (--methods '' for that alone)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    features = feature_rates(args) if args.features else None
    run = (lambda m, u: trainer_rate(args, m, u)) if args.trainer_steps else (lambda m, u: measure(args, m, u))
    rows = [run(m, int(u)) for m in args.methods.split(",") for u in args.unrolls.split(",") if m]
    print(json.dumps({"threads": args.threads, "batch_size": args.batch_size, "jakiro_loss": args.jakiro_loss,
                      "features": features, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
