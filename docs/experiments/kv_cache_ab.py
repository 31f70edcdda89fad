"""The KV cache held as float32 or as float16 (``--kv-cache``), side by side in one process: a
target's forward over one new token and over one new token for each of 8 sequences, at several
context lengths, then requests decoded together end to end (``generate_batch``, plain decoding),
each kind of cache in turn, round after round; medians per kind. One process for both: separate
processes on a shared VM differ by up to a third.

    python docs/experiments/kv_cache_ab.py --target smollm2-135m --threads 2 --contexts 256,1024,2048 \
        --rounds 10 --prompts 16 --parallel 8 --out kv-cache-smollm2.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

KINDS = ("float32", "float16")


def forward_calls(target, contexts: list[int], sequences: int) -> dict:
    """(context, kind, rows) -> a forward: one token after ``context`` entries of one sequence,
    and one token for each of ``sequences`` sequences each ``context`` entries long."""
    calls = {}
    for ctx in contexts:
        for kind in KINDS:
            target.use_kv_cache(kind)
            cache = target.new_cache(ctx + 8)
            cache.data.normal_()  # any entries: the forward reads them all the same
            cache.length = ctx
            token = torch.tensor([7])
            calls[(ctx, kind, 1)] = lambda c=cache: target(token, c)
            batch = target.new_batch_cache(sequences, ctx + 8)
            batch.data.normal_()
            seq, at = torch.arange(sequences), torch.full((sequences,), ctx)
            mask = torch.eye(sequences, dtype=torch.bool)
            calls[(ctx, kind, sequences)] = lambda b=batch, s=seq, a=at, m=mask: target.forward_rows(
                torch.arange(7, 7 + sequences), b.data, s, a, a, a, m)
    return calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--contexts", default="256,1024,2048")
    ap.add_argument("--sequences", type=int, default=8, help="sequences of the batched forward")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--questions", default="../shared/data/spec_bench/question.jsonl")
    ap.add_argument("--prompts", type=int, default=16, help="first turns decoded together end to end (0: none)")
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-rounds", type=int, default=2)
    ap.add_argument("--float32-inputs", action="store_true",
                    help="float32-accurate inputs (default: int8 where the CPU has the kernels)")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import jakiro
    from jakiro.bench.runner import select_questions
    from jakiro.data.questions import read_questions

    jk = jakiro.load(target=args.target, prompt_cache=False,
                     runtime=jakiro.Runtime(threads=args.threads, kv_cache="float32",
                                            int8_activations=False if args.float32_inputs else None))
    target = jk.target
    contexts = [int(c) for c in args.contexts.split(",")]
    calls = forward_calls(target, contexts, args.sequences)
    times = {key: [] for key in calls}
    with torch.inference_mode():
        for round_ in range(args.rounds + 1):  # the first round primes and is dropped
            for key, call in calls.items():
                t0 = time.perf_counter()
                call()
                if round_:
                    times[key].append((time.perf_counter() - t0) * 1000)
    forwards = []
    for ctx in contexts:
        for rows in (1, args.sequences):
            ms = {kind: statistics.median(times[(ctx, kind, rows)]) for kind in KINDS}
            forwards.append({"context": ctx, "sequences": rows, "float32_ms": round(ms["float32"], 2),
                             "float16_ms": round(ms["float16"], 2), "speedup": round(ms["float32"] / ms["float16"], 3)})
            print(f"context {ctx:5d}, {rows} sequence(s): float32 {ms['float32']:7.2f} ms, float16 "
                  f"{ms['float16']:7.2f} ms ({ms['float32'] / ms['float16']:.2f}x)")
    result = {"target": args.target, "threads": args.threads, "int8_activations": target.int8_activations,
              "kv_bytes_per_token": {kind: target.config.num_layers * 2 * target.config.num_kv_heads *
                                     target.config.head_dim * (2 if kind == "float16" else 4) for kind in KINDS},
              "rounds": args.rounds, "forwards": forwards}
    if args.prompts:
        chosen = select_questions(read_questions(args.questions), 2)[:args.prompts]  # 2 per category
        prompts = [q["turns"][0] for q in chosen]
        runs = {kind: [] for kind in KINDS}
        answers = {}
        for _ in range(args.batch_rounds):
            for kind in KINDS:
                target.use_kv_cache(kind)
                t0 = time.perf_counter()
                out = jk.generate_batch(prompts, max_new_tokens=args.max_new_tokens, method="ar",
                                        parallel=args.parallel)
                seconds = time.perf_counter() - t0
                tokens = sum(len(r.token_ids) for r in out)
                runs[kind].append(tokens / seconds)
                answers[kind] = [r.token_ids for r in out]
        rate = {kind: statistics.median(v) for kind, v in runs.items()}
        same = sum(a == b for a, b in zip(answers["float32"], answers["float16"]))
        result["decoded_together"] = {
            "prompts": len(prompts), "parallel": args.parallel, "max_new_tokens": args.max_new_tokens,
            "rounds": args.batch_rounds, "float32_tokens_per_s": round(rate["float32"], 1),
            "float16_tokens_per_s": round(rate["float16"], 1), "speedup": round(rate["float16"] / rate["float32"], 3),
            "answers_identical": same}
        print(f"{len(prompts)} prompts, {args.parallel} at a time: float32 {rate['float32']:.1f} tokens/s, float16 "
              f"{rate['float16']:.1f} ({rate['float16'] / rate['float32']:.2f}x); {same} answers identical")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
