"""A benchmark run's summary: per method and category tokens/s, speedups over plain decoding, τ,
acceptance and agreement with plain decoding's text (``summarize``), its Markdown table and plots."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from .config import LOADED_TARGET_FIELDS

if TYPE_CHECKING:
    from .config import BenchConfig


def _aggregate(turns: list[dict]) -> dict:
    from ..decoding.engine import Metrics
    out = {"answers": len(turns), "new_tokens": sum(t["new_tokens"] for t in turns),
           "seconds": sum(t["total_s"] for t in turns)}
    out["tokens_per_s"] = out["new_tokens"] / out["seconds"] if out["seconds"] else 0.0
    if all("prefill_s" in t for t in turns):  # the answer alone: a long prompt's prefill, the same for
        out["prefill_s"] = sum(t["prefill_s"] for t in turns)  # every method, dilutes the speedup
        decode_s = out["seconds"] - out["prefill_s"]
        out["decode_tokens_per_s"] = out["new_tokens"] / decode_s if decode_s > 0 else 0.0
    if "committed" in turns[0]:  # our engine's answers (Hugging Face's carry times and tokens only)
        m = Metrics.total(Metrics.from_dict(t) for t in turns)
        out.update(tau=m.tau, target_forwards=m.target_forwards, accept_rate_per_depth=m.accept_rate_per_depth,
                   draft_s=m.draft_s, target_s=m.target_s,
                   draft_fraction=m.draft_s / max(1e-9, m.draft_s + m.target_s),
                   plain_steps=m.plain_steps,  # cycles that drafted nothing
                   accepted_from={src: m.accepted_from.get(src, 0) for src in ("draft", "lookup", "both")})
        if m.drafted:  # draft tokens accepted per draft token verified (llama.cpp's n_accept / n_drafted)
            out["acceptance"] = m.acceptance
    else:
        out["tau"] = None
    if all(t.get("llamacpp_drafted") is not None for t in turns):  # llama.cpp's speculation
        drafted = sum(t["llamacpp_drafted"] for t in turns)
        out["acceptance"] = sum(t["llamacpp_accepted"] for t in turns) / drafted if drafted else 0.0
    covered = [t["head_coverage"] for t in turns if "head_coverage" in t]
    if covered:  # share of answer tokens the draft's head holds: its vocabulary alone, with the prompt's tokens, and the answer's
        n = sum(c["tokens"] for c in covered)
        out["head_coverage"] = {k: sum(c.get(k, c["with_prompt"]) for c in covered) / n
                                for k in ("draft_vocab", "with_prompt", "with_answer")}
    return out


def _turn_ids(rows: list[dict]) -> dict:
    """(question id, turn) -> the answer's token ids."""
    return {(r["question_id"], i): t["token_ids"] for r in rows for i, t in enumerate(r["turns"])}


def _share_same(sel: list[dict], reference: dict) -> float:
    """The share of the turns of ``sel`` whose tokens equal the reference's (``_turn_ids``)."""
    same = [t["token_ids"] == reference[(r["question_id"], i)] for r in sel for i, t in enumerate(r["turns"])]
    return sum(same) / len(same)


def summarize(records: dict[str, list[dict]], cfg: BenchConfig) -> dict:
    categories = sorted({r["category"] for r in records["ar"]})
    ar_ids = _turn_ids(records["ar"])
    # llama.cpp's speculation is also held against its own plain text
    llama_ids = _turn_ids(records["llamacpp"]) if "llamacpp" in records else None
    result = {"config": {k: v for k, v in cfg.__dict__.items() if k not in LOADED_TARGET_FIELDS},
              "threads": torch.get_num_threads(), "quantized_weights": cfg.quantized_weights,
              "int8_activations": cfg.int8_activations, "kv_cache": cfg.kv_cache, "methods": {}}
    for m, rows in records.items():
        per_cat = {}
        for cat in categories + ["all"]:
            sel = [r for r in rows if cat == "all" or r["category"] == cat]
            turns = [t for r in sel for t in r["turns"]]
            agg = _aggregate(turns)
            if cfg.temperature == 0:
                agg["greedy_match"] = _share_same(sel, ar_ids)
                if m.startswith("llamacpp-") and llama_ids is not None:
                    agg["llamacpp_match"] = _share_same(sel, llama_ids)
            per_cat[cat] = agg
        result["methods"][m] = per_cat
    for m, per_cat in result["methods"].items():
        for cat, agg in per_cat.items():
            base = result["methods"]["ar"][cat]
            agg["speedup"] = agg["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else 0.0
            if agg.get("decode_tokens_per_s") and base.get("decode_tokens_per_s"):
                agg["decode_speedup"] = agg["decode_tokens_per_s"] / base["decode_tokens_per_s"]
    return result


def markdown_table(summary: dict) -> str:
    methods = list(summary["methods"])
    cats = list(summary["methods"]["ar"])
    lines = ["| method | category | tokens/s | speedup | decode speedup | tau | plain steps "
             "| accepted from draft / lookup / both | greedy match |", "|---|---|---|---|---|---|---|---|---|"]
    for m in methods:
        for c in cats:
            a = summary["methods"][m][c]
            tau = f"{a['tau']:.2f}" if a.get("tau") is not None else "-"
            gm = f"{a['greedy_match']:.2f}" if "greedy_match" in a else "-"
            plain = f"{a['plain_steps']}/{a['target_forwards']}" if "plain_steps" in a else "-"
            src = "/".join(str(a["accepted_from"][k]) for k in ("draft", "lookup", "both")) if "accepted_from" in a else "-"
            dec = f"{a['decode_speedup']:.2f}x" if "decode_speedup" in a else "-"
            lines.append(f"| {m} | {c} | {a['tokens_per_s']:.1f} | {a['speedup']:.2f}x | {dec} | {tau} | {plain} "
                         f"| {src} | {gm} |")
    return "\n".join(lines) + "\n"


def plot_summary(summary: dict, out: str) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure state
    methods = list(summary["methods"])
    cats = list(summary["methods"]["ar"])
    for key, fname in (("speedup", "speedup.png"), ("tau", "tau.png")):
        fig = Figure(figsize=(max(6, len(cats) * 1.2), 4))
        ax = fig.subplots()
        width = 0.8 / len(methods)
        for i, m in enumerate(methods):
            vals = [summary["methods"][m][c].get(key) or 0 for c in cats]
            ax.bar([j + i * width for j in range(len(cats))], vals, width, label=m)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cats))], cats, rotation=30, ha="right")
        ax.set_ylabel(key)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(out, fname), dpi=100)
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    plotted = False
    for m in methods:
        rates = summary["methods"][m]["all"].get("accept_rate_per_depth")
        if rates and m != "ar":
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=m)
            plotted = True
    ax.set_xlabel("draft depth")
    ax.set_ylabel("acceptance rate")
    if plotted:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no speculative method in this run", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "acceptance.png"), dpi=100)
