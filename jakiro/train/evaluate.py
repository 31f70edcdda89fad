"""``jakiro eval-draft``: finished drafts measured on a dataset's held-out records the way the
trainer measures them while training (the same split and metrics), so that drafts trained in
different runs, or a draft against the one it was continued from, compare on the same records."""

from __future__ import annotations

from ..settings import Runtime
from .batches import heldout_batches, heldout_split, heldout_tau


def evaluate_drafts(data: str, drafts: list[str], target: str | None = None, cache_dir: str | None = None,
                    prompts: int = 8, tokens: int = 48, eval_records: int = 32, steps: int = 4,
                    seq_len: int = 512, all_records: bool = False, runtime: Runtime | None = None) -> list[dict]:
    """Per draft: held-out top-1 per draft step (and Jakiro's contrastive branch and expert
    agreement) and greedy τ with the default tree, fixed, on the first user turns of ``prompts``
    held-out records, ``tokens`` new tokens each. ``all_records``: every record counts as held
    out (folders built for evaluation only)."""
    from ..api import load_tokenizer
    from ..decoding.engine import Engine
    from ..decoding.proposers import TreeBudget
    from ..decoding.draft_proposer import DraftProposer
    from ..draft import load_draft
    from ..errors import JakiroError
    from ..models.hub import resolve_target
    from ..models.target import TargetModel
    from .feature_dataset import FeatureDataset
    from .losses import heldout_metrics

    if not drafts:
        raise JakiroError("name at least one draft folder to evaluate")
    if prompts < 0 or tokens < 1:
        raise JakiroError("--prompts must be >= 0 and --tokens >= 1")
    ds = FeatureDataset(data)
    path = resolve_target(target, cache_dir)
    model = TargetModel.from_folder(path, runtime)
    ds.check_target(model)
    tokenizer = load_tokenizer(path)
    eval_idx = list(range(len(ds))) if all_records else heldout_split(ds.parts, eval_records)[1]
    # the held-out batches once for every draft (a tokens-only dataset's features cost a target forward)
    batches = list(heldout_batches(ds, eval_idx, seq_len, "cpu", featurizer=ds.featurizer(path)))
    out = []
    for folder in drafts:
        draft = load_draft(folder, model)
        ds.check_draft(draft.config)
        metrics = heldout_metrics(draft, batches, steps, model.dense_head())
        row = {"draft": folder, "heldout_records": len(eval_idx),
               **{k: [round(x, 4) for x in v] for k, v in metrics.items()}}
        if prompts:
            engine = Engine(model, tokenizer, DraftProposer(draft, TreeBudget()))
            row["tau_fixed_default_tree"] = round(heldout_tau(engine, ds, eval_idx[:prompts], tokens), 3)
        out.append(row)
    return out
