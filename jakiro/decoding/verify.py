"""Lossless verification of a draft tree against the target's logits.

Greedy: accept the longest root-to-leaf path whose every token is the target's argmax at its
parent, then append the target's argmax after it (the bonus token).

Sampling: multi-candidate rejection sampling. Walk down from the root; at a node, try its
children in order against p, the target's processed distribution (temperature, top-k, top-p) at
that node. A child x chosen deterministically (top-k drafts, prompt lookup: q is a point mass) is
accepted with probability p(x) / sum(p), and on rejection p(x) = 0; a child drawn from a
distribution q (a sampled draft chain, ``Tree.proposals``) is accepted with probability
min(1, p(x) / q(x)) (p normalised), and on rejection p becomes max(0, p - q). Either way the
next sibling is tried against what is left. If no child is accepted (or the node is a leaf) the
bonus token is drawn from what is left of p, still processed. Each step is the speculative
sampling step for its candidate against the distribution left by the steps before it, and the
candidates are drawn independently of one another, so the committed token follows p. Drawn
children are tried before chosen siblings: a node where a drawn token met a chosen one (a lookup
token merged into the draft's) then stands for both, and the chosen one, tried second, could
never be accepted (after the drawn x is rejected, p(x) < q(x), so nothing of p(x) is left).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import SamplingParams, processed_probs, sample
from .tree import Tree


@dataclass
class Verdict:
    accepted: torch.Tensor  # [m] node indices of the accepted path, starting with the root 0
    bonus: int  # the target's own token after the path

    @property
    def accept_length(self) -> int:
        """Draft tokens accepted (root and bonus excluded)."""
        return int(self.accepted.shape[0]) - 1


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [n, vocab] -> [n] argmax, by numpy where it can: the same first-maximum rule as
    torch's and 20x faster on a row of a large vocabulary (a plain step's whole verification)."""
    if logits.dtype != torch.float32:
        return logits.argmax(-1)
    return torch.from_numpy(logits.detach().contiguous().numpy().argmax(-1))


def verify_greedy(tree: Tree, logits: torch.Tensor) -> Verdict:
    """logits: [n, vocab] target logits at every tree node."""
    target_next = argmax_rows(logits)  # [n]
    paths = tree.retrieve_paths  # [leaves, depth + 1]
    if paths.shape[1] == 1:
        return Verdict(paths[0, :1], int(target_next[0]))
    if paths.shape[0] == 1:  # a chain (prompt lookup, a one-token probe): walk it
        wanted, drafted = target_next.tolist(), tree.tokens.tolist()
        m = 0
        while m + 1 < len(drafted) and drafted[m + 1] == wanted[m]:
            m += 1
        return Verdict(paths[0, :m + 1], wanted[m])
    safe = paths.clamp(min=0)
    ok = (tree.tokens[safe[:, 1:]] == target_next[safe[:, :-1]]) & (paths[:, 1:] >= 0)
    accept_len = ok.to(torch.int32).cumprod(1).sum(1)  # [leaves]
    best = int(torch.argmax(accept_len))
    accepted = paths[best, : int(accept_len[best]) + 1]
    return Verdict(accepted, int(target_next[accepted[-1]]))


def verify_sampling(tree: Tree, logits: torch.Tensor, params: SamplingParams,
                    generator: torch.Generator) -> Verdict:
    parents = tree.parents.tolist()
    tokens = tree.tokens.tolist()
    children: dict[int, list[int]] = {}
    for node in range(1, len(parents)):
        children.setdefault(parents[node], []).append(node)
    proposals = tree.proposals or {}
    if proposals:  # drawn children before chosen ones (see the module docstring)
        for kids in children.values():
            kids.sort(key=lambda child: child not in proposals)
    node, accepted = 0, [0]
    while True:
        # only the rows the walk reaches are processed (at most the accepted path and one more):
        # a 16-node tree's softmax over the whole vocabulary took 0.2 ms of a 5 ms cycle
        p = processed_probs(logits[node], params)
        moved = False
        for child in children.get(node, ()):
            x = tokens[child]
            px, total = float(p[x]), float(p.sum())
            u = float(torch.rand((), generator=generator))
            if child not in proposals:  # chosen deterministically
                if px > 0 and u * total < px:
                    node, moved = child, True
                    accepted.append(child)
                    break
                p[x] = 0.0  # rejected: the residual distribution excludes x (p is a fresh tensor)
                continue
            ids, q = proposals[child]
            qx = float(q[ids == x].sum())
            if px > 0 and u * qx * total < px:  # u < min(1, p(x) / q(x)), p normalised
                node, moved = child, True
                accepted.append(child)
                break
            residual = (p / total).index_add_(0, ids, q, alpha=-1.0).clamp_(min=0.0)
            if float(residual.sum()) > 0:
                p = residual
            else:  # q = p up to rounding: a rejection has probability ~0; exclude x as for a point mass
                p[x] = 0.0
        if not moved:
            bonus = sample(p, generator)
            return Verdict(torch.tensor(accepted), bonus)


def verify(tree: Tree, logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator) -> Verdict:
    if params.greedy:
        return verify_greedy(tree, logits)
    return verify_sampling(tree, logits, params, generator)
