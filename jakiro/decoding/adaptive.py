"""Cost-aware drafting: each cycle drafts only as deep as pays, verifies only the nodes that pay,
or takes a plain decoding step.

Two inputs. (a) What things cost on this machine: the target's forward over n tree tokens and a
draft proposal of depth d, measured once per loaded engine (``measure_costs``). (b) How well the
draft predicts *this* request: the share of drafted cycles whose accepted path reached depth i,
and a calibration of the draft's path probabilities (EAGLE-2 scores are products of draft
probabilities, over-confident for a weak draft) against the nodes actually accepted.

Per cycle: the depth d (0 = plain step) maximises expected committed tokens per millisecond,
E(d) / (t(n_d) + draft(d)) with E(d) = 1 + sum_{i<=d} P(path reaches depth i); the drafted tree is
then cut to the k best nodes maximising (1 + sum of their calibrated acceptance) / t(k + 1).
While plain steps win, a probe after 4, 8, 16 ... plain steps drafts one level and compares it
with the token the plain step commits (one draft step, no verification), so a draft that starts
predicting well is noticed. Decisions depend only on the fixed cost table and on this request's
outcomes, so a seeded request decodes the same way every time in one process.
Verification is untouched: any tree chosen before the target's forward keeps decoding lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .costs import forward_costs, median_ms
from .proposers import DraftProposer, PromptLookupProposer, Proposer
from .tree import DRAFT, LOOKUP, Tree, add_chain, build_tree, chain_tree

PROBE_AFTER = 4  # plain steps before drafting again, doubled after each probe that did not pay
MAX_WAIT = 64
BUCKETS = torch.tensor([0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0001])
PRIOR_WEIGHT = 2.0  # pseudo-observations behind each prior
PRIOR_SHRINK = 0.8  # prior: a node is accepted with 0.8 x its draft probability
PRIOR_DEPTH = 0.6  # prior: P(path reaches depth i) = 0.6 ** i (optimistic, so drafting is tried)
PRIOR_LOOKUP = 0.5  # prior: each prompt-lookup token matches with 0.5 once the ones before it did


@dataclass
class CostTable:
    """Milliseconds on this machine: target forward over n tree tokens (root included), and one
    proposal of depth d."""
    target_ms: dict[int, float]
    draft_ms: dict[int, float]

    def target(self, n: int) -> float:
        known = sorted(self.target_ms)
        if n in self.target_ms:
            return self.target_ms[n]
        lo = max((k for k in known if k < n), default=known[0])
        hi = min((k for k in known if k > n), default=known[-1])
        if hi == lo:  # beyond the table: extend its last slope
            a, b = known[-2:] if len(known) > 1 else (known[-1], known[-1])
            slope = (self.target_ms[b] - self.target_ms[a]) / (b - a) if b != a else 0.0
            return self.target_ms[hi] + slope * (n - hi)
        w = (n - lo) / (hi - lo)
        return self.target_ms[lo] * (1 - w) + self.target_ms[hi] * w

    def draft(self, depth: int) -> float:
        return self.draft_ms.get(depth, max(self.draft_ms.values()) if self.draft_ms else 0.0)

    def as_dict(self) -> dict:
        return {"target_ms": {str(k): round(v, 3) for k, v in self.target_ms.items()},
                "draft_ms": {str(k): round(v, 3) for k, v in self.draft_ms.items()}}


@torch.inference_mode()
def measure_costs(target, proposer: DraftProposer, context: int = 128, repeats: int = 3) -> CostTable:
    """Measure the cost table once (about a second for SmolLM2-135M on two cores)."""
    gen = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    max_n = proposer.max_tree_tokens
    context = min(context, target.config.max_context - max_n - 8)
    sizes = sorted({n for n in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64) if n < max_n} | {max_n})
    target_ms = forward_costs(target, context, repeats, sizes)
    d = proposer.draft.config.hidden_size
    ids = torch.randint(0, vocab, (context,), generator=gen).tolist()
    proposer.start(context + (proposer.budget.depth + 1) * (repeats + 1) + 8)
    proposer.observe(torch.randn(context, d, generator=gen), torch.tensor(ids[1:] + [ids[0]]))
    proposer.propose(ids)
    draft_ms = {}
    for depth in range(1, proposer.budget.depth + 1):
        def one():
            proposer.observe(torch.randn(1, d, generator=gen), torch.tensor([ids[0]]))
            proposer.propose(ids, depth=depth)
        draft_ms[depth] = median_ms(one, repeats, warmup=1)
    return CostTable(target_ms, draft_ms)


class AdaptiveProposer(Proposer):
    """Wraps a draft proposer; see the module docstring. With ``lookup`` the prompt-lookup
    continuation joins the draft's tree as extra branches (merged where the tokens coincide) and
    the same cost-aware cut covers both sources; a lookup chain is proposed even on cycles that
    do not draft. ``adaptive=False`` keeps the draft's fixed tree (plus the lookup branch)."""

    needs_features = True

    def __init__(self, inner: DraftProposer, target, costs: CostTable | None = None,
                 lookup: PromptLookupProposer | None = None, adaptive: bool = True):
        self.inner, self.target, self.lookup, self.adaptive = inner, target, lookup, adaptive
        self.max_tree_tokens = inner.max_tree_tokens + (lookup.num_tokens if lookup else 0)
        self.costs = costs or (measure_costs(target, inner) if adaptive else None)
        self.name = inner.name + ("+pld" if lookup else "")
        self.max_depth = inner.budget.depth
        self.start_stats()

    # ------------------------------------------------------------------ request state
    def start_stats(self) -> None:
        D = self.max_depth
        self.reached = torch.zeros(D + 1)  # drafted cycles whose accepted path reached depth i
        self.tried = torch.zeros(D + 1)  # drafted cycles whose tree had depth >= i
        mids = (BUCKETS[1:] + BUCKETS[:-1]) / 2
        self.hits = PRIOR_WEIGHT * PRIOR_SHRINK * mids.clamp(max=1.0)  # calibration, per bucket
        self.seen = torch.full_like(mids, PRIOR_WEIGHT)
        self.nodes = {d: float(d) for d in range(1, D + 1)}  # typical verified draft nodes per depth
        L = self.lookup.num_tokens if self.lookup else 0
        # per chain position i: P(token i matches | tokens before it matched)
        self.lookup_hits = torch.full((L,), PRIOR_WEIGHT * PRIOR_LOOKUP)
        self.lookup_seen = torch.full((L,), PRIOR_WEIGHT)
        self.idle = 0
        self.wait = PROBE_AFTER
        self.shadow: Tree | None = None  # a probe's draft, compared with the next committed token
        self.chain: list[int] = []  # this cycle's lookup continuation, compared with what is committed

    def start(self, max_len: int) -> None:
        self.inner.start(max_len)
        self.start_stats()

    def observe(self, features: torch.Tensor, next_tokens: torch.Tensor) -> None:
        self.inner.observe(features, next_tokens)

    # ------------------------------------------------------------------ decisions
    def reach_probability(self) -> torch.Tensor:
        """P(accepted path reaches depth i), i = 1..D: observed share with an optimistic prior."""
        i = torch.arange(1, self.max_depth + 1, dtype=torch.float32)
        prior = PRIOR_DEPTH ** i
        return (self.reached[1:] + PRIOR_WEIGHT * prior) / (self.tried[1:] + PRIOR_WEIGHT)

    def choose_depth(self) -> int:
        c = self.costs
        best_depth, best_rate = 0, 1.0 / c.target(1)
        reach = self.reach_probability()
        for d in range(1, self.max_depth + 1):
            expected = 1.0 + float(reach[:d].sum())
            # a path to depth d verifies at least d nodes
            rate = expected / (c.target(1 + max(d, round(self.nodes[d]))) + c.draft(d))
            if rate > best_rate:
                best_depth, best_rate = d, rate
        return best_depth

    def _bucket(self, draft_prob: torch.Tensor) -> torch.Tensor:
        return (torch.bucketize(draft_prob, BUCKETS, right=True) - 1).clamp(0, len(self.seen) - 1)

    def _calibrate(self, scores: torch.Tensor, accepted: torch.Tensor) -> None:
        b = self._bucket(scores.exp())
        self.seen.index_add_(0, b, torch.ones(b.shape[0]))
        self.hits.index_add_(0, b, accepted.float())

    def calibrated(self, draft_prob: torch.Tensor) -> torch.Tensor:
        """Observed acceptance of nodes whose draft probability fell in the same bucket."""
        b = self._bucket(draft_prob)
        return self.hits[b] / self.seen[b]

    def acceptance(self, tree: Tree) -> torch.Tensor:
        """Estimated P(node accepted) [n] (root 1): calibrated draft probability for drafted
        nodes, the observed chance that the lookup chain matches that deep for lookup nodes, the
        larger for nodes from both; capped by the parent's estimate so that the best k nodes are
        always ancestor-closed."""
        est = torch.zeros(tree.size)
        sources = tree.sources if tree.sources is not None else torch.full((tree.size,), DRAFT)
        drafted = (sources & DRAFT) > 0
        est[drafted] = self.calibrated(tree.scores[drafted].exp())
        looked = ((sources & LOOKUP) > 0).nonzero().flatten()
        if looked.numel():  # P(the chain matches up to depth d) = product of per-position rates
            reach = (self.lookup_hits / self.lookup_seen).cumprod(0)
            d = (tree.depths[looked] - 1).clamp(max=len(reach) - 1)
            est[looked] = torch.maximum(est[looked], reach[d])
        est[0] = 1.0
        capped = est.tolist()
        parents = tree.parents.tolist()
        for i in range(1, tree.size):
            capped[i] = min(capped[i], capped[parents[i]])
        return torch.tensor(capped)

    def prune(self, tree: Tree, min_keep: int = 0) -> Tree:
        """Keep the k nodes most likely accepted (an ancestor-closed set) for the k that maximises
        expected committed tokens per ms of verification, and at least ``min_keep``."""
        n = tree.size - 1
        if n == 0:
            return tree
        est = self.acceptance(tree)[1:]
        order = torch.sort(-est, stable=True).indices  # ties: parents (lower index) first
        gain = 1.0 + torch.cat((torch.zeros(1), est[order].cumsum(0)))  # [n + 1]
        cost = torch.tensor([self.costs.target(k + 1) for k in range(n + 1)])
        k = max(int(torch.argmax(gain / cost)), min(min_keep, n))
        if k == n:
            return tree
        keep = torch.cat((torch.zeros(1, dtype=torch.long), order[:k].sort().values + 1))
        position = torch.full((n + 1,), -1, dtype=torch.long)
        position[keep] = torch.arange(k + 1)
        parents = torch.where(tree.parents[keep] >= 0, position[tree.parents[keep].clamp(min=0)], -1)
        pruned = build_tree(tree.tokens[keep], parents)
        pruned.scores = tree.scores[keep]
        pruned.sources = tree.sources[keep] if tree.sources is not None else None
        return pruned

    def propose(self, context: list[int]) -> Tree:
        chain = self.lookup.lookup(context) if self.lookup else []
        self.chain = chain
        if not self.adaptive:
            tree = self.inner.propose(context)
            return add_chain(tree, chain) if chain else tree
        depth = self.choose_depth()
        self.shadow = None
        if depth == 0:
            self.idle += 1
            if self.idle >= self.wait:
                # probe without paying for verification: draft one level now and compare it with
                # the token the plain step commits (``feedback``)
                self.idle, self.wait = 0, min(self.wait * 2, MAX_WAIT)
                self.shadow = self.inner.propose(context, depth=1)
            if not chain:
                return chain_tree(context[-1], [])
            return self.prune(add_chain(chain_tree(context[-1], []), chain))
        self.wait, self.idle = PROBE_AFTER, 0
        tree = self.inner.propose(context, depth=depth)
        if chain:
            tree = add_chain(tree, chain)
        tree = self.prune(tree)
        drafted = int((tree.sources & DRAFT > 0).sum())
        self.nodes[depth] = 0.7 * self.nodes[depth] + 0.3 * drafted
        if drafted == 0:  # the draft was not confident enough to verify: a cycle that reached nothing
            self.tried[1:depth + 1] += 1
        return tree

    def feedback(self, tree: Tree, verdict) -> None:
        if not self.adaptive:
            return
        if self.shadow is not None:  # a probe: the draft's first level against the committed token
            shadow, self.shadow = self.shadow, None
            level = (shadow.depths == 1).nonzero().flatten()
            hit = shadow.tokens[level] == verdict.bonus if verdict.accept_length == 0 else \
                shadow.tokens[level] == tree.tokens[verdict.accepted[1]]
            self._calibrate(shadow.scores[level], hit)
            self.tried[1] += 1
            self.reached[1] += float(hit.any())
        self._lookup_feedback(tree, verdict)
        if tree.size == 1 or tree.scores is None:
            return
        accepted = verdict.accepted
        on_path = torch.zeros(tree.size, dtype=torch.bool)
        on_path[accepted] = True
        sources = tree.sources if tree.sources is not None else torch.full((tree.size,), DRAFT)
        drafted = ((sources & DRAFT) > 0) & (torch.arange(tree.size) > 0)
        if bool(drafted.any()):
            self._calibrate(tree.scores[drafted], on_path[drafted])
            depth = int(tree.depths[drafted].max())
            accept_length = int(accepted.shape[0]) - 1
            self.tried[1:depth + 1] += 1
            self.reached[1:min(depth, accept_length) + 1] += 1

    def _lookup_feedback(self, tree: Tree, verdict) -> None:
        """Score the lookup chain against the tokens this cycle committed, position by position
        until the first miss: its verified nodes, and also the ones the cut left out (free to
        check, so the lookup keeps being judged while it is not proposed)."""
        chain, self.chain = self.chain, []
        if not chain:
            return
        committed = tree.tokens[verdict.accepted[1:]].tolist() + [verdict.bonus]
        L = len(self.lookup_seen)
        for i, tok in enumerate(chain[:min(L, len(committed))]):
            hit = committed[i] == tok
            self.lookup_seen[i] += 1
            self.lookup_hits[i] += float(hit)
            if not hit:
                break
