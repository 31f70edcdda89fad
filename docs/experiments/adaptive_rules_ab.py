"""Cost-aware drafting at T = 0 with its two rules for a draft that has gone idle against the
earlier behaviour, and against the tuned tree kept fixed, interleaved in one process.

The rules (``AdaptiveProposer``): outcomes fade with every plain step too (``IDLE_FORGET``), and a
drafted cycle whose nodes were all cut counts by what its best nodes were expected to reach
(``_count_unverified``). Earlier, outcomes faded only with drafted cycles and a cut cycle counted
as a miss. Engines: ``ar``; ``current`` (both rules); ``no fade`` and ``cut = miss`` (one rule
each); ``earlier`` (neither); optional probe budgets (``--probe-shares``, earlier rules); ``fixed``
(the tuned tree every cycle). Prompts: development prompts (the trainer's held-out records,
``sampled_chain_ab.development_prompts``), the same prompts to translate into German (where a
draft predicts badly) and the README's prompt, repeated. Prints per prompt and per kind decoding
tokens/s (prefill excluded) as a ratio to plain decoding, and tau.

    python docs/experiments/adaptive_rules_ab.py --threads 2 [--int8-activations]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

from jakiro.decoding.adaptive import PROBE_SHARE
from jakiro.settings import Runtime

sys.path.insert(0, os.path.dirname(__file__))
from sampled_chain_ab import development_prompts  # noqa: E402

README_PROMPT = "Explain speculative decoding in three sentences."
KINDS = ("dev", "translation", "readme")


def earlier_rules(proposer, fade: bool = False, cut_as_miss: bool = True, probe_share: float | None = None):
    """Give ``proposer`` the earlier behaviour, rule by rule."""
    class Earlier(type(proposer)):
        if not fade:  # outcomes fade only with drafted cycles
            def _fade_idle(self):
                self.idle += 1

        if probe_share is not None:  # another probe budget: the plain steps' time scaled to it
            def _probe_affordable(self, plain_tokens):
                real = self.plain_ms
                self.plain_ms = real * probe_share / PROBE_SHARE
                try:
                    return super()._probe_affordable(plain_tokens)
                finally:
                    self.plain_ms = real

        if cut_as_miss:
            def _count_unverified(self, tree):
                self._count(int(tree.depths.max()), 0)
    proposer.__class__ = Earlier


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="jakiro", choices=("eagle2", "jakiro"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--int8-activations", action="store_true")
    ap.add_argument("--per-file", type=int, default=4)
    ap.add_argument("--translations", type=int, default=8, help="development prompts also asked to translate")
    ap.add_argument("--readme-repeats", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--probe-shares", type=float, nargs="*", default=[], help="earlier rules with these probe budgets")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import jakiro
    jk = jakiro.load(runtime=Runtime(int8_activations=args.int8_activations))
    engines = {"ar": jk.engine("ar"), "current": jk.add_method(args.method)}
    variants = {"no fade": {"fade": False, "cut_as_miss": False}, "cut = miss": {"fade": True},
                "earlier": {}} | {f"share {s}": {"probe_share": s} for s in args.probe_shares}
    for name, rules in variants.items():
        engines[name] = jk.add_method(args.method)
        earlier_rules(engines[name].proposer, **rules)
    engines["fixed"] = jk.add_method(args.method, adaptive=False)
    dev = development_prompts(args.per_file)
    hard = [f"Translate the following text into German:\n\n{p}" for p in dev[:args.translations]]
    prompts = [(p, "dev") for p in dev] + [(p, "translation") for p in hard] + [(README_PROMPT, "readme")] * args.readme_repeats
    rates = {name: {k: [] for k in KINDS} for name in engines}
    taus: dict[str, list[float]] = {name: [] for name in engines}
    for i, (prompt, kind) in enumerate(prompts):
        order = list(engines) if i % 2 == 0 else list(engines)[::-1]
        got = {}
        for name in order:
            m = engines[name].generate(prompt, args.max_new_tokens).metrics
            got[name] = m.new_tokens / (m.total_s - m.prefill_s)
            taus[name].append(m.tau)
        for name in engines:
            rates[name][kind].append(got[name] / got["ar"])
        print(f"{i:3d} {kind:11s} ar {got['ar']:6.1f} tok/s  " + "  ".join(
            f"{name} {got[name] / got['ar']:.3f}x tau {taus[name][-1]:.2f}" for name in engines if name != "ar"), flush=True)
    print(f"threads {args.threads}, int8 activations {args.int8_activations}, {args.method}; ratio to ar: median (geomean)")
    for name in engines:
        print(f"{name:10s} " + "  ".join(f"{k} {statistics.median(rates[name][k]):.3f}x "
                                          f"({statistics.geometric_mean(rates[name][k]):.3f}x)" for k in KINDS if rates[name][k])
              + f"  tau mean {statistics.mean(taus[name]):.2f}")


if __name__ == "__main__":
    main()
