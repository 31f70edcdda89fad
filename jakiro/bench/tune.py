"""Tree-budget tuning: measure tokens/s of a draft on a small calibration set for a grid of
trees (and reduced draft vocabularies) on this machine, keep the fastest, and save the choice so
that later runs use it by default."""

from __future__ import annotations

import json
import os
import time

import torch

from ..draft.tuning import tuning_path
from ..settings import Runtime

CHAINS = [(d, 1, d) for d in (2, 3, 4, 5)]
TREES = [(d, k, n) for d in (3, 4, 5) for k in (2, 4) for n in (6, 10, 16)]
SCREEN_TOKENS = 24  # the first round: every tree on the first calibration prompt, this many tokens
SURVIVORS = 6  # trees measured on every prompt in the second round
FINALISTS = 3
FINAL_ROUNDS = 2
CALIBRATION = [
    "Explain how vaccines train the immune system.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Give three tips for writing clean Python code, with an example for each.",
]


def _measure(engine, prompts: list[list[int]], max_new_tokens: int) -> tuple[float, float]:
    from ..decoding.engine import Metrics
    m = Metrics.total(engine.generate(ids, max_new_tokens).metrics for ids in prompts)
    return m.tokens_per_s, m.tau


def run_tune(draft: str, target: str | None = None, cache: str | None = None,
             max_new_tokens: int = 48, prompts: list[str] | None = None, progress: bool = True,
             runtime: Runtime | None = None) -> dict:
    """Successive halving over the tree grid: every tree on one short prompt, the best
    ``SURVIVORS`` on every calibration prompt, three reduced draft vocabularies on the best (an
    eighth, a quarter and half of it: the prompt's own tokens join any of them), and
    the finalists side by side with plain decoding. The best so far is saved after every
    measurement (``complete: false``), so an interrupted run keeps what it measured."""
    from tqdm import tqdm

    from ..api import load
    from ..decoding.costs import forward_costs
    from ..draft.checkpoint import draft_method

    method = draft_method(draft)
    jk = load(target, draft, method, runtime=runtime, cache_dir=cache, depth=4, tree_top_k=4, total_tokens=8,
              prompt_cache=False)  # untuned; every prompt whole
    base = jk.engine(method)
    prompts_ids = [base.encode(p) for p in (prompts or CALIBRATION)]
    model = base.proposer.draft
    configs = _grid_configs(method, model)
    survivors = min(len(configs), max(SURVIVORS, FINALISTS))
    vocab = model.config.draft_vocab_size
    bar = tqdm(total=len(configs) + survivors + (3 if vocab else 0), desc="tune", disable=not progress)
    tuning = _Tuning(jk, model, draft, method, cache, bar)
    result = tuning.result
    try:
        costs = forward_costs(jk.target, 256, repeats=5, sizes=(1, 2, 4, 8, 16, 32))
        result["forward_ms"] = {str(k): v for k, v in costs.items()}
        result["ar_tokens_per_s"], _ = _measure(jk.engine("ar"), prompts_ids, max_new_tokens)
        # untimed: the first drafted generation pays one-time setup (on a Zen 4 the first tree
        # screened, a two-token chain, measured 90 tokens/s against 150-200 when measured later,
        # and was dropped from the second round)
        tuning.engine_for(configs[0]).generate(prompts_ids[0], min(SCREEN_TOKENS, max_new_tokens))
        screened = [tuning.measure(row, prompts_ids[:1], min(SCREEN_TOKENS, max_new_tokens), 1) for row in configs]
        screened.sort(key=lambda r: r["tokens_per_s"], reverse=True)
        finals = [tuning.measure(row, prompts_ids, max_new_tokens, 2) for row in screened[:survivors]]
        best = max(finals, key=lambda r: r["tokens_per_s"])
        if vocab:
            for size in (vocab // 8, vocab // 4, vocab // 2):
                finals.append(tuning.measure(dict(best, draft_vocab=size), prompts_ids, max_new_tokens, 2))
        bar.close()
        finalists = sorted(finals, key=lambda r: r["tokens_per_s"], reverse=True)[:FINALISTS]
        speedups = _side_by_side(jk.engine("ar"), [tuning.engine_for(r) for r in finalists], prompts_ids,
                                 max_new_tokens)
        i = max(range(len(finalists)), key=speedups.__getitem__)
        result["complete"] = True
        tuning.save(dict(finalists[i], speedup=speedups[i]))
    except KeyboardInterrupt:
        bar.close()
        result["interrupted"] = True
    result["saved_to"] = tuning.path if os.path.exists(tuning.path) and "best" in result else None
    return result


def _grid_configs(method: str, model) -> list[dict]:
    # Jakiro drafts: the last tree layer from the contrastive branch (one draft forward less) or not
    parallel = [True, False] if method == "jakiro" and model.config.parallel_decoding else [None]
    return [dict(depth=d, top_k=k, total_tokens=n, **({} if p is None else {"parallel_decoding": p}))
            for d, k, n in CHAINS + TREES for p in parallel]


class _Tuning:
    """The record being measured: every configuration shares the one loaded draft; each
    measurement replaces its tree's row, saves the best so far and moves ``bar`` on."""

    def __init__(self, jk, model, draft: str, method: str, cache: str | None, bar):
        self.jk, self.model, self.bar = jk, model, bar
        self.vocab = model.config.draft_vocab_size
        self.path = tuning_path(draft, cache, quantized=jk.target.quantized_matrices > 0,
                                int8_activations=jk.target.int8_activations)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.result = {"draft": os.path.abspath(draft), "method": method, "threads": torch.get_num_threads(),
                       "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"), "complete": False, "grid": []}
        self.grid = self.result["grid"]

    def save(self, best: dict | None = None) -> None:
        grid = self.grid
        if best is None and grid:
            best = max(grid, key=lambda r: (r.get("round", 0), r["tokens_per_s"]))
        if best is not None:
            self.result["best"] = dict(best, draft_vocab=best.get("draft_vocab") or self.vocab)
            with open(self.path + ".tmp", "w") as f:
                json.dump(self.result, f, indent=2)
            os.replace(self.path + ".tmp", self.path)

    def engine_for(self, row: dict):
        from ..decoding.engine import Engine
        from ..decoding.proposers import TreeBudget
        from ..decoding.draft_proposer import DraftProposer
        proposer = DraftProposer(self.model, TreeBudget(row["depth"], row["top_k"], row["total_tokens"]),
                                 parallel_decoding=row.get("parallel_decoding"), head_vocab=row.get("draft_vocab"))
        return Engine(self.jk.target, self.jk.tokenizer, proposer)

    def measure(self, row: dict, prompts_: list[list[int]], tokens: int, round_: int) -> dict:
        tps, tau = _measure(self.engine_for(row), prompts_, tokens)
        out = dict({k: v for k, v in row.items() if k not in ("tokens_per_s", "tau", "round")},
                   tokens_per_s=tps, tau=tau, round=round_)
        self.grid[:] = [r for r in self.grid if _tree_key(r) != _tree_key(out)] + [out]
        self.save()
        self.bar.update(1)
        self.bar.set_postfix(best=_describe(max(self.grid, key=lambda r: (r["round"], r["tokens_per_s"]))))
        return out


def _side_by_side(plain, engines: list, prompts_ids: list[list[int]], max_new_tokens: int) -> list[float]:
    """Speedup of each engine over plain decoding, measured interleaved per prompt (choose by
    measured speedup, not by tokens/s measured minutes apart on a machine whose speed drifts)."""
    from ..decoding.engine import Metrics
    totals = [Metrics() for _ in range(len(engines) + 1)]
    for _ in range(FINAL_ROUNDS):
        for ids in prompts_ids:
            for total, engine in zip(totals, [plain] + engines):
                total.merge(engine.generate(ids, max_new_tokens).metrics)
    return [t.tokens_per_s / totals[0].tokens_per_s for t in totals[1:]]


def _tree_key(row: dict) -> tuple:
    return tuple(row.get(k) for k in ("depth", "top_k", "total_tokens", "parallel_decoding", "draft_vocab"))


def _describe(row: dict) -> str:
    par = {True: "+con", False: "", None: ""}[row.get("parallel_decoding")]
    return f"d{row['depth']}k{row['top_k']}n{row['total_tokens']}{par} {row['tokens_per_s']:.1f}tok/s"
