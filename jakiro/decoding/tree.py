"""Draft token trees: the structure verified by one target forward.

Node 0 is the root (the last committed token, not yet in the target's KV cache); every other
node's parent precedes it. From ``tokens`` and ``parents`` we derive, with loops over depth only
(never over nodes): ``depths``, the ancestor-or-self ``tree_mask``, and one ``retrieve_paths``
row per leaf (node indices from the root down, padded with -1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


DRAFT, LOOKUP = 1, 2  # node sources (bit flags: a node proposed by both is DRAFT | LOOKUP)


@dataclass
class Tree:
    tokens: torch.Tensor  # [n] long, tokens[0] = root
    parents: torch.Tensor  # [n] long, parents[0] = -1, parents[i] < i
    depths: torch.Tensor  # [n] long, depths[0] = 0
    tree_mask: torch.Tensor  # [n, n] bool, True where j is i or an ancestor of i
    retrieve_paths: torch.Tensor  # [leaves, max_depth + 1] long, -1 padded
    scores: torch.Tensor | None = None  # [n] the draft's cumulative log-prob per node (root 0)
    sources: torch.Tensor | None = None  # [n] where each node came from: DRAFT | LOOKUP bits (root 0)
    # node -> (token ids [V'], probabilities [V']): the distribution a sampled node's token was
    # drawn from (``verify_sampling`` accepts it with min(1, p / q)); nodes without one were chosen
    # deterministically (top-k, lookup)
    proposals: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    def children(self, node: int) -> torch.Tensor:
        return torch.nonzero(self.parents == node).flatten()


def build_tree(tokens: torch.Tensor, parents: torch.Tensor) -> Tree:
    """The tree of ``tokens`` [n] under ``parents`` [n] (parents[0] = -1, parents[i] < i). Walked
    in Python (a draft tree has a few dozen nodes: a handful of tensor operations per depth level
    would cost more than the walk) and handed over as tensors in three calls."""
    n = int(tokens.shape[0])
    parents = parents.to(torch.long)
    par = parents.tolist()
    if n == 0 or par[0] != -1:
        raise ValueError("node 0 must be the root (parent -1)")
    depth = [0] * n
    rows: list[int] = []
    cols: list[int] = []
    is_leaf = [True] * n
    for i in range(1, n):
        p = par[i]
        if not 0 <= p < i:
            raise ValueError("every non-root node's parent must come before it")
        depth[i] = depth[p] + 1
        is_leaf[p] = False
    paths = []
    for i in range(n):
        node = i
        while node >= 0:  # i and its ancestors: the mask row, and for a leaf its path
            rows.append(i)
            cols.append(node)
            node = par[node]
        if is_leaf[i]:
            paths.append(cols[len(cols) - depth[i] - 1:][::-1])
    width = max(depth) + 1
    tree_mask = torch.zeros(n, n, dtype=torch.bool)
    tree_mask[rows, cols] = True
    retrieve_paths = torch.tensor([path + [-1] * (width - len(path)) for path in paths], dtype=torch.long)
    return Tree(tokens.to(torch.long), parents, torch.tensor(depth), tree_mask, retrieve_paths)


_CHAIN_PARTS: dict[int, tuple] = {}  # a chain's structure by length (shared: trees are never modified in place)


def chain_tree(root: int, drafted: list[int] | torch.Tensor) -> Tree:
    """A single path: root followed by the drafted tokens (prompt lookup, top_k = 1 drafts).
    Built directly, its structure kept per length (a plain decoding step is one of these: it
    should cost nothing; built afresh a one-node tree took 18 us, a tenth of a cycle's bookkeeping)."""
    if isinstance(drafted, torch.Tensor):
        tokens = torch.cat((torch.tensor([root]), drafted.to(torch.long).flatten()))
    else:
        tokens = torch.tensor([root, *drafted], dtype=torch.long)
    n = int(tokens.shape[0])
    parts = _CHAIN_PARTS.get(n)
    if parts is None:
        idx = torch.arange(n)
        parts = _CHAIN_PARTS[n] = (idx - 1, idx, torch.ones(n, n, dtype=torch.bool).tril_(), idx.unsqueeze(0))
    return Tree(tokens, *parts)


def add_chain(tree: Tree, chain: list[int]) -> Tree:
    """Hang ``chain`` (prompt-lookup tokens) under the root, sharing the nodes where the tree already
    has the same tokens; new nodes get score -inf (the draft did not propose them) and source
    LOOKUP, shared ones gain the LOOKUP bit."""
    if tree.size == 1:  # nothing drafted (a lookup-only step): the chain itself
        merged = chain_tree(int(tree.tokens[0]), chain)
        root_score = float(tree.scores[0]) if tree.scores is not None else 0.0
        merged.scores = torch.tensor([root_score] + [float("-inf")] * len(chain))
        merged.sources = torch.tensor([0] + [LOOKUP] * len(chain))
        return merged
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    n = len(tokens)
    scores = tree.scores.tolist() if tree.scores is not None else [0.0] + [float("-inf")] * (n - 1)
    sources = tree.sources.tolist() if tree.sources is not None else [0] + [DRAFT] * (n - 1)
    node = 0
    for tok in chain:
        match = next((i for i in range(1, len(tokens)) if parents[i] == node and tokens[i] == tok), None)
        if match is None:
            tokens.append(int(tok))
            parents.append(node)
            scores.append(float("-inf"))
            sources.append(LOOKUP)
            match = len(tokens) - 1
        else:
            sources[match] |= LOOKUP
        node = match
    merged = build_tree(torch.tensor(tokens), torch.tensor(parents))
    merged.scores, merged.sources = torch.tensor(scores), torch.tensor(sources)
    merged.proposals = tree.proposals  # the tree's nodes keep their indices; the chain's are appended
    return merged


def kept_proposals(tree: Tree, keep: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]] | None:
    """``tree.proposals`` of a subtree made of the nodes ``keep`` (increasing, the root first),
    renumbered as the subtree numbers them."""
    if not tree.proposals:
        return None
    return {new: tree.proposals[old] for new, old in enumerate(keep) if old in tree.proposals} or None


def select_nodes(scores: torch.Tensor, parents: torch.Tensor, total_tokens: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-2 reranking: keep the ``total_tokens`` best candidates by cumulative log-prob.

    ``scores``/``parents`` [m] describe candidates 0..m-1 in creation order (a parent is created
    before its children; parent -1 means the root). A child never scores above its parent, and a
    stable sort puts a parent ahead of a tied child, so the kept set is ancestor-closed.
    Returns (kept candidate indices in creation order, their parents as positions in the output
    tree where 0 is the root and kept candidate j is node j + 1).
    """
    m = int(scores.shape[0])
    k = min(total_tokens, m)
    order = torch.sort(-scores, stable=True).indices[:k]
    kept = order.sort().values
    position = torch.full((m,), -1, dtype=torch.long)
    position[kept] = torch.arange(1, k + 1)
    kept_parents = parents[kept]
    tree_parents = torch.where(kept_parents >= 0, position[kept_parents.clamp(min=0)], 0)
    if bool((tree_parents < 0).any()):
        raise AssertionError("dynamic tree selection is not ancestor-closed")
    return kept, tree_parents
