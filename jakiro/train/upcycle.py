"""Starting a draft from another's weights: a Jakiro draft from an EAGLE-2 one (sparse
upcycling), or a draft that gains parts the other lacks (kept at their own initialisation)."""

from __future__ import annotations

import torch

from ..errors import JakiroError


def upcycle(model, dense) -> None:
    """A Jakiro draft from an EAGLE-2 draft of the same width ("sparse upcycling"): the fusion
    layer, attention and norms are the dense draft's, every expert starts as a copy of its MLP
    and the routers keep their fresh initialisation. The first activated expert then drafts as
    well as the dense draft from the first step, and training has only to make the experts
    differ (the second expert's and the contrastive branch's losses), instead of learning the
    whole draft again at a Jakiro step's price."""
    c, dc = model.config, dense.config
    if (c.intermediate_size, c.draft_vocab_size) != (dc.intermediate_size, dc.draft_vocab_size):
        raise JakiroError(f"cannot upcycle: the EAGLE-2 draft has MLP width {dc.intermediate_size} and "
                          f"draft vocabulary {dc.draft_vocab_size}, this Jakiro draft {c.intermediate_size} "
                          f"and {c.draft_vocab_size}")
    state = dense.state_dict()
    with torch.no_grad():
        for name in ("gate_up", "down"):
            state[name] = state[name].expand(c.num_experts, *state[name].shape[1:]).clone()
    model.load_state_dict(keeping_own(state, model))


def keeping_own(state: dict, model) -> dict:
    """``state`` with ``model``'s own values for what it lacks (fresh routers; a mid-layer map
    that starts at zero, i.e. as the draft without mid-layer inputs)."""
    own = model.state_dict()
    return {**{k: v for k, v in own.items() if k not in state}, **state}
