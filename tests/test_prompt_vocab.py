"""A draft's head scores its vocabulary plus the tokens of the request's prompt it lacks."""

import torch

from jakiro.decoding.engine import Engine
from jakiro.decoding.proposers import TreeBudget
from jakiro.decoding.draft_proposer import DraftProposer
from jakiro.decoding.request_head import PROMPT_VOCAB_MAX

from test_speculative_greedy import assert_same, random_draft
from test_static_tree import draft_tree


def test_head_rows_are_the_vocabulary_then_the_missing_prompt_tokens(tiny):
    root, target, tok, prompts, reference = tiny
    draft = random_draft(root, target, "eagle2", {"draft_vocab_size": 48}, "pv-rows")
    vocab = draft.d2t.tolist()
    prompt = prompts[1]
    head = draft.head(None, extra=torch.tensor(prompt + vocab[:5] + [-1, 10 ** 9]))
    ids = head.ids.tolist()
    assert ids[:48] == vocab
    assert len(ids) == len(set(ids)) and len(ids) % 16 == 0  # no token twice; whole tiles
    missing = list(dict.fromkeys(t for t in prompt if t not in vocab))
    assert ids[48:48 + len(missing)] == missing  # in the order given; the rest pads to 16 rows
    assert all(0 <= t < target.config.vocab_size for t in ids)
    x = torch.randn(3, draft.config.hidden_size)
    with torch.inference_mode():
        logits = draft.head_logits(x, head)
    torch.testing.assert_close(logits, x @ target.lm_head.weight[head.ids].T, atol=1e-4, rtol=1e-4)
    assert draft.head(None, extra=torch.tensor(vocab)) is draft.head(None)  # nothing to add


def test_a_request_drafts_from_its_prompt_tokens(tiny):
    """The tree's first level is the top-k of the draft's predicted feature over the draft
    vocabulary and the prompt's tokens (computed here from the target's whole LM head), and
    each request starts from its own prompt."""
    root, target, tok, prompts, reference = tiny
    draft = random_draft(root, target, "eagle2", {"draft_vocab_size": 48}, "pv-tree")
    proposer = DraftProposer(draft, TreeBudget(1, 4, 4))
    from_prompt = 0
    for prompt in prompts[:4]:
        tree = draft_tree(proposer, target, prompt)
        with torch.inference_mode():
            _, feats = target(torch.tensor(prompt), target.new_cache(len(prompt)))
            out = draft(feats.unsqueeze(0), torch.tensor([prompt[1:] + [5]]), torch.arange(len(prompt)),
                        draft.new_cache(len(prompt) + 4))
        wanted = set(draft.d2t.tolist()) | set(prompt + [5])
        rows = set(proposer.head.ids.tolist())
        assert wanted <= rows and len(rows - wanted) < 16  # the rest pads the head to whole tiles
        allowed = torch.tensor(sorted(rows))
        scores = out.blend[0, -1] @ target.lm_head.weight[allowed].T
        expected = allowed[scores.topk(4).indices].tolist()
        assert tree.tokens[1:].tolist() == expected
        from_prompt += sum(t not in draft.d2t.tolist() for t in expected)
    assert from_prompt > 0  # the prompts' tokens are proposed


def test_greedy_output_is_plain_decoding_with_and_without_prompt_tokens(tiny):
    root, target, tok, prompts, reference = tiny
    draft = random_draft(root, target, "jakiro", {"draft_vocab_size": 48}, "pv-greedy")
    for on in (True, False):
        for budget in (TreeBudget(3, 2, 6), TreeBudget(2, 1, 2)):
            proposer = DraftProposer(draft, budget, prompt_vocab=on)
            assert_same(Engine(target, tok, proposer), prompts[:4], reference[:4])


def test_long_prompts_add_a_bounded_number_of_rows(tiny):
    root, target, tok, prompts, reference = tiny
    draft = random_draft(root, target, "eagle2", {"draft_vocab_size": 48}, "pv-long")
    proposer = DraftProposer(draft, TreeBudget(1, 1, 1))
    vocab = set(draft.d2t.tolist())
    frequent = next(t for t in range(target.config.vocab_size) if t not in vocab)
    context = torch.randperm(target.config.vocab_size)[:3 * PROMPT_VOCAB_MAX].tolist()
    context += [frequent] * 3  # the most repeated token the vocabulary lacks comes first
    head = proposer.prompt_head(context)
    assert head.size <= 48 + PROMPT_VOCAB_MAX + 15
    assert head.ids[:48].tolist() == draft.d2t.tolist() and int(head.ids[48]) == frequent


def test_the_head_takes_in_the_answer_tokens_it_lacks(tiny):
    """Each proposal's head holds the tokens committed before it: the vocabulary, the prompt's
    tokens it lacks, then the answer's in the order they came (where the previous head had its
    padding), and scores them as the whole LM head does; ``answer_vocab`` bounds the rows the
    answer adds, 0 keeps the prompt's head."""
    root, target, tok, prompts, reference = tiny
    draft = random_draft(root, target, "eagle2", {"draft_vocab_size": 48}, "pv-answer")
    vocab = draft.d2t.tolist()
    x = torch.randn(3, draft.config.hidden_size)
    for rows_max in (512, 16, 0):
        proposer = DraftProposer(draft, TreeBudget(2, 2, 4))
        proposer.answer_vocab = rows_max
        engine = Engine(target, tok, proposer)
        for prompt, ref in list(zip(prompts, reference))[:3]:
            assert engine.generate(prompt, len(ref)).token_ids == ref
            context = prompt + ref[:1]  # the first proposal's
            real = vocab + proposer.prompt_tokens(context).tolist()
            ids = proposer.head.ids.tolist()
            assert len(ids) == len(set(ids)) and len(ids) % 16 == 0
            if rows_max == 0:
                assert ids == proposer.prompt_head(context).ids.tolist() and proposer.answer_rows == 0
                continue
            answer_new = [t for t in dict.fromkeys(ref) if t not in real]
            n = proposer.answer_rows
            assert 0 < n <= rows_max
            assert ids[:len(real) + n] == real + answer_new[:n] and len(ids) - len(real) - n < 16
            if rows_max == 512:  # every token committed before the last proposal
                assert set(ref[:-5]) <= set(ids)
            with torch.inference_mode():
                logits = draft.head_logits(x, proposer.head)
            torch.testing.assert_close(logits, x @ target.lm_head.weight[proposer.head.ids].T, atol=1e-4, rtol=1e-4)
