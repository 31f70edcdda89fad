"""Static draft trees (EAGLE-1): a fixed list of paths, each a list of child ranks from the root.

``[[0], [1], [0, 0]]`` means: the root's best and second-best candidates, and the best candidate
after the best one. A draft fills rank r at a node with its r-th candidate there (for Jakiro, the
decoupled experts' candidates in the order the dynamic tree uses). Trees come from a preset name
or a JSON file: ``static:eagle1``, ``static:path/to/tree.json``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from ..errors import JakiroError
from .tree import DRAFT, Tree, build_tree

MAX_DEPTH = 16
MAX_NODES = 255  # the target's RoPE slack past the context bounds the nodes of one tree

PRESETS = {
    # EAGLE-1's default tree (25 nodes, depth 5), as published with EAGLE for GPU targets
    "eagle1": [[0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0],
               [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0],
               [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1]],
    # small trees for CPUs, where every verified token costs (see README, static trees)
    "chain2": [[0], [0, 0]],
    "cpu": [[0], [1], [0, 0]],
}


@dataclass(frozen=True)
class StaticTree:
    name: str
    paths: tuple[tuple[int, ...], ...]  # sorted by depth, then as given

    @property
    def depth(self) -> int:
        return max(len(p) for p in self.paths)

    @property
    def max_rank(self) -> int:
        return max(p[-1] for p in self.paths)

    def at_depth(self, depth: int) -> list[tuple[int, ...]]:
        return [p for p in self.paths if len(p) == depth]

    def as_list(self) -> list[list[int]]:
        return [list(p) for p in self.paths]


def validate_paths(paths, source: str) -> tuple[tuple[int, ...], ...]:
    """One clear error per malformed tree: not a list, bad ranks, missing prefixes, duplicates,
    too deep or too large."""
    if not isinstance(paths, list) or not paths:
        raise JakiroError(f"{source}: a static tree is a non-empty list of paths (lists of child ranks)")
    seen: set[tuple[int, ...]] = set()
    for i, p in enumerate(paths):
        if not isinstance(p, list) or not p:
            raise JakiroError(f"{source}: path {i} must be a non-empty list of ranks, got {json.dumps(p)[:40]}")
        if not all(isinstance(r, int) and not isinstance(r, bool) for r in p):
            raise JakiroError(f"{source}: path {p} must hold integer ranks")
        if any(r < 0 for r in p):
            raise JakiroError(f"{source}: path {p} has a negative rank")
        if len(p) > MAX_DEPTH:
            raise JakiroError(f"{source}: path {p} is deeper than the {MAX_DEPTH} levels a draft tree may have")
        t = tuple(p)
        if t in seen:
            raise JakiroError(f"{source}: path {p} is listed twice")
        seen.add(t)
    for t in seen:
        if len(t) > 1 and t[:-1] not in seen:
            raise JakiroError(f"{source}: path {list(t)} has no parent path {list(t[:-1])}")
    if len(seen) > MAX_NODES:
        raise JakiroError(f"{source}: {len(seen)} nodes; a draft tree may have at most {MAX_NODES}")
    order = {tuple(p): i for i, p in enumerate(paths)}
    return tuple(sorted(seen, key=lambda t: (len(t), order[t])))


def parse_tree(spec: str) -> StaticTree:
    """``static:NAME`` (a preset) or ``static:PATH`` (a JSON file holding the list of paths)."""
    if not isinstance(spec, str) or not spec.startswith("static:"):
        raise JakiroError(f"--tree takes static:NAME or static:PATH, got {spec!r} "
                          f"(presets: {', '.join(PRESETS)}); without --tree drafts use the dynamic tree")
    ref = spec[len("static:"):]
    if ref in PRESETS:
        return StaticTree(ref, validate_paths(PRESETS[ref], f"preset {ref}"))
    if not os.path.exists(ref):
        raise JakiroError(f"static tree {ref!r} is neither a preset ({', '.join(PRESETS)}) nor a file")
    try:
        with open(ref, encoding="utf-8") as f:
            paths = json.load(f)
    except (OSError, ValueError) as exc:
        raise JakiroError(f"{ref}: not a JSON list of paths ({exc})") from None
    return StaticTree(os.path.basename(ref), validate_paths(paths, ref))


def _forward_level(proposer, forward: list[tuple], carried: dict, slots_of: dict, n_slots: int, base: int,
                   level: int) -> torch.Tensor:
    """One draft forward of the nodes ``forward`` (each from the feature and token that proposed
    it, ``carried``) at scratch slots after the ``n_slots`` taken, each attending the prompt's
    ``base`` positions and its forwarded ancestors' slots (``slots_of``, extended here)."""
    P = len(forward)
    mask = torch.zeros(P, n_slots + P, dtype=torch.bool)
    for j, p in enumerate(forward):
        slots_of[p] = slots_of[p[:-1]] + [n_slots + j]
        mask[j, slots_of[p]] = True
    attn = torch.cat((torch.ones(P, base, dtype=torch.bool), mask), 1)
    in_feats = torch.stack([carried[p][0] for p in forward])
    in_tokens = torch.tensor([carried[p][1] for p in forward])
    o = proposer.draft(in_feats.unsqueeze(0), in_tokens.unsqueeze(0), torch.full((P,), base + level - 1),
                       proposer.cache, attn)
    proposer.cache.commit(P)
    proposer.draft_forwards += 1
    return o


def fill_static_tree(proposer, context: list[int], out, base: int) -> Tree:
    """Fill the static tree level by level: the children of all nodes at one level come from
    one draft forward of those nodes (rank r = the node's r-th candidate); with parallel
    decoding the last level comes from the contrastive branch of the level above's parents."""
    st, cache = proposer.static, proposer.cache
    tokens, parents, scores = [context[-1]], [-1], [0.0]
    node_of: dict[tuple, int] = {(): 0}
    output_of: dict[tuple, tuple] = {(): (out, 0)}  # forwarded node -> (draft output, row)
    slots_of: dict[tuple, list[int]] = {(): []}  # scratch slots of a node's forwarded ancestors-or-self
    carried: dict[tuple, tuple] = {}  # node -> (feature that proposed it, its token)
    n_slots = 0
    available = proposer.head.size
    for level in range(1, st.depth + 1):
        kids = [c for c in st.at_depth(level) if c[:-1] in node_of]
        if not kids:
            break
        contrastive = proposer.parallel and level == st.depth
        sources = list(dict.fromkeys(c[:-2] if contrastive else c[:-1] for c in kids))
        k = min(max(c[-1] for c in kids) + 1, available)
        outs = output_of[sources[0]][0]  # every source was forwarded together
        rows = torch.tensor([output_of[p][1] for p in sources])
        if contrastive:
            tok, logp = proposer._contrastive_children(outs, rows, k)
            feats = None
        else:
            tok, logp, feats = proposer._children(outs, rows, k)
        for c in kids:
            rank = c[-1]
            if rank >= tok.shape[1]:
                continue  # a rank beyond what the draft can supply
            i = sources.index(c[:-2] if contrastive else c[:-1])
            parent = node_of[c[:-1]]
            node_of[c] = len(tokens)
            tokens.append(int(tok[i, rank]))
            parents.append(parent)
            scores.append(scores[parent] + float(logp[i, rank]))
            if feats is not None:
                carried[c] = (feats[i, rank], int(tok[i, rank]))
        below = [c for c in st.at_depth(level + 1) if c[:-1] in node_of]
        if not below or (proposer.parallel and level + 1 == st.depth):
            continue  # nothing to forward: no next level, or it comes from the contrastive branch
        forward = list(dict.fromkeys(c[:-1] for c in below))
        o = _forward_level(proposer, forward, carried, slots_of, n_slots, base, level)
        n_slots += len(forward)
        for j, p in enumerate(forward):
            output_of[p] = (o, j)
    cache.truncate(base)
    tree = build_tree(torch.tensor(tokens), torch.tensor(parents))
    tree.scores = torch.tensor(scores)
    tree.sources = torch.tensor([0] + [DRAFT] * (tree.size - 1))
    return tree
