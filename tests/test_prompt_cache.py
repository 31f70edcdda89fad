"""The prompt cache: a request starts from what the last one left in the KV cache where its prompt
starts the same way (a conversation's next turn, a shared system prompt), and its answer is
bitwise what a whole prefill gives, greedy or seeded; the cached entries are those a whole prefill
writes; a target whose prompts do not go through the one-call kernels, or a request that failed,
leaves nothing to reuse; batch slots keep their last request's entries and a request takes the
slot that shares the most with it; the server reports cached tokens as OpenAI does."""

import json

import openai
import pytest
import torch

from serving import ServerThread

TURN = [{"role": "user", "content": "Tell me about the history of Rome in a few sentences."}]


def engines(smol, method):
    """Two engines of ``method`` on the session's target, the prompt cache on and off, with the
    same fixed tree every cycle (cost-aware drafting would let each request's timings shape the next
    one's trees, and with them a sampled request's draws)."""
    from jakiro.api import Jakiro
    return [Jakiro(smol.target, smol.tokenizer, smol.target_path, prompt_cache=on).add_method(method, adaptive=False)
            for on in (True, False)]


@pytest.mark.parametrize("method", ["ar", pytest.param("pld", marks=pytest.mark.slow), "jakiro"])
def test_a_next_turn_starts_from_the_cache_and_answers_as_a_whole_prefill(smol, method):
    cached, whole = engines(smol, method)
    first = cached.generate(TURN, 32)
    assert first.metrics.cached_tokens == 0
    second_turn = TURN + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And Carthage?"}]
    second = cached.generate(second_turn, 32)
    assert second.metrics.cached_tokens >= len(cached.encode(TURN))  # the first turn's prompt, at least
    assert second.metrics.prompt_tokens == len(cached.encode(second_turn))
    reference = whole.generate(second_turn, 32)
    assert reference.metrics.cached_tokens == 0
    assert second.token_ids == reference.token_ids and second.text == reference.text
    # the same prompt again, sampled with a seed: all but its last token from the cache, the same draws
    sampled = cached.generate(second_turn, 32, SAMPLING)
    assert sampled.metrics.cached_tokens == second.metrics.prompt_tokens - 1
    assert sampled.token_ids == whole.generate(second_turn, 32, SAMPLING).token_ids


def _sampling():
    from jakiro.decoding.sampling import SamplingParams
    return SamplingParams(0.8, seed=3)


SAMPLING = _sampling()


def test_the_kept_entries_are_those_a_whole_prefill_writes(smol):
    """After a drafted answer (prefill, then verified trees), the entries and features the cache
    keeps for the next request equal bitwise those of prefilling the same tokens at once."""
    engine = engines(smol, "jakiro")[0]
    decoder = engine.decoder
    engine.generate(TURN, 40)
    kept = decoder._retained
    n = len(kept.tokens)
    assert n > len(engine.encode(TURN)) + 20  # the answer's tokens too
    target = engine.target
    cache = target.new_cache(n)
    _, feats = target(torch.tensor(kept.tokens), cache, chunked=True, aux_layers=engine.proposer.aux_layers)
    assert torch.equal(decoder._cache.data[..., :n, :], cache.data[..., :n, :])
    assert torch.equal(kept.features, feats)


def test_a_target_whose_prompts_bypass_the_one_call_kernels_never_reuses(tiny_llama_dir):
    from jakiro.decoding.decoder import Decoder
    from jakiro.models.target import TargetModel
    target = TargetModel.from_folder(tiny_llama_dir)
    ids = list(range(3, 60))
    assert not target.fused_rows(len(ids), tree=False)
    decoder = Decoder(target, None, set(), prompt_cache=True)
    first = decoder.decode(ids, 8)
    again = decoder.decode(ids, 8)
    assert again.metrics.cached_tokens == 0 and again.token_ids == first.token_ids


def test_a_request_that_fails_leaves_nothing_behind(smol):
    engine = engines(smol, "ar")[0]
    decoder = engine.decoder
    ids = engine.encode(TURN)
    decoder.decode(ids, 8)
    assert decoder._retained is not None

    def broken(generated):
        raise RuntimeError("a stop rule that fails")

    with pytest.raises(RuntimeError):
        decoder.decode(ids, 8, stop=broken)
    assert decoder._retained is None
    assert decoder.decode(ids, 8).metrics.cached_tokens == 0
    decoder.forget()
    assert decoder._retained is None and decoder._cache is None


def test_batch_slots_keep_their_entries_and_a_request_takes_the_slot_sharing_most(smol):
    from jakiro.decoding.batch import BatchDecoder
    cached, whole = engines(smol, "jakiro")
    rome, bread = (cached.encode(text, chat=False) for text in (
        "The history of Rome begins with a small town on the Tiber, which", "To bake bread you need flour, water,"))
    batch = BatchDecoder(cached.decoder, 2, slot_tokens=256)
    first = batch.decode([(rome, 24, None, None), (bread, 24, None, None)])
    rome_more = rome + first[0].token_ids + cached.encode(" Later,", chat=False)
    seq = batch.add(rome_more, 24)
    assert seq.slot == 0 and seq.metrics.cached_tokens >= len(rome) + 20  # rome's slot, not the lowest free one
    bread_more = bread + first[1].token_ids[:10]
    other = batch.add(bread_more, 24)
    assert other.slot == 1 and other.metrics.cached_tokens == len(bread_more) - 1
    done = {}
    while batch.running:
        for event in batch.step():
            if event.done is not None:
                done[event.sequence.slot] = event.done.token_ids
    assert done[0] == whole.decoder.decode(rome_more, 24).token_ids
    assert done[1] == whole.decoder.decode(bread_more, 24).token_ids


def test_benchmarks_prefill_whole_and_refuse_the_cache_outside_concurrency(tmp_path, capsys):
    from jakiro import cli
    code = cli.main(["bench", "--questions", "mt-bench", "--methods", "ar", "--prompt-cache",
                     "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code != 0 and "--prompt-cache applies to --concurrency runs" in err and len(err.strip().splitlines()) == 1
    parser = cli.build_parser()
    assert parser.parse_args(["chat", "--no-prompt-cache"]).prompt_cache is False
    assert parser.parse_args(["serve"]).prompt_cache is True
    with pytest.raises(SystemExit):  # one request: generate has nothing to reuse
        parser.parse_args(["generate", "--prompt", "x", "--no-prompt-cache"])


def test_the_server_reports_cached_prompt_tokens(smol):
    from jakiro.serve.app import create_app
    app = create_app(smol, "ar", max_queue=2)
    with ServerThread(app) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        first = client.chat.completions.create(model=model, messages=TURN, max_tokens=16, temperature=0)
        turn = TURN + [{"role": "assistant", "content": first.choices[0].message.content},
                       {"role": "user", "content": "And Carthage?"}]
        second = client.chat.completions.create(model=model, messages=turn, max_tokens=16, temperature=0)
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached >= len(smol.engine("ar").encode(TURN))
        assert first.usage.prompt_tokens_details.cached_tokens < cached
        whole = engines(smol, "ar")[1].generate(turn, 16)
        assert second.choices[0].message.content == whole.text
        import http.client
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        line = next(x for x in text.splitlines() if x.startswith("jakiro_prompt_tokens_cached_total"))
        assert float(line.split()[-1]) >= cached
    assert json.dumps(second.usage.model_dump())  # plain JSON, as OpenAI's


def test_a_draft_model_keeps_what_it_read_of_the_last_turn(smol):
    """With the prompt cache a draft model (here the target drafting for itself, a GGUF model)
    starts a next turn from what its own cache holds of the last one: it reads far fewer tokens,
    and the answers, greedy and seeded, are those of a draft model that reads everything anew."""
    from jakiro.decoding.draft_model import DraftModelProposer
    from jakiro.decoding.engine import Engine
    read = {True: 0, False: 0}
    runs = {}
    for keep in (True, False):
        proposer = DraftModelProposer(smol.target, num_tokens=4, keep_context=keep)
        forward = proposer._forward

        def counted(tokens, keep=keep, forward=forward):
            read[keep] += len(tokens)
            return forward(tokens)

        proposer._forward = counted
        engine = Engine(smol.target, smol.tokenizer, proposer, prompt_cache=keep)
        first = engine.generate(TURN, 24)
        turn = TURN + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And Carthage?"}]
        read[keep] = 0
        runs[keep] = [engine.generate(turn, 24).token_ids, engine.generate(turn, 24, SAMPLING).token_ids]
    assert runs[True] == runs[False]
    assert read[True] < read[False] - len(smol.engine("ar").encode(TURN))


def test_two_streams_of_one_engine_interleaved_keep_their_own_caches(smol):
    """A request's cache goes back to the engine only when it ends: a second request that starts
    while the first still streams decodes in a cache of its own, and both answer as alone."""
    cached, whole = engines(smol, "ar")
    prompts = [TURN, [{"role": "user", "content": "Name three rivers of Europe."}]]
    alone = [whole.generate(p, 24).token_ids for p in prompts]
    cached.generate(TURN, 8)  # something in the cache to start from
    streams = [cached.stream(p, 24) for p in prompts]
    results = [None, None]
    while any(r is None for r in results):
        for i, stream in enumerate(streams):
            if results[i] is None:
                try:
                    next(stream)
                except StopIteration as done:
                    results[i] = done.value
    assert [r.token_ids for r in results] == alone
