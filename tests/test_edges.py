"""Edges of a request: what τ counts when generation stops inside a verified cycle, token ids
that end where a stop string cuts the text, and drafting at the very end of the context."""

import torch

from helpers import CharTokenizer, TargetTreeProposer, make_tiny_target
from jakiro.decoding.engine import Engine
from jakiro.decoding.proposers import DraftProposer, TreeBudget
from jakiro.draft import DraftConfig, DraftModel
from jakiro.models.target import TargetModel


def tiny(tmp_path, **overrides):
    target = TargetModel.from_folder(make_tiny_target(str(tmp_path / "t"), "llama", eos_token_id=None, **overrides))
    tok = CharTokenizer()
    tok.eos_token_id = None
    return target, tok


def test_tau_counts_only_tokens_kept_after_the_length_limit(tmp_path):
    target, tok = tiny(tmp_path)
    prompt = tok("Once upon a time").input_ids
    engine = Engine(target, tok, TargetTreeProposer(target, depth=4, width=1))  # an oracle: all accepted
    for n in (2, 3, 4, 7, 9):
        res = engine.generate(prompt, n)
        m = res.metrics
        assert len(res.token_ids) == n
        # the first token comes from the prefill; every later one from a verification cycle
        assert m.committed == n - 1, (n, m.committed)
        assert m.tau == (n - 1) / m.target_forwards


def test_token_ids_end_where_a_stop_string_cuts_the_text(tmp_path):
    target, tok = tiny(tmp_path)
    prompt = tok("Once upon a time").input_ids
    engine = Engine(target, tok, TargetTreeProposer(target, depth=5, width=1))
    free = engine.generate(prompt, 40).text
    stop = free[12:14]  # a stop string that appears inside a 6-token verified cycle
    res = engine.generate(prompt, 40, stop=[stop])
    assert res.finish_reason == "stop" and stop not in res.text and res.text == free[:free.index(stop)]
    assert tok.decode(res.token_ids) == res.text  # no tokens after the cut
    assert res.metrics.committed == len(res.token_ids) - 1


def test_deep_draft_tree_at_the_end_of_the_context(tmp_path):
    target, tok = tiny(tmp_path, max_position_embeddings=128)
    cfg = DraftConfig.for_target(target.config, target.hf_config, "jakiro", num_experts=2, experts_per_token=2)
    torch.manual_seed(0)
    draft = DraftModel(cfg).eval()
    draft.reset_parameters(std=0.3)
    draft.attach_target(target.embed, target.lm_head.weight)
    engine = Engine(target, tok, DraftProposer(draft, TreeBudget(depth=6, top_k=2, total_tokens=12)))
    prompt = list(range(2, 122))  # 120 tokens: generation reaches position 127, the drafts beyond it
    plain = Engine(target, tok).generate(prompt, 8).token_ids
    assert engine.generate(prompt, 8).token_ids == plain


def test_accepted_tokens_by_source_count_only_kept_tokens(tmp_path):
    from jakiro.decoding.proposers import PromptLookupProposer
    target, tok = tiny(tmp_path)
    prompt = tok("abcabcabcabcabcabcabcabc").input_ids
    engine = Engine(target, tok, PromptLookupProposer(num_tokens=6))
    for n in (3, 5, 11, 40):
        m = engine.generate(prompt, n).metrics
        assert m.committed == m.new_tokens - 1
        # every kept cycle token is an accepted lookup token or a cycle's bonus; the last cycle's
        # bonus may be cut by the length limit
        bonuses = m.committed - m.accepted_from["lookup"]
        assert bonuses in (m.target_forwards - 1, m.target_forwards), n
        assert m.accepted_from["draft"] == m.accepted_from["both"] == 0
