"""Aggregate throughput under concurrent requests (``jakiro bench --concurrency 1,4,8``): for each
method and level N, the questions' first turns are answered N at a time by the continuous-batching
decoder (``decoding.batch``, what ``jakiro serve --parallel N`` runs), and the run reports
aggregate tokens/s, per-request latency and time to first token, the speedup over one request at
a time with the same method and over plain decoding, and whether every greedy answer equals its
answer at N = 1."""

from __future__ import annotations

import json
import os
import statistics
import time

from ..errors import JakiroError
from ..settings import Runtime
from ..methods import METHODS
from ..data.questions import read_questions
from .runner import select_questions


def parse_levels(text: str) -> list[int]:
    try:
        levels = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        levels = []
    if not levels or levels[0] < 1:
        raise JakiroError(f"--concurrency takes positive integers separated by commas (e.g. 1,4,8), got {text!r}")
    return levels if levels[0] == 1 else [1] + levels  # N = 1 is the reference


def run_concurrency(cfg, levels: list[int], progress: bool = True, runtime: Runtime | None = None) -> dict:
    """``cfg``: a ``runner.BenchConfig`` (questions, methods, target, tokens, temperature, out).
    Writes concurrency.json and concurrency.md in ``cfg.out``; returns the summary."""
    import torch

    from ..api import load
    from ..decoding.sampling import SamplingParams
    for m in cfg.methods:
        if m not in METHODS:
            raise JakiroError(f"--concurrency measures the engine's methods, not {m!r}")
    methods = cfg.methods if "ar" in cfg.methods else ["ar"] + list(cfg.methods)
    questions = select_questions(read_questions(cfg.questions), cfg.limit_per_category)
    prompts = [q["turns"][0] for q in questions]
    if len(prompts) < max(levels):
        raise JakiroError(f"{len(prompts)} questions for {max(levels)} concurrent requests: take more questions")
    jk = load(cfg.target, cache_dir=cfg.cache_dir, runtime=runtime, prompt_cache=False)
    # with --prompt-cache each method also runs as the server does, "METHOD (prompt cache)", in the same rounds
    variants = [(m, False) for m in methods] + [(m, True) for m in methods if cfg.prompt_cache]
    engines = {(f"{m} {CACHED}" if cached else m): jk.add_method(m, draft=cfg.drafts.get(m.removesuffix("+pld")),
                                                               draft_model=cfg.draft_model, prompt_cache=cached)
               for m, cached in variants}
    sampling = SamplingParams(cfg.temperature, seed=cfg.seed) if cfg.temperature > 0 else None
    for engine in engines.values():  # warm-up
        engine.generate_batch(prompts[:2], 8, sampling, parallel=2)
    rows: dict[str, dict[str, dict]] = {m: {} for m in engines}
    for n in levels:  # each level over every method before the next: drift hits all alike
        for m, engine in engines.items():
            rows[m][str(n)] = _level(engine, prompts, cfg.max_new_tokens, sampling, n,
                                     rows[m]["1"]["token_ids"] if n > 1 else None)
            if progress:
                print(f"[concurrency] {m} N={n}: {rows[m][str(n)]['tokens_per_s']:.1f} tokens/s", flush=True)
    probe = _probe_prompt(engines["ar"], prompts, PROBE_TOKENS)
    background = [engines["ar"].encode(p) for p in prompts[:max(levels) - 1]]
    first_token = {}
    for m in methods:  # a 200-token prompt arriving at an idle engine, and while N - 1 others decode
        # (a fresh batch: its slots hold nothing for the prompt cache to offer)
        idle = statistics.median(_first_token_s(engines[m], [], probe, max(levels)) for _ in range(3))
        loaded = statistics.median(_first_token_s(engines[m], background, probe, max(levels)) for _ in range(3))
        first_token[m] = {"prompt_tokens": len(probe), "running": len(background), "idle_s": idle,
                          "loaded_s": loaded, "ratio": loaded / idle}
    for m in engines:
        one, plain = rows[m]["1"]["tokens_per_s"], rows["ar"]["1"]["tokens_per_s"]
        for row in rows[m].values():
            row.pop("token_ids", None)
            row["vs_one_at_a_time"] = row["tokens_per_s"] / one
            row["vs_plain_one_at_a_time"] = row["tokens_per_s"] / plain
    summary = {"target": os.path.basename(jk.target_path.rstrip("/")), "questions": cfg.questions,
               "prompts": len(prompts), "max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature,
               "threads": torch.get_num_threads(), "int8_activations": jk.target.int8_activations,
               "kv_cache": jk.target.runtime.kv_cache, "prompt_cache": cfg.prompt_cache,
               "levels": levels, "methods": rows, "first_token": first_token}
    os.makedirs(cfg.out, exist_ok=True)
    with open(os.path.join(cfg.out, "concurrency.json"), "w") as f:
        json.dump(summary, f, indent=2)
    with open(os.path.join(cfg.out, "concurrency.md"), "w") as f:
        f.write(concurrency_table(summary) + "\n")
    return summary


def _level(engine, prompts: list[str], max_new_tokens: int, sampling, n: int, alone: list | None) -> dict:
    """Every prompt answered ``n`` at a time: aggregate and per-request figures, and whether the
    answers are ``alone``'s (those at N = 1; None: this is N = 1)."""
    t0 = time.perf_counter()
    results = engine.generate_batch(prompts, max_new_tokens, sampling, parallel=n)
    wall = time.perf_counter() - t0
    ids = [r.token_ids for r in results]
    tokens = sum(len(i) for i in ids)
    forwards = sum(r.metrics.target_forwards for r in results)
    return {"requests": len(prompts), "new_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "cached_prompt_tokens": sum(r.metrics.cached_tokens for r in results),
            "tau": sum(r.metrics.committed for r in results) / forwards if forwards else 0.0,
            "latency_s_median": statistics.median(r.metrics.total_s for r in results),
            "first_token_s_median": statistics.median(r.metrics.prefill_s for r in results),
            "same_as_alone": alone is None or ids == alone, "token_ids": ids}


PROBE_TOKENS = 200
CACHED = "(prompt cache)"  # the label's suffix of a method measured with the prompt cache


def _probe_prompt(engine, prompts: list[str], tokens: int) -> list[int]:
    """A prompt of ``tokens`` ids: the questions' text, chat-templated, cut to length."""
    ids = engine.encode("\n\n".join(prompts))
    return ids[:tokens]


def _first_token_s(engine, background: list[list[int]], probe: list[int], slots: int) -> float:
    """Seconds from ``probe``'s arrival to its first new token, with ``background`` requests
    decoding (past their prompts) in the same batch."""
    room = max(len(i) for i in [probe, *background]) + 256
    batch = engine.batch(slots, room)
    for ids in background:  # long enough not to end during the measurement
        batch.add(ids, room - len(ids))
    for _ in range(4):
        batch.step()
    t0 = time.perf_counter()
    seq = batch.add(probe, 4)
    while not seq.generated:
        batch.step()
    return time.perf_counter() - t0


def concurrency_table(summary: dict) -> str:
    lines = ["| method | concurrent requests | aggregate tokens/s | × one at a time | × plain, one at a time "
             "| τ | median latency (s) | median first token (s) | answers as alone |",
             "|---|---|---|---|---|---|---|---|---|"]
    for m, levels in summary["methods"].items():
        for n, r in levels.items():
            lines.append(f"| {m} | {n} | {r['tokens_per_s']:.1f} | {r['vs_one_at_a_time']:.2f} | "
                         f"{r['vs_plain_one_at_a_time']:.2f} | {r['tau']:.2f} | {r['latency_s_median']:.2f} | "
                         f"{r['first_token_s_median']:.2f} | {'yes' if r['same_as_alone'] else 'no'} |")
    if summary.get("first_token"):
        lines += ["", "| method | prompt tokens | first token, idle (s) | first token, others running (s) | ratio |",
                  "|---|---|---|---|---|"]
        for m, f in summary["first_token"].items():
            lines.append(f"| {m} | {f['prompt_tokens']} | {f['idle_s']:.3f} | {f['loaded_s']:.3f} "
                         f"(with {f['running']}) | {f['ratio']:.2f} |")
    return "\n".join(lines)
