"""A small model of the target's family as the draft (``--method draft-model``): greedy output is
exactly plain decoding's, with another model and with the target drafting for itself (every
token accepted), with prompt lookup merged in, and from the last tokens of a long context; a
draft model with another tokenizer or vocabulary is refused in one line. (Sampling:
test_sampling_lossless.py.)"""

from types import SimpleNamespace

import pytest

from helpers import make_tiny_target
from jakiro.decoding.draft_model import DraftModelProposer, check_same_tokenizer
from jakiro.decoding.engine import Engine
from jakiro.decoding.proposers import PromptLookupProposer
from jakiro.errors import JakiroError
from jakiro.models.target import TargetModel


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    """A different tiny model with the target's vocabulary (one layer: a cheaper draft)."""
    return TargetModel.from_folder(make_tiny_target(str(tmp_path_factory.mktemp("draft_model")), "llama",
                                                    seed=5, eos_token_id=None, num_hidden_layers=1))


@pytest.mark.parametrize("which", ["other", "itself", "itself+pld"])
def test_greedy_output_is_plain_decodings(tiny, other_model, which):
    _, target, tok, prompts, reference = tiny
    model = target if which.startswith("itself") else other_model
    lookup = PromptLookupProposer(num_tokens=4) if which.endswith("+pld") else None
    engine = Engine(target, tok, DraftModelProposer(model, num_tokens=4, min_prob=0.0, lookup=lookup))
    accepted = forwards = 0
    for prompt, ref in zip(prompts[:8], reference):
        res = engine.generate(prompt, len(ref))
        assert res.token_ids == ref
        accepted += res.metrics.committed
        forwards += res.metrics.target_forwards
    tau = accepted / forwards
    if which.startswith("itself"):  # its own greedy chain: every drafted token is accepted
        assert tau > 4.5
    else:
        assert 1.0 <= tau < 4.5


def test_an_unsure_draft_stops_early(tiny, other_model):
    """With min_prob 1 every chain stops after its first token (a probability below one)."""
    _, target, tok, prompts, reference = tiny
    proposer = DraftModelProposer(other_model, num_tokens=4, min_prob=1.0)
    engine = Engine(target, tok, proposer)
    proposer.start(600)
    assert proposer.propose(prompts[0]).size == 2
    assert engine.generate(prompts[0], 32).token_ids == reference[0][:32]


def test_a_draft_model_must_share_the_tokenizer():
    vocab = {"a": 0, "b": 1}
    same = SimpleNamespace(get_vocab=lambda: dict(vocab), eos_token_id=1)
    other = SimpleNamespace(get_vocab=lambda: {"a": 0, "c": 1}, eos_token_id=1)
    check_same_tokenizer(same, same, 2, 2, "m")
    with pytest.raises(JakiroError, match="has a vocabulary of 3 tokens, the target 2"):
        check_same_tokenizer(same, same, 2, 3, "m")
    with pytest.raises(JakiroError, match="another tokenizer than the target"):
        check_same_tokenizer(same, other, 2, 2, "m")
    with pytest.raises(JakiroError, match="ends text with another token"):
        check_same_tokenizer(same, SimpleNamespace(get_vocab=lambda: dict(vocab), eos_token_id=0), 2, 2, "m")


def test_load_refuses_a_mismatched_or_missing_draft_model(tmp_path):
    import jakiro
    from gguf_models import write_model
    target = write_model(str(tmp_path / "target.gguf"), "qwen2", layers=1)
    wider = write_model(str(tmp_path / "wider.gguf"), "qwen2", layers=1, vocab=288)
    with pytest.raises(JakiroError, match="has a vocabulary of 288 tokens, the target 272"):
        jakiro.load(target=target, method="draft-model", draft_model=wider, cache_dir=str(tmp_path))
    with pytest.raises(JakiroError, match="needs a draft model: pass --draft-model"):
        jakiro.load(target=target, method="draft-model", cache_dir=str(tmp_path))
    with pytest.raises(JakiroError, match="--tree does not apply"):
        jakiro.load(target=target, method="draft-model", draft_model=target, tree="static:eagle1")
    res = jakiro.load(target=target, method="draft-model", draft_model=target, cache_dir=str(tmp_path)).generate(
        "hello there", max_new_tokens=16)
    plain = jakiro.load(target=target, cache_dir=str(tmp_path)).generate("hello there", max_new_tokens=16)
    assert res.token_ids == plain.token_ids and res.metrics.tau > 1.0
    # a draft model with a shorter context than the request drafts from the context's last tokens
    short = write_model(str(tmp_path / "short.gguf"), "qwen2", layers=1, context=64)
    long_plain = jakiro.load(target=target, cache_dir=str(tmp_path)).generate("hello there", max_new_tokens=80)
    long_res = jakiro.load(target=target, method="draft-model", draft_model=short, cache_dir=str(tmp_path)).generate(
        "hello there", max_new_tokens=80)
    assert long_res.token_ids == long_plain.token_ids and len(long_res.token_ids) == 80
    # a target run as a float32 copy (--float32) still gets a draft model streaming its blocks
    from jakiro.settings import Runtime
    copy = jakiro.load(target=target, method="draft-model", draft_model=target, cache_dir=str(tmp_path),
                       runtime=Runtime(quantized=False))
    assert copy.engine().proposer.model.blocks_only and not copy.target.blocks_only
    assert copy.generate("hello there", max_new_tokens=16).token_ids == jakiro.load(
        target=target, cache_dir=str(tmp_path), runtime=Runtime(quantized=False)).generate(
        "hello there", max_new_tokens=16).token_ids


def test_a_long_prompt_is_read_from_its_last_tokens(tiny, other_model):
    """With a window of 8 the draft model reads only a prompt's last 8 tokens before its first
    proposal, and the answer is still plain decoding's."""
    _, target, tok, prompts, reference = tiny
    proposer = DraftModelProposer(other_model, num_tokens=4, min_prob=0.0, window=8)
    proposer.start(len(prompts[0]) + 8)
    tree = proposer.propose(prompts[0])
    assert len(prompts[0]) > 8 and proposer._cache.length == 8 + tree.size - 2  # the window, the chain but its last
    assert proposer._held[:8] == prompts[0][-8:]
    engine = Engine(target, tok, proposer)
    for prompt, ref in zip(prompts[:4], reference):
        assert engine.generate(prompt, len(ref)).token_ids == ref


def test_requests_decoded_together_get_their_answers_alone(tiny, other_model):
    """Continuous batching with a draft model: each request drafts with its own fork of the
    proposer (its own draft KV cache) and gets plain decoding's answer."""
    from jakiro.decoding.batch import BatchDecoder
    _, target, tok, prompts, reference = tiny
    proposer = DraftModelProposer(other_model, num_tokens=4, min_prob=0.0, lookup=PromptLookupProposer(num_tokens=4))
    batch = BatchDecoder(Engine(target, tok, proposer).decoder, 3, slot_tokens=400)
    answers = batch.decode([(p, len(ref), None, None) for p, ref in zip(prompts[:5], reference)])
    assert [a.token_ids for a in answers] == reference[:5]
    assert sum(a.metrics.committed for a in answers) > sum(a.metrics.target_forwards for a in answers)
