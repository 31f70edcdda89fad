"""Training throughput of `jakiro train` on this machine: tokens/s of full optimiser steps (loss,
backward, gradient clip, AdamW) on the same batches, per method and unroll depth, with the
floating-point work per position and the share of the step spent in matrix products.

The batches are built once (a tokens-only dataset's features computed by the target beforehand,
outside the timing) and each configuration times ``--rounds`` passes over them after two warm-up
steps; tokens/s counts every position of the batch, as the trainer's log does. The first batch's
step is then counted (floating-point operations per position, and per second of one more step)
and profiled (the share of its time in matrix products). To compare two
versions, run it with ``PYTHONPATH`` pointing at a ``git worktree`` of the other one.

    python docs/experiments/train_throughput.py --threads 1 --data runs/tok2/own-greedy \\
        --aux-layers 3,15 --methods eagle2,jakiro --unrolls 1,4
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch


def _setup(args, method: str, unroll: int, out: str):
    from jakiro.train.config import TrainConfig
    from jakiro.train.trainer import Trainer, make_batch

    cfg = TrainConfig(data=args.data, out=out, method=method, unroll=unroll, jakiro_loss=args.jakiro_loss,
                      steps=100, warmup=5, aux_layers=args.aux_layers, batch_size=args.batch_size)
    trainer = Trainer(cfg, progress=False)
    batches = [make_batch(trainer.ds, trainer.train_idx[k * cfg.batch_size:(k + 1) * cfg.batch_size], cfg.seq_len,
                          trainer.device, cfg.noise, 7, trainer.featurizer) for k in range(args.batches)]
    return trainer, batches


def _step(trainer, batch) -> None:
    ids, feats, mask, noises = batch
    total, _ = trainer.loss(ids, feats, mask, noises)
    loss = total / mask[:, 1:].sum().clamp(min=1).float()
    trainer.opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), trainer.cfg.grad_clip)
    trainer.opt.step()


def measure(args, method: str, unroll: int) -> dict:
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.flop_counter import FlopCounterMode

    with tempfile.TemporaryDirectory() as out:
        trainer, batches = _setup(args, method, unroll, out)
        for batch in batches[:2]:
            _step(trainer, batch)
        seconds, positions = 0.0, 0
        for _ in range(args.rounds):
            for batch in batches:
                start = time.perf_counter()
                _step(trainer, batch)
                seconds += time.perf_counter() - start
                positions += batch[0].numel()
        counter = FlopCounterMode(display=False)
        with counter:
            _step(trainer, batches[0])
        flops = counter.get_total_flops()
        start = time.perf_counter()
        _step(trainer, batches[0])
        step_s = time.perf_counter() - start
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _step(trainer, batches[0])
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
    ap.add_argument("--jakiro-loss", default="full")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [measure(args, m, int(u)) for m in args.methods.split(",") for u in args.unrolls.split(",")]
    print(json.dumps({"threads": args.threads, "batch_size": args.batch_size, "jakiro_loss": args.jakiro_loss,
                      "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
