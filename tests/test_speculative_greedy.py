"""Greedy losslessness: every proposer and tree shape reproduces plain greedy decoding token for
token (20 Spec-Bench prompts x 128 tokens on a tiny target, and SmolLM2 with real drafts)."""

import pytest
import torch

from helpers import TargetTreeProposer, needs_int8_activations, spec_bench_prompts
from jakiro.decoding.engine import Engine
from jakiro.decoding.proposers import PromptLookupProposer, TreeBudget
from jakiro.decoding.draft_proposer import DraftProposer
from jakiro.draft import DraftConfig, DraftModel, load_draft, save_draft
from jakiro.settings import Runtime

N_PROMPTS, N_TOKENS = 20, 128

# (method, draft overrides, budget, candidate mode, parallel decoding)
DRAFT_CASES = [
    ("eagle2", {}, TreeBudget(1, 1, 1), None, None),
    ("eagle2", {}, TreeBudget(6, 1, 6), None, None),
    ("eagle2", {"draft_vocab_size": 64}, TreeBudget(5, 4, 24), None, None),
    ("jakiro", {}, TreeBudget(1, 1, 1), "decoupled", None),
    ("jakiro", {}, TreeBudget(5, 4, 24), "decoupled", True),
    ("jakiro", {}, TreeBudget(5, 4, 24), "decoupled", False),
    ("jakiro", {}, TreeBudget(4, 4, 8), "blended", True),
    ("jakiro", {}, TreeBudget(2, 4, 60), "blended", False),
    ("jakiro", {"num_experts": 4, "experts_per_token": 3, "draft_vocab_size": 48}, TreeBudget(5, 6, 32),
     "decoupled", True),
    ("jakiro", {"num_experts": 4, "experts_per_token": 2, "draft_vocab_size": 48}, TreeBudget(3, 1, 3),
     "decoupled", True),
]


def random_draft(root, target, method, overrides, name):
    cfg = DraftConfig.for_target(target.config, target.hf_config, method, **overrides)
    torch.manual_seed(hash(name) % 1000)
    model = DraftModel(cfg)
    model.reset_parameters(std=0.3)
    if cfg.draft_vocab_size:
        model.set_draft_vocab(torch.randperm(target.config.vocab_size)[: cfg.draft_vocab_size])
    folder = str(root / name)
    save_draft(model, folder)
    return load_draft(folder, target)  # through the checkpoint format


def assert_same(engine, prompts, reference):
    accepted = 0
    for prompt, ref in zip(prompts, reference):
        res = engine.generate(prompt, N_TOKENS)
        assert res.token_ids == ref, f"{engine.method}: diverged from plain greedy decoding"
        assert res.metrics.committed == len(res.token_ids) - 1  # every kept token after the prefill's
        accepted += res.metrics.committed - res.metrics.target_forwards
    return accepted


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(DRAFT_CASES)))
def test_draft_greedy_equals_plain(tiny, case):
    root, target, tok, prompts, reference = tiny
    method, overrides, budget, mode, parallel = DRAFT_CASES[case]
    draft = random_draft(root, target, method, overrides, f"draft{case}")
    proposer = DraftProposer(draft, budget, mode, parallel)
    assert_same(Engine(target, tok, proposer), prompts, reference)


def test_prompt_lookup_greedy_equals_plain(tiny):
    root, target, tok, prompts, reference = tiny
    accepted = assert_same(Engine(target, tok, PromptLookupProposer(num_tokens=5)), prompts, reference)
    assert accepted > 100  # the tiny model repeats itself: lookup must be accepted often


@pytest.mark.parametrize("depth, width, corrupt", [(3, 2, 0), (4, 1, 3), (2, 3, 2)])
def test_oracle_trees_greedy_equals_plain(tiny, depth, width, corrupt):
    root, target, tok, prompts, reference = tiny
    proposer = TargetTreeProposer(target, depth, width, corrupt)
    accepted = assert_same(Engine(target, tok, proposer), prompts[:8], reference[:8])
    assert accepted > 0


@pytest.mark.slow
def test_smollm2_speculative_greedy_equals_plain(smol):
    """The real model: prompt lookup and both shipped drafts (real acceptance) on 10 prompts."""
    from jakiro.api import shipped_draft
    prompts = spec_bench_prompts(10)
    ref_engine = smol.engine("ar")
    ids = [ref_engine.encode(p) for p in prompts]
    reference = [ref_engine.generate(i, N_TOKENS).token_ids for i in ids]
    engines = [smol.engine("pld")]
    for method in ("jakiro", "eagle2"):
        assert shipped_draft(method), f"the {method} draft for SmolLM2 is missing from the package"
        engines.append(smol.add_method(method))
    for engine in engines:
        for prompt, ref in zip(ids, reference):
            assert engine.generate(prompt, N_TOKENS).token_ids == ref, engine.method


@pytest.mark.slow
@needs_int8_activations
def test_smollm2_int8_activations_greedy_equals_plain(smol):
    """With int8 activations the target is another computation, shared by every method: prompt
    lookup, both shipped drafts and a hybrid (cost-aware, so plain steps and drafted cycles mix
    within a request) still give plain decoding's tokens exactly."""
    import jakiro
    from jakiro.api import shipped_draft
    jk = jakiro.load(runtime=Runtime.from_env(int8_activations=True))
    assert jk.target.input_bytes == 1 and jk.target.tile_matrices == 4 * jk.target.config.num_layers + 1
    prompts = spec_bench_prompts(4)
    ref_engine = jk.engine("ar")
    ids = [ref_engine.encode(p) for p in prompts]
    reference = [ref_engine.generate(i, N_TOKENS).token_ids for i in ids]
    assert reference != [smol.engine("ar").generate(i, N_TOKENS).token_ids for i in ids]  # it is another computation
    for method in ("pld", "jakiro", "eagle2", "eagle2+pld"):
        engine = jk.add_method(method, draft=shipped_draft(method.split("+")[0]) if method != "pld" else None)
        for prompt, ref in zip(ids, reference):
            assert engine.generate(prompt, N_TOKENS).token_ids == ref, method


def test_draft_reads_only_the_prompts_last_window(tiny, monkeypatch):
    """A prompt longer than ``PROMPT_WINDOW`` is read from its last positions only: the draft
    proposes exactly what it proposes when given just those positions (positions count from its
    cache, so the rows read keep their relative positions), its cost estimate counts only them,
    and greedy decoding still equals plain decoding."""
    from jakiro.decoding import draft_proposer
    root, target, tok, prompts, reference = tiny
    monkeypatch.setattr(draft_proposer, "PROMPT_WINDOW", 6)
    draft = random_draft(root, target, "eagle2", {}, "window-draft")
    gen = torch.Generator().manual_seed(3)
    feats = torch.randn(20, draft.feature_width, generator=gen)
    toks = torch.randint(0, target.config.vocab_size, (20,), generator=gen)
    context = toks.tolist()
    windowed, alone = DraftProposer(draft, TreeBudget(3, 2, 6)), DraftProposer(draft, TreeBudget(3, 2, 6))
    windowed.start(64, prompt_vocab=False)
    alone.start(64, prompt_vocab=False)
    windowed.observe(feats, toks)
    alone.observe(feats[-6:], toks[-6:])
    assert windowed.pending_rows == 6
    a, b = windowed.propose(context), alone.propose(context)
    assert windowed.cache.length == 6
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents) and torch.equal(a.scores, b.scores)
    # the tiny target's tokens are characters: every Spec-Bench prompt is far longer than 6
    assert_same(Engine(target, tok, DraftProposer(draft, TreeBudget(4, 2, 8))), prompts[:5], reference[:5])
