"""The OpenAI-compatible server on loopback, through the official ``openai`` client and raw HTTP:
greedy answers equal ``jakiro generate``, streaming, errors, queueing/429, disconnects, metrics."""

import http.client
import json
import threading
import time

import openai
import pytest

from serving import ServerThread

MAX_TOKENS = 24
PROMPTS = ["What is the capital of France?", "Name three colours.", "Write a haiku about snow.",
           "What is 7 times 6?", "Give one tip for sleeping well.", "Translate 'good morning' to Spanish.",
           "Why is the sky blue?", "Say something kind."]


@pytest.fixture(scope="module")
def server(smol):
    from jakiro.serve.app import create_app
    app = create_app(smol, "jakiro", max_queue=4)
    with ServerThread(app) as srv:
        srv.app = app
        srv.model = json.loads(get(srv, "/v1/models")[1])["data"][0]["id"]
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def get(server, path):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("GET", path)
    res = conn.getresponse()
    return res.status, res.read().decode()


def post(server, path, body):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    conn.request("POST", path, data, {"Content-Type": "application/json"})
    res = conn.getresponse()
    text = res.read().decode()
    return res.status, json.loads(text) if text else None


def reference(smol, prompt, chat=True, max_tokens=MAX_TOKENS):
    return smol.engine("jakiro").generate(prompt, max_tokens, chat=chat).text


def test_models_and_health(server):
    status, body = get(server, "/v1/models")
    assert status == 200
    data = json.loads(body)
    assert data["object"] == "list" and data["data"][0]["id"] == server.model == "SmolLM2-135M-Instruct.Q4_1"
    status, body = get(server, "/health")
    assert status == 200 and json.loads(body)["status"] == "ok" and json.loads(body)["method"] == "jakiro"


def test_chat_greedy_equals_jakiro_generate(server, client, capsys):
    from jakiro import cli
    prompt = PROMPTS[0]
    assert cli.main(["generate", "--method", "jakiro", "--json", "--prompt", prompt,
                     "--max-new-tokens", str(MAX_TOKENS)]) == 0
    expected = json.loads(capsys.readouterr().out)["text"]
    res = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": prompt}],
                                         max_tokens=MAX_TOKENS, temperature=0)
    assert res.choices[0].message.content == expected
    usage = res.usage
    assert res.choices[0].finish_reason == ("length" if usage.completion_tokens == MAX_TOKENS else "stop")
    assert usage.completion_tokens >= 1 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    extra = usage.model_extra
    assert extra["tau"] == pytest.approx((usage.completion_tokens - 1) / extra["target_forwards"], abs=1e-3)
    assert usage.model_extra["method"] == "jakiro"

    chunks = list(client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS,
        temperature=0, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [res.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == usage.completion_tokens


def test_completions_stream_and_not(server, client, smol):
    prompt = "The three primary colours are"
    expected = reference(smol, prompt, chat=False, max_tokens=12)
    res = client.completions.create(model=server.model, prompt=prompt, max_tokens=12, temperature=0)
    assert res.object == "text_completion" and res.choices[0].text == expected
    parts = list(client.completions.create(model=server.model, prompt=prompt, max_tokens=12, temperature=0,
                                           stream=True))
    assert "".join(p.choices[0].text for p in parts) == expected
    assert parts[-1].choices[0].finish_reason == res.choices[0].finish_reason


def test_stop_and_seeded_sampling(server, client):
    msgs = [{"role": "user", "content": "List the days of the week, comma separated."}]
    full = client.chat.completions.create(model=server.model, messages=msgs, max_tokens=20, temperature=0)
    text = full.choices[0].message.content
    assert len(text) > 8, text  # 20 tokens of a list: long enough to stop inside it
    stop = text[5:7]
    cut = client.chat.completions.create(model=server.model, messages=msgs, max_tokens=20, temperature=0,
                                         stop=[stop])
    assert cut.choices[0].message.content == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    a = client.chat.completions.create(model=server.model, messages=msgs, max_tokens=12, temperature=0.9,
                                       top_p=0.9, seed=7)
    b = client.chat.completions.create(model=server.model, messages=msgs, max_tokens=12, temperature=0.9,
                                       top_p=0.9, seed=7)
    assert a.choices[0].message.content == b.choices[0].message.content


CHAT = "/v1/chat/completions"


def msg(**kw):
    body = {"model": "SmolLM2-135M-Instruct.Q4_1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    body.update(kw)
    return {k: v for k, v in body.items() if v is not None}


@pytest.mark.parametrize("path, body, status, param, words", [
    (CHAT, b"{not json", 400, None, "not valid JSON"),
    (CHAT, b"[1, 2]", 400, None, "must be a JSON object"),
    (CHAT, msg(model="gpt-9"), 404, "model", "does not exist"),
    (CHAT, msg(model=None), 400, "model", "provide a model"),
    (CHAT, msg(messages=None), 400, "messages", "'messages' is required"),
    (CHAT, msg(messages=[]), 400, "messages", "non-empty list"),
    (CHAT, msg(messages="hi"), 400, "messages", "non-empty list"),
    (CHAT, msg(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages", "role must be one of"),
    (CHAT, msg(messages=[{"role": "user", "content": 5}]), 400, "messages", "content must be a string"),
    (CHAT, msg(max_tokens=0), 400, "max_tokens", "at least 1"),
    (CHAT, msg(max_tokens=-5), 400, "max_tokens", "at least 1"),
    (CHAT, msg(max_tokens="ten"), 400, "max_tokens", "must be an integer"),
    (CHAT, msg(max_tokens=10 ** 6), 400, "max_tokens", "maximum context length is 8192"),
    (CHAT, msg(temperature=-0.5), 400, "temperature", "between 0 and 2"),
    (CHAT, msg(temperature=3), 400, "temperature", "between 0 and 2"),
    (CHAT, msg(temperature="hot"), 400, "temperature", "must be a number"),
    (CHAT, msg(top_p=0), 400, "top_p", "(0, 1]"),
    (CHAT, msg(top_p=1.5), 400, "top_p", "(0, 1]"),
    (CHAT, msg(seed="x"), 400, "seed", "must be an integer"),
    (CHAT, msg(stop=["a", "b", "c", "d", "e"]), 400, "stop", "at most 4"),
    (CHAT, msg(stop=5), 400, "stop", "string or a list"),
    (CHAT, msg(stream="yes"), 400, "stream", "boolean"),
    (CHAT, msg(n=2), 400, "n", "n = 1"),
    ("/v1/completions", {"model": "SmolLM2-135M-Instruct.Q4_1"}, 400, "prompt", "'prompt' is required"),
    ("/v1/completions", {"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": ["a", "b"]}, 400, "prompt",
     "not supported"),
    ("/v1/completions", {"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": "x " * 9000}, 400, "prompt",
     "maximum context length"),
    ("/v1/nothing", {}, 404, None, "Not Found"),
])
def test_bad_requests_get_openai_errors(server, path, body, status, param, words):
    code, err = post(server, path, body)
    assert code == status, err
    assert set(err["error"]) == {"message", "type", "param", "code"}
    assert err["error"]["param"] == param
    assert words in err["error"]["message"]


def test_errors_through_the_openai_client_and_server_keeps_serving(server, client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                       temperature=5)
    ok = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens <= 3
    assert json.loads(get(server, "/health")[1])["status"] == "ok"


def test_failing_request_does_not_take_the_server_down(server, client):
    scheduler = server.app.state.scheduler
    real = scheduler.engine

    class Broken:
        method = "jakiro"

        def stream(self, *a, **kw):
            raise RuntimeError("simulated engine failure")
            yield  # noqa

    scheduler.engine = Broken()
    try:
        with pytest.raises(openai.InternalServerError, match="simulated engine failure"):
            client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=3)
    finally:
        scheduler.engine = real
    ok = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=3, temperature=0)
    assert ok.choices[0].message.content is not None


def wait_idle(server, timeout=10.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        h = json.loads(get(server, "/health")[1])
        if not h["busy"] and h["waiting"] == 0:
            return True
        time.sleep(0.05)
    return False


def metric(server, name):
    for line in get(server, "/metrics")[1].splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def open_stream(server, chunks, max_tokens=4000):
    """Start a long streaming chat request and read ``chunks`` SSE events from it. Greedy: the
    answer is plain decoding's whatever trees the engine drafts (over 2,000 tokens here), where a
    sampled one's length depends on the draws, which depend on the trees (one ended within a second)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = msg(messages=[{"role": "user", "content": "Write a very long essay about the history of Rome."}],
               max_tokens=max_tokens, temperature=0, stream=True)
    conn.request("POST", CHAT, json.dumps(body), {"Content-Type": "application/json"})
    res = conn.getresponse()
    assert res.status == 200 and res.getheader("content-type").startswith("text/event-stream")
    seen = 0
    while seen < chunks:
        seen += res.fp.readline().startswith(b"data: ")
    return conn


def hang_up(conn):
    conn.sock.shutdown(2)
    conn.close()


def test_client_disconnect_frees_the_engine(server):
    cancelled = metric(server, "jakiro_requests_cancelled_total")
    running = open_stream(server, 3)  # a few chunks arrive ...
    assert json.loads(get(server, "/health")[1])["busy"]
    waiting = open_stream(server, 1)  # only the role chunk: it waits behind the first one
    assert json.loads(get(server, "/health")[1])["waiting"] == 1
    hang_up(waiting)  # ... a waiting client leaves: it never reaches the engine
    time.sleep(4 * 0.25)
    assert json.loads(get(server, "/health")[1])["busy"]
    hang_up(running)  # ... and the running one leaves: the engine stops within a decode cycle
    # idle long before the answer's 2,000+ tokens could have been decoded
    assert wait_idle(server, timeout=5), "the engine kept decoding for a client that left"
    assert metric(server, "jakiro_requests_cancelled_total") == cancelled + 2


@pytest.mark.slow
def test_load_16_concurrent_streams_64_requests(server, client):
    expected = {}
    for p in PROMPTS:  # single-request versions
        r = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": p}],
                                           max_tokens=12, temperature=0)
        expected[p] = r.choices[0].message.content
    results, errors = [], []
    lock = threading.Lock()

    def worker(w):
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        for i in range(4):
            prompt = PROMPTS[(w + i) % len(PROMPTS)]
            try:
                stream = c.chat.completions.create(model=server.model, messages=[{"role": "user", "content": prompt}],
                                                   max_tokens=12, temperature=0, stream=True)
                chunks = list(stream)
                text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
                finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
                outcome = ("ok", prompt, text, finish)
            except openai.RateLimitError as exc:
                outcome = ("429", prompt, exc.body, None)
            except Exception as exc:  # anything else fails the test below
                outcome = ("error", prompt, repr(exc), None)
            with lock:
                (errors if outcome[0] == "error" else results).append(outcome)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors[:3]
    assert len(results) == 64
    ok = [r for r in results if r[0] == "ok"]
    refused = [r for r in results if r[0] == "429"]
    assert ok and refused, (len(ok), len(refused))  # 16 clients against 1 engine + 4 queue slots
    for _, prompt, text, finish in ok:
        assert text == expected[prompt]  # no mixed-up or truncated outputs
        assert len(finish) == 1
    for _, _, body, _ in refused:
        assert body["code"] == "rate_limit_exceeded"
    assert wait_idle(server)
    assert json.loads(get(server, "/health")[1])["status"] == "ok"
    text = get(server, "/metrics")[1]
    assert f'jakiro_requests_total{{endpoint="{CHAT}",status="429"}} {float(len(refused))}' in text


def test_metrics_are_prometheus_text(server, client):
    client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                   max_tokens=4, temperature=0)
    status, text = get(server, "/metrics")
    assert status == 200
    for name in ("jakiro_requests_total", "jakiro_generated_tokens_total", "jakiro_target_forwards_total",
                 "jakiro_accepted_tokens_total", "jakiro_acceptance_rate", "jakiro_tau", "jakiro_queue_waiting"):
        assert f"# TYPE {name.removesuffix('_total')}" in text, name
    assert metric(server, "jakiro_generated_tokens_total") >= 4
    assert 'jakiro_acceptance_rate{depth="1"}' in text
    tried = metric(server, 'jakiro_draft_depth_tried{depth="1"}')
    assert 0 <= metric(server, 'jakiro_draft_depth_accepted{depth="1"}') <= tried
    assert metric(server, "jakiro_target_forwards_total") >= 1


def test_depth_series_exist_before_any_drafted_cycle():
    """A scrape before the first request (or while cost-aware drafting backs off) shows every depth
    the engine's trees can reach, with nothing tried and no rate yet."""
    from jakiro.decoding.engine import Metrics
    from jakiro.serve.metrics import ServerMetrics

    m = ServerMetrics(draft_depth=3)
    text = m.render().decode()
    for d in (1, 2, 3):
        assert f'jakiro_draft_depth_tried{{depth="{d}"}} 0.0' in text
        assert f'jakiro_acceptance_rate{{depth="{d}"}} NaN' in text
    assert 'depth="4"' not in text

    class Done:  # a finished request whose one drafted cycle accepted the depth-1 token only
        metrics = Metrics(new_tokens=2, target_forwards=1, committed=2)
    Done.metrics.record_cycle(tree_depth=3, accept_length=1)
    m.record(Done)
    text = m.render().decode()
    assert 'jakiro_acceptance_rate{depth="1"} 1.0' in text
    assert 'jakiro_acceptance_rate{depth="2"} 0.0' in text
    assert 'jakiro_acceptance_rate{depth="3"} NaN' in text


@pytest.mark.slow
def test_serve_command_starts_answers_and_stops():
    import os
    import signal
    import socket
    import subprocess
    import sys
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "jakiro", "serve", "--port", str(port), "--threads", "1",
                             "--method", "pld", "--model-name", "smol", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        deadline = time.time() + 120
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/health")
                health = json.loads(conn.getresponse().read())
                break
            except OSError:
                assert proc.poll() is None and time.time() < deadline, proc.stdout.read()
                time.sleep(0.5)
        assert health["model"] == "smol" and health["method"] == "pld"
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        res = c.completions.create(model="smol", prompt="One, two, three,", max_tokens=6, temperature=0)
        assert res.choices[0].text and res.usage.completion_tokens <= 6
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0


@pytest.mark.parametrize("args, message", [
    (["--port", "70000"], "--port must be in 1..65535"),
    (["--max-queue", "0"], "--max-queue must be >= 1"),
    (["--method", "ar", "--depth", "3"], "apply to eagle2 and jakiro drafts"),
])
def test_serve_command_rejects_bad_options(args, message):
    import subprocess
    import sys
    res = subprocess.run([sys.executable, "-m", "jakiro", "serve", *args], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2 and message in res.stderr and res.stderr.count("\n") == 1, res.stderr
