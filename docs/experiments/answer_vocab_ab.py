"""A request's draft head taking in its answer's tokens as they come (``DraftProposer.answer_vocab``,
``ANSWER_VOCAB_MAX`` rows) against the prompt's tokens alone (``answer_vocab = 0``), both shipped
drafts with their tuned trees, on the README's first prompt and held-out development prompts
(the last records of the self-distilled files, never trained on). Prints τ (weighted by answer
length) and, with ``--timing``, the median speedup over plain decoding of both settings,
interleaved. Greedy texts must be equal throughout.

    python docs/experiments/answer_vocab_ab.py --threads 2 --per-file 4 [--adaptive] [--timing]
"""

import argparse
import statistics

import torch

from jakiro.api import load
from jakiro.bench.runner import head_coverage
from sampled_chain_ab import development_prompts

FIRST = "Explain speculative decoding in three sentences."


def drafter(engine):
    p = engine.proposer
    return getattr(p, "inner", None) or p


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--per-file", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--adaptive", action="store_true", help="cost-aware cycles (tokens/s); off: every cycle drafts")
    ap.add_argument("--timing", action="store_true")
    ap.add_argument("--methods", default="eagle2,jakiro")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = [FIRST] + development_prompts(args.per_file)
    methods = args.methods.split(",")
    jk = load(None, method=methods[0], adaptive=args.adaptive)
    for m in methods[1:] + ["ar"]:
        jk.add_method(m, adaptive=args.adaptive)
    rows = []
    for i, prompt in enumerate(prompts):
        ref = jk.generate(prompt, max_new_tokens=args.max_new_tokens, method="ar")
        row = {"ar": ref.metrics.tokens_per_s}
        for m in methods:
            d = drafter(jk.engine(m))
            for name, rows_max in (("prompt", 0), ("answer", 512)):
                d.answer_vocab = rows_max
                res = jk.generate(prompt, max_new_tokens=args.max_new_tokens, method=m)
                assert res.token_ids == ref.token_ids, (prompt, m, name)
                row[(m, name)] = (res.metrics.tau, res.metrics.tokens_per_s, len(res.token_ids))
        rows.append(row)
        if i == 0:
            print("first prompt, tau:", {f"{k[0]}/{k[1]}": round(v[0], 2) for k, v in row.items() if k != "ar"})
            for m in methods:
                d = drafter(jk.engine(m))
                c = head_coverage(d, jk.engine(m).encode(prompt), ref.token_ids)
                print(f"first prompt, {m} head of {d.head_vocab} tokens holds", {k: round(v / c["tokens"], 3)
                                                                      for k, v in c.items() if k != "tokens"})
    for m in methods:
        for name in ("prompt", "answer"):
            vals = [r[(m, name)] for r in rows]
            tokens = sum(v[2] for v in vals)
            tau = sum(v[0] * v[2] for v in vals) / tokens  # weighted by answer length
            line = f"{m} head of {name:6s}: tau {tau:.3f} over {len(vals)} prompts ({tokens} tokens)"
            if args.timing:
                line += f", median speedup {statistics.median(v[1] / r['ar'] for v, r in zip(vals, rows)):.3f}x"
            print(line)


if __name__ == "__main__":
    main()
