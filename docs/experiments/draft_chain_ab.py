"""A chain proposal in one kernel call against the same proposal step by step (the draft's
fused attention and MLP/head calls, and torch for Jakiro's contrastive step), interleaved in one
process: per prompt and round, one request each way. Prints the median and mean milliseconds of
a proposal and decoding tokens/s (prefill excluded) per way.

    python docs/experiments/draft_chain_ab.py --method eagle2 --threads 2 --int8-activations
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from jakiro.settings import Runtime

PROMPTS = ["Write a short story about a lighthouse keeper.",
           "How do I reverse a linked list in Python? Explain step by step.",
           "What are the main causes of inflation?",
           "Describe the water cycle for a ten-year-old."]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="eagle2", choices=("eagle2", "jakiro"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--int8-activations", action="store_true")
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import jakiro
    from jakiro.draft.model import DraftModel
    jk = jakiro.load(method=args.method, runtime=Runtime(int8_activations=args.int8_activations), depth=args.depth, tree_top_k=1,
                     total_tokens=args.depth, adaptive=False)
    proposer = jk.engine().proposer
    one_call, propose = DraftModel.chain, proposer.propose
    times = {True: [], False: []}
    decoded = {True: [0, 0.0], False: [0, 0.0]}
    way = [True]

    def timed(context, depth=None):
        t0 = time.perf_counter()
        tree = propose(context, depth)
        times[way[0]].append(time.perf_counter() - t0)
        return tree

    proposer.propose = timed
    jk.generate(PROMPTS[0], max_new_tokens=8)  # warm-up
    try:
        for _ in range(args.rounds):
            for prompt in PROMPTS:
                for fused in (True, False):
                    way[0] = fused
                    DraftModel.chain = one_call if fused else (lambda self, *a: None)
                    m = jk.generate(prompt, max_new_tokens=args.max_new_tokens).metrics
                    decoded[fused][0] += m.new_tokens
                    decoded[fused][1] += m.total_s - m.prefill_s
    finally:
        DraftModel.chain = one_call
    for fused in (True, False):
        t = times[fused]
        print(f"{args.method} {'one call    ' if fused else 'step by step'} proposal median "
              f"{1000 * statistics.median(t):.3f} ms, mean {1000 * statistics.mean(t):.3f} ms; decoding "
              f"{decoded[fused][0] / decoded[fused][1]:.1f} tokens/s")


if __name__ == "__main__":
    main()
