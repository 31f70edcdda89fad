"""Draft training losses, trained the way the draft is used: unrolled over several
draft steps (training-time test).

Step 1 of row j reads the target's feature f_j and token x_{j+1} and predicts f_{j+1}; step s
reads the draft's own prediction from step s − 1 of the same row and the token x_{j+s}, sees the
target's features of rows 0..j and its own earlier steps (``DraftModel.attend_unrolled``),
and predicts f_{j+s}. Each prediction costs SmoothL1 to the target's feature plus w_p times the
cross-entropy against the target's next-token distribution over the draft vocabulary; step s
weighs decay^(s−1). An EAGLE-3 draft's features are its own (it reads fc over three of the
target's residual streams, then its own outputs): its loss is the cross-entropy of its own head alone. A Jakiro draft's contrastive branch at step s predicts f_{j+s+1}.

Rows are gathered before the per-row half of the draft (experts, heads): only rows whose own or
later steps have a target inside the loss mask are computed, and the target's LM-head product is
taken once per position and shared by every step and branch that predicts it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F

from .config import JAKIRO_LOSSES, P_WEIGHT, STEP_DECAY

CONTRASTIVE_WEIGHT = 0.5
EXPERT_QUOTA = 2  # candidates the first expert proposes before the second one (top-k 4, 2 experts)


@dataclass
class StepRows:
    """One unrolled step over the rows it computed: ``b``, ``j`` index the batch and the root
    position; ``out`` is the DraftOutput of those rows; ``r`` their residual stream."""
    step: int
    b: torch.Tensor
    j: torch.Tensor
    out: object
    r: torch.Tensor

    def targets(self, mask: torch.Tensor, ahead: int = 0):
        """The rows whose prediction ``ahead`` positions past this step's (the contrastive branch:
        1) lands inside ``mask``: (selector over the rows, their batch index, that position)."""
        p = self.j + self.step + ahead
        ok = p < mask.shape[1]
        ok[ok.clone()] = mask[self.b[ok], p[ok]]
        return ok, self.b[ok], p[ok]


def carried_feature(model, out) -> torch.Tensor:
    """The feature the next draft step reads on the best path: the first activated expert's with
    decoupled candidates, the blend otherwise (what ``DraftProposer`` carries)."""
    if model.config.method == "jakiro" and model.config.candidate_mode == "decoupled":
        return out.features[..., 0, :]
    return out.blend


def _window_any(mask: torch.Tensor, start: int, end: int, T: int) -> torch.Tensor:
    """[B, T]: whether mask[b, j + start : j + end] holds any True (positions past the end count as
    False)."""
    B, L = mask.shape
    c = torch.zeros(B, L + end + 1, device=mask.device)
    c[:, 1:L + 1] = mask.float().cumsum(1)
    c[:, L + 1:] = c[:, L:L + 1]
    j = torch.arange(T, device=mask.device)
    return (c[:, j + end] - c[:, j + start]) > 0


def unroll(model, ids: torch.Tensor, inputs: torch.Tensor, mask: torch.Tensor, steps: int,
           lookahead: int = 1) -> Iterator[StepRows]:
    """Draft ``steps`` steps from every root position of a padded batch.

    ids [B, L], inputs [B, L, d] (the first step's inputs at positions 0..L-1, as ``_inputs``
    gives them), mask [B, L] (positions whose prediction counts).
    Yields each step's rows; a row is computed at step s when a position within
    j + s .. j + steps + lookahead − 1 is in the mask (its own prediction or a later one needs it).
    """
    B, L, d = inputs.shape
    T = L - 1
    inp = inputs[:, :-1]
    kv: list = []
    for s in range(1, steps + 1):
        tok = ids[:, s:s + T]
        if tok.shape[1] < T:
            tok = F.pad(tok, (0, T - tok.shape[1]))
        pos = torch.arange(s - 1, s - 1 + T, device=ids.device)
        b, j = torch.nonzero(_window_any(mask, s, steps + lookahead, T), as_tuple=True)
        rr = model.attend_unrolled(inp, tok, pos, kv, (b, j))
        out = model.heads(rr)
        yield StepRows(s, b, j, out, rr)
        if s < steps:
            inp = torch.zeros(B, T, d, device=inputs.device, dtype=inputs.dtype).index_put(
                (b, j), carried_feature(model, out))


class TargetRows:
    """The target's next-token distribution over the draft vocabulary at every loss position of
    a batch, computed once: ``probs(b, p)`` for positions p in the mask."""

    def __init__(self, feats: torch.Tensor, mask: torch.Tensor, head: torch.Tensor):
        self.feats = feats
        self.index = torch.full(mask.shape, -1, dtype=torch.long, device=mask.device)
        self.index[mask] = torch.arange(int(mask.sum()), device=mask.device)
        with torch.no_grad():
            self._probs = F.linear(feats[mask], head).softmax(-1)

    def probs(self, b: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return self._probs[self.index[b, p]]


def _ce(logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """-sum(q log softmax(logits)) per row (torch's fused soft-target cross-entropy: a third
    faster than writing it out, forward and backward)."""
    return F.cross_entropy(logits, target_probs, reduction="none")


def branch_loss(pred: torch.Tensor, target_feat: torch.Tensor, target_probs: torch.Tensor,
                head: torch.Tensor, weight: torch.Tensor | float = 1.0, p_weight: float = P_WEIGHT,
                logits: torch.Tensor | None = None) -> torch.Tensor:
    """Summed (not averaged) loss over rows, each weighted by ``weight``.

    pred, target_feat: [M, d]; target_probs: [M, V] (over the draft vocabulary); head: [V, d];
    ``logits``: pred's head product when the caller already has it.
    """
    v = F.smooth_l1_loss(pred, target_feat, reduction="none").mean(-1)
    logits = F.linear(pred, head) if logits is None else logits
    return ((v + p_weight * _ce(logits, target_probs)) * weight).sum()


def second_expert_loss(taken: torch.Tensor, pred_b: torch.Tensor, target_feat: torch.Tensor,
                       target_probs: torch.Tensor, head: torch.Tensor, p_weight: float = P_WEIGHT,
                       logits: torch.Tensor | None = None) -> torch.Tensor:
    """The second expert as decoding uses it: it proposes only tokens the first expert did not
    (``taken`` [M, q]: the first expert's top tokens, draft ids). Its cross-entropy is taken over
    the draft vocabulary without them, against the target's probability mass on the rest (so it
    learns the alternatives, and nothing where the target agrees with the first expert); its
    feature term keeps it usable as the next step's input. ``logits``: pred_b's head product when
    the caller already has it."""
    logits_b = (F.linear(pred_b, head) if logits is None else logits).scatter(-1, taken, float("-inf"))
    rest = target_probs.scatter(-1, taken, 0.0)
    logp = F.log_softmax(logits_b, -1).masked_fill(rest == 0, 0.0)
    v = F.smooth_l1_loss(pred_b, target_feat, reduction="none").mean(-1)
    return (v - p_weight * (rest * logp).sum(-1)).sum()


def step_parts(model, rows: StepRows, targets: TargetRows, mask: torch.Tensor, head: torch.Tensor,
               jakiro_loss: str, p_weight: float = P_WEIGHT) -> dict[str, torch.Tensor]:
    """Summed losses of one unrolled step, by branch; ``p_weight``: see ``branch_loss``.

    Where the experts' own losses need their head products anyway, the blend's is their
    router-weighted sum (blend = r + sum_k w_k E_k = sum_k w_k (r + E_k), the weights summing to
    1, and the head is linear): one product fewer per row and step."""
    out = rows.out
    ok, b, p = rows.targets(mask)
    feat, probs = targets.feats[b, p], targets.probs(b, p)
    if model.config.method == "eagle3":  # no feature target: its features are its own
        return {"blend": _ce(model.head_logits(out.blend[ok]), probs).sum()}
    if model.config.method != "jakiro":
        return {"blend": branch_loss(out.blend[ok], feat, probs, head, p_weight=p_weight)}
    experts, weights = out.features[ok], out.weights[ok]
    blend_logits = None
    if jakiro_loss != "reference":  # (the reference loss reads no expert on its own)
        logits = [F.linear(experts[:, k], head) for k in range(experts.shape[1])]
        blend_logits = sum(weights[:, k:k + 1] * lk for k, lk in enumerate(logits))
    parts = {"blend": branch_loss(out.blend[ok], feat, probs, head, p_weight=p_weight, logits=blend_logits)}
    if jakiro_loss == "full":  # every activated expert toward the same target, router-weighted
        parts["experts"] = sum(branch_loss(experts[:, k], feat, probs, head, weights[:, k], p_weight, logits[k])
                               for k in range(experts.shape[1]))
    elif jakiro_loss == "separate":  # the first expert as a draft, the second on what it leaves
        taken = torch.topk(logits[0].detach(), EXPERT_QUOTA, dim=-1).indices
        parts["experts"] = branch_loss(experts[:, 0], feat, probs, head, p_weight=p_weight, logits=logits[0]) + \
            second_expert_loss(taken, experts[:, 1], feat, probs, head, p_weight, logits[1])
    if out.contrastive is not None:  # predicts one position further
        ok2, b2, p2 = rows.targets(mask, ahead=1)
        parts["contrastive"] = CONTRASTIVE_WEIGHT * branch_loss(
            out.contrastive[ok2], targets.feats[b2, p2], targets.probs(b2, p2), head, p_weight=p_weight)
    return parts


def _inputs(model, feats: torch.Tensor, noise: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Target features as a dataset holds them -> (the final features, the first step's inputs:
    ``DraftModel.input_features`` with the noise)."""
    final, _ = model.split_features(feats)
    return final, model.input_features(feats, noise)


def draft_loss(model, ids: torch.Tensor, feats: torch.Tensor, mask: torch.Tensor, steps: int = 1,
               noise: torch.Tensor | None = None, jakiro_loss: str = "separate",
               decay: float = STEP_DECAY, p_weight: float = P_WEIGHT) -> tuple[torch.Tensor, dict]:
    """Total summed loss of a batch unrolled ``steps`` draft steps, and its parts (per branch and
    per step, as floats); ``p_weight``: the cross-entropy's weight (``branch_loss``)."""
    if jakiro_loss not in JAKIRO_LOSSES:
        raise ValueError(f"unknown Jakiro loss {jakiro_loss!r}; choose from {', '.join(JAKIRO_LOSSES)}")
    feats, inputs = _inputs(model, feats, noise)
    head = model.head_weight
    targets = TargetRows(feats, mask, head)
    lookahead = 2 if model.config.parallel_decoding else 1
    total = feats.new_zeros(())
    report: dict[str, float] = {}
    for rows in unroll(model, ids, inputs, mask, steps, lookahead):
        parts = step_parts(model, rows, targets, mask, head, jakiro_loss, p_weight)
        step_total = sum(parts.values())
        total = total + decay ** (rows.step - 1) * step_total
        for k, v in parts.items():
            report[k] = report.get(k, 0.0) + float(v.detach())
        report[f"step{rows.step}"] = float(step_total.detach())
    return total, report


@torch.no_grad()
def heldout_metrics(model, batches, steps: int, full_head: torch.Tensor) -> dict:
    """Held-out accuracy as drafting sees it, from the unrolled steps over ``batches`` of
    (ids, feats, mask): ``top1`` per step (the best path's token equals the target's own next
    token); for Jakiro also ``contrastive_top1`` per step (the contrastive branch's token equals
    the target's token two ahead), ``expert_same_top1`` (both experts propose the same first
    token) and ``expert_cos`` (cosine of the two activated experts' outputs)."""
    was_training = model.training
    model.eval()
    sums: dict[str, torch.Tensor] = {}

    def add(name: str, k: int, hits: torch.Tensor) -> None:
        acc = sums.setdefault(name, torch.zeros(2, steps, dtype=torch.float64))
        acc[0, k] += float(hits.sum())
        acc[1, k] += hits.numel()

    jakiro = model.config.method == "jakiro"
    decoupled = jakiro and model.config.candidate_mode == "decoupled"
    for ids, feats, mask in batches:
        feats, inputs = _inputs(model, feats, None)
        target_tok = torch.full(mask.shape, -1, dtype=torch.long, device=mask.device)
        target_tok[mask] = F.linear(feats[mask], full_head).argmax(-1)
        for rows in unroll(model, ids, inputs, mask, steps, lookahead=2 if jakiro else 1):
            k = rows.step - 1
            ok, b, p = rows.targets(mask)
            if jakiro:
                experts = rows.out.features[ok]
                tops = model.head_logits(experts).argmax(-1)  # [M, K]
            # the best path's token: the first expert's top token with decoupled candidates
            best = tops[:, 0] if decoupled else model.head_logits(carried_feature(model, rows.out)[ok]).argmax(-1)
            add("top1", k, model.to_target_ids(best) == target_tok[b, p])
            if not jakiro:
                continue
            add("expert_same_top1", k, (tops[:, 0] == tops[:, 1]).double())
            delta = experts - rows.r[ok].unsqueeze(1)
            add("expert_cos", k, F.cosine_similarity(delta[:, 0], delta[:, 1], dim=-1).double())
            if rows.out.contrastive is not None:
                ok2, b2, p2 = rows.targets(mask, ahead=1)
                con = model.to_target_ids(model.head_logits(rows.out.contrastive[ok2]).argmax(-1))
                add("contrastive_top1", k, con == target_tok[b2, p2])
    model.train(was_training)
    return {name: (acc[0] / acc[1].clamp(min=1)).tolist() for name, acc in sums.items()}
