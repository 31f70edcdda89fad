"""Tree construction on hand-built cases, and the shape of the trees the draft proposer builds."""

import pytest
import torch

from helpers import make_tiny_target
from jakiro.decoding.proposers import PromptLookupProposer, TreeBudget
from jakiro.decoding.draft_proposer import DraftProposer
from jakiro.decoding.tree import build_tree, chain_tree, select_nodes
from jakiro.draft import DraftConfig, DraftModel
from jakiro.models.target import TargetModel


def test_build_tree_mask_positions_and_paths():
    #        0
    #      / | \
    #     1  2  3
    #    / \     \
    #   4   5     6
    #   |
    #   7
    tree = build_tree(torch.tensor([10, 11, 12, 13, 14, 15, 16, 17]),
                      torch.tensor([-1, 0, 0, 0, 1, 1, 3, 4]))
    assert tree.depths.tolist() == [0, 1, 1, 1, 2, 2, 2, 3]
    expected_ancestors = {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 3], 4: [0, 1, 4], 5: [0, 1, 5],
                          6: [0, 3, 6], 7: [0, 1, 4, 7]}
    for node, anc in expected_ancestors.items():
        assert torch.nonzero(tree.tree_mask[node]).flatten().tolist() == anc
    paths = {tuple(p[p >= 0].tolist()) for p in tree.retrieve_paths}
    assert paths == {(0, 2), (0, 1, 5), (0, 3, 6), (0, 1, 4, 7)}
    assert tree.retrieve_paths.shape == (4, 4)
    assert tree.children(1).tolist() == [4, 5]


def test_build_tree_rejects_parent_after_child():
    import pytest
    with pytest.raises(ValueError, match="parent must come before"):
        build_tree(torch.tensor([1, 2, 3]), torch.tensor([-1, 2, 0]))


def test_chain_tree_is_a_single_path():
    tree = chain_tree(5, [6, 7, 8])
    assert tree.tokens.tolist() == [5, 6, 7, 8]
    assert tree.depths.tolist() == [0, 1, 2, 3]
    assert tree.retrieve_paths.tolist() == [[0, 1, 2, 3]]
    assert bool(tree.tree_mask.equal(torch.ones(4, 4, dtype=torch.bool).tril()))
    root_only = chain_tree(5, [])
    assert root_only.retrieve_paths.tolist() == [[0]]
    # the same as building it node by node, for lists and tensors, again and again (structure is reused)
    for drafted in ([6, 7, 8], torch.tensor([6, 7, 8]), [9, 10, 11]):
        built = build_tree(torch.tensor([5, *list(map(int, drafted))]), torch.tensor([-1, 0, 1, 2]))
        again = chain_tree(5, drafted)
        for field in ("tokens", "parents", "depths", "tree_mask", "retrieve_paths"):
            assert torch.equal(getattr(again, field), getattr(built, field)), field


def test_select_nodes_keeps_best_and_is_ancestor_closed():
    # candidates: 0,1 children of root; 2,3 children of 0; 4 child of 2; 5 child of 1
    scores = torch.tensor([-0.1, -1.0, -0.3, -2.0, -0.5, -1.0])
    parents = torch.tensor([-1, -1, 0, 0, 2, 1])
    kept, tree_parents = select_nodes(scores, parents, total_tokens=4)
    assert kept.tolist() == [0, 1, 2, 4]  # the tie between 1 and 5 goes to the parent
    assert tree_parents.tolist() == [0, 0, 1, 3]  # positions in the tree, root = 0


def test_prompt_lookup_proposes_continuation_of_last_match():
    pld = PromptLookupProposer(num_tokens=3, max_ngram=2)
    tree = pld.propose([1, 2, 3, 4, 5, 9, 2, 3])
    assert tree.tokens.tolist() == [3, 4, 5, 9]
    assert pld.propose([1, 2, 3]).tokens.tolist() == [3]


def _tiny_jakiro(tmp_path, method="jakiro", **overrides):
    target = TargetModel.from_folder(make_tiny_target(str(tmp_path), "llama"))
    cfg = DraftConfig.for_target(target.config, target.hf_config, method, **overrides)
    torch.manual_seed(0)
    draft = DraftModel(cfg).eval()
    draft.reset_parameters(std=0.3)
    draft.attach_target(target.embed, target.lm_head.weight)
    return target, draft


def _start(proposer, target, prompt):
    cache = target.new_cache(64)
    _, feats = target(prompt, cache)
    proposer.start(64)
    proposer.observe(feats, torch.cat((prompt[1:], torch.tensor([42]))))
    return prompt.tolist() + [42]


def test_contrastive_children_hang_under_best_child_of_their_producer(tmp_path):
    target, draft = _tiny_jakiro(tmp_path, num_experts=3, experts_per_token=2)
    prompt = torch.arange(2, 22)
    proposer = DraftProposer(draft, TreeBudget(depth=2, top_k=3, total_tokens=100))
    tree = proposer.propose(_start(proposer, target, prompt))
    # the same forward by hand: pairs (f_t, x_{t+1}) for the prompt, the root's row is the last
    cache = target.new_cache(64)
    _, feats = target(prompt, cache)
    with torch.inference_mode():
        out = draft(feats[None], torch.cat((prompt[1:], torch.tensor([42])))[None],
                    torch.arange(len(prompt)), draft.new_cache(64))
        tokens, logp, _ = proposer._children(out, torch.tensor([len(prompt) - 1]), 3)
        con = torch.topk(draft.head_logits(out.contrastive[0, -1]).log_softmax(-1), 3).indices
    depth1 = torch.nonzero(tree.depths == 1).flatten()
    depth2 = torch.nonzero(tree.depths == 2).flatten()
    assert sorted(tree.tokens[depth1].tolist()) == sorted(tokens[0].tolist())
    best_token = int(tokens[0, logp[0].argmax()])
    assert sorted(tree.tokens[depth2].tolist()) == sorted(con.tolist())
    for node in depth2.tolist():
        parent = int(tree.parents[node])
        assert int(tree.depths[parent]) == 1 and int(tree.tokens[parent]) == best_token


def test_decoupled_children_come_from_distinct_experts_without_duplicates(tmp_path):
    target, draft = _tiny_jakiro(tmp_path, num_experts=4, experts_per_token=3, parallel_decoding=False)
    proposer = DraftProposer(draft, TreeBudget(depth=3, top_k=5, total_tokens=200), "decoupled")
    tree = proposer.propose(_start(proposer, target, torch.arange(2, 22)))
    assert tree.size == 1 + 5 + 25 + 25  # every candidate kept with a large budget
    for node in range(tree.size):
        kids = tree.children(node)
        assert len(set(tree.tokens[kids].tolist())) == len(kids)
    assert int(tree.depths.max()) == 3


def test_parallel_decoding_saves_one_draft_forward(tmp_path):
    target, draft = _tiny_jakiro(tmp_path)
    counts = {}
    for parallel in (True, False):
        proposer = DraftProposer(draft, TreeBudget(depth=4, top_k=2, total_tokens=30),
                                 parallel_decoding=parallel)
        tree = proposer.propose(_start(proposer, target, torch.arange(2, 22)))
        counts[parallel] = proposer.draft_forwards
        assert int(tree.depths.max()) == 4
    assert counts == {True: 3, False: 4}


@pytest.mark.parametrize("overrides,parallel", [({"num_experts": 3, "experts_per_token": 2}, True),
                                                ({"num_experts": 3, "experts_per_token": 2}, False),
                                                ({"method": "eagle2"}, False)])
@pytest.mark.parametrize("total_tokens", [2, 3, 8])
def test_top1_chain_path_equals_the_dynamic_tree(tmp_path, overrides, parallel, total_tokens):
    """top_k = 1 drafts its chain without tree bookkeeping: the same tokens, scores and sources
    as the general dynamic tree, and the draft's cache left as it was."""
    target, draft = _tiny_jakiro(tmp_path, **overrides)
    prompt = torch.arange(2, 22)
    trees, lengths = [], []
    for chain in (True, False):
        proposer = DraftProposer(draft, TreeBudget(depth=4, top_k=1, total_tokens=total_tokens),
                                 parallel_decoding=parallel)
        context = _start(proposer, target, prompt)
        if chain:
            tree = proposer.propose(context)
        else:
            with torch.inference_mode():
                tree = proposer._propose_dynamic(context, proposer._catch_up(), proposer.cache.length, 4)
        trees.append(tree)
        lengths.append(proposer.cache.length)
    fast, general = trees
    assert fast.size == min(total_tokens, 4) + 1
    assert fast.tokens.tolist() == general.tokens.tolist()
    assert fast.parents.tolist() == general.parents.tolist()
    assert torch.allclose(fast.scores, general.scores, atol=1e-5)
    assert fast.sources.tolist() == general.sources.tolist()
    assert fast.tree_mask.tolist() == general.tree_mask.tolist()
    assert lengths[0] == lengths[1] == len(prompt)


@pytest.mark.parametrize("limit", [None, 48])
def test_fused_mlp_head_topk_equals_heads_then_topk(tmp_path, limit):
    from jakiro.models import smallgemm
    if not smallgemm.available():
        pytest.skip("the small-batch kernels are not built here")
    _, draft = _tiny_jakiro(tmp_path, method="eagle2", draft_vocab_size=64)
    draft.set_draft_vocab(torch.randperm(256, generator=torch.Generator().manual_seed(3))[:64])
    r = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        fused = draft.mlp_head_topk(r, 5, limit)
        assert fused is not None  # the path under test ran
        feats, ids, logp = fused
        out = draft.heads(r)
        top = torch.topk(draft.head_logits(out.blend, limit).log_softmax(-1), 5, dim=-1)
    torch.testing.assert_close(feats, out.blend, atol=1e-5, rtol=1e-5)
    assert ids.tolist() == draft.to_target_ids(top.indices).tolist()
    torch.testing.assert_close(logp, top.values, atol=1e-5, rtol=1e-5)
    with torch.inference_mode():
        assert draft.mlp_head_topk(r, 1000, limit)[1].shape == (3, limit or 64)  # k beyond the head: all of it


def test_draft_head_top_k_over_a_long_head_with_ties():
    """The fused step's top-k skips blocks of logits that cannot enter it: over a head of
    thousands of rows, with many exact ties, it picks what a stable descending sort of the same
    logits puts first (ties: the lower row), with their log-softmax."""
    from jakiro.models import smallgemm
    from jakiro.models.linear import FastLinear
    if not smallgemm.available():
        pytest.skip("the small-batch kernels are not built here")
    gen = torch.Generator().manual_seed(5)
    d, inter, V, k = 64, 96, 3000, 6
    base = torch.randn(40, d, generator=gen)
    head = FastLinear(base[torch.randint(0, 40, (V,), generator=gen)])  # each logit repeated ~75 times
    zero = lambda rows, cols: FastLinear(torch.zeros(rows, cols)).kernel_weight  # noqa: E731 - MLP adds nothing
    r = torch.randn(9, d, generator=gen)
    with torch.inference_mode():
        feats, ids, logp = smallgemm.draft_mlp_head(r, torch.ones(d), zero(2 * inter, d), zero(d, inter), inter,
                                                    head.kernel_weight, V, k, 1e-6)
        logits = head(r)
    torch.testing.assert_close(feats, r)
    order = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :k]
    assert ids.tolist() == order.tolist()
    torch.testing.assert_close(logp, logits.log_softmax(-1).gather(1, order), atol=1e-5, rtol=1e-5)


def test_fused_first_expert_equals_the_decoupled_first_child(tmp_path):
    """A decoupled Jakiro node's only child comes from the expert the router ranks first: the
    fused call ranks the experts itself, evaluates that expert only and gives its feature, token
    and log-prob."""
    import torch.nn.functional as F
    from jakiro.models import smallgemm
    if not smallgemm.available():
        pytest.skip("the small-batch kernels are not built here")
    _, draft = _tiny_jakiro(tmp_path, num_experts=4, experts_per_token=2, parallel_decoding=False)
    proposer = DraftProposer(draft, TreeBudget(depth=2, top_k=1, total_tokens=2))
    experts = set()
    for seed in range(6):
        r = torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(seed))
        with torch.inference_mode():
            m = F.rms_norm(r[0], (64,), draft.post_norm, draft.config.rms_norm_eps)
            experts.add(int(draft.router(m).argmax()))
            feats, tok, logp = draft.experts_topk(r[0], [1])
            out = draft.heads(r)
            ref_tok, ref_logp, ref_feat = proposer._children(out, torch.zeros(1, dtype=torch.long), 1)
        assert tok.tolist() == ref_tok.tolist()
        torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(feats.reshape(1, -1), ref_feat.reshape(1, -1), atol=1e-5, rtol=1e-5)
    assert len(experts) > 1  # the router's choice matters, and was followed


def test_fused_experts_call_refuses_a_router_of_the_wrong_shape(tmp_path):
    """The fused Jakiro step ranks experts with the router it is given: one whose rows are not
    the experts, or whose width is not the draft's, is refused with a clear message."""
    from jakiro.models import smallgemm
    if not smallgemm.available():
        pytest.skip("the small-batch kernels are not built here")
    _, draft = _tiny_jakiro(tmp_path, num_experts=2, experts_per_token=2, parallel_decoding=False)
    r = torch.randn(1, 64)
    with torch.inference_mode():
        assert draft.experts_topk(r, [1, 1]) is not None  # the call itself works
        assert draft.mlp_head_topk(r, 1) is None  # EAGLE-2's one-MLP path is not for several experts
        experts = [(draft._fast_layer(f"gate_up{e}", (draft.gate_up[e],)).kernel_weight,
                    draft._fast_layer(f"down{e}", (draft.down[e],)).kernel_weight) for e in range(2)]
        head = draft._head_of(None).layer
        for router in (torch.randn(3, 64), torch.randn(2, 32)):
            with pytest.raises(RuntimeError, match="router must be"):
                smallgemm.draft_experts_topk(r, draft.post_norm.detach(), [g for g, _ in experts],
                                             [d for _, d in experts], draft.config.intermediate_size,
                                             head.kernel_weight, head.out_features, router, [1], 1e-6)


def test_chain_call_refuses_bad_shapes_with_clear_messages(tmp_path):
    """The one-call chain checks what it is given: a router whose rows are not the experts, a
    contrastive branch without a router, and no rows to catch up on are refused by name."""
    from jakiro.models import smallgemm
    if not smallgemm.available():
        pytest.skip("the small-batch kernels are not built here")
    _, draft = _tiny_jakiro(tmp_path, num_experts=2, experts_per_token=2)
    c = draft.config
    cache = draft.new_cache(16)
    layers = draft._attend_layers()
    mlps = [(draft._fast_layer(f"gate_up{e}", (draft.gate_up[e],)).kernel_weight,
             draft._fast_layer(f"down{e}", (draft.down[e],)).kernel_weight) for e in range(2)]
    head = draft._head_of(None)

    def call(features, router, con_router):
        return smallgemm.draft_chain(
            features, torch.zeros(features.shape[0], dtype=torch.long), 2, draft.embed, layers[0].kernel_weight,
            layers[0].bias, draft.input_norm.detach(), layers[1].kernel_weight, layers[2].kernel_weight, cache.data,
            0, draft.rope_cos, draft.rope_sin, c.num_attention_heads, c.num_key_value_heads, c.head_dim ** -0.5,
            draft.post_norm.detach(), [g for g, _ in mlps], [d for _, d in mlps], c.intermediate_size, router,
            con_router, head.kernel_weight, head.ids, c.rms_norm_eps, 1)

    rows, router = torch.randn(2, 64), draft.router.weight.detach()
    with torch.inference_mode():
        ids, logp, probs = call(rows, router, draft.con_router.weight.detach())
        assert ids.shape == logp.shape == (3,) and probs.numel() == 0  # two steps and the contrastive token
        with pytest.raises(RuntimeError, match="router must be"):
            call(rows, torch.randn(3, 64), None)
        with pytest.raises(RuntimeError, match="contrastive branch needs a router"):
            call(rows, None, draft.con_router.weight.detach())
        with pytest.raises(RuntimeError, match="m >= 1"):
            call(torch.randn(0, 64), router, None)


@pytest.mark.parametrize("method,top_k,overrides", [
    ("eagle2", 3, {}), ("eagle2", 1, {}),
    ("jakiro", 1, {"parallel_decoding": False}),  # a decoupled chain: the router's first expert only
    ("jakiro", 1, {}),  # a chain with the contrastive branch last
    ("jakiro", 1, {"num_experts": 4, "experts_per_token": 2}),  # its experts: the router's first two of four
    ("jakiro", 3, {}),  # decoupled children of both experts, 2 + 1
    ("jakiro", 4, {"num_experts": 4, "experts_per_token": 2}),  # each row its own two of four experts
    ("jakiro", 5, {"num_experts": 3, "experts_per_token": 3, "parallel_decoding": False}),
])
def test_trees_with_and_without_the_fused_kernel_agree(tmp_path, monkeypatch, method, top_k, overrides):
    """The fused calls (one expert, the head and its top-k; or every activated expert and its
    share of the children; or a whole chain, contrastive branch included, in one call) only
    change how a step is computed: the same trees as the per-operation path (the draft's
    ``heads``, then its head and top-k, and ``attend`` step by step)."""
    from jakiro.draft import DraftModel
    from jakiro.models import smallgemm
    if not smallgemm.available():
        pytest.skip("the small-batch kernels are not built here")
    target, draft = _tiny_jakiro(tmp_path, method=method, **overrides)
    prompt = torch.arange(2, 22)
    calls, chains = [], []
    fused_experts, fused_chain = DraftModel.experts_topk, DraftModel.chain
    monkeypatch.setattr(DraftModel, "experts_topk", lambda self, *a: calls.append(a[1]) or fused_experts(self, *a))
    monkeypatch.setattr(DraftModel, "chain", lambda self, *a: chains.append(fused_chain(self, *a)) or chains[-1])
    trees = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(DraftModel, "mlp_head_topk", lambda self, *a: None)
            monkeypatch.setattr(DraftModel, "experts_topk", lambda self, *a: None)
            monkeypatch.setattr(DraftModel, "chain", lambda self, *a: None)
        proposer = DraftProposer(draft, TreeBudget(depth=3, top_k=top_k, total_tokens=6))
        trees.append(proposer.propose(_start(proposer, target, prompt)))
    assert trees[0].tokens.tolist() == trees[1].tokens.tolist()
    assert trees[0].parents.tolist() == trees[1].parents.tolist()
    # (the chain's call takes the experts' outputs as differences of residuals: a rounding more)
    torch.testing.assert_close(trees[0].scores, trees[1].scores, atol=1e-4, rtol=1e-5)
    # the experts' call ran where it applies (decoupled children), the chain's for a chain (top-k 1)
    assert bool(calls) == (method == "jakiro" and top_k > 1)
    assert [c is not None for c in chains] == [True] * (top_k == 1)
    if method == "jakiro" and top_k == 3 and not overrides:
        assert calls[0] == [2, 1]


@pytest.mark.parametrize("method,overrides", [
    ("eagle2", {}), ("jakiro", {"parallel_decoding": False}), ("jakiro", {}),
])
def test_drawn_chains_with_and_without_the_fused_kernel_agree(tmp_path, monkeypatch, method, overrides):
    """A sampled request's chain drawn in the one kernel call (uniforms drawn up front, softmax
    of the logits over the temperature, the first row whose running sum passes a draw) is the
    chain the per-operation path draws from the same generator, with the same distributions."""
    from jakiro.decoding.sampling import SamplingParams
    from jakiro.draft import DraftModel
    from jakiro.models import smallgemm
    if not smallgemm.available():
        pytest.skip("the small-batch kernels are not built here")
    target, draft = _tiny_jakiro(tmp_path, method=method, **overrides)
    prompt = torch.arange(2, 22)
    fused_chain, chains = DraftModel.chain, []
    monkeypatch.setattr(DraftModel, "chain", lambda self, *a: chains.append(fused_chain(self, *a)) or chains[-1])
    for seed in range(4):
        trees = []
        for fused in (True, False):
            if not fused:
                monkeypatch.setattr(DraftModel, "chain", lambda self, *a: None)
            proposer = DraftProposer(draft, TreeBudget(depth=3, top_k=1, total_tokens=3))
            context = _start(proposer, target, prompt)
            proposer.set_sampling(SamplingParams(temperature=0.8), torch.Generator().manual_seed(seed))
            trees.append(proposer.propose(context))
        monkeypatch.setattr(DraftModel, "chain", lambda self, *a: chains.append(fused_chain(self, *a)) or chains[-1])
        assert trees[0].tokens.tolist() == trees[1].tokens.tolist()
        assert sorted(trees[0].proposals) == sorted(trees[1].proposals) == list(range(1, 3 if draft.config.parallel_decoding else 4))
        for node, (ids, q) in trees[0].proposals.items():
            assert torch.equal(ids, trees[1].proposals[node][0])
            torch.testing.assert_close(q, trees[1].proposals[node][1], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(trees[0].scores, trees[1].scores, atol=1e-4, rtol=1e-5)
    assert len(chains) == 4 and all(c is not None and c[2] is not None for c in chains)
