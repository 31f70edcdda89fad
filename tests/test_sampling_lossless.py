"""Sampling losslessness: the first three sampled tokens of speculative decoding follow the exact
distribution of plain sampling (chi-square tests against exact probabilities), for T = 1 and
for T = 0.7 with top-p 0.9 and top-k 20; a verifier that forgets the logits processors after a
fully accepted path must fail the same test."""

import math

import pytest
import torch

from helpers import CharTokenizer, TargetTreeProposer, make_tiny_target
from jakiro.decoding import verify as verify_module
from jakiro.decoding.engine import Engine
from jakiro.decoding.proposers import TreeBudget
from jakiro.decoding.draft_proposer import DraftProposer
from jakiro.decoding.sampling import SamplingParams, processed_probs
from jakiro.decoding.tree import build_tree
from jakiro.decoding.verify import Verdict
from jakiro.draft import DraftConfig, DraftModel
from jakiro.models.kv_cache import KVCache
from jakiro.models.target import TargetModel

V = 32
N_SAMPLES = 3000
PARAM_SETS = {"T=1": dict(temperature=1.0), "T=0.7,p=0.9,k=20": dict(temperature=0.7, top_p=0.9, top_k=20)}


def exact_three_tokens(target, prompt, params: SamplingParams):
    """Exact P(t1), P(t1, t2), P(t1, t2, t3) of plain sampling, by one tree forward over the
    support of the processed distributions (root = last prompt token)."""
    cfg = target.config
    cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, len(prompt) + 20000)
    target(torch.tensor(prompt[:-1]), cache)
    cache.commit(len(prompt) - 1)

    def probs_at(tokens, parents):
        tree = build_tree(torch.tensor(tokens), torch.tensor(parents))
        logits, _ = target(tree.tokens, cache, cache.length + tree.depths, tree.tree_mask)
        return processed_probs(logits, params)

    p1 = probs_at([prompt[-1]], [-1])[0]
    firsts = torch.nonzero(p1).flatten().tolist()
    tokens, parents = [prompt[-1]] + firsts, [-1] + [0] * len(firsts)
    probs = probs_at(tokens, parents)
    seconds = []  # (a, b) pairs with their node index
    for i, a in enumerate(firsts, start=1):
        for b in torch.nonzero(probs[i]).flatten().tolist():
            tokens.append(b)
            parents.append(i)
            seconds.append((a, b, len(tokens) - 1))
    probs = probs_at(tokens, parents)
    first = {a: float(p1[a]) for a in firsts}
    pair, triple = {}, {}
    for i, a in enumerate(firsts, start=1):
        for a2, b, node in seconds:
            if a2 != a:
                continue
            pab = first[a] * float(probs[i][b])
            pair[(a, b)] = pab
            for c in torch.nonzero(probs[node]).flatten().tolist():
                triple[(a, b, c)] = pab * float(probs[node][c])
    return first, pair, triple


def chi_square_z(counts: dict, expected_p: dict, n: int) -> float:
    """Wilson-Hilferty z-score of Pearson's chi-square; cells with < 5 expected are pooled."""
    cells, pooled_obs, pooled_exp = [], 0.0, 0.0
    for key, p in expected_p.items():
        e, o = p * n, counts.get(key, 0)
        if e < 5:
            pooled_obs += o
            pooled_exp += e
        else:
            cells.append((o, e))
    if pooled_exp > 0:
        cells.append((pooled_obs, pooled_exp))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    k = max(1, len(cells) - 1)
    return ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))


def sample_three(engine, prompt, params_kw, n, seed0=0):
    out = []
    for i in range(n):
        res = engine.generate(prompt, 3, SamplingParams(seed=seed0 + i, **params_kw))
        out.append(tuple(res.token_ids[:3]))
    return out


def check_distribution(samples, exact):
    first, pair, triple = exact
    n = len(samples)
    impossible = [s for s in samples if s not in triple]
    assert not impossible, f"sampled sequences the target can never produce: {impossible[:3]}"
    z = {}
    for name, key_fn, ref in (("t1", lambda s: s[0], first), ("t1,t2", lambda s: s[:2], pair)):
        counts = {}
        for s in samples:
            counts[key_fn(s)] = counts.get(key_fn(s), 0) + 1
        z[name] = chi_square_z(counts, ref, n)
    for pos in (1, 2):
        marg = {}
        for key, p in triple.items():
            marg[key[pos]] = marg.get(key[pos], 0.0) + p
        counts = {}
        for s in samples:
            counts[s[pos]] = counts.get(s[pos], 0) + 1
        z[f"t{pos + 1}"] = chi_square_z(counts, marg, n)
    assert max(z.values()) < 4.5, f"distribution differs from plain sampling: z = {z}"
    return z


def test_sampler_draws_each_row_by_its_weights(monkeypatch):
    """``sample_rows`` (inverse CDF in float64) against the exact shares of unnormalised weights
    with zeros, rows independent; and a draw that rounds up to the total still lands on a token
    of weight > 0."""
    from jakiro.decoding import sampling
    weights = torch.tensor([[0.0, 2.0, 0.0, 1.0, 0.5, 0.0, 0.5], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 3.0]])
    gen = torch.Generator().manual_seed(0)
    counts: dict = {}
    for _ in range(N_SAMPLES):
        a, b = sampling.sample_rows(weights, gen).tolist()
        assert b == 6
        counts[a] = counts.get(a, 0) + 1
    assert set(counts) <= {1, 3, 4, 6}, counts
    expected = {i: float(w) / 4.0 for i, w in enumerate(weights[0]) if w > 0}
    assert chi_square_z(counts, expected, N_SAMPLES) < 4.5
    skewed = {1: 0.7, 3: 0.1, 4: 0.1, 6: 0.1}  # the check itself tells a wrong distribution apart
    assert chi_square_z(counts, skewed, N_SAMPLES) > 4.5
    monkeypatch.setattr(sampling.torch, "rand", lambda *shape, **kw: torch.ones(*shape, dtype=torch.float64))
    assert sampling.sample_rows(weights, gen).tolist() == [6, 6]
    assert sampling.sample(torch.tensor([0.0, 1.0, 1.0, 0.0]), gen) == 2


@pytest.fixture(scope="module")
def tiny_small_vocab(tmp_path_factory):
    folder = make_tiny_target(str(tmp_path_factory.mktemp("v32")), "llama", vocab_size=V, eos_token_id=None,
                              std=0.12)
    target = TargetModel.from_folder(folder)
    tok = CharTokenizer(V)
    tok.eos_token_id = None
    prompt = tok("The quick brown fox").input_ids
    return target, tok, prompt


@pytest.mark.slow
@pytest.mark.parametrize("params", list(PARAM_SETS))
def test_oracle_tree_sampling_matches_plain(tiny_small_vocab, params):
    target, tok, prompt = tiny_small_vocab
    kw = PARAM_SETS[params]
    engine = Engine(target, tok, TargetTreeProposer(target, depth=2, width=2))
    samples = sample_three(engine, prompt, kw, N_SAMPLES)
    check_distribution(samples, exact_three_tokens(target, prompt, SamplingParams(**kw)))
    plain = sample_three(Engine(target, tok), prompt, kw, N_SAMPLES, seed0=10**6)
    check_distribution(plain, exact_three_tokens(target, prompt, SamplingParams(**kw)))


@pytest.mark.slow
@pytest.mark.parametrize("params", list(PARAM_SETS))
def test_jakiro_draft_sampling_matches_plain(tiny_small_vocab, params):
    target, tok, prompt = tiny_small_vocab
    kw = PARAM_SETS[params]
    draft = random_jakiro_draft(target, seed=0)
    engine = Engine(target, tok, DraftProposer(draft, TreeBudget(depth=3, top_k=3, total_tokens=10)))
    samples = sample_three(engine, prompt, kw, N_SAMPLES)
    check_distribution(samples, exact_three_tokens(target, prompt, SamplingParams(**kw)))


@pytest.mark.slow
@pytest.mark.parametrize("params", list(PARAM_SETS))
def test_cost_aware_drafting_sampling_matches_plain(tiny_small_vocab, params):
    """Cycles that switch between drafting (pruned trees) and plain steps within a request, with
    prompt-lookup branches merged into the trees (hybrid trees)."""
    from jakiro.decoding.adaptive import AdaptiveProposer, CostTable
    from jakiro.decoding.proposers import PromptLookupProposer
    target, tok, prompt = tiny_small_vocab
    kw = PARAM_SETS[params]
    draft = random_jakiro_draft(target, seed=1)
    # drafting pays under the optimistic prior and stops paying after a cycle that accepts nothing
    costs = CostTable({1: 1.0, 2: 1.2, 3: 1.4, 4: 1.6, 8: 2.4, 16: 4.0}, {1: 0.3, 2: 0.5, 3: 0.7})
    proposer = AdaptiveProposer(DraftProposer(draft, TreeBudget(depth=3, top_k=3, total_tokens=10)), target, costs,
                                lookup=PromptLookupProposer(num_tokens=3))
    engine = Engine(target, tok, proposer)
    plain = drafted = from_lookup = 0
    samples = []
    for i in range(N_SAMPLES):
        res = engine.generate(prompt, 3, SamplingParams(seed=i, **kw))
        samples.append(tuple(res.token_ids[:3]))
        plain += res.metrics.plain_steps
        drafted += res.metrics.target_forwards - res.metrics.plain_steps
        from_lookup += res.metrics.accepted_from["lookup"] + res.metrics.accepted_from["both"]
    assert plain > 0 and drafted > 0 and from_lookup > 0
    check_distribution(samples, exact_three_tokens(target, prompt, SamplingParams(**kw)))


@pytest.mark.slow
@pytest.mark.parametrize("params", list(PARAM_SETS))
def test_draft_model_sampling_matches_plain(tiny_small_vocab, tmp_path, params):
    """A draft model's chains drawn from its own processed distribution (accepted with
    min(1, p / q)), with prompt lookup merged in: the target's distribution."""
    from jakiro.decoding.draft_model import DraftModelProposer
    from jakiro.decoding.proposers import PromptLookupProposer
    target, tok, prompt = tiny_small_vocab
    kw = PARAM_SETS[params]
    draft = TargetModel.from_folder(make_tiny_target(str(tmp_path), "llama", vocab_size=V, eos_token_id=None,
                                                     std=0.12, seed=3))
    proposer = DraftModelProposer(draft, num_tokens=3, min_prob=0.0, lookup=PromptLookupProposer(num_tokens=2))
    engine = Engine(target, tok, proposer)
    samples = sample_three(engine, prompt, kw, N_SAMPLES)
    check_distribution(samples, exact_three_tokens(target, prompt, SamplingParams(**kw)))


@pytest.mark.slow
def test_static_tree_sampling_matches_plain(tiny_small_vocab):
    from jakiro.decoding.static_tree import StaticTree, validate_paths
    target, tok, prompt = tiny_small_vocab
    kw = PARAM_SETS["T=0.7,p=0.9,k=20"]
    draft = random_jakiro_draft(target, seed=2)
    paths = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1]]  # last level from the contrastive branch
    static = StaticTree("t", validate_paths(paths, "t"))
    engine = Engine(target, tok, DraftProposer(draft, TreeBudget(), static=static))
    assert engine.proposer.parallel
    samples = sample_three(engine, prompt, kw, N_SAMPLES)
    check_distribution(samples, exact_three_tokens(target, prompt, SamplingParams(**kw)))


def random_jakiro_draft(target, seed: int):
    """A random Jakiro draft (3 experts, 2 active, 24-token head) attached to the tiny target."""
    cfg = DraftConfig.for_target(target.config, target.hf_config, "jakiro", num_experts=3,
                                 experts_per_token=2, draft_vocab_size=24)
    torch.manual_seed(seed)
    draft = DraftModel(cfg).eval()
    draft.reset_parameters(std=0.3)
    draft.attach_target(target.embed, target.lm_head.weight)
    return draft


def forgetful_verify_sampling(tree, logits, params, generator):
    """A deliberately wrong verifier: after a fully accepted path it samples the bonus token from
    the raw softmax, ignoring temperature, top-p and top-k (the reference code's bug)."""
    probs = processed_probs(logits, params)
    node, accepted = 0, [0]
    while True:
        p = probs[node]
        kids = torch.nonzero(tree.parents == node).flatten().tolist()
        if not kids:
            raw = logits[node].float().softmax(-1)
            return Verdict(torch.tensor(accepted), int(torch.multinomial(raw, 1, generator=generator)))
        for child in kids:
            x = int(tree.tokens[child])
            if float(torch.rand((), generator=generator)) * float(p.sum()) < float(p[x]):
                node = child
                accepted.append(child)
                break
            p[x] = 0.0
        else:
            return Verdict(torch.tensor(accepted), int(torch.multinomial(p, 1, generator=generator)))


@pytest.mark.slow
def test_forgetful_verifier_is_caught(tiny_small_vocab, monkeypatch):
    target, tok, prompt = tiny_small_vocab
    kw = PARAM_SETS["T=0.7,p=0.9,k=20"]
    monkeypatch.setattr(verify_module, "verify_sampling", forgetful_verify_sampling)
    engine = Engine(target, tok, TargetTreeProposer(target, depth=1, width=3))
    samples = sample_three(engine, prompt, kw, N_SAMPLES)
    with pytest.raises(AssertionError, match="can never produce|differs from plain sampling"):
        check_distribution(samples, exact_three_tokens(target, prompt, SamplingParams(**kw)))


@pytest.mark.slow
@pytest.mark.parametrize("params", list(PARAM_SETS))
@pytest.mark.parametrize("setup", ["chain", "cost-aware hybrid chain"])
def test_sampled_draft_chain_matches_plain(tiny_small_vocab, params, setup, monkeypatch):
    """Chains drawn from the draft's own distribution (``DraftProposer.set_sampling``) and
    accepted with min(1, p / q): alone, and cost-aware with prompt-lookup branches merged into
    them and plain steps between them."""
    from jakiro.decoding.adaptive import AdaptiveProposer, CostTable
    from jakiro.decoding.proposers import PromptLookupProposer
    target, tok, prompt = tiny_small_vocab
    kw = PARAM_SETS[params]
    proposer = DraftProposer(random_jakiro_draft(target, seed=4), TreeBudget(depth=3, top_k=1, total_tokens=3))
    if setup != "chain":
        costs = CostTable({1: 1.0, 2: 1.2, 3: 1.4, 4: 1.6, 8: 2.4}, {1: 0.3, 2: 0.5, 3: 0.7})
        proposer = AdaptiveProposer(proposer, target, costs, lookup=PromptLookupProposer(num_tokens=3))
    sampled = []
    real_verify = verify_module.verify_sampling

    def counting(tree, logits, params_, generator):
        sampled.append(bool(tree.proposals))
        return real_verify(tree, logits, params_, generator)
    monkeypatch.setattr(verify_module, "verify_sampling", counting)
    samples = sample_three(Engine(target, tok, proposer), prompt, kw, N_SAMPLES)
    assert sum(sampled) > N_SAMPLES // 2  # drawn chains verified (each request has two or three cycles)
    check_distribution(samples, exact_three_tokens(target, prompt, SamplingParams(**kw)))


def test_drawn_chains_repeat_with_a_seed(tiny_small_vocab, monkeypatch):
    target, tok, prompt = tiny_small_vocab
    proposer = DraftProposer(random_jakiro_draft(target, seed=5), TreeBudget(depth=3, top_k=1, total_tokens=3))
    engine = Engine(target, tok, proposer)
    trees = []
    real_verify = verify_module.verify_sampling

    def keeping(tree, logits, params_, generator):
        trees.append(tree)
        return real_verify(tree, logits, params_, generator)
    monkeypatch.setattr(verify_module, "verify_sampling", keeping)
    params = SamplingParams(temperature=1.0, seed=5)
    first = engine.generate(prompt, 12, params).token_ids
    assert engine.generate(prompt, 12, params).token_ids == first
    assert proposer.parallel  # the chain's last token comes from the contrastive branch: chosen, not drawn
    assert trees and all(t.proposals and set(t.proposals) == set(range(1, t.size - 1)) for t in trees)
    for t in trees:  # each node carries the distribution its token was drawn from
        for node, (ids, q) in t.proposals.items():
            assert float(q[ids == t.tokens[node]].sum()) > 0 and abs(float(q.sum()) - 1) < 1e-5
    trees.clear()
    engine.generate(prompt, 12, SamplingParams())  # greedy requests take the most likely tokens
    assert not trees
