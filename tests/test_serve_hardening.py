"""jakiro serve against hostile or unusual clients, on loopback: parser limits, invalid Unicode,
numbers at the engine's edges, queued clients that hang up, oversized bodies, agent
conversations, API keys, Host and media-type checks, slow headers and connection limits."""

import http.client
import json
import socket
import threading
import time

import openai
import pytest

from serving import ServerThread

CHAT = "/v1/chat/completions"
MODEL = "SmolLM2-135M-Instruct.Q4_1"


def request(server, method, path, body=None, headers=None, timeout=120):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    hdrs = {"Content-Type": "application/json"}
    hdrs.update(headers or {})
    data = body if body is None or isinstance(body, (bytes, str)) else json.dumps(body)
    conn.request(method, path, data, hdrs)
    res = conn.getresponse()
    text = res.read().decode()
    try:
        payload = json.loads(text) if text else None
    except ValueError:
        payload = text
    return res.status, payload, res


def chat(content="hi", **kw):
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4,
            "temperature": 0}
    body.update(kw)
    return body


def metric(server, name):
    text = request(server, "GET", "/metrics")[1]
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


@pytest.fixture(scope="module")
def server(smol):
    from jakiro.serve.app import create_app
    app = create_app(smol, "ar", max_queue=1, max_body_bytes=200_000)
    with ServerThread(app, header_timeout=1.0, max_connections=16) as srv:
        srv.app = app
        yield srv


@pytest.mark.parametrize("raw, words", [
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"model": "m", "junk": ' + b"9" * 5000 + b"}", "not valid JSON"),
])
def test_parser_limits_are_client_errors(server, raw, words):
    status, body, _ = request(server, "POST", CHAT, raw)
    assert status == 400 and words in body["error"]["message"], body


@pytest.mark.parametrize("body, param", [
    (chat("\ud800 hello"), "messages"),
    ({"model": MODEL, "prompt": "x\udfff", "max_tokens": 2}, "prompt"),
    (chat(model="\ud800"), "model"),
])
def test_lone_surrogates_are_refused(server, body, param):
    path = "/v1/completions" if "prompt" in body else CHAT
    raw = json.dumps(body)  # ensure_ascii: the surrogate travels as a \\ud800 escape
    status, err, _ = request(server, "POST", path, raw)
    assert status == 400 and err["error"]["param"] == param and "surrogate" in err["error"]["message"]


def test_temperature_below_float32_resolution_is_greedy(server):
    greedy = request(server, "POST", CHAT, chat("Name a colour.", max_tokens=8))[1]
    tiny = request(server, "POST", CHAT, chat("Name a colour.", max_tokens=8, temperature=1e-40))
    assert tiny[0] == 200
    assert tiny[1]["choices"][0]["message"]["content"] == greedy["choices"][0]["message"]["content"]
    status, text, _ = request(server, "POST", CHAT, chat("Name a colour.", max_tokens=8, temperature=1e-40,
                                                         stream=True))
    assert status == 200 and "error" not in text and text.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize("seed", [2 ** 64, -(2 ** 63) - 1])
def test_seed_outside_64_bits_is_refused(server, seed):
    status, err, _ = request(server, "POST", CHAT, chat(seed=seed, temperature=1))
    assert status == 400 and err["error"]["param"] == "seed"
    assert request(server, "POST", CHAT, chat(seed=2 ** 64 - 1, temperature=1))[0] == 200


def open_stream(server, content="Write a very long essay about the history of Rome.", chunks=1):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = chat(content, max_tokens=4000, temperature=0, stream=True)  # greedy: as long as plain decoding's
    conn.request("POST", CHAT, json.dumps(body), {"Content-Type": "application/json"})
    res = conn.getresponse()
    seen = 0
    while seen < chunks:
        seen += res.fp.readline().startswith(b"data: ")
    return conn


def health(server):
    return request(server, "GET", "/health")[1]


def test_queued_client_that_hangs_up_frees_its_slot(server):
    running = open_stream(server, chunks=2)  # a chat stream sends its role chunk at once
    waiting = open_stream(server)
    assert health(server)["waiting"] == 1
    status, err, res = request(server, "POST", CHAT, chat())  # the one queue slot is taken
    assert status == 429 and res.getheader("Retry-After") == "1"
    waiting.sock.shutdown(socket.SHUT_RDWR)
    waiting.close()
    deadline = time.time() + 5
    while health(server)["waiting"] and time.time() < deadline:
        time.sleep(0.1)
    assert health(server)["waiting"] == 0
    replacement = open_stream(server)  # admitted, not 429
    assert health(server)["waiting"] == 1
    for conn in (replacement, running):
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
    deadline = time.time() + 10
    while (health(server)["busy"] or health(server)["waiting"]) and time.time() < deadline:
        time.sleep(0.1)
    assert not health(server)["busy"]


def test_oversized_bodies_get_413_declared_or_chunked(server):
    big = json.dumps(chat("x" * 300_000))
    status, err, _ = request(server, "POST", CHAT, big)
    assert status == 413 and err["error"]["code"] == "request_too_large"

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", CHAT, (big[i:i + 10_000].encode() for i in range(0, len(big), 10_000)),
                 {"Content-Type": "application/json"}, encode_chunked=True)
    res = conn.getresponse()
    assert res.status == 413 and json.loads(res.read())["error"]["code"] == "request_too_large"


def test_tokenising_a_big_body_does_not_block_health(server):
    body = json.dumps(chat("lorem ipsum dolor sit amet " * 7000))  # ~190 KB, ~50k tokens: over the context
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("r", request(server, "POST", CHAT, body)))
    t.start()
    worst = 0.0
    while t.is_alive():
        t0 = time.time()
        assert health(server)["status"] == "ok"
        worst = max(worst, time.time() - t0)
    t.join()
    assert result["r"][0] == 400 and "maximum context length" in result["r"][1]["error"]["message"]
    assert worst < 1.0, worst


def test_every_response_is_counted(server, monkeypatch):
    from jakiro.serve import protocol
    before = {s: metric(server, f'jakiro_requests_total{{endpoint="{CHAT}",status="{s}"}}')
              for s in ("413", "415", "500")}
    request(server, "POST", CHAT, json.dumps(chat("x" * 300_000)))
    request(server, "POST", CHAT, json.dumps(chat()), {"Content-Type": "text/plain"})

    def broken(raw):
        raise RuntimeError("simulated parser failure")
    monkeypatch.setattr(protocol, "parse_body", broken)
    status, err, _ = request(server, "POST", CHAT, chat())
    assert status == 500 and "simulated" not in json.dumps(err)  # no internals leak
    for s in before:
        assert metric(server, f'jakiro_requests_total{{endpoint="{CHAT}",status="{s}"}}') == before[s] + 1, s


AGENT = [
    {"role": "system", "content": "You can look up the weather."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 18}"},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_agent_conversations_are_answered(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    res = client.chat.completions.create(model=MODEL, messages=AGENT, tools=TOOLS, max_tokens=6, temperature=0)
    assert res.choices[0].message.content
    legacy = AGENT[:2] + [{"role": "assistant", "content": None,
                           "function_call": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
                          {"role": "function", "name": "get_weather", "content": "18 degrees"}]
    res = client.chat.completions.create(model=MODEL, messages=legacy, max_tokens=6, temperature=0)
    assert res.choices[0].message.content


def test_plain_rendering_of_tool_messages():
    from jakiro.serve.protocol import parse_chat, render_tools
    req = parse_chat({"model": MODEL, "messages": AGENT, "tools": TOOLS}, [MODEL])
    msgs, tools = render_tools(req.prompt, req.tools, template_has_tools=False)
    assert tools is None and [m["role"] for m in msgs] == ["system", "system", "user", "assistant", "user"]
    assert json.dumps(TOOLS[0]) in msgs[0]["content"]
    assert msgs[3]["content"] == '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    assert msgs[4]["content"] == '<tool_response>\n{"temperature": 18}\n</tool_response>'
    msgs, tools = render_tools(req.prompt, req.tools, template_has_tools=True)
    assert tools == TOOLS and msgs[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert msgs[3] == {"role": "tool", "content": '{"temperature": 18}', "tool_call_id": "call_1"}


def test_long_paths_are_not_echoed(server):
    status, err, _ = request(server, "GET", "/v1/models/" + "a" * 5000)
    assert status == 404 and len(err["error"]["message"]) < 200


def test_cross_origin_simple_post_is_refused(server):
    status, err, _ = request(server, "POST", CHAT, json.dumps(chat()),
                             {"Content-Type": "text/plain", "Origin": "http://evil.example"})
    assert status == 415 and err["error"]["code"] == "unsupported_media_type"


def test_slow_request_head_is_dropped(server):
    s = socket.create_connection(("127.0.0.1", server.port))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finishes its head
    s.settimeout(30)  # the server's header timeout is 1 s: a recv that times out here fails the test
    assert s.recv(100) == b""  # closed by the server
    s.close()


@pytest.fixture(scope="module")
def guarded(smol):
    from jakiro.serve.app import create_app, default_allowed_hosts
    app = create_app(smol, "ar", api_key="s3cret", allowed_hosts=default_allowed_hosts("127.0.0.1"), docs=True)
    with ServerThread(app, max_connections=3, header_timeout=5.0) as srv:
        yield srv


def test_api_key_is_required_on_v1(guarded):
    assert request(guarded, "POST", CHAT, chat())[0] == 401
    assert request(guarded, "POST", CHAT, chat(), {"Authorization": "Bearer wrong"})[0] == 401
    status, err, _ = request(guarded, "GET", "/v1/models")
    assert status == 401 and err["error"]["type"] == "authentication_error"
    assert request(guarded, "POST", CHAT, chat(), {"Authorization": "Bearer s3cret"})[0] == 200
    assert request(guarded, "GET", "/health")[0] == 200
    client = openai.OpenAI(base_url=guarded.url + "/v1", api_key="s3cret", max_retries=0)
    assert client.models.list().data[0].id == MODEL


def test_host_header_outside_loopback_is_refused(guarded):
    status, err, _ = request(guarded, "GET", "/health", headers={"Host": "attacker.example:8000"})
    assert status == 400 and err["error"]["code"] == "invalid_host"
    assert request(guarded, "GET", "/health", headers={"Host": "localhost:8000"})[0] == 200


def test_docs_are_opt_in(server, guarded):
    assert request(server, "GET", "/docs")[0] == 404
    assert request(guarded, "GET", "/docs")[0] == 200


def test_connection_limit_answers_503(guarded):
    idle = [socket.create_connection(("127.0.0.1", guarded.port)) for _ in range(3)]
    try:
        time.sleep(0.2)
        assert request(guarded, "GET", "/health")[0] == 503
    finally:
        for s in idle:
            s.close()
    time.sleep(0.2)
    assert request(guarded, "GET", "/health")[0] == 200
