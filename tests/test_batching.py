"""Continuous batching: many requests decoded together, each with its own proposer and cache slot,
their trees verified in one target forward. Every answer is the one it gets alone (greedy exactly,
sampled with the same seed), requests join and leave between steps, and the server decodes
--parallel requests at once with the same guarantees."""

import json
import threading

import openai
import pytest
import torch

from serving import ServerThread

# short and long prompts: the long one (over 128 tokens) goes in by pieces while others decode
PROMPTS = ["Write a haiku about the sea.", "List three prime numbers and say why they are prime.",
           "What is the capital of France? Answer in one sentence.",
           "Summarise this: " + " ".join(f"Item {i} is a small red box that holds {i} marbles." for i in range(14))]


@pytest.mark.parametrize("method", ["ar", pytest.param("pld", marks=pytest.mark.slow),
                                    pytest.param("eagle2", marks=pytest.mark.slow), "jakiro"])
def test_batched_greedy_answers_equal_each_answer_alone(smol, method):
    from jakiro.decoding.batch import PREFILL_PIECE, BatchDecoder
    from jakiro.api import Jakiro
    engines = [smol.engine(method)]  # cost-aware drafting: on this machine it may draft little or nothing
    if method in ("pld", "jakiro"):  # and the same tree every cycle, whose proposals are verified
        engines.append(Jakiro(smol.target, smol.tokenizer, smol.target_path).add_method(method, adaptive=False))
    ids = [engines[0].encode(p) for p in PROMPTS]
    assert max(len(i) for i in ids) > PREFILL_PIECE
    alone = [engines[0].decoder.decode(i, 40) for i in ids]
    for engine in engines:
        batch = BatchDecoder(engine.decoder, 3, slot_tokens=512)  # 4 requests, 3 slots: one joins later
        together = batch.decode([(i, 40, None, None) for i in ids])
        assert [t.token_ids for t in together] == [a.token_ids for a in alone]
        assert [t.finish_reason for t in together] == [a.finish_reason for a in alone]
        assert batch.free_slots == 3 and not batch.running
    if len(engines) > 1:  # the fixed tree's proposals were verified, not skipped
        assert sum(t.metrics.committed for t in together) > sum(t.metrics.target_forwards for t in together)


def test_a_float16_cache_keeps_batched_answers_equal_to_each_alone(smol):
    """Keys and values held as float16 (``--kv-cache float16``): each slot takes half the memory,
    and every request's greedy answer in a batch of trees is still the one it gets alone."""
    import jakiro
    from jakiro.api import Jakiro
    from jakiro.decoding.batch import BatchDecoder
    from jakiro.settings import Runtime
    half = jakiro.load(runtime=Runtime.from_env(int8_activations=False, kv_cache="float16"))
    # the same tree every cycle (cost-aware drafting may draft little on a given machine)
    engine = Jakiro(half.target, half.tokenizer, half.target_path).add_method("jakiro", adaptive=False)
    ids = [engine.encode(p) for p in PROMPTS]
    alone = [engine.decoder.decode(i, 40) for i in ids]
    batch = BatchDecoder(engine.decoder, 3, slot_tokens=512)
    exact = BatchDecoder(smol.engine("jakiro").decoder, 3, slot_tokens=512)
    assert batch.cache.data.dtype == torch.float16 and 2 * batch.kv_bytes == exact.kv_bytes
    together = batch.decode([(i, 40, None, None) for i in ids])
    assert [t.token_ids for t in together] == [a.token_ids for a in alone]
    assert sum(t.metrics.committed for t in together) > sum(t.metrics.target_forwards for t in together)


def test_sampled_requests_reproduce_their_seeded_draws_in_a_batch(smol):
    alone = [smol.generate(p, max_new_tokens=32, temperature=0.9, seed=11, method="jakiro") for p in PROMPTS[:3]]
    together = smol.generate_batch(PROMPTS[:3], max_new_tokens=32, temperature=0.9, seed=11, method="jakiro")
    assert [t.token_ids for t in together] == [a.token_ids for a in alone]
    assert [t.text for t in together] == [a.text for a in alone]


def test_generate_batch_applies_stop_strings_and_refuses_bad_input(smol):
    from jakiro.errors import JakiroError
    prompts = ["Count from 1 to 20, separated by commas.", "Say hello."]
    alone = [smol.generate(p, max_new_tokens=48, stop=["7"]) for p in prompts]
    together = smol.generate_batch(prompts, max_new_tokens=48, stop=["7"], parallel=2)
    assert [t.text for t in together] == [a.text for a in alone]
    assert "7" not in together[0].text and together[0].finish_reason == "stop"
    with pytest.raises(JakiroError, match="context length"):
        smol.generate_batch(["hi", "word " * 9000], max_new_tokens=16)
    engine = smol.engine("ar")
    with pytest.raises(JakiroError, match="2 sampling settings for 3 prompts"):
        engine.generate_batch(["a", "b", "c"], 4, sampling=[None, None])
    batch = engine.batch(1, slot_tokens=64)
    with pytest.raises(JakiroError, match="slot's room"):
        batch.add(engine.encode("hello"), 80)
    batch.add(engine.encode("hello"), 8)
    with pytest.raises(JakiroError, match="all 1 slots are busy"):
        batch.add(engine.encode("hello"), 8)
    with pytest.raises(JakiroError, match="positive integer"):
        engine.batch(0)


def test_a_request_that_leaves_frees_its_slot_and_the_others_go_on(smol):
    engine = smol.engine("jakiro")
    ids = [engine.encode(p) for p in PROMPTS[:2]]
    alone = engine.decoder.decode(ids[1], 30).token_ids
    batch = engine.batch(2, slot_tokens=256)
    first, second = batch.add(ids[0], 200), batch.add(ids[1], 30)
    got = []
    for _ in range(3):
        got += [t for e in batch.step() if e.sequence is second for t in e.new_ids]
    batch.remove(first)  # its client hung up
    assert batch.free_slots == 1 and batch.running == [second]
    while batch.running:
        got += [t for e in batch.step() if e.sequence is second for t in e.new_ids]
    assert got == alone


@pytest.mark.parametrize("kv_cache", ["float32", "float16"])
def test_trees_of_several_sequences_in_one_forward_give_each_trees_logits_alone(smol, kv_cache):
    """Three sequences with contexts of different lengths and trees of 6, 1 and 3 rows (rows of
    one sequence read its keys and values together, up to four at a time): every row's logits
    are bitwise those of its tree's forward alone."""
    target = smol.target
    target.use_kv_cache(kv_cache)
    try:
        gen = torch.Generator().manual_seed(7)
        contexts = [torch.randint(0, 1000, (n,), generator=gen) for n in (90, 40, 130)]
        trees = [torch.randint(0, 1000, (n,), generator=gen) for n in (6, 1, 3)]
        masks = [torch.ones(6, 6, dtype=torch.bool).tril_(), torch.ones(1, 1, dtype=torch.bool),
                 torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)]
        depths = [torch.arange(6), torch.zeros(1, dtype=torch.long), torch.tensor([0, 1, 1])]
        batch = target.new_batch_cache(3, 160, scratch=8)
        alone = []
        for b, (ctx, tree, mask, depth) in enumerate(zip(contexts, trees, masks, depths)):
            slot = batch.slot(b)
            target(ctx, slot, chunked=True)
            slot.commit(len(ctx))
            batch.set_length(b, len(ctx))
            single = target.new_cache(160, scratch=8)
            single.data[:, :, :, :, :len(ctx)] = slot.data[:, :, :, :, :len(ctx)]
            single.length = len(ctx)
            alone.append(target(tree, single, len(ctx) + depth, mask)[0])
        n = [len(t) for t in trees]
        logits, _ = target.forward_rows(
            torch.cat(trees), batch.data, torch.cat([torch.full((k,), b) for b, k in enumerate(n)]),
            torch.cat([torch.arange(len(c), len(c) + k) for c, k in zip(contexts, n)]),
            torch.cat([torch.full((k,), len(c)) for c, k in zip(contexts, n)]),
            torch.cat([len(c) + d for c, d in zip(contexts, depths)]), torch.block_diag(*masks))
        assert torch.equal(logits, torch.cat(alone))
    finally:
        target.use_kv_cache("float32")


def test_rows_may_not_see_another_sequence(smol):
    target = smol.target
    cache = target.new_batch_cache(2, 16)
    two = torch.tensor([1, 2])
    with pytest.raises(RuntimeError, match="its own sequence"):
        target.forward_rows(two, cache.data, torch.tensor([0, 1]), torch.tensor([0, 0]), torch.tensor([0, 0]),
                            torch.tensor([0, 0]), torch.ones(2, 2, dtype=torch.bool))


@pytest.fixture(scope="module")
def parallel_server(smol):
    from jakiro.serve.app import create_app
    app = create_app(smol, "jakiro", max_queue=2, parallel=3, slot_tokens=1024)
    with ServerThread(app) as srv:
        from test_serve import get
        srv.model = json.loads(get(srv, "/v1/models")[1])["data"][0]["id"]
        yield srv


def test_parallel_server_answers_each_client_as_alone(parallel_server, smol):
    from test_serve import get, metric
    prompts = PROMPTS + ["Name three colours.", "Why is the sky blue?"]
    expected = {p: smol.generate(p, max_new_tokens=24, method="jakiro").text for p in prompts}
    results, errors = {}, []

    def ask(p):
        c = openai.OpenAI(base_url=parallel_server.url + "/v1", api_key="unused", max_retries=10, timeout=120)
        try:
            stream = c.chat.completions.create(model=parallel_server.model, messages=[{"role": "user", "content": p}], max_tokens=24,
                                               temperature=0, stream=True)
            results[p] = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        except Exception as exc:  # reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert results == expected
    health = json.loads(get(parallel_server, "/health")[1])
    assert health["parallel"] == 3 and health["slot_tokens"] == 1024 and health["kv_cache_bytes"] > 0
    assert metric(parallel_server, "jakiro_parallel_slots") == 3
    assert metric(parallel_server, "jakiro_time_to_first_token_seconds_count") >= len(prompts)
    assert metric(parallel_server, "jakiro_inter_token_seconds_count") > 0
    # at least one step decoded more than one request
    assert metric(parallel_server, "jakiro_batch_size_count") > metric(parallel_server,
                                                                      'jakiro_batch_size_bucket{le="1.0"}')


def test_parallel_server_frees_the_slot_of_a_client_that_left(parallel_server):
    from test_serve import get, hang_up, metric, open_stream, wait_idle
    cancelled = metric(parallel_server, "jakiro_requests_cancelled_total")
    streams = [open_stream(parallel_server, 3, max_tokens=900) for _ in range(2)]
    assert json.loads(get(parallel_server, "/health")[1])["running"] == 2
    for conn in streams:
        hang_up(conn)
    assert wait_idle(parallel_server, timeout=10), "the engine kept decoding for clients that left"
    assert json.loads(get(parallel_server, "/health")[1])["running"] == 0
    assert metric(parallel_server, "jakiro_requests_cancelled_total") == cancelled + 2


def test_parallel_server_refuses_prompts_beyond_a_slot(parallel_server):
    from test_serve import post
    status, body = post(parallel_server, "/v1/completions", {"model": parallel_server.model, "prompt": "word " * 1100, "max_tokens": 8})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert "1024 tokens" in body["error"]["message"]


def test_a_full_parallel_server_answers_429_with_retry_after(smol):
    import http.client

    from jakiro.serve.app import create_app
    from test_serve import CHAT, get, hang_up, msg, open_stream, wait_idle
    app = create_app(smol, "ar", max_queue=1, parallel=2, slot_tokens=1024)
    with ServerThread(app) as srv:
        running = [open_stream(srv, 3, max_tokens=900) for _ in range(2)]  # both slots decode ...
        waiting = open_stream(srv, 1, max_tokens=900)  # ... one request waits ...
        health = json.loads(get(srv, "/health")[1])
        assert (health["running"], health["waiting"]) == (2, 1)
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)  # ... and the next is refused
        conn.request("POST", CHAT, json.dumps(msg(max_tokens=8)), {"Content-Type": "application/json"})
        res = conn.getresponse()
        assert res.status == 429 and res.getheader("Retry-After") == "1"
        assert json.loads(res.read())["error"]["code"] == "rate_limit_exceeded"
        for c in running + [waiting]:
            hang_up(c)
        assert wait_idle(srv, timeout=10)
