"""Cost-aware drafting: the tree cut and the depth choice follow the cost table and the observed
acceptance, and greedy output stays identical to plain decoding whatever the decisions (always
drafting, mostly plain steps with probes, switching mid-request)."""

import math

import pytest
import torch

from jakiro.decoding import adaptive
from jakiro.decoding.adaptive import PROBE_SHARE, AdaptiveProposer, CostTable
from jakiro.decoding.engine import Engine, Metrics
from jakiro.decoding.proposers import PromptLookupProposer, TreeBudget
from jakiro.decoding.draft_proposer import DraftProposer
from jakiro.decoding.tree import build_tree, chain_tree
from jakiro.decoding.verify import Verdict
from test_speculative_greedy import assert_same, random_draft

FREE = CostTable({1: 1.0, 32: 1.0}, {d: 0.0 for d in range(1, 7)})  # verification and drafting cost nothing
DEAR = CostTable({1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0, 16: 16.0, 32: 32.0}, {d: 0.5 * d for d in range(1, 7)})
CHEAP_DRAFT = CostTable({1: 1.0, 2: 1.05, 3: 1.1, 4: 1.15, 8: 1.6, 16: 2.8}, {1: 0.1, 2: 0.2, 3: 0.3, 4: 0.4})


def test_cost_table_interpolates_and_extends():
    c = CostTable({1: 10.0, 4: 16.0, 8: 20.0}, {1: 2.0})
    assert c.target(2) == pytest.approx(12.0) and c.target(6) == pytest.approx(18.0)
    assert c.target(12) == pytest.approx(24.0)  # the last slope, 1 ms per token
    assert c.draft(3) == 2.0


def test_cost_table_grows_with_the_context():
    c = CostTable({1: 10.0, 9: 20.0}, {1: 2.0, 2: 4.0}, context=100,
                  target_slope={1: 0.01, 9: 0.03}, draft_slope={1: 0.001, 2: 0.002})
    assert c.target(1) == 10.0 and c.target(1, 100) == 10.0
    assert c.target(1, 1100) == pytest.approx(20.0) and c.target(5, 1100) == pytest.approx(15.0 + 20.0)
    assert c.draft(2, 1100) == pytest.approx(6.0) and c.draft(5, 1100) == pytest.approx(6.0)
    as_dict = c.as_dict()
    assert as_dict["context"] == 100 and as_dict["target_ms_per_context_token"] == {"1": 0.01, "9": 0.03}


def test_cost_table_after_a_proposal_and_for_long_catch_ups():
    c = CostTable({1: 10.0, 9: 20.0}, {1: 2.0}, drafted_ms={1: 11.0, 9: 22.0}, catch_up_ms={2: 0.0, 34: 1.6, 258: 4.4})
    assert c.target(5) == pytest.approx(15.0) and c.target(5, drafted=True) == pytest.approx(16.5)
    assert c.draft(1) == c.draft(1, pending=2) == 2.0 and c.draft(1, pending=18) == pytest.approx(2.8)
    assert c.draft(1, pending=146) == pytest.approx(5.0) and c.draft(1, pending=482) == pytest.approx(9.2)
    assert CostTable({1: 10.0}, {1: 2.0}).target(1, drafted=True) == 10.0  # not measured: the plain curve
    assert c.as_dict()["target_ms_after_draft"] == {"1": 11.0, "9": 22.0}


def test_what_every_cycle_costs_beside_its_forward_favours_committing_more(tiny):
    """A cycle's bookkeeping costs the same whether it drafted or not: counted, a draft whose
    cycles commit 1.55 tokens at 1.52 x a plain step's forward (the draft included) pays; without it,
    it would not."""
    def proposer_with(cycle_ms):
        costs = CostTable({1: 1.0, 2: 1.47, 4: 2.0}, {1: 0.05}, cycle_ms=cycle_ms)
        p = make(tiny, costs)
        p.start(64)
        p.reached[1:] = [11.0] + [0.0] * (p.max_depth - 1)  # depth 1 reached in 55 % of the cycles
        p.tried[1:] = [20.0] * p.max_depth
        return p
    assert CostTable({1: 1.0}, {}, cycle_ms=0.25).cycle(1) == 1.25
    assert proposer_with(0.0).choose_depth() == 0
    assert proposer_with(0.25).choose_depth() == 1


def test_a_long_catch_up_is_paid_for(tiny):
    """After a run of plain steps the draft must first read every position it missed: with that
    cost in the table, a draft that pays after a typical cycle does not pay after 60 of them."""
    costs = CostTable({1: 1.0, 2: 1.05, 4: 1.1, 8: 1.3, 16: 1.6}, {d: 0.2 * d for d in range(1, 5)},
                      catch_up_ms={2: 0.0, 34: 1.6})
    proposer = make(tiny, costs)
    proposer.start(256)
    proposer.reached[1:] = [10.0, 5.0, 2.5, 1.0]  # depth 1 reached in half the cycles
    proposer.tried[1:] = [20.0] * 4
    d = proposer.inner.draft.config.hidden_size
    proposer.observe(torch.randn(2, d), torch.tensor([1, 2]))
    assert proposer.inner.pending_rows == 2 and proposer.choose_depth() >= 1
    proposer.observe(torch.randn(60, d), torch.arange(60))
    assert proposer.inner.pending_rows == 62 and proposer.choose_depth() == 0


def test_reading_a_long_prompt_is_spread_over_the_cycles_that_follow(tiny):
    """Before its first proposal the draft reads the whole prompt, a debt paid whenever it first
    drafts: charged to that cycle alone, a 256-token prompt kept a draft that pays idle; spread
    over the cycles after it, the draft starts at once."""
    costs = CostTable({1: 1.0, 2: 1.05, 4: 1.1, 8: 1.3, 16: 1.6}, {d: 0.2 * d for d in range(1, 5)},
                      catch_up_ms={2: 0.0, 34: 0.32, 258: 2.56})
    proposer = make(tiny, costs)
    proposer.start(512)
    proposer.reached[1:] = [16.0, 12.0, 9.0, 6.0]  # depth 1 reached in 4 of 5 cycles
    proposer.tried[1:] = [20.0] * 4
    d = proposer.inner.draft.config.hidden_size
    proposer.observe(torch.randn(258, d), torch.randint(0, 60, (258,)))
    assert proposer.inner.pending_rows == 258
    assert proposer.draft_cost(1, 258) == pytest.approx(0.2 + 2.56 / 8)
    assert 1.8 / (1.05 + costs.draft(1, pending=258)) < 1.0  # charged in full it would not pay
    assert proposer.choose_depth() >= 1


def test_measured_costs_cover_every_depth_and_grow_with_the_context(tiny):
    from jakiro.decoding.adaptive import measure_costs
    root, target, tok, prompts, reference = tiny
    proposer = DraftProposer(random_draft(root, target, "eagle2", {}, "cost-draft"), TreeBudget(3, 2, 6))
    c = measure_costs(target, proposer, context=32, long_context=256, rounds=2)
    assert c.context == 32 and sorted(c.draft_ms) == [1, 2, 3] and sorted(c.target_ms)[-1] == 7
    assert all(v > 0 for v in list(c.target_ms.values()) + list(c.draft_ms.values()))
    assert sorted(c.target_slope) == [1, 7] and min(c.target_slope.values()) >= 0.0
    assert c.draft_slope[3] >= c.draft_slope[1] >= 0.0
    assert sorted(c.drafted_ms) == sorted(c.target_ms) and min(c.drafted_ms.values()) > 0  # after a proposal
    assert sorted(c.catch_up_ms) == [2, 34] and c.draft(1, pending=40) >= c.draft(1)  # 258 rows do not fit


def test_cost_differences_are_paired_within_each_round(monkeypatch):
    """The machine's pace changes from round to round (here 1x, 3x, 1x, 5x, 2x): every quantity is
    sampled in every round, and a difference the table keeps (a forward after a proposal vs after
    a forward, a long context vs a short one, a catch-up vs a typical proposal) is the median of
    the differences within rounds, so it comes out exact."""
    from jakiro.decoding import costs

    pace = iter([1.0, 3.0, 1.0, 5.0, 2.0] * 4)
    now = {"pace": 1.0}

    def forward_ms(target, cache, repeats, sizes, before=None, warmup=2, primed=0):
        if cache.length == 32 and before is None:  # each round starts with the short-context forwards: a new pace
            now["pace"] = next(pace)
        extra = 0.5 if before is not None else 3.0 if cache.length == 256 else 0.0
        return {n: now["pace"] * (1.0 + 0.1 * n) + extra for n in sizes}

    def draft_costs(target, cache, proposer, context, depths, repeats, rows=2):
        extra = 2.0 * (context - 32) / 224 + (rows - 2) / 32
        return {d: now["pace"] * 0.2 * d + extra for d in depths}

    class Cache:
        def __init__(self, length):
            self.length = length

    monkeypatch.setattr(costs, "prefilled_cache", lambda target, context, scratch: Cache(context))
    monkeypatch.setattr(costs, "forward_ms", forward_ms)
    monkeypatch.setattr(costs, "_draft_costs", draft_costs)
    monkeypatch.setattr(costs, "_prepared", lambda *a, **k: ([1, 2], lambda: None))

    class Target:
        class config:
            max_context = 2048

    class Proposer:
        max_tree_tokens = 4
        budget = TreeBudget(2, 2, 3)

    c = costs.measure_costs(Target(), Proposer(), context=32, long_context=256, rounds=5)
    assert c.target_ms[1] == pytest.approx(2.0 * 1.1)  # the median pace
    assert all(c.drafted_ms[n] - c.target_ms[n] == pytest.approx(0.5) for n in c.target_ms)
    assert all(v * 224 == pytest.approx(3.0) for v in c.target_slope.values())
    assert c.draft_slope[2] * 224 == pytest.approx(2.0)
    assert c.catch_up_ms[34] == pytest.approx(1.0) and c.catch_up_ms[258] == pytest.approx(8.0)
    assert c.cycle_ms == pytest.approx(costs.CYCLE_SHARE * c.target_ms[1])


def test_cost_rounds_are_kept_per_setup_and_shared_by_later_loads(monkeypatch, tmp_path):
    """Each load adds its rounds to its setup's store and takes the medians over every kept round,
    so one load's slow moment no longer decides the table; once ``STORED_ENOUGH`` are kept a load
    measures only ``FEW_ROUNDS``, and only the newest ``STORE_ROUNDS`` are kept. A store that is
    unreadable, or measured other sizes, is measured afresh and rewritten."""
    import json
    from jakiro.decoding import costs

    now = {"pace": 1.0}

    class Cache:
        def __init__(self, length):
            self.length = length

    class Target:
        class config:
            max_context = 2048

    monkeypatch.setattr(costs, "prefilled_cache", lambda target, context, scratch: Cache(context))
    monkeypatch.setattr(costs, "forward_ms", lambda target, cache, repeats, sizes, before=None, warmup=2, primed=0:
                        {n: now["pace"] * (1.0 + 0.1 * n) for n in sizes})
    store = tmp_path / "costs" / "setup.json"

    def load(pace, tree_tokens=4):
        now["pace"] = pace
        table = costs.measure_costs(Target(), None, max_tree_tokens=tree_tokens, store=str(store))
        return table.target_ms[1], len(json.loads(store.read_text())["rounds"])

    assert load(1.0) == (pytest.approx(1.1), costs.MEASURE_ROUNDS)
    assert load(10.0) == (pytest.approx((1.1 + 11.0) / 2), 2 * costs.MEASURE_ROUNDS)  # five slow rounds of ten
    assert costs.STORED_ENOUGH <= 2 * costs.MEASURE_ROUNDS
    assert load(1.0) == (pytest.approx(1.1), 2 * costs.MEASURE_ROUNDS + costs.FEW_ROUNDS)
    for _ in range(costs.STORE_ROUNDS):
        t1, kept = load(3.0)
    assert (t1, kept) == (pytest.approx(3.3), costs.STORE_ROUNDS)  # the oldest rounds dropped
    store.write_text("{not json")
    assert load(2.0) == (pytest.approx(2.2), costs.MEASURE_ROUNDS)
    assert load(5.0, tree_tokens=8) == (pytest.approx(5.5), costs.MEASURE_ROUNDS)  # other sizes: not mixed


def test_a_cost_store_is_shared_by_the_same_setup_only(tiny, tmp_path):
    from jakiro.decoding.adaptive import cost_store_path
    root, target, tok, prompts, reference = tiny
    draft = random_draft(root, target, "eagle2", {}, "store-draft")
    path = lambda budget, tokens=7: cost_store_path(target, DraftProposer(draft, budget), tokens, str(tmp_path))  # noqa: E731
    same = path(TreeBudget(3, 2, 6))
    assert same == path(TreeBudget(3, 2, 6)) and same.startswith(str(tmp_path / "costs"))
    assert len({same, path(TreeBudget(4, 2, 6)), path(TreeBudget(3, 2, 6), tokens=13),
                cost_store_path(target, None, 7, str(tmp_path))}) == 4  # deeper, with lookup, lookup alone
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert path(TreeBudget(3, 2, 6)) != same  # timed with another thread count
    finally:
        torch.set_num_threads(threads)


def test_a_good_lookup_chain_leaves_a_weak_draft_idle(tiny):
    from jakiro.decoding.proposers import PromptLookupProposer
    root, target, tok, prompts, reference = tiny
    draft = random_draft(root, target, "eagle2", {}, "chain-draft")
    costs = CostTable({1: 1.0, 2: 1.02, 4: 1.06, 8: 1.2, 16: 1.5}, {1: 0.15, 2: 0.3, 3: 0.45})
    proposer = AdaptiveProposer(DraftProposer(draft, TreeBudget(3, 2, 6)), target, costs,
                                lookup=PromptLookupProposer(num_tokens=4))
    proposer.reached[1:] = [8.0, 4.0, 2.0]  # the draft reaches depth 1 in 40 % of cycles
    proposer.tried[1:] = [20.0] * 3
    assert proposer.choose_depth(0) >= 1  # alone it pays
    proposer.lookup_hits = [[19.0] * len(row) for row in proposer.lookup_hits]  # the chain matches 95 % of the
    proposer.lookup_seen = [[20.0] * len(row) for row in proposer.lookup_seen]  # time, token after token
    assert proposer.choose_depth(4) == 0  # next to it, drafting is not worth its cost


def test_a_poor_lookup_chain_does_not_keep_a_good_draft_idle(tiny):
    """A six-token chain found by a one-token match, each token right a third of the time. Priced
    whole into every option, such a chain moved the choice (here to a deeper draft than alone; on
    Spec-Bench math, to plain steps: the hybrid drafted a tenth of what the draft alone did); with
    each option priced with the chain's best prefix for it (here none of it), the draft's choice is
    what it is alone."""
    from jakiro.decoding.proposers import PromptLookupProposer
    root, target, tok, prompts, reference = tiny
    draft = random_draft(root, target, "eagle2", {}, "poor-chain-draft")
    costs = CostTable({1: 1.0, 2: 1.3, 4: 1.9, 8: 3.1}, {1: 0.1, 2: 0.2})
    proposer = AdaptiveProposer(DraftProposer(draft, TreeBudget(2, 1, 2)), target, costs,
                                lookup=PromptLookupProposer(num_tokens=6))
    proposer.reached[1:] = [14.0, 8.0]  # the draft reaches depth 1 in 70 % of cycles
    proposer.tried[1:] = [20.0] * 2
    alone = proposer.choose_depth(0)
    assert alone >= 1
    proposer.lookup_hits = [[6.0] * len(row) for row in proposer.lookup_hits]  # right a third of the time
    proposer.lookup_seen = [[18.0] * len(row) for row in proposer.lookup_seen]
    proposer.chain_ngram = 1
    whole = (1 + sum(proposer.lookup_reach(6))) / costs.cycle(7)
    assert whole < 1.0  # the whole chain alone loses to a plain step ...
    assert proposer.choose_depth(6) == alone  # ... and does not change the draft's choice



def test_a_draft_that_repeats_the_chain_earns_nothing_beside_it(tiny):
    """Accepted nodes that the lookup chain proposed too say nothing of what drafting adds: the
    draft's chances are learnt where the chain failed."""
    from jakiro.decoding.proposers import PromptLookupProposer
    from jakiro.decoding.tree import DRAFT, LOOKUP
    root, target, tok, prompts, reference = tiny
    draft = random_draft(root, target, "eagle2", {}, "echo-draft")
    costs = CostTable({1: 1.0, 2: 1.02, 4: 1.06, 8: 1.2, 16: 1.5}, {1: 0.15, 2: 0.3, 3: 0.45})
    proposer = AdaptiveProposer(DraftProposer(draft, TreeBudget(3, 2, 6)), target, costs,
                                lookup=PromptLookupProposer(num_tokens=4))
    proposer.start(64)
    prior = proposer.reach_probability()

    def cycle(sources, accepted):
        tree = build_tree(torch.tensor([1, 2, 3]), torch.tensor([-1, 0, 1]))
        tree.scores = torch.tensor([0.0, math.log(0.9), math.log(0.8)])
        tree.sources = torch.tensor(sources)
        proposer.feedback(tree, Verdict(torch.tensor(accepted), 7))
    for _ in range(30):  # the draft proposes exactly the chain, and both are accepted
        cycle([0, DRAFT | LOOKUP, DRAFT | LOOKUP], [0, 1, 2])
    assert proposer.reach_probability() == pytest.approx(prior)
    for _ in range(30):  # where the chain misses at once, the draft's own tokens are rejected
        cycle([0, DRAFT, DRAFT], [0])
    assert proposer.reach_probability()[0] < 0.2  # from the 0.6 prior, with ~10 recent cycles against it
    for _ in range(30):  # ... or accepted
        cycle([0, DRAFT, DRAFT], [0, 1, 2])
    assert proposer.reach_probability()[1] > 0.7

def make(tiny, costs, method="jakiro", budget=TreeBudget(4, 3, 12), name="adaptive-draft", **overrides):
    root, target, tok, prompts, reference = tiny
    draft = random_draft(root, target, method, overrides, name)
    return AdaptiveProposer(DraftProposer(draft, budget), target, costs)


def test_prune_keeps_the_nodes_that_pay(tiny):
    proposer = make(tiny, CostTable({1: 1.0, 2: 1.1, 3: 1.2, 4: 3.0}, {1: 0.1}))
    # root, a (p=0.9), a->b (p=0.9*0.8), c (p=0.05)
    tree = build_tree(torch.tensor([5, 6, 7, 8]), torch.tensor([-1, 0, 1, 0]))
    tree.scores = torch.tensor([0.0, math.log(0.9), math.log(0.72), math.log(0.05)])
    c = proposer.calibrated(tree.scores.exp())
    rates = [1 / 1.0, (1 + c[1]) / 1.1, (1 + c[1] + c[2]) / 1.2, (1 + c[1:].sum()) / 3.0]
    best = max(range(4), key=lambda k: float(rates[k]))
    assert best == 2  # the third node would not pay for the jump to t(4)
    pruned = proposer.prune(tree)
    assert pruned.tokens.tolist() == [5, 6, 7] and pruned.parents.tolist() == [-1, 0, 1]
    assert torch.equal(pruned.scores, tree.scores[:3])


def test_depth_follows_observed_acceptance(tiny):
    proposer = make(tiny, CHEAP_DRAFT)
    proposer.start(64)
    assert proposer.choose_depth() >= 1  # the prior is optimistic: a cheap draft is tried
    for _ in range(30):  # thirty drafted cycles, nothing accepted (a few misses are not enough to
        # stop a draft this cheap: the prior holds until the recent cycles outweigh it)
        tree = build_tree(torch.tensor([1, 2]), torch.tensor([-1, 0]))
        tree.scores = torch.tensor([0.0, math.log(0.5)])
        proposer.feedback(tree, Verdict(torch.tensor([0]), 7))
    assert proposer.choose_depth() == 0
    # the prior fades like the cycles observed, all but DEPTH_PRIOR_FLOOR of its weight (held
    # whole, it kept the estimate at 0.17 against a draft that reaches nothing)
    assert proposer.reach_probability()[0] < 0.1
    for _ in range(40):  # then everything accepted
        tree = build_tree(torch.tensor([1, 2, 3]), torch.tensor([-1, 0, 1]))
        tree.scores = torch.tensor([0.0, math.log(0.5), math.log(0.3)])
        proposer.feedback(tree, Verdict(torch.tensor([0, 1, 2]), 7))
    assert proposer.choose_depth() >= 2
    assert proposer.reach_probability()[0] > 0.9


def test_an_idle_draft_is_tried_again_as_its_misses_go_stale(tiny, monkeypatch):
    """Outcomes fade with plain steps too: after a run of misses has made plain steps win, the
    estimate drifts back toward the prior and the draft drafts again within a dozen steps, probes
    aside. With outcomes fading only when the draft drafts, it would stay idle for good."""
    def plain_steps_until_drafting(idle_forget):
        proposer = make(tiny, CostTable({1: 1.0, 2: 1.3, 3: 1.6, 4: 1.9, 16: 5.0}, {d: 0.05 * d for d in range(1, 5)}))
        monkeypatch.setattr(adaptive, "IDLE_FORGET", idle_forget)
        monkeypatch.setattr(adaptive, "PROBE_SHARE", 0.0)  # no probes
        proposer.start(256)
        proposer.reached[1:] = [0.5, 0.1, 0.0, 0.0]  # 20 recent cycles, depth 1 reached in 2.5 % of them
        proposer.tried[1:] = [20.0, 0.5, 0.1, 0.0]
        d = proposer.inner.draft.config.hidden_size
        proposer.observe(torch.randn(8, d), torch.randint(0, 60, (8,)))
        context = list(range(1, 9))
        for step in range(200):
            tree = proposer.propose(context)
            if proposer.idle == 0:  # drafted (whatever the cut kept of it)
                return step
            assert tree.size == 1
            context.append(7)
            proposer.observe(torch.randn(1, d), torch.tensor([7]))
        return None
    steps = plain_steps_until_drafting(0.9)
    assert steps is not None and 5 <= steps <= 30
    assert plain_steps_until_drafting(1.0) is None


def test_a_cycle_cut_to_nothing_counts_by_its_expected_outcome(tiny):
    """A drafted chain whose nodes the cut all dropped was never verified: it counts by the
    calibrated chances of its nodes (the prior here: 0.8 x the draft probability's bucket middle,
    0.44 and 0.2), not as a cycle that reached nothing."""
    from jakiro.decoding.adaptive import FORGET
    from jakiro.decoding.tree import DRAFT
    proposer = make(tiny, CHEAP_DRAFT)
    proposer.start(64)
    proposer.reached[1:] = [10.0, 5.0, 2.0, 1.0]
    proposer.tried[1:] = [20.0, 10.0, 5.0, 2.0]
    tree = chain_tree(1, [2, 3])
    tree.scores = torch.tensor([0.0, math.log(0.55), math.log(0.25)])
    tree.sources = torch.tensor([0, DRAFT, DRAFT])
    proposer._count_unverified(tree)
    # levels 1 and 2 tried (level 2 as often as level 1 is expected to be reached), not deeper ones
    assert proposer.tried[1:] == pytest.approx([20 * FORGET + 1, 10 * FORGET + 0.44, 5 * FORGET, 2 * FORGET])
    assert proposer.reached[1:] == pytest.approx([10 * FORGET + 0.44, 5 * FORGET + 0.2, 2 * FORGET, 1 * FORGET])


@pytest.mark.parametrize("costs, method, overrides", [
    (FREE, "jakiro", {}),
    (DEAR, "jakiro", {}),
    (CHEAP_DRAFT, "jakiro", {"num_experts": 4, "experts_per_token": 3, "draft_vocab_size": 48}),
    (CHEAP_DRAFT, "eagle2", {"draft_vocab_size": 64}),
])
def test_adaptive_greedy_equals_plain(tiny, costs, method, overrides):
    root, target, tok, prompts, reference = tiny
    proposer = make(tiny, costs, method, name=f"adaptive-{method}-{len(overrides)}", **overrides)
    engine = Engine(target, tok, proposer)
    assert_same(engine, prompts[:10], reference[:10])
    # long enough for a probe where drafting is dear (the plain steps must first cost
    # 1 / PROBE_SHARE times what one probe does)
    res = engine.generate(prompts[0], 160)
    m = res.metrics
    if costs is FREE:
        assert m.plain_steps == 0  # drafting always pays
    elif costs is DEAR:
        # plain steps but for a few probes (one drafted token verified), each once the plain
        # steps before it cost 1 / PROBE_SHARE times as much as it: its draft level and the
        # extra token in the step's forward
        probes = m.target_forwards - m.plain_steps
        probe_cost = costs.draft(1) + costs.target(2) - costs.target(1)
        assert 1 <= probes <= PROBE_SHARE * m.plain_steps * costs.target(1) / probe_cost and m.depth_tried[1:] == []
        assert 0 < proposer.probe_ms <= PROBE_SHARE * proposer.plain_ms
    else:
        assert 0 < m.plain_steps < m.target_forwards  # both kinds of cycle in one request


def test_lookup_chain_merges_into_the_draft_tree():
    from jakiro.decoding.tree import DRAFT, LOOKUP, add_chain
    tree = build_tree(torch.tensor([9, 1, 2, 3]), torch.tensor([-1, 0, 0, 1]))  # 9 -> 1 -> 3, 9 -> 2
    tree.scores = torch.tensor([0.0, -0.1, -0.2, -0.3])
    tree.sources = torch.tensor([0, DRAFT, DRAFT, DRAFT])
    merged = add_chain(tree, [1, 4, 5])  # shares node 1, then leaves the draft's path
    assert merged.tokens.tolist() == [9, 1, 2, 3, 4, 5]
    assert merged.parents.tolist() == [-1, 0, 0, 1, 1, 4]
    assert merged.sources.tolist() == [0, DRAFT | LOOKUP, DRAFT, DRAFT, LOOKUP, LOOKUP]
    assert merged.scores[4] == float("-inf")


@pytest.mark.parametrize("adaptive", [True, False])
def test_hybrid_lookup_and_draft_greedy_equals_plain(tiny, adaptive):
    from jakiro.decoding.proposers import PromptLookupProposer
    root, target, tok, prompts, reference = tiny
    draft = random_draft(root, target, "jakiro", {}, "hybrid-draft")
    # verifying is cheap, drafting dear: lookup branches pay even when the (random) draft does not
    costs = CostTable({1: 1.0, 2: 1.02, 4: 1.06, 8: 1.14, 16: 1.3}, {1: 0.3, 2: 0.6, 3: 0.9})
    proposer = AdaptiveProposer(DraftProposer(draft, TreeBudget(3, 3, 8)), target, costs if adaptive else None,
                                lookup=PromptLookupProposer(num_tokens=5), adaptive=adaptive)
    assert proposer.name == "jakiro+pld"
    engine = Engine(target, tok, proposer)
    assert_same(engine, prompts[:10], reference[:10])
    from_lookup = 0
    for prompt in prompts[:10]:
        m = engine.generate(prompt, 128).metrics
        from_lookup += m.accepted_from["lookup"] + m.accepted_from["both"]
        assert m.committed - sum(m.accepted_from.values()) in (m.target_forwards - 1, m.target_forwards)
    assert from_lookup > 20  # the tiny model repeats itself: lookup branches are accepted
    if adaptive:
        assert m.plain_steps > 0  # the draft was switched off, lookup-only cycles remain


def test_cost_aware_prompt_lookup_greedy_equals_plain_and_cuts_the_chain_when_verifying_is_dear(tiny):
    """pld by default: the lookup chain is verified only as deep as pays (no draft, no features)."""
    from jakiro.decoding.proposers import PromptLookupProposer
    root, target, tok, prompts, reference = tiny
    depth_tried = {}
    for name, curve in (("cheap", {1: 1.0, 2: 1.02, 4: 1.06, 8: 1.14}), ("dear", {1: 1.0, 2: 1.9, 4: 3.7, 8: 7.3})):
        proposer = AdaptiveProposer(None, target, CostTable(curve, {}), lookup=PromptLookupProposer(num_tokens=5))
        assert proposer.name == "pld" and not proposer.needs_features and proposer.max_tree_tokens == 6
        engine = Engine(target, tok, proposer)
        assert_same(engine, prompts[:10], reference[:10])
        m = Metrics.total(engine.generate(p, 128).metrics for p in prompts[:10])
        depth_tried[name] = m.depth_tried + [0] * 6
        assert m.accepted_from["draft"] == 0
    assert depth_tried["cheap"][1] > 0  # chains verified when a forward over them costs little
    assert depth_tried["dear"][0] < depth_tried["cheap"][0] / 2  # and cut when each token costs almost a step


def test_cost_aware_drafting_needs_a_draft_or_lookup(tiny):
    root, target, tok, prompts, reference = tiny
    with pytest.raises(ValueError, match="needs a draft or prompt lookup"):
        AdaptiveProposer(None, target, CostTable({1: 1.0}, {}))


def test_lookup_chances_are_kept_apart_by_the_match_that_found_the_chain(tiny):
    """A chain found by one matching token and one found by three are judged by their own record:
    after unigram chains kept missing and trigram chains kept matching, a trigram chain is
    verified and a unigram chain is not."""
    from jakiro.decoding.proposers import PromptLookupProposer
    root, target, tok, prompts, reference = tiny
    lookup = PromptLookupProposer(num_tokens=4)
    assert lookup.match([1, 2, 3, 4, 5, 6, 1, 2, 3]) == ([4, 5, 6, 1], 3)
    assert lookup.match([7, 8, 9, 10, 11, 9]) == ([10, 11, 9], 1)
    assert lookup.match([7, 8]) == ([], 0)
    proposer = AdaptiveProposer(None, target, CostTable({1: 1.0, 2: 1.2, 4: 1.6, 8: 2.4}, {}), lookup=lookup)
    proposer.start(64)
    assert proposer.lookup_reach(1, 3) > proposer.lookup_reach(1, 1)  # the prior already says so
    for n, hit in ((1, False), (3, True)):
        for _ in range(30):  # verify the whole chain: all of it matches, or its first token misses
            proposer.chain, proposer.chain_ngram = [4, 5, 6, 1], n
            tree = chain_tree(3, [4, 5, 6, 1])
            verdict = Verdict(torch.arange(5), 0) if hit else Verdict(torch.tensor([0]), 9)
            proposer.feedback(tree, verdict)
    assert float(proposer.lookup_reach(1, 1)[-1]) < 0.1 and float(proposer.lookup_reach(4, 3)[-1]) > 0.8
    assert proposer.propose([1, 2, 3, 4, 5, 6, 1, 2, 3]).size > 1  # trigram-found chain: verified
    assert proposer.propose([7, 8, 9, 10, 11, 9]).size == 1  # unigram-found chain: a plain step


def test_noisy_timings_become_a_non_decreasing_cost_curve():
    from jakiro.decoding.costs import monotone
    assert monotone({1: 5.0, 2: 4.0, 4: 6.0, 8: 9.0}) == {1: 4.5, 2: 4.5, 4: 6.0, 8: 9.0}
    assert monotone({1: 3.0, 2: 3.5, 4: 3.2, 8: 3.1}) == pytest.approx({1: 3.0, 2: 3.2666667, 4: 3.2666667, 8: 3.2666667})
    assert monotone({3: 1.0}) == {3: 1.0} and monotone({}) == {}


def test_cost_timing_primes_and_keeps_prompt_sized_forwards_apart():
    """``forward_costs`` times each forward right after untimed ones of the same size, and runs
    forwards beyond the tree sizes (prompts) in rounds of their own, after the tree sizes."""
    from jakiro.decoding.costs import PRIMING_CALLS, forward_ms, interleaved_ms
    from jakiro.models.linear import SMALL_ROWS

    order = []
    calls = {k: (lambda k=k: order.append(k)) for k in "ab"}
    interleaved_ms(calls, repeats=2, warmup=1, before=lambda: order.append("before"), primed=2)
    assert order == ["before", "a", "a", "a", "before", "b", "b", "b"] * 3

    class Target:
        class config:
            vocab_size = 50

        def __call__(self, ids, cache, positions, mask):
            seen.append(len(ids))

    class Cache:
        length = 7

    seen = []
    sizes = (1, SMALL_ROWS + 1, 4)
    times = forward_ms(Target(), Cache(), repeats=1, sizes=sizes, warmup=0, primed=PRIMING_CALLS)
    assert list(times) == list(sizes)  # in the order asked
    per_call = PRIMING_CALLS + 1
    assert seen == [1] * per_call + [4] * per_call + [SMALL_ROWS + 1] * per_call


def test_in_a_batch_a_tree_is_priced_by_what_it_adds_to_the_batched_forward():
    costs = CostTable({1: 10.0, 2: 10.5, 4: 11.0, 8: 14.0, 16: 20.0}, {1: 1.0, 2: 2.0})
    assert costs.beside(0) is costs
    in_batch = costs.beside(4)  # four rows of other requests in the same forward
    assert in_batch.target(1) == pytest.approx(costs.target(5) - costs.target(4))
    assert in_batch.target(4) == pytest.approx(3.0)  # 8 rows cost 14, 4 rows 11
    assert in_batch.draft(2) == costs.draft(2)  # a request's own draft is not shared
    proposer = AdaptiveProposer(None, None, costs=costs, lookup=PromptLookupProposer())
    proposer.in_batch(4)
    assert proposer.costs.target(4) == pytest.approx(3.0)
    proposer.in_batch(0)
    assert proposer.costs is costs
    # past the table, forwards keep growing by its last half's slope, even where its last two sizes
    # were pooled flat: beside seven requests a tree of nine tokens costs far more than a plain step
    flat_end = CostTable({1: 34.8, 2: 38.7, 4: 49.6, 8: 83.0, 9: 83.0}, {1: 2.0})
    beside_seven = flat_end.beside(7)
    assert beside_seven.target(9) == pytest.approx(83.0 + 7 * (83.0 - 49.6) / 5 - flat_end.target(7))  # 16 rows
    assert beside_seven.target(9) > 5 * beside_seven.target(1)


def test_a_batch_prices_trees_by_forwards_measured_up_to_its_size(tiny, monkeypatch):
    """A table measured for one request's trees (prompt lookup: up to 7 tokens) does not reach a
    batch's forwards: the first ``BatchDecoder`` of more than one slot has the proposer measure
    every size up to ``SMALL_ROWS`` in the same rounds, once per engine, before the requests fork
    it. Beside other requests trees are priced by it; alone, by the table as it was; a batch of
    one measures nothing."""
    from jakiro.decoding import costs as cost_module
    from jakiro.decoding.batch import BatchDecoder
    root, target, tok, prompts, reference = tiny
    table = CostTable({1: 1.0, 2: 1.2, 4: 1.5, 7: 2.0}, {}, context=16)
    proposer = AdaptiveProposer(None, target, table, lookup=PromptLookupProposer(num_tokens=6))
    assert proposer.max_tree_tokens == 7
    engine = Engine(target, tok, proposer)
    measured = []
    real = cost_module.forward_ms
    monkeypatch.setattr(cost_module, "forward_ms", lambda *a, **k: measured.append(a[3]) or real(*a, **k))
    BatchDecoder(engine.decoder, 1)
    assert not measured
    batch = BatchDecoder(engine.decoder, 8)
    assert measured and all(m == [1, 2, 4, 8, 16, 32] for m in measured)
    priced = proposer._batch_costs
    assert sorted(priced.target_ms) == [1, 2, 4, 8, 16, 32] and priced.draft_ms == table.draft_ms
    assert list(priced.target_ms.values()) == sorted(priced.target_ms.values())
    BatchDecoder(engine.decoder, 16)  # measured already, for any batch: nothing more
    assert len(measured) == cost_module.BATCH_ROUNDS
    proposer.in_batch(7)
    assert proposer.costs.target(3) == pytest.approx(priced.target(10) - priced.target(7))
    proposer.in_batch(0)
    assert proposer.costs is table
    seq = batch.add(prompts[0], 4)
    assert seq.proposer is not proposer and seq.proposer._batch_costs is priced  # the forks share it
