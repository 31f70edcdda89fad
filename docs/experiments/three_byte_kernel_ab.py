"""The target's float32-accurate forwards through the int8 (AVX-512 VNNI) kernel with three bytes per
input against the float32 kernel (``smallgemm.int8_disabled()`` while the target loads; the drafts
keep their int8 kernel in both), on a CPU with AVX-512 VNNI and no AMX tiles: the forward's cost
for 1..16 tokens, then plain decoding and the shipped drafts (default settings: cost-aware cycles)
on the README's first prompt and held-out development prompts, interleaved, ``--rounds`` times.
Prints medians; each method's greedy text must equal plain decoding's on the same target (the two
targets' texts may differ: their sums are rounded differently, both within float32 accuracy).

    python docs/experiments/three_byte_kernel_ab.py --threads 2 --per-file 2 --rounds 3
"""

import argparse
import statistics

import torch

from jakiro.api import Jakiro, load_tokenizer
from jakiro.decoding.costs import forward_costs
from jakiro.models import smallgemm
from jakiro.models.hub import resolve_target
from jakiro.models.target import TargetModel
from sampled_chain_ab import development_prompts

FIRST = "Explain speculative decoding in three sentences."
KERNELS = ("float32", "three-byte")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--per-file", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--methods", default="eagle2,jakiro")
    args = ap.parse_args()
    if not smallgemm.int8_enabled():
        raise SystemExit("this compares the int8 kernel with the float32 one: it needs AVX-512 VNNI and no AMX tiles")
    torch.set_num_threads(args.threads)
    path = resolve_target(None, None)
    with smallgemm.int8_disabled():
        old = TargetModel.from_folder(path)
    new = TargetModel.from_folder(path)
    assert old.tile_matrices == 0 and new.tile_matrices > 0
    methods = args.methods.split(",")
    jks = {}
    for name, model in zip(KERNELS, (old, new)):
        jk = Jakiro(model, load_tokenizer(path), path)
        for m in ["ar"] + methods:
            jk.add_method(m)
        jks[name] = jk

    sizes = (1, 2, 3, 4, 8, 16)
    rounds = {k: [] for k in KERNELS}  # the two targets alternately, each round medians of 5 per size
    for _ in range(4):
        for k in KERNELS:
            rounds[k].append(forward_costs(jks[k].target, 100, repeats=5, sizes=sizes))
    for k in KERNELS:
        med = {n: statistics.median(r[n] for r in rounds[k]) for n in sizes}
        print(f"{k:10s} forward ms:", {n: round(v, 2) for n, v in med.items()},
              "x t(1):", {n: round(v / med[1], 2) for n, v in med.items()}, flush=True)

    prompts = [FIRST] + development_prompts(args.per_file)
    speed = {(k, m): [] for k in KERNELS for m in ["ar"] + methods}  # per round: tokens / s over all prompts
    tau = {(k, m): [] for k in KERNELS for m in methods}
    first = {}
    for r in range(args.rounds):
        totals = {key: [0, 0.0] for key in speed}
        for i, prompt in enumerate(prompts):
            for k in KERNELS:
                ref = None
                for m in ["ar"] + methods:
                    res = jks[k].generate(prompt, max_new_tokens=args.max_new_tokens, method=m)
                    if ref is None:
                        ref = res
                    assert res.token_ids == ref.token_ids, (k, m, prompt)
                    totals[(k, m)][0] += len(res.token_ids)
                    totals[(k, m)][1] += len(res.token_ids) / res.metrics.tokens_per_s
                    if m != "ar" and r == 0:
                        tau[(k, m)].append((res.metrics.tau, len(res.token_ids)))
                    if i == 0:
                        first.setdefault((k, m), []).append(res.metrics.tokens_per_s)
        for key, (tokens, seconds) in totals.items():
            speed[key].append(tokens / seconds)
    for k in KERNELS:
        ar = statistics.median(speed[(k, "ar")])
        ar1 = statistics.median(first[(k, "ar")])
        print(f"{k:10s} all prompts: ar {ar:.1f} tokens/s; first prompt: ar {ar1:.1f} tokens/s")
        for m in methods:
            s, s1 = statistics.median(speed[(k, m)]), statistics.median(first[(k, m)])
            t = sum(a * n for a, n in tau[(k, m)]) / sum(n for _, n in tau[(k, m)])
            print(f"{'':10s} {m}: all {s:.1f} tokens/s ({s / ar:.2f}x, tau {t:.2f}); "
                  f"first prompt {s1:.1f} tokens/s ({s1 / ar1:.2f}x, tau {tau[(k, m)][0][0]:.2f})")
    print("three-byte over float32, plain decoding:",
          round(statistics.median(speed[("three-byte", "ar")]) / statistics.median(speed[("float32", "ar")]), 3))


if __name__ == "__main__":
    main()
