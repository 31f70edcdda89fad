"""The trainer's report: a one-line held-out summary and the plot of a run's log."""

from __future__ import annotations


def describe_eval(ev: dict) -> str:
    """One line: top-1 per draft step, and for Jakiro the contrastive branch and expert agreement."""
    line = "top-1 per step " + " ".join(f"{x:.3f}" for x in ev["top1"])
    if "contrastive_top1" in ev:
        line += ("; contrastive (two ahead) " + " ".join(f"{x:.3f}" for x in ev["contrastive_top1"])
                 + f"; experts agree on top-1 {ev['expert_same_top1'][0]:.2f}, cos {ev['expert_cos'][0]:.2f}")
    return line


def plot_log(log: list[dict], path: str, title: str) -> None:
    """Training loss per step, and held-out top-1 against training tokens: one line per draft
    step (depth), dashed for the contrastive branch."""
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure state
    fig = Figure(figsize=(11, 4))
    a, b = fig.subplots(1, 2)
    a.plot([r["step"] for r in log], [r["loss"] for r in log], lw=0.8)
    a.set_xlabel("optimizer step")
    a.set_ylabel("training loss (per loss token)")
    a.set_yscale("log")
    evals = [r for r in log if "eval_acc" in r]
    x = [r.get("tokens", r["step"]) for r in evals]
    for k in range(len(evals[0]["eval_acc"]) if evals else 0):
        b.plot(x, [r["eval_acc"][k] for r in evals], marker="o", ms=3, label=f"draft step {k + 1}")
    for k in range(len(evals[0].get("eval", {}).get("contrastive_top1", [])) if evals else 0):
        b.plot(x, [r["eval"]["contrastive_top1"][k] for r in evals], ls="--", marker=".",
               label=f"contrastive after step {k + 1}")
    taus = [r for r in log if "tau" in r]
    if taus:
        t = b.twinx()
        t.plot([r.get("tokens", r["step"]) for r in taus], [r["tau"] for r in taus], color="black", marker="s",
               ms=4, label="greedy decoding τ (right axis)")
        t.set_ylabel("τ (tokens per target forward)")
        t.legend(fontsize=7, loc="lower right")
    b.set_xlabel("training tokens (loss positions)" if evals and "tokens" in evals[0] else "optimizer step")
    b.set_ylabel("held-out top-1 accuracy")
    b.legend(fontsize=7)
    fig.suptitle(f"{title} draft training")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
