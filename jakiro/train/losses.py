"""Draft training losses (DESIGN §7): per predicted feature, SmoothL1 to the target's next
feature plus w_p times the cross-entropy against the target's next-token distribution.

Only positions inside the loss mask are evaluated (rows are gathered first): the LM-head
products dominate the cost and masked-out rows would contribute zero anyway."""

from __future__ import annotations

import torch
import torch.nn.functional as F

P_WEIGHT = 0.1  # w_p
CONTRASTIVE_WEIGHT = 0.5


def branch_loss(pred: torch.Tensor, target_feat: torch.Tensor, target_probs: torch.Tensor,
                head: torch.Tensor, weight: torch.Tensor, p_weight: float = P_WEIGHT) -> torch.Tensor:
    """Summed (not averaged) loss over rows, each weighted by ``weight``.

    pred, target_feat: [..., d]; target_probs: [..., V] (over the draft vocabulary);
    head: [V, d]; weight: [...] (0/1 mask, or mask times a router weight).
    """
    v = F.smooth_l1_loss(pred, target_feat, reduction="none").mean(-1)
    ce = -(target_probs * F.log_softmax(F.linear(pred, head), -1)).sum(-1)
    return ((v + p_weight * ce) * weight.to(pred.dtype)).sum()


def draft_loss(out, feats: torch.Tensor, head: torch.Tensor, mask: torch.Tensor, method: str,
               p_weight: float = P_WEIGHT) -> tuple[torch.Tensor, dict]:
    """Total summed loss for a batch of draft outputs.

    out: DraftOutput over inputs at positions 0..T-1 (pairs f_t, x_{t+1});
    feats: [B, T + 1, d] target features f_0..f_T; mask: [B, T + 1] loss mask aligned with feats.
    """
    T = out.blend.shape[1]
    sel = mask[:, 1:T + 1].bool()  # [B, T]: predicted position t + 1 is in the loss mask
    next_feat = feats[:, 1:T + 1][sel]  # [M, d]
    with torch.no_grad():
        next_probs = F.linear(next_feat, head).softmax(-1)
    ones = torch.ones(next_feat.shape[0], device=feats.device)
    parts = {"blend": branch_loss(out.blend[sel], next_feat, next_probs, head, ones, p_weight)}
    if method != "eagle2":
        feats_k, weights_k = out.features[sel], out.weights[sel]  # [M, K, d], [M, K]
        parts["experts"] = sum(branch_loss(feats_k[:, k], next_feat, next_probs, head, weights_k[:, k], p_weight)
                               for k in range(feats_k.shape[1]))
        if out.contrastive is not None and T >= 2:
            # the contrastive branch at position t predicts f_{t+2}
            sel2 = mask[:, 2:T + 1].bool()
            feat2 = feats[:, 2:T + 1][sel2]
            with torch.no_grad():
                probs2 = F.linear(feat2, head).softmax(-1)
            parts["contrastive"] = CONTRASTIVE_WEIGHT * branch_loss(
                out.contrastive[:, : T - 1][sel2], feat2, probs2, head,
                torch.ones(feat2.shape[0], device=feats.device), p_weight)
    return sum(parts.values()), {k: float(v.detach()) for k, v in parts.items()}
