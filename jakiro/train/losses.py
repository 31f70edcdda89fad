"""Draft training losses (DESIGN §7): per predicted feature, SmoothL1 to the target's next
feature plus w_p times the cross-entropy against the target's next-token distribution."""

from __future__ import annotations

import torch
import torch.nn.functional as F

P_WEIGHT = 0.1  # w_p
CONTRASTIVE_WEIGHT = 0.5


def branch_loss(pred: torch.Tensor, target_feat: torch.Tensor, target_probs: torch.Tensor,
                head: torch.Tensor, mask: torch.Tensor, p_weight: float = P_WEIGHT) -> torch.Tensor:
    """Summed (not averaged) loss over masked positions.

    pred, target_feat: [..., d]; target_probs: [..., V] (over the draft vocabulary);
    head: [V, d]; mask: [...] bool/float.
    """
    mask = mask.to(pred.dtype)
    v = F.smooth_l1_loss(pred, target_feat, reduction="none").mean(-1)
    ce = -(target_probs * F.log_softmax(F.linear(pred, head), -1)).sum(-1)
    return ((v + p_weight * ce) * mask).sum()


def draft_loss(out, feats: torch.Tensor, head: torch.Tensor, mask: torch.Tensor, method: str,
               p_weight: float = P_WEIGHT) -> tuple[torch.Tensor, dict]:
    """Total summed loss for a batch of draft outputs.

    out: DraftOutput over inputs at positions 0..T-1 (pairs f_t, x_{t+1});
    feats: [B, T + 1, d] target features f_0..f_T; mask: [B, T + 1] loss mask aligned with feats.
    """
    T = out.blend.shape[1]
    with torch.no_grad():
        next_feat = feats[:, 1:T + 1]
        next_probs = F.linear(next_feat, head).softmax(-1)
    m1 = mask[:, 1:T + 1]
    parts = {}
    if method == "eagle2":
        parts["blend"] = branch_loss(out.blend, next_feat, next_probs, head, m1, p_weight)
    else:
        K = out.features.shape[2]
        per_expert = sum(branch_loss(out.features[:, :, k], next_feat, next_probs, head,
                                     m1 * out.weights[:, :, k], p_weight) for k in range(K))
        parts["experts"] = per_expert
        parts["blend"] = branch_loss(out.blend, next_feat, next_probs, head, m1, p_weight)
        if out.contrastive is not None and T >= 2:
            # the contrastive branch at position t predicts f_{t+2}
            with torch.no_grad():
                probs2 = F.linear(feats[:, 2:T + 1], head).softmax(-1)
            parts["contrastive"] = CONTRASTIVE_WEIGHT * branch_loss(
                out.contrastive[:, : T - 1], feats[:, 2:T + 1], probs2, head, mask[:, 2:T + 1], p_weight)
    return sum(parts.values()), {k: float(v.detach()) for k, v in parts.items()}
