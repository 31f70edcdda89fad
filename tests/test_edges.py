"""Edges of a request: what τ counts when generation stops inside a verified cycle, token ids
that end where a stop string cuts the text, and drafting at the very end of the context."""

import torch

from helpers import CharTokenizer, TargetTreeProposer, make_tiny_target
from jakiro.decoding.engine import Engine
from jakiro.decoding.proposers import TreeBudget
from jakiro.decoding.draft_proposer import DraftProposer
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


def test_metrics_merge_is_the_aggregate_of_its_requests():
    from jakiro.decoding.engine import Metrics
    a = Metrics(new_tokens=9, target_forwards=4, committed=8, total_s=1.0, plain_steps=1,
                accepted_from={"draft": 3, "lookup": 1, "both": 0}, depth_tried=[3, 2], depth_accepted=[2, 1])
    b = Metrics(new_tokens=5, target_forwards=4, committed=4, total_s=0.5, plain_steps=4,
                depth_tried=[1, 1, 1], depth_accepted=[0, 0, 0])
    total = Metrics.total([a, b])
    assert total.tau == 12 / 8 and total.tokens_per_s == 14 / 1.5 and total.plain_steps == 5
    assert total.accept_rate_per_depth == [2 / 4, 1 / 3, 0.0]
    assert total.accepted_from == {"draft": 3, "lookup": 1, "both": 0}
    assert a.depth_tried == [3, 2] and b.new_tokens == 5  # the parts are untouched
    again = Metrics.from_dict(total.as_dict())
    assert again.as_dict() == total.as_dict()


def test_incremental_detokenisation_equals_decoding_the_whole_answer():
    """Text released piece by piece (a few tokens per cycle, through multi-byte characters and
    random tokens) is the decode of all the tokens; with a stop string, the decode cut there."""
    import random
    from jakiro.api import load_tokenizer
    from jakiro.decoding.text import TextTracker
    from jakiro.models.hub import resolve_target
    tok = load_tokenizer(resolve_target(None))
    rng = random.Random(0)
    for text in ["Héllo wörld — 你好，世界! 🙂 and\nnew lines   spaces.", "def f(x):\n    return x ** 2  # ok",
                 " ünïcödé  🎉🎉 mixed…"]:
        ids = tok(text, add_special_tokens=False).input_ids + [rng.randrange(0, 49000) for _ in range(30)]
        full = tok.decode(ids, skip_special_tokens=True)
        for stop in ([], [full[12:15]]):
            tracker, out, i, cut = TextTracker(tok, stop), "", 0, None
            while i < len(ids) and cut is None:
                i += rng.randint(1, 4)
                delta, cut = tracker.update(ids[:i])
                out += delta
            out += tracker.flush()
            assert out == tracker.text == (full[:full.index(stop[0])] if stop else full)
