"""Cost-aware drafting: each cycle drafts only as deep as pays, verifies only the nodes that pay,
or takes a plain decoding step.

Two inputs. (a) What things cost on this machine: the target's forward over n tree tokens and a
draft proposal of depth d, and how both grow with the context, measured once per loaded engine
in the order decoding runs them (``measure_costs``). (b) How well the draft predicts *this*
request: the share of drafted cycles whose accepted path reached depth i (recent cycles weigh
more: FORGET), and a calibration of the draft's path probabilities (EAGLE-2 scores are products
of draft probabilities, over-confident for a weak draft) against the nodes actually accepted.

Per cycle: the depth d (0 = plain step) maximises expected committed tokens per millisecond,
E(d) / (t(n_d) + draft(d) + c) with E(d) = 1 + sum_{i<=d} P(path reaches depth i) and c what every
cycle costs beside the two (``costs.CYCLE_SHARE``), the costs at the request's current length (the
draft's including a share of the positions it must catch up on first, the target's as it runs
right after a proposal), and drafting must beat not drafting by a small margin;
the drafted tree is then cut to the k best nodes maximising
(1 + sum of their calibrated acceptance) / (t(k + 1) + c). With prompt lookup, depth i counts as
reached when the draft or the lookup chain gets there, the draft's chance being estimated on the
cycles where the chain had not (a draft that proposes what the chain already holds adds nothing),
and each option (a plain step included) is priced with the chain's best prefix for it;
the chain's chances are kept apart by the length of the n-gram match that found it (a chain
found by one matching token is right far less often than one found by three).
Outcomes fade with every cycle, plain steps included, so while plain steps win the estimate
drifts back toward the prior and drafting is tried again; a drafted cycle whose nodes were all cut
counts by what its best nodes were expected to reach. Where even the prior does not pay, a probe
after 4, 8, 16 ... plain steps drafts one level and verifies its best token in the step's forward,
so a draft that starts predicting well is noticed; probes may cost at most 1.5 % of the plain steps
before them (a short answer never pays for the draft reading its prompt). Decisions depend only on the fixed cost table and on this request's outcomes, so a
seeded request decodes the same way every time in one process.
Verification is untouched: any tree chosen before the target's forward keeps decoding lossless.
"""

from __future__ import annotations

import bisect
import math

import torch

from .costs import CostTable, batch_costs, cost_store_path, measure_costs
from ..models.linear import SMALL_ROWS
from .proposers import PromptLookupProposer, Proposer
from .draft_proposer import DraftProposer
from .tree import DRAFT, LOOKUP, Tree, add_chain, build_tree, chain_tree, kept_proposals

PROBE_AFTER = 4  # plain steps before drafting again, doubled after each probe that did not pay
MAX_WAIT = 64
PROBE_SHARE = 0.015  # probes (and the catch-up each does first) may cost at most this share of the
# plain steps taken so far in the request, by the table: measured they cost about twice what the
# table says (a catch-up after plain steps reads evicted weights), so half the 3 % noise band
BUCKETS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0001)  # of draft probabilities
PRIOR_WEIGHT = 2.0  # pseudo-observations behind each prior
DEPTH_PRIOR_WEIGHT = 4.0  # ... and behind the depth prior, against at most 1 / (1 - FORGET) observations:
# lighter, two early misses (an answer's first words) kept a good draft idle for dozens of steps
DEPTH_PRIOR_FLOOR = 1.5  # of which this many stay; the rest fade with FORGET like observations (held
# whole, the prior kept a weak draft's estimate far above what it got)
FORGET = 0.9  # each drafted cycle's outcome weighs this much less per later one: a draft that did
# well on an answer's opening words and not on the rest (a translation) is dropped within ~10 cycles
IDLE_FORGET = 0.9  # ... and per plain step: the estimate drifts back toward the prior while the
# draft is idle, so drafting resumes on its own (else an answer's unsure opening words kept a good
# draft idle for the rest of a short answer)
PRIOR_SHRINK = 0.8  # prior: a node is accepted with 0.8 x its draft probability
PRIOR_DEPTH = 0.6  # prior: P(path gets past level i | it reached i - 1) = 0.6 (optimistic, so drafting is tried)
DRAFT_MARGIN = 0.03  # drafting must promise this much more than not drafting: a drafted cycle's
# bookkeeping (~3 % of its time) is not in the table; a draft that only breaks even stays idle
CATCH_UP_CYCLES = 8  # drafted cycles over which one catch-up is charged (``draft_cost``)
PRIOR_LOOKUP_MISS = 0.7  # prior: a lookup token found by an n-token match (and whose predecessors
PRIOR_LOOKUP_DECAY = 0.6  # matched) misses with 0.7 x 0.6^(n - 1): 0.3 / 0.58 / 0.75 match for n = 1 / 2 / 3


class AdaptiveProposer(Proposer):
    """Wraps a draft proposer; see the module docstring. With ``lookup`` the prompt-lookup
    continuation joins the draft's tree as extra branches (merged where the tokens coincide) and
    the same cost-aware cut covers both sources; a lookup chain is proposed even on cycles that
    do not draft. Without a draft (``inner=None``) it is prompt lookup that verifies only as much
    of the chain as pays. ``adaptive=False`` keeps the draft's fixed tree (plus the lookup branch)."""

    needs_features = True

    def __init__(self, inner: DraftProposer | None, target, costs: CostTable | None = None,
                 lookup: PromptLookupProposer | None = None, adaptive: bool = True,
                 keep_costs: bool = False, cache_dir: str | None = None):
        """``costs``: the cost table (default: measured here, ``measure_costs``; with ``keep_costs``
        together with the rounds of earlier loads of the same setup, kept under ``cache_dir``)."""
        if inner is None and lookup is None:
            raise ValueError("cost-aware drafting needs a draft or prompt lookup")
        self.inner, self.target, self.lookup, self.adaptive = inner, target, lookup, adaptive
        self.max_tree_tokens = ((inner.max_tree_tokens if inner else 1)
                                + (lookup.num_tokens if lookup else 0))
        if costs is None and adaptive:
            store = cost_store_path(target, inner, self.max_tree_tokens, cache_dir) if keep_costs else None
            costs = measure_costs(target, inner, max_tree_tokens=self.max_tree_tokens, store=store)
        self.costs = self._own_costs = costs  # ``costs``: as they apply now (``in_batch``)
        self._batch_costs: CostTable | None = None  # the forwards of a batch (``batch_costs``)
        self.name = inner.name + ("+pld" if lookup else "") if inner else lookup.name
        self.needs_features = inner is not None
        self.aux_layers = inner.aux_layers if inner else ()
        self.max_depth = inner.budget.depth if inner else 0
        self.max_tree_depth = max(self.max_depth, lookup.num_tokens if lookup else 0)
        self.start_stats()

    # ------------------------------------------------------------------ request state
    def start_stats(self) -> None:
        """This request's statistics, as Python floats: they change every cycle, where two dozen
        tiny tensor operations cost a few percent of a cycle (measured with SmolLM2-135M: a
        cycle's feedback took 0.24 ms on tensors, 0.04 ms on floats)."""
        D = self.max_depth
        # drafted cycles whose accepted path reached depth i, and those whose tree had depth >= i
        # and whose path reached i - 1; both start with the fading part of the depth prior
        fading = DEPTH_PRIOR_WEIGHT - DEPTH_PRIOR_FLOOR
        self.reached = [0.0] + [fading * PRIOR_DEPTH] * D
        self.tried = [0.0] + [fading] * D
        mids = [(lo + hi) / 2 for lo, hi in zip(BUCKETS[:-1], BUCKETS[1:])]
        self.hits = [PRIOR_WEIGHT * PRIOR_SHRINK * min(m, 1.0) for m in mids]  # calibration, per bucket
        self.seen = [PRIOR_WEIGHT] * len(mids)
        self.nodes = {d: float(d) for d in range(1, D + 1)}  # typical verified draft nodes per depth
        L = self.lookup.num_tokens if self.lookup else 0
        N = self.lookup.max_ngram + 1 if self.lookup else 1
        # per n-gram match length n and chain position i: P(token i matches | tokens before it matched)
        prior = [1 - PRIOR_LOOKUP_MISS * PRIOR_LOOKUP_DECAY ** max(n - 1, 0) for n in range(N)]
        self.lookup_hits = [[PRIOR_WEIGHT * p] * L for p in prior]
        self.lookup_seen = [[PRIOR_WEIGHT] * L for _ in range(N)]
        self.chain_ngram = 0  # the match length that found this cycle's chain
        self.idle = 0
        self.wait = PROBE_AFTER
        self.plain_ms = 0.0  # what this request's plain steps cost by the table ...
        self.probe_ms = 0.0  # ... and its probes
        self.chain: list[int] = []  # this cycle's lookup continuation, compared with what is committed
        self.context_length: int | None = None  # committed tokens at this cycle (costs grow with it)

    def start(self, max_len: int) -> None:
        if self.inner:
            self.inner.start(max_len)
        self.start_stats()

    def set_sampling(self, params, generator=None) -> None:
        if self.inner:
            self.inner.set_sampling(params, generator)

    def for_batch(self, slots: int) -> None:
        # once per engine, every size up to the one-call stack's largest, whatever the batch:
        # measured again for each larger batch, the table cost a benchmark level its first seconds
        if self._own_costs is not None and slots > 1 and self._batch_costs is None:
            self._batch_costs = batch_costs(self._own_costs, self.target, SMALL_ROWS)

    def in_batch(self, rows: int) -> None:
        if self.costs is not None:
            self.costs = (self._batch_costs or self._own_costs).beside(rows) if rows else self._own_costs

    def observe(self, features: torch.Tensor, next_tokens: torch.Tensor) -> None:
        if self.inner:
            self.inner.observe(features, next_tokens)

    # ------------------------------------------------------------------ decisions
    def reach_probability(self) -> list[float]:
        """P(accepted path reaches depth i), i = 1..D: the product of the observed chances of
        getting past each level once the one above was reached, each with an optimistic prior that
        fades like the cycles observed (``DEPTH_PRIOR_FLOOR`` of its weight stays)."""
        out, p = [], 1.0
        for reached, tried in zip(self.reached[1:], self.tried[1:]):
            p *= (reached + DEPTH_PRIOR_FLOOR * PRIOR_DEPTH) / (tried + DEPTH_PRIOR_FLOOR)
            out.append(p)
        return out

    def _count(self, depth: int, reached: int, covered: int = 0) -> None:
        """One drafted cycle (or probe) whose tree reached ``depth`` and whose accepted path the
        draft carried ``reached`` deep: level i was tried if level i - 1 was reached. Levels the
        lookup chain carried the path through anyway (``covered``) say nothing of what drafting
        adds, so only the levels below them count: the estimate is the draft's chance where the
        chain has failed (a draft that merely repeats the chain is worth nothing beside it).
        Earlier cycles fade by FORGET."""
        self.tried = [t * FORGET for t in self.tried]
        self.reached = [r * FORGET for r in self.reached]
        first = covered + 1
        for i in range(first, min(depth, reached + 1) + 1):
            self.tried[i] += 1
        for i in range(first, min(depth, reached) + 1):
            self.reached[i] += 1

    def lookup_reach(self, length: int, ngram: int | None = None) -> list[float]:
        """P(the lookup chain's first i tokens all match), i = 1..length, for a chain found by an
        ``ngram``-token match (default: this cycle's)."""
        n = self.chain_ngram if ngram is None else ngram
        out, p = [], 1.0
        for hits, seen in zip(self.lookup_hits[n][:length], self.lookup_seen[n][:length]):
            p *= hits / seen
            out.append(p)
        return out

    def choose_depth(self, chain_length: int = 0) -> int:
        """The draft depth (0: none) that maximises expected committed tokens per ms, drafting only
        where that beats not drafting by ``DRAFT_MARGIN``. With a lookup chain of ``chain_length``
        tokens, each option is priced with the chain's best prefix for it (``prune`` cuts the
        chain as it cuts the draft: charging the whole of a poor chain to every drafted option kept
        the draft idle beside it, the hybrid drafting a tenth of what the draft alone did on math),
        and depth i is reached when either source gets there (taken as independent)."""
        c, n_ctx = self.costs, self.context_length
        pending = self.inner.pending_rows if self.inner else 0
        reach = self.reach_probability()
        chain = self.lookup_reach(chain_length) if chain_length else []
        best_depth, best_rate = 0, 0.0
        for d in range(0, self.max_depth + 1):
            # a path to depth d verifies at least d nodes
            nodes = max(d, round(self.nodes[d])) if d else 0
            spent = self.draft_cost(d, pending) if d else 0.0
            for kept in range(chain_length + 1):  # the chain's first `kept` tokens go with it
                q = chain[:kept] + [0.0] * max(0, d - kept)
                expected = 1.0 + sum(1 - (1 - qi) * (1 - ri) for qi, ri in zip(q[:d], reach)) + sum(q[d:])
                rate = expected / (c.cycle(1 + kept + nodes, n_ctx, drafted=d > 0) + spent)
                if d == 0:
                    rate *= 1 + DRAFT_MARGIN
                if rate > best_rate:
                    best_depth, best_rate = d, rate
        return best_depth

    def draft_cost(self, depth: int, pending: int) -> float:
        """A proposal of ``depth`` now, with what catching up on ``pending`` committed positions
        costs more spread over ``CATCH_UP_CYCLES``: the draft reads every committed position
        before it next drafts, whenever that is, so taking plain steps only defers (and grows)
        that debt. Charged in full to this cycle, the prompt's reading kept long prompts from ever
        drafting (a 400-token document: two dozen plain steps before the first probe)."""
        return self.costs.draft(depth, self.context_length) + self.costs.catch_up(pending) / CATCH_UP_CYCLES

    def _bucket(self, draft_prob: float) -> int:
        return min(max(bisect.bisect_right(BUCKETS, draft_prob) - 1, 0), len(self.seen) - 1)

    def _calibrate(self, scores: list[float], accepted: list[bool]) -> None:
        for score, hit in zip(scores, accepted):
            b = self._bucket(math.exp(score))
            self.seen[b] += 1
            self.hits[b] += hit

    def calibrated(self, draft_prob: torch.Tensor) -> torch.Tensor:
        """Observed acceptance of nodes whose draft probability fell in the same bucket."""
        return torch.tensor([self.hits[b] / self.seen[b] for b in map(self._bucket, draft_prob.tolist())])

    def acceptance(self, tree: Tree) -> list[float]:
        """Estimated P(node accepted) per node (root 1): calibrated draft probability for drafted
        nodes, the observed chance that the lookup chain matches that deep for lookup nodes, the
        larger for nodes from both; capped by the parent's estimate so that the best k nodes are
        always ancestor-closed. (Python floats: trees are small and this runs every cycle.)"""
        n = tree.size
        sources = tree.sources.tolist() if tree.sources is not None else [0] + [DRAFT] * (n - 1)
        scores = tree.scores.tolist() if tree.scores is not None else [0.0] * n
        hits, seen = self.hits, self.seen
        reach = self.lookup_reach(len(self.lookup_seen[0])) if self.lookup else []
        depths, parents = tree.depths.tolist(), tree.parents.tolist()
        est = [1.0] + [0.0] * (n - 1)
        for i in range(1, n):
            e = 0.0
            if sources[i] & DRAFT:
                b = self._bucket(math.exp(scores[i]))
                e = hits[b] / seen[b]
            if sources[i] & LOOKUP and reach:
                e = max(e, reach[min(depths[i] - 1, len(reach) - 1)])
            est[i] = min(e, est[parents[i]])
        return est

    def prune(self, tree: Tree, min_keep: int = 0, drafted: bool = False) -> Tree:
        """Keep the k nodes most likely accepted (an ancestor-closed set) for the k that maximises
        expected committed tokens per ms of verification, and at least ``min_keep``; ``drafted``:
        the tree comes from a draft proposal (the target's forward then costs ``drafted_ms``)."""
        n = tree.size - 1
        if n == 0:
            return tree
        est = self.acceptance(tree)[1:]
        order = sorted(range(n), key=lambda i: -est[i])  # stable: ties keep parents (lower index) first
        gain, best_k = 1.0, 0
        best_rate = gain / self.costs.cycle(1, self.context_length, drafted)
        for k in range(1, n + 1):
            gain += est[order[k - 1]]
            rate = gain / self.costs.cycle(k + 1, self.context_length, drafted)
            if rate > best_rate:
                best_k, best_rate = k, rate
        k = max(best_k, min(min_keep, n))
        if k == n:
            return tree
        if tree.retrieve_paths.shape == (1, n + 1):  # a chain (a lookup step): keep its first k tokens
            pruned = chain_tree(int(tree.tokens[0]), tree.tokens[1:k + 1])
            pruned.scores = tree.scores[:k + 1]
            pruned.sources = tree.sources[:k + 1] if tree.sources is not None else None
            pruned.proposals = kept_proposals(tree, list(range(k + 1)))
            return pruned
        keep = [0] + sorted(i + 1 for i in order[:k])
        position = {node: p for p, node in enumerate(keep)}
        parents = tree.parents.tolist()
        keep_t = torch.tensor(keep)
        pruned = build_tree(tree.tokens[keep_t], torch.tensor([-1] + [position[parents[i]] for i in keep[1:]]))
        pruned.scores = tree.scores[keep_t]
        pruned.sources = tree.sources[keep_t] if tree.sources is not None else None
        pruned.proposals = kept_proposals(tree, keep)
        return pruned

    def propose(self, context: list[int]) -> Tree:
        chain, self.chain_ngram = self.lookup.match(context) if self.lookup else ([], 0)
        self.chain = chain
        if not self.adaptive:
            tree = self.inner.propose(context) if self.inner else chain_tree(context[-1], [])
            return add_chain(tree, chain) if chain else tree
        self.context_length = len(context)
        depth = self.choose_depth(len(chain))
        if depth == 0:
            self._fade_idle()
            self.plain_ms += self.costs.cycle(1 + len(chain), self.context_length)
            plain = self.prune(add_chain(chain_tree(context[-1], []), chain)) if chain else chain_tree(context[-1], [])
            if self.idle >= self.wait and self.inner and self._probe_affordable(plain.size):
                # a probe: draft one level and verify its best token with the step's own tokens
                # (its cost: ``_probe_affordable``); ``feedback`` scores it like any drafted cycle
                self.idle, self.wait = 0, min(self.wait * 2, MAX_WAIT)
                return self._probe(context, plain)
            return plain
        self.wait, self.idle = PROBE_AFTER, 0
        tree = self.inner.propose(context, depth=depth)
        if chain:
            tree = add_chain(tree, chain)
        # a sampled chain keeps its first token: once drafting is chosen, that token's chance is
        # what the depth estimate priced (its score, the draft's confidence, is a weak guide to
        # min(1, p / q)); cut to nothing and counted as a miss, it kept a draft idle at T = 1
        proposed, tree = tree, self.prune(tree, min_keep=1 if tree.proposals else 0, drafted=True)
        drafted = sum(1 for source in tree.sources.tolist() if source & DRAFT)
        self.nodes[depth] = 0.7 * self.nodes[depth] + 0.3 * drafted
        if drafted == 0:  # the draft was not confident enough to verify anything
            self._count_unverified(proposed)
        return tree

    def _count_unverified(self, tree: Tree) -> None:
        """A drafted cycle whose nodes were all cut: counted by what verifying it would have
        reached on average (the calibrated chance of its best node per level, ``acceptance``), not
        as a cycle that reached nothing. Counted as a miss, an answer's unsure opening words (a
        few cut cycles in a row) drove the estimate below what pays and kept a draft that accepts
        half of its first tokens idle for the rest of a short answer."""
        est, depths, sources = self.acceptance(tree), tree.depths.tolist(), tree.sources.tolist()
        best = [1.0] + [0.0] * max(depths)
        for e, d, source in zip(est, depths, sources):
            if d and source & DRAFT:
                best[d] = max(best[d], e)
        self.tried = [t * FORGET for t in self.tried]
        self.reached = [r * FORGET for r in self.reached]
        for i in range(1, min(len(best), len(self.tried))):
            self.tried[i] += best[i - 1]
            self.reached[i] += best[i]

    def _probe(self, context: list[int], plain: Tree) -> Tree:
        """The draft's most likely next token under the root, plus the lookup chain ``plain``
        verifies (if any)."""
        level = self.inner.propose(context, depth=1)
        best = int(level.scores[1:].argmax()) + 1  # one level: every node but the root is a child
        probe = chain_tree(context[-1], [int(level.tokens[best])])
        probe.scores = level.scores[[0, best]]
        probe.sources = torch.tensor([0, DRAFT])
        probe.proposals = kept_proposals(level, [0, best])
        return add_chain(probe, plain.tokens[1:].tolist()) if plain.size > 1 else probe

    def _fade_idle(self) -> None:
        """A plain step: what drafted cycles showed goes stale (``IDLE_FORGET``)."""
        self.idle += 1
        self.tried = [t * IDLE_FORGET for t in self.tried]
        self.reached = [r * IDLE_FORGET for r in self.reached]

    def _probe_affordable(self, plain_tokens: int) -> bool:
        """Whether a probe (one draft level after catching up on what is pending, and one more
        token in the forward of a step that verifies ``plain_tokens``) keeps the request's probes
        within ``PROBE_SHARE`` of its plain steps; if so, it is counted (the extra token is not
        free: without matrix tiles about as much as the draft level)."""
        n_ctx = self.context_length
        cost = (self.costs.draft(1, n_ctx, self.inner.pending_rows)
                + self.costs.target(plain_tokens + 1, n_ctx) - self.costs.target(plain_tokens, n_ctx))
        if self.probe_ms + cost > PROBE_SHARE * self.plain_ms:
            return False
        self.probe_ms += cost
        return True

    def feedback(self, tree: Tree, verdict) -> None:
        if not self.adaptive:
            return
        accepted = verdict.accepted.tolist()
        self._lookup_feedback(tree, verdict, accepted)
        if tree.size == 1 or tree.scores is None:
            return
        n = tree.size
        sources = tree.sources.tolist() if tree.sources is not None else [0] + [DRAFT] * (n - 1)
        drafted = [i for i in range(1, n) if sources[i] & DRAFT]
        if drafted:
            scores, depths, on_path = tree.scores.tolist(), tree.depths.tolist(), set(accepted)
            self._calibrate([scores[i] for i in drafted], [i in on_path for i in drafted])
            depth = max(depths[i] for i in drafted)
            # how deep the draft's own nodes carried the accepted path (lookup-only nodes do not
            # count: they would keep a draft that adds nothing to the chain drafting)
            on_draft = [bool(sources[i] & DRAFT) for i in accepted[1:]] + [False]
            on_chain = [bool(sources[i] & LOOKUP) for i in accepted[1:]] + [False]
            self._count(depth, on_draft.index(False), covered=on_chain.index(False))

    def _lookup_feedback(self, tree: Tree, verdict, accepted: list[int]) -> None:
        """Score the lookup chain against the tokens this cycle committed, position by position
        until the first miss: its verified nodes, and also the ones the cut left out (free to
        check, so the lookup keeps being judged while it is not proposed)."""
        chain, self.chain = self.chain, []
        if not chain:
            return
        tokens = tree.tokens.tolist()
        committed = [tokens[i] for i in accepted[1:]] + [verdict.bonus]
        hits, seen = self.lookup_hits[self.chain_ngram], self.lookup_seen[self.chain_ngram]
        for i, tok in enumerate(chain[:min(len(seen), len(committed))]):
            hit = committed[i] == tok
            seen[i] += 1
            hits[i] += hit
            if not hit:
                break
