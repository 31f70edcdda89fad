"""A conversation's second turn with and without the prompt cache: the time to its first token
(the prefill, ``Metrics.prefill_s``), how many of its prompt tokens came from the cache, and
whether its greedy answer is the same. Spec-Bench's two-turn development questions; per question
the cached engine answers the first turn, then both engines answer the second (interleaved).

    python docs/experiments/prompt_cache_ttft.py --target qwen2.5-coder-1.5b --threads 2 --questions 10
"""

import argparse
import json
import statistics

import torch

from jakiro.api import Jakiro, load
from jakiro.data.questions import read_questions

QUESTIONS = "../shared/data/spec_bench/question.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=None)
    ap.add_argument("--method", default="ar")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--questions", type=int, default=10, help="two-turn questions to answer")
    ap.add_argument("--questions-file", default=QUESTIONS)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None, help="JSON file for the per-question figures")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    jk = load(args.target, method=args.method)
    cached = jk.engine(args.method)
    whole = Jakiro(jk.target, jk.tokenizer, jk.target_path, jk.cache_dir, prompt_cache=False).add_method(args.method)
    questions = [q for q in read_questions(args.questions_file) if len(q["turns"]) >= 2][:args.questions]
    cached.generate("Hello", 4)  # warm-up of both engines
    whole.generate("Hello", 4)
    rows = []
    for q in questions:
        first = [{"role": "user", "content": q["turns"][0]}]
        answer = cached.generate(first, args.max_new_tokens)
        turn = first + [{"role": "assistant", "content": answer.text}, {"role": "user", "content": q["turns"][1]}]
        a = cached.generate(turn, args.max_new_tokens)
        b = whole.generate(turn, args.max_new_tokens)
        rows.append({"question_id": q.get("question_id"), "prompt_tokens": a.metrics.prompt_tokens,
                     "cached_tokens": a.metrics.cached_tokens, "first_token_s_cached": a.metrics.prefill_s,
                     "first_token_s_whole": b.metrics.prefill_s, "same_answer": a.token_ids == b.token_ids})
        r = rows[-1]
        print(f"{r['question_id']}: {r['cached_tokens']}/{r['prompt_tokens']} prompt tokens cached, first token "
              f"{r['first_token_s_cached']:.3f} s against {r['first_token_s_whole']:.3f} s", flush=True)
    summary = {
        "target": jk.target_path, "method": args.method, "threads": args.threads,
        "int8_activations": jk.target.int8_activations, "questions": len(rows),
        "median_prompt_tokens": statistics.median(r["prompt_tokens"] for r in rows),
        "median_cached_tokens": statistics.median(r["cached_tokens"] for r in rows),
        "median_first_token_s_cached": statistics.median(r["first_token_s_cached"] for r in rows),
        "median_first_token_s_whole": statistics.median(r["first_token_s_whole"] for r in rows),
        "median_ratio": statistics.median(r["first_token_s_whole"] / r["first_token_s_cached"] for r in rows),
        "same_answers": sum(r["same_answer"] for r in rows),
    }
    print(json.dumps(summary, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "questions": rows}, f, indent=2)


if __name__ == "__main__":
    main()
