"""Sampling with top-p: the filter as it ranks tokens now (``decoding.sampling._top_p_kept``:
``topk`` over the first tokens until a row's cut is inside) against a sort of the whole vocabulary
per row (what it did before), interleaved in one process, plain decoding and EAGLE-2.

    python docs/experiments/top_p_ab.py --threads 2
"""

import argparse
import statistics

import torch

import jakiro.decoding.sampling as sampling
from jakiro.api import load

PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how vaccines work.",
           "Give me three tips for learning to cook."]


def sorted_kept(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    drop = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, probs.cumsum(-1) - probs >= top_p)
    return ~drop


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    jk = load(None, method="eagle2", draft="jakiro/drafts/smollm2-135m-eagle2")
    jk.add_method("ar")
    ranked = sampling._top_p_kept
    speeds: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.repeats):
        for name, kept in (("sort", sorted_kept), ("ranked", ranked)):
            sampling._top_p_kept = kept
            for method in ("ar", "eagle2"):
                for seed, prompt in enumerate(PROMPTS):
                    res = jk.generate(prompt, max_new_tokens=96, temperature=0.8, top_p=0.95, seed=seed, method=method)
                    speeds.setdefault((name, method), []).append(res.metrics.tokens_per_s)
    for method in ("ar", "eagle2"):
        before, after = (statistics.median(speeds[(n, method)]) for n in ("sort", "ranked"))
        print(f"{method}: {before:.1f} -> {after:.1f} tokens/s ({after / before:.2f}x), T 0.8, top-p 0.95, "
              f"median of {len(speeds[('sort', method)])} answers")


if __name__ == "__main__":
    main()
