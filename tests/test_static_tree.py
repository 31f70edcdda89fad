"""Static (EAGLE-1) trees: malformed trees are refused with one clear line, ranks are filled
from the draft's candidates as the dynamic tree fills them, and greedy output stays identical to
plain decoding for every shape (single path, unbalanced, ranks beyond the draft's vocabulary)."""

import json

import pytest
import torch

from jakiro.decoding.engine import Engine
from jakiro.decoding.proposers import TreeBudget
from jakiro.decoding.draft_proposer import DraftProposer
from jakiro.decoding.static_tree import PRESETS, StaticTree, parse_tree, validate_paths
from jakiro.errors import JakiroError
from test_speculative_greedy import assert_same, random_draft


@pytest.mark.parametrize("paths, words", [
    ({"a": 1}, "non-empty list of paths"),
    ([], "non-empty list of paths"),
    ([[0], 3], "path 1 must be a non-empty list"),
    ([[0], []], "path 1 must be a non-empty list"),
    ([[0], [0, -1]], "negative rank"),
    ([[0], [0, "1"]], "integer ranks"),
    ([[0], [1, 0]], "has no parent path [1]"),
    ([[0], [0, 0], [0]], "listed twice"),
    ([[0] * i for i in range(1, 19)], "deeper than the 16 levels"),
])
def test_malformed_trees_are_refused(paths, words, tmp_path):
    path = tmp_path / "tree.json"
    path.write_text(json.dumps(paths))
    with pytest.raises(JakiroError) as err:
        parse_tree(f"static:{path}")
    assert words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("spec, words", [
    ("eagle1", "static:NAME or static:PATH"),
    ("static:nowhere.json", "neither a preset"),
])
def test_bad_tree_specs(spec, words):
    with pytest.raises(JakiroError, match=words):
        parse_tree(spec)


def test_presets_are_valid_and_eagle1_is_the_published_tree():
    for name in PRESETS:
        tree = parse_tree(f"static:{name}")
        assert isinstance(tree, StaticTree) and len(tree.paths) == len(PRESETS[name])
    eagle1 = parse_tree("static:eagle1")
    assert len(eagle1.paths) == 25 and eagle1.depth == 5 and eagle1.max_rank == 3


def test_first_level_ranks_are_the_dynamic_tree_candidates(tiny):
    root, target, tok, prompts, reference = tiny
    draft = random_draft(root, target, "jakiro", {}, "static-first-level")
    static = StaticTree("t", validate_paths([[0], [1], [2]], "t"))
    dynamic = DraftProposer(draft, TreeBudget(1, 3, 3))
    fixed = DraftProposer(draft, TreeBudget(), static=static)
    a, b = draft_tree(dynamic, target, prompts[0]), draft_tree(fixed, target, prompts[0])
    assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()


def draft_tree(proposer, target, prompt):
    """The tree a proposer drafts right after the prompt."""
    proposer.start(len(prompt) + 64)
    with torch.inference_mode():
        _, feats = target(torch.tensor(prompt), target.new_cache(len(prompt)))
    proposer.observe(feats, torch.tensor(prompt[1:] + [5]))
    return proposer.propose(prompt + [5])


TREES = {
    "single path": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]],
    "unbalanced": [[0], [1], [0, 0], [0, 1], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0], [1, 0]],
    "last level under best children": [[0], [1], [0, 0], [1, 0], [0, 0, 0], [0, 0, 1], [1, 0, 0]],
    "ranks beyond the draft vocabulary": [[0], [60], [0, 0], [0, 50], [0, 0, 0]],
    "eagle1": PRESETS["eagle1"],
}


@pytest.mark.parametrize("method, overrides, parallel", [
    ("eagle2", {"draft_vocab_size": 48}, None),
    ("jakiro", {"draft_vocab_size": 48}, True),
    ("jakiro", {"num_experts": 4, "experts_per_token": 3, "draft_vocab_size": 48}, False),
])
@pytest.mark.slow
def test_static_trees_greedy_equal_plain(tiny, method, overrides, parallel):
    root, target, tok, prompts, reference = tiny
    draft = random_draft(root, target, method, overrides, f"static-{method}-{parallel}")
    for name, paths in TREES.items():
        static = StaticTree(name, validate_paths(paths, name))
        for prompt_vocab in (True, False):
            proposer = DraftProposer(draft, TreeBudget(), parallel_decoding=parallel, static=static,
                                     prompt_vocab=prompt_vocab)
            assert_same(Engine(target, tok, proposer), prompts[:4], reference[:4])
            tree = draft_tree(proposer, target, prompts[1])
            # the draft vocabulary has 48 tokens; with the prompt's tokens it lacks, more
            assert (proposer.head.size > 48) == prompt_vocab
            suppliable = [p for p in paths if max(p) < proposer.head.size]
            assert tree.size == 1 + len(suppliable), name
            assert int(tree.depths.max()) == max(len(p) for p in suppliable), name
