"""Plain decoding: exact greedy equality with Hugging Face, seeded sampling, stop rules."""

import pytest
import torch

from helpers import spec_bench_prompts
from jakiro.decoding.sampling import SamplingParams, processed_probs
from jakiro.errors import JakiroError

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain recursion to a ten year old.",
    "List three uses of baking soda.",
    "Translate 'good morning' into Spanish and German.",
    "def fibonacci(n):",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "What is 17 times 23?",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
] + spec_bench_prompts(2)


@pytest.mark.slow
def test_greedy_equals_hf_generate(smol):
    from jakiro.models.gguf_file import hugging_face_model
    hf = hugging_face_model(smol.target_path)
    engine = smol.engine("ar")
    for prompt in PROMPTS:
        ids = engine.encode(prompt)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)[0, len(ids):]
        ours = smol.generate(ids, max_new_tokens=64, method="ar")
        assert ours.token_ids == ref.tolist(), prompt


def test_seeded_sampling_is_reproducible(smol):
    kw = dict(max_new_tokens=24, temperature=0.9, top_p=0.95, top_k=50, method="ar")
    a = smol.generate("Tell me a story.", seed=123, **kw)
    b = smol.generate("Tell me a story.", seed=123, **kw)
    c = smol.generate("Tell me a story.", seed=7, **kw)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_stop_string_max_tokens_and_streaming(smol):
    full = smol.generate("Count from one to twenty in words, separated by commas.", max_new_tokens=40)
    assert full.finish_reason == ("length" if len(full.token_ids) == 40 else "stop")
    assert len(full.token_ids) <= 40
    words = full.text.split()
    assert len(words) > 4
    word = words[len(words) // 2]
    stopped = smol.generate("Count from one to twenty in words, separated by commas.",
                            max_new_tokens=40, stop=[word])
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.index(word)]
    assert word not in stopped.text
    pieces = list(smol.stream("Count from one to twenty in words, separated by commas.",
                              max_new_tokens=40))
    assert "".join(pieces) == full.text and len(pieces) > 3
    short = smol.generate("Why is the sky blue?", max_new_tokens=5)
    assert short.finish_reason == "length" and len(short.token_ids) == 5


def test_eos_stops_generation(smol):
    res = smol.generate("Reply with just the word: yes", max_new_tokens=60)
    assert res.finish_reason == "stop"
    assert res.token_ids[-1] in smol.engine().eos_ids


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.5), "temperature must be a finite number >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=2.5), "top_k must be a non-negative integer"),
    (dict(max_new_tokens=0), "max_new_tokens must be a positive integer"),
    (dict(max_new_tokens=9000), r"exceeds the model's context length \(8192\)"),
])
def test_bad_generation_arguments(smol, kwargs, message):
    with pytest.raises(JakiroError, match=message):
        smol.generate("hello", **kwargs)


@pytest.mark.parametrize("scale, top_p", [(4.0, 0.9), (1.0, 0.95), (0.05, 0.95), (8.0, 0.3), (0.5, 0.999)])
def test_top_p_keeps_what_sorting_the_whole_vocabulary_keeps(scale, top_p):
    """Top-p ranks only as many tokens as its cut needs (peaked rows: the first 64; flat ones:
    up to all of them) and keeps exactly the tokens a sort of the whole row keeps."""
    g = torch.Generator().manual_seed(int(scale * 100))
    logits = torch.randn(6, 49152, generator=g) * scale
    logits[0, :5] += 30  # one row all but decided
    params = SamplingParams(temperature=0.8, top_p=top_p)
    scaled = logits / 0.8
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(-1)
    drop = torch.zeros_like(sorted_probs, dtype=torch.bool).scatter(
        -1, order, sorted_probs.cumsum(-1) - sorted_probs >= top_p)
    expected = scaled.masked_fill(drop, float("-inf")).softmax(-1)
    got = processed_probs(logits, params)
    assert torch.equal(got > 0, expected > 0)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-9)


def test_processors_temperature_top_k_top_p():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))
    p = processed_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    torch.testing.assert_close(p, torch.tensor([0.5, 0.25, 0, 0]) / 0.75)
    p = processed_probs(logits, SamplingParams(temperature=1.0, top_k=3))
    torch.testing.assert_close(p, torch.tensor([0.5, 0.25, 0.15, 0]) / 0.9)
    p = processed_probs(logits, SamplingParams(temperature=0.5))
    q = torch.tensor([0.5, 0.25, 0.15, 0.1]) ** 2
    torch.testing.assert_close(p, q / q.sum())


def test_the_id_core_decodes_ids_and_its_stop_rule_cuts_them(smol):
    """The decode core takes and yields token ids (no tokenizer): the same answer as the text
    engine's, its cycles' ids concatenated are the answer, and a stop rule on ids ends it where
    the rule says."""
    engine = smol.engine("ar")
    ids = engine.encode("List three uses of baking soda.")
    decoder = engine.decoder
    assert not hasattr(decoder, "tokenizer")
    whole = engine.generate(ids, max_new_tokens=24)
    run, pieces = decoder.run(ids, 24), []
    while True:
        try:
            pieces.append(next(run))
        except StopIteration as done:
            answer = done.value
            break
    assert sum(pieces, []) == answer.token_ids == whole.token_ids
    assert answer.finish_reason == whole.finish_reason
    cut = decoder.decode(ids, 24, stop=lambda generated: 5 if len(generated) >= 7 else None)
    assert cut.token_ids == whole.token_ids[:5] and cut.finish_reason == "stop"
    assert cut.metrics.new_tokens == 5
