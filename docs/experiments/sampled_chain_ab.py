"""Sampled requests with drawn draft chains against the same chains taken as the draft's most
likely tokens, interleaved in one process, on development prompts: the first user turns of the
last records of the self-distilled conversation files (the records the trainer holds out).

Two measurements. ``--acceptance``: on the target's own sampled answers (plain decoding, one
seed per prompt), the draft's depth-1 acceptance each way, computed exactly from the target's
and the draft's distributions at every answer position: p(x*) for the draft's most likely token
x*, and sum(min(p, q)) for a token drawn from the draft's processed distribution q. Then
decoding: per prompt, one request per engine (plain decoding, each draft drawn and most likely,
with the cost-aware sizing and with the tuned tree fixed), the order reversed every other
prompt. Prints decoding tokens/s (prefill excluded), its ratio to plain decoding, and tau.

    python docs/experiments/sampled_chain_ab.py --threads 2 --int8-activations --temperature 1 --acceptance
"""

from __future__ import annotations

import argparse
import gzip
import json
import os

import torch

from jakiro.settings import Runtime

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "data", "self-distilled")
FILES = ("greedy", "tasks-greedy", "tasks2-greedy", "tasks3-greedy", "sample")
HELD_OUT = 32  # the trainer holds out each file's last 32 records


def draw_chains(proposer, drawn: bool) -> None:
    """Whether ``proposer`` draws its chains from the draft's distribution in sampled requests
    (the runtime's way) or takes the draft's most likely tokens as in greedy ones."""
    if drawn:
        proposer.__dict__.pop("set_sampling", None)
    else:
        proposer.set_sampling = lambda params, generator=None: type(proposer).set_sampling(proposer, None)


def development_prompts(per_file: int) -> list[str]:
    prompts = []
    for name in FILES:
        with gzip.open(os.path.join(DATA, f"smollm2-135m-instruct-{name}.jsonl.gz"), "rt") as f:
            rows = [json.loads(line) for line in f]
        prompts += [r["messages"][0]["content"] for r in rows[-HELD_OUT:][:per_file]]
    return prompts


@torch.no_grad()
def acceptance(jk, method: str, prompts: list[str], temperature: float, max_new_tokens: int) -> tuple[float, float]:
    from jakiro.api import shipped_draft
    from jakiro.decoding.sampling import SamplingParams, processed_probs
    from jakiro.draft import load_draft
    target = jk.target
    draft = load_draft(shipped_draft(method), target)
    params = SamplingParams(temperature=temperature)
    ar = jk.engine("ar")
    top = drawn = n = 0.0
    for seed, prompt in enumerate(prompts):
        prompt_ids = ar.encode(prompt)
        answer = ar.generate(prompt, max_new_tokens, SamplingParams(temperature=temperature, seed=seed)).token_ids
        ids = torch.tensor(prompt_ids + answer)
        logits, feats = target(ids, target.new_cache(len(ids)), aux_layers=tuple(draft.config.aux_layers))
        # draft row j reads f_j and x_{j+1} and predicts the token after x_{j+1}: the target's row j + 1
        out = draft(draft.input_features(feats)[None, :-1], ids[None, 1:], torch.arange(len(ids) - 1))
        carried = out.blend if draft.config.method == "eagle2" else out.features[..., 0, :]
        q_logits = draft.head_logits(carried[0])
        vocab = draft.to_target_ids(torch.arange(q_logits.shape[-1]))
        for j in range(len(prompt_ids) - 1, len(ids) - 2):
            p = processed_probs(logits[j + 1], params)
            q = torch.zeros_like(p).index_copy_(0, vocab, processed_probs(q_logits[j], params))
            top += float(p[vocab[q_logits[j].argmax()]])
            drawn += float(torch.minimum(p, q).sum())
            n += 1
    return top / n, drawn / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--int8-activations", action="store_true")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--methods", default="eagle2,jakiro")
    ap.add_argument("--per-file", type=int, default=4, help="prompts from each conversation file")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--acceptance", action="store_true", help="also the exact depth-1 acceptance each way")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import jakiro
    from jakiro.decoding.sampling import SamplingParams
    jk = jakiro.load(runtime=Runtime(int8_activations=args.int8_activations))
    prompts = development_prompts(args.per_file)
    methods = args.methods.split(",")
    if args.acceptance:
        for method in methods:
            top, drawn = acceptance(jk, method, prompts, args.temperature, args.max_new_tokens)
            print(f"{method}: depth-1 acceptance, most likely token {top:.3f}, drawn token {drawn:.3f}")
    engines = {"ar": jk.engine("ar")}
    for method in methods:
        for adaptive in (True, False):
            engine = jk.add_method(method, adaptive=adaptive)
            jk.engines.pop(method)
            proposer = engine.proposer.inner if adaptive else engine.proposer
            engines[f"{method} {'cost-aware' if adaptive else 'fixed'} drawn"] = (engine, proposer, True)
            engines[f"{method} {'cost-aware' if adaptive else 'fixed'} most likely"] = (engine, proposer, False)
    totals = {name: [0, 0.0, 0] for name in engines}
    names = list(engines)
    for i, prompt in enumerate(prompts):
        for name in names if i % 2 == 0 else names[::-1]:
            entry = engines[name]
            engine = entry if name == "ar" else entry[0]
            if name != "ar":
                _, proposer, drawn = entry
                draw_chains(proposer, drawn)
            m = engine.generate(prompt, args.max_new_tokens, SamplingParams(temperature=args.temperature, seed=i)).metrics
            totals[name][0] += m.new_tokens
            totals[name][1] += m.total_s - m.prefill_s
            totals[name][2] += m.target_forwards
    base = totals["ar"][0] / totals["ar"][1]
    print(f"{len(prompts)} prompts, T = {args.temperature}, {args.threads} threads, "
          f"int8 activations {args.int8_activations}")
    for name, (tokens, seconds, forwards) in totals.items():
        rate = tokens / seconds
        print(f"{name:32s} {rate:7.1f} tokens/s  {rate / base:.3f}x  tau {tokens / forwards:.2f}")


if __name__ == "__main__":
    main()
