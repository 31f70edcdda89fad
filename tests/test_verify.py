"""Greedy verification, table style: which path is accepted and which bonus token follows."""

import pytest
import torch

from jakiro.decoding.tree import build_tree, chain_tree
from jakiro.decoding.verify import Verdict, verify_greedy, verify_sampling
from jakiro.decoding.sampling import SamplingParams

V = 10


def logits_with_argmax(argmaxes):
    logits = torch.zeros(len(argmaxes), V)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits


@pytest.mark.parametrize("name, drafted, target_argmax, accepted, bonus", [
    ("perfect match", [3, 4, 5], [3, 4, 5, 6], [0, 1, 2, 3], 6),
    ("early mismatch", [3, 4, 5], [7, 4, 5, 6], [0], 7),
    ("late mismatch", [3, 4, 5], [3, 4, 9, 6], [0, 1, 2], 9),
    ("nothing drafted", [], [8], [0], 8),
])
def test_greedy_chain(name, drafted, target_argmax, accepted, bonus):
    verdict = verify_greedy(chain_tree(1, drafted), logits_with_argmax(target_argmax))
    assert verdict.accepted.tolist() == accepted, name
    assert verdict.bonus == bonus, name


def test_greedy_tree_takes_the_longest_accepted_branch():
    # root 1 -> {2 -> 4, 3 -> 5 -> 6}; target: after 1 comes 3, after 3 comes 5, after 5 comes 7
    tree = build_tree(torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([-1, 0, 0, 1, 2, 4]))
    verdict = verify_greedy(tree, logits_with_argmax([3, 4, 5, 0, 7, 0]))
    assert verdict.accepted.tolist() == [0, 2, 4]
    assert verdict.bonus == 7
    assert verdict.accept_length == 2


def test_sampling_with_certain_target_accepts_what_it_would_sample():
    tree = build_tree(torch.tensor([1, 2, 3, 4]), torch.tensor([-1, 0, 0, 2]))
    logits = torch.full((4, V), -1e9)
    logits[0, 3] = logits[2, 4] = logits[3, 9] = 0.0  # deterministic target: 1 -> 3 -> 4 -> 9
    logits[1, 0] = 0.0
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        verdict = verify_sampling(tree, logits, SamplingParams(temperature=1.0), g)
        assert verdict.accepted.tolist() == [0, 2, 3] and verdict.bonus == 9


def test_sampling_rejection_uses_residual_distribution():
    # target at root: p(2) = 0.5, p(5) = 0.5; the only draft child is 2
    tree = chain_tree(1, [2])
    logits = torch.full((2, V), -1e9)
    logits[0, 2] = logits[0, 5] = 0.0
    logits[1, 7] = 0.0
    g = torch.Generator().manual_seed(0)
    outcomes = [verify_sampling(tree, logits, SamplingParams(temperature=1.0), g) for _ in range(2000)]
    rejected = [v for v in outcomes if v.accept_length == 0]
    assert all(v.bonus == 5 for v in rejected)  # 2 was rejected, so the residual is all on 5
    assert all(v.bonus == 7 for v in outcomes if v.accept_length == 1)
    assert 900 < len(rejected) < 1100


def test_bench_cost_times_greedy_and_sampled_verification():
    from jakiro.bench.cost_curve import verification_costs
    out = verification_costs(vocab=64, repeats=2, sizes=(1, 4))
    assert out["vocab"] == 64
    for key in ("greedy_ms", "sampled_t1_ms"):
        assert set(out[key]) == {"1", "4"} and all(ms > 0 for ms in out[key].values())
    assert set(out["one_sample_ms"]) == {"sample_rows", "torch_multinomial"}


def sampled_tree(children, proposals):
    """Root 1 with the given children; ``proposals``: child node -> q over the V tokens."""
    tree = build_tree(torch.tensor([1, *children]), torch.tensor([-1] + [0] * len(children)))
    tree.proposals = {node: (torch.arange(V), q) for node, q in proposals.items()}
    return tree


def test_a_sampled_token_drawn_from_the_target_distribution_is_always_accepted():
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0)
    p = logits[0].softmax(-1)
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        x = int(torch.multinomial(p, 1, generator=g))
        verdict = verify_sampling(sampled_tree([x], {1: p}), logits, params, g)
        assert verdict.accepted.tolist() == [0, 1]


def residual_as_for_a_point_mass(tree, logits, params, generator):
    """A deliberately wrong verifier: a drawn child is accepted with min(1, p / q), but on
    rejection only x leaves p (as for a chosen token) instead of p becoming max(0, p - q)."""
    from jakiro.decoding.sampling import processed_probs, sample
    kids = sorted(range(1, tree.size), key=lambda c: c not in tree.proposals)
    p = processed_probs(logits[0], params)
    for child in kids:
        x = int(tree.tokens[child])
        u = float(torch.rand((), generator=generator))
        if child in tree.proposals:
            ids, q = tree.proposals[child]
            accept = u * float(q[x]) * float(p.sum()) < float(p[x])
        else:
            accept = u * float(p.sum()) < float(p[x])
        if accept:
            return Verdict(torch.tensor([0, child]), 0)
        p[x] = 0.0
    return Verdict(torch.tensor([0]), sample(p, generator))


@pytest.mark.parametrize("verifier", ["verify_sampling", "residual as for a point mass"])
def test_drawn_and_chosen_siblings_commit_the_target_distribution(verifier):
    """A child drawn from a draft distribution q far from p and a chosen (lookup) child, merged
    into one node when they coincide: the committed token follows p exactly, whichever comes
    first in the tree. A verifier whose residual after rejecting a drawn token ignores q commits
    another distribution, and the check tells it apart."""
    from test_sampling_lossless import chi_square_z
    verify = verify_sampling if verifier == "verify_sampling" else residual_as_for_a_point_mass
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2)) * 1.5
    params = SamplingParams(temperature=1.0)
    p = logits[0].softmax(-1)
    q = torch.flip(p, [0]) * 0.5 + 0.05  # the draft's distribution: mass where p has little
    q = q / q.sum()
    draws, g = torch.Generator().manual_seed(3), torch.Generator().manual_seed(4)
    counts: dict = {}
    n = 6000
    for i in range(n):
        x = int(torch.multinomial(q, 1, generator=draws))
        if x == 3:
            tree = sampled_tree([3], {1: q})
        else:  # the chosen child first in half the trees, second in the others
            tree = sampled_tree([3, x], {2: q}) if i % 2 else sampled_tree([x, 3], {1: q})
        verdict = verify(tree, logits, params, g)
        first = int(tree.tokens[verdict.accepted[1]]) if verdict.accept_length else verdict.bonus
        counts[first] = counts.get(first, 0) + 1
    z = chi_square_z(counts, {i: float(p[i]) for i in range(V)}, n)
    assert (z < 4.5) if verifier == "verify_sampling" else (z > 4.5), z
