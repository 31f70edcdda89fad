"""How fast speculative decoding can get on this machine, whatever the draft: decoding with an
*oracle* chain whose tokens are the target's own greedy continuation, each kept right with
probability p (independently; a wrong token ends what the cycle accepts), at a fixed chain depth
d, against plain decoding, interleaved in one process. Each oracle cycle also runs the shipped
draft's real chain of the same depth and throws its tokens away, so a cycle costs what a real
draft's does; only the acceptance is chosen. The shipped drafts at the same fixed depths run in
the same rounds, to place them on the curve.

The output is exactly plain decoding's text in every configuration (checked), so the speedup of
a configuration is the most any draft with that per-token acceptance could get from chains of
that depth on this machine, with this decode loop. Prompts: the development prompts (the first
user turns of the records the trainer holds out; never evaluation questions), or ``--prompt``.

    python docs/experiments/oracle_ceiling.py --threads 2 --out runs/oracle-ceiling.json
    python docs/experiments/oracle_ceiling.py --threads 2 --int8-activations --out runs/oracle-ceiling-int8.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

import torch

from jakiro.settings import Runtime

sys.path.insert(0, os.path.dirname(__file__))
from sampled_chain_ab import development_prompts  # noqa: E402

from jakiro.api import shipped_draft  # noqa: E402
from jakiro.decoding.engine import Engine  # noqa: E402
from jakiro.decoding.proposers import Proposer, TreeBudget  # noqa: E402
from jakiro.decoding.draft_proposer import DraftProposer
from jakiro.decoding.tree import DRAFT, chain_tree  # noqa: E402
from jakiro.draft import load_draft  # noqa: E402


class OracleChain(Proposer):
    """A chain of ``depth`` tokens read from the target's known greedy continuation, each one right
    with probability ``accept``; the real draft ``inner`` drafts a chain of the same depth first
    (its cost is paid, its tokens dropped) and is fed the target's features as in decoding."""

    needs_features = True

    def __init__(self, inner: DraftProposer, depth: int, accept: float, vocab: int, seed: int = 0):
        self.inner, self.depth, self.accept, self.vocab = inner, depth, accept, vocab
        self.name = f"oracle d{depth} p{accept:g}"
        self.aux_layers = inner.aux_layers
        self.max_tree_tokens, self.max_tree_depth = depth + 1, depth
        self.rng = random.Random(seed)
        self.reference: list[int] = []  # prompt ids + the target's greedy answer

    def start(self, max_len: int) -> None:
        self.inner.start(max_len)

    def observe(self, features: torch.Tensor, next_tokens: torch.Tensor) -> None:
        self.inner.observe(features, next_tokens)

    def feedback(self, tree, verdict) -> None:
        self.inner.feedback(tree, verdict)

    def propose(self, context: list[int]):
        self.inner.propose(context, depth=self.depth)
        if context != self.reference[:len(context)]:
            raise RuntimeError("decoding left the target's greedy continuation")
        right = self.reference[len(context):len(context) + self.depth]
        tokens = [t if self.rng.random() < self.accept else (t + 1) % self.vocab for t in right]
        tree = chain_tree(context[-1], tokens)
        tree.sources = torch.tensor([0] + [DRAFT] * len(tokens))
        return tree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--int8-activations", action="store_true")
    ap.add_argument("--accept", default="0.6,0.7,0.8,0.9,1.0", help="per-token acceptance of the oracle")
    ap.add_argument("--depths", default="1,2,3,4,6", help="chain depths (draft tokens per cycle)")
    ap.add_argument("--methods", default="eagle2,jakiro", help="shipped drafts placed on the curve")
    ap.add_argument("--per-file", type=int, default=2, help="development prompts from each conversation file")
    ap.add_argument("--prompt", help="one prompt instead of the development prompts")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=1, help="rounds over the prompts")
    ap.add_argument("--out", help="write the figures as JSON")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import jakiro

    jk = jakiro.load(runtime=Runtime(int8_activations=args.int8_activations))
    target, tok = jk.target, jk.tokenizer
    accepts = [float(a) for a in args.accept.split(",")]
    depths = [int(d) for d in args.depths.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    prompts = ([args.prompt] if args.prompt else development_prompts(args.per_file)) * args.repeats
    ar = jk.engine("ar")
    cost_draft = load_draft(shipped_draft("eagle2"), target)
    # the oracles' real chains: one proposer serves them all (each request starts it afresh)
    cost_chain = DraftProposer(cost_draft, TreeBudget(max(depths), 1, max(depths)), parallel_decoding=False)

    def fixed_chain(model, depth):  # a real draft's chain of ``depth`` tokens every cycle
        return DraftProposer(model, TreeBudget(depth, 1, depth))  # Jakiro: its contrastive last step

    engines: dict[str, Engine] = {"ar": ar}
    oracles = []
    for d in depths:
        for p in accepts:
            oracle = OracleChain(cost_chain, d, p, target.config.vocab_size)
            oracles.append(oracle)
            engines[f"oracle d{d} p{p:g}"] = Engine(target, tok, oracle)
    for method in methods:
        model = cost_draft if method == "eagle2" else load_draft(shipped_draft(method), target)
        for d in depths:
            engines[f"{method} d{d}"] = Engine(target, tok, fixed_chain(model, d))
        engines[f"{method} tuned"] = jk.add_method(method)  # the tuned tree, cost-aware: what users get
    totals = {name: [0, 0.0, 0] for name in engines}
    names = list(engines)
    for i, prompt in enumerate(prompts):
        reference = ar.generate(prompt, args.max_new_tokens)  # the continuation, and a warm-up
        full = ar.encode(prompt) + reference.token_ids
        for oracle in oracles:
            oracle.reference = full
        for name in names if i % 2 == 0 else names[::-1]:
            res = engines[name].generate(prompt, args.max_new_tokens)
            if res.token_ids != reference.token_ids:
                raise RuntimeError(f"{name}: output differs from plain decoding on prompt {i}")
            m = res.metrics
            totals[name][0] += m.new_tokens
            totals[name][1] += m.total_s - m.prefill_s
            totals[name][2] += m.target_forwards
        print(f"prompt {i + 1}/{len(prompts)} done", file=sys.stderr, flush=True)
    base = totals["ar"][0] / totals["ar"][1]
    rows = {name: {"tokens_per_s": t / s, "speedup": t / s / base, "tau": t / f}
            for name, (t, s, f) in totals.items()}
    print(f"{len(prompts)} prompts, {args.max_new_tokens} new tokens, {args.threads} threads, "
          f"int8 activations {args.int8_activations}; plain decoding {base:.1f} tokens/s")
    print("speedup (tau) of an oracle chain, by per-token acceptance p (rows) and depth d (columns)")
    print("p \\ d  " + "".join(f"{d:>14d}" for d in depths))
    for p in accepts:
        cells = [rows[f"oracle d{d} p{p:g}"] for d in depths]
        print(f"{p:<7g}" + "".join(f"{c['speedup']:>8.2f}x ({c['tau']:.2f})" for c in cells))
    for method in methods:
        cells = [rows[f"{method} d{d}"] for d in depths]
        print(f"{method:<7s}" + "".join(f"{c['speedup']:>8.2f}x ({c['tau']:.2f})" for c in cells))
    for method in methods:
        c = rows[f"{method} tuned"]
        print(f"{method}, tuned tree with cost-aware drafting (the default): {c['speedup']:.2f}x (tau {c['tau']:.2f})")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"threads": args.threads, "int8_activations": args.int8_activations,
                       "prompts": len(prompts), "prompt": args.prompt, "max_new_tokens": args.max_new_tokens,
                       "plain_tokens_per_s": base, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
