"""Tree-budget tuning: measure tokens/s of a draft on a small calibration set for a grid of
trees (and reduced draft vocabularies) on this machine, keep the fastest, and save the choice so
that later runs use it by default."""

from __future__ import annotations

import hashlib
import json
import os
import time

import torch

from ..errors import JakiroError
from ..models.hub import cache_dir

CHAINS = [(d, 1, d) for d in (2, 3, 4, 5, 6)]
TREES = [(d, k, n) for d in (3, 4, 5) for k in (2, 4) for n in (6, 8, 12, 16)]
FINALISTS = 3
FINAL_ROUNDS = 2
CALIBRATION = [
    "Explain how vaccines train the immune system.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Give three tips for writing clean Python code, with an example for each.",
]


def tuning_path(draft: str, cache: str | None = None) -> str:
    """One saved choice per draft checkpoint (its path and weights' modification time)."""
    draft = os.path.abspath(draft)
    weights = os.path.join(draft, "model.safetensors")
    stamp = f"{draft}:{os.path.getmtime(weights) if os.path.exists(weights) else 0}"
    key = hashlib.sha256(stamp.encode()).hexdigest()[:12]
    return os.path.join(cache_dir(cache), "tuning", f"{key}.json")


def load_tuning(draft: str, cache: str | None = None) -> dict | None:
    path = tuning_path(draft, cache)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _measure(engine, prompts: list[list[int]], max_new_tokens: int) -> tuple[float, float]:
    tokens = secs = committed = forwards = 0
    for ids in prompts:
        res = engine.generate(ids, max_new_tokens)
        tokens += res.metrics.new_tokens
        secs += res.metrics.total_s
        committed += res.metrics.committed
        forwards += res.metrics.target_forwards
    return tokens / secs, committed / max(1, forwards)


def run_tune(draft: str, target: str | None = None, cache: str | None = None,
             max_new_tokens: int = 48, prompts: list[str] | None = None, progress: bool = True) -> dict:
    from tqdm import tqdm

    from ..api import load
    from ..decoding.costs import forward_costs
    from ..decoding.engine import Engine
    from ..decoding.proposers import DraftProposer, TreeBudget
    from ..draft.checkpoint import read_draft_config

    method = read_draft_config(draft).method
    jk = load(target, draft, method, cache_dir=cache, depth=4, top_k=4, total_tokens=8)  # untuned
    base = jk.engine(method)
    prompts_ids = [base.encode(p) for p in (prompts or CALIBRATION)]
    costs = forward_costs(jk.target, 256, repeats=5, sizes=(1, 2, 4, 8, 16, 32))
    ar_tps, _ = _measure(jk.engine("ar"), prompts_ids, max_new_tokens)
    model = base.proposer.draft
    # Jakiro drafts: the last tree layer from the contrastive branch (one draft forward less) or not
    parallel = [True, False] if method == "jakiro" and model.config.parallel_decoding else [None]

    def engine_for(row: dict) -> Engine:  # every configuration shares the one loaded draft
        proposer = DraftProposer(model, TreeBudget(row["depth"], row["top_k"], row["total_tokens"]),
                                 parallel_decoding=row.get("parallel_decoding"))
        if row.get("draft_vocab"):
            proposer.head_vocab = row["draft_vocab"]
        return Engine(jk.target, jk.tokenizer, proposer)

    grid = []
    configs = [dict(depth=d, top_k=k, total_tokens=n, **({} if p is None else {"parallel_decoding": p}))
               for d, k, n in CHAINS + TREES for p in parallel]
    for row in tqdm(configs, desc="trees", disable=not progress):
        tps, tau = _measure(engine_for(row), prompts_ids, max_new_tokens)
        grid.append(dict(row, tokens_per_s=tps, tau=tau))
    best = max(grid, key=lambda r: r["tokens_per_s"])
    vocab = model.config.draft_vocab_size
    if vocab:
        for size in (vocab // 4, vocab // 2):
            row = {k: v for k, v in best.items() if k not in ("tokens_per_s", "tau")}
            row["draft_vocab"] = size
            tps, tau = _measure(engine_for(row), prompts_ids, max_new_tokens)
            grid.append(dict(row, tokens_per_s=tps, tau=tau))
    # the finalists again, side by side with plain decoding: choose by measured speedup, not by
    # tokens/s measured minutes apart on a machine whose speed drifts
    finalists = sorted(grid, key=lambda r: r["tokens_per_s"], reverse=True)[:FINALISTS]
    engines = [jk.engine("ar")] + [engine_for(r) for r in finalists]
    tokens = [0] * len(engines)
    secs = [0.0] * len(engines)
    for _ in range(FINAL_ROUNDS):
        for ids in prompts_ids:  # interleaved per prompt
            for i, engine in enumerate(engines):
                m = engine.generate(ids, max_new_tokens).metrics
                tokens[i] += m.new_tokens
                secs[i] += m.total_s
    rates = [t / s for t, s in zip(tokens, secs)]
    speedups = [r / rates[0] for r in rates[1:]]
    i = max(range(len(finalists)), key=speedups.__getitem__)
    best = dict(finalists[i], speedup=speedups[i])
    best.setdefault("draft_vocab", vocab)
    result = {"draft": os.path.abspath(draft), "method": method, "threads": torch.get_num_threads(),
              "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"), "ar_tokens_per_s": ar_tps,
              "forward_ms": {str(k): v for k, v in costs.items()}, "best": best, "grid": grid}
    path = tuning_path(draft, cache)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    result["saved_to"] = path
    return result


def tuned_budget(draft: str | None, cache: str | None = None) -> dict | None:
    """The saved choice for this draft and thread count, if ``jakiro tune`` was run."""
    if draft is None or not os.path.isdir(draft):
        return None
    try:
        tuning = load_tuning(draft, cache)
    except (OSError, json.JSONDecodeError) as exc:
        raise JakiroError(f"unreadable tuning file for {draft}: {exc}") from None
    return tuning["best"] if tuning else None
