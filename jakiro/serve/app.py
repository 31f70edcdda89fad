"""The OpenAI-compatible FastAPI app: /v1/models, /v1/completions, /v1/chat/completions (with
server-sent-event streaming), /health and Prometheus /metrics."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import json
import os
import re
import sys
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..api import Jakiro, load_tokenizer
from ..decoding.text import render_prompt
from ..errors import JakiroError
from ..settings import ServeSettings, settings_with
from . import protocol as P
from .metrics import CONTENT_TYPE, ServerMetrics
from .scheduler import Job, QueueFull, Scheduler

DISCONNECT_POLL_S = 0.25
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")


class _ClientGone(Exception):
    pass


def served_name(target_path: str) -> str:
    """The model id clients use: the target folder's name without the cache's hash suffix."""
    return re.sub(r"-[0-9a-f]{10}$", "", os.path.basename(os.path.normpath(target_path)))


def _error(exc: P.APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def _host_name(host_header: str) -> str:
    """'example.com:8000' -> 'example.com', '[::1]:8000' -> '::1'."""
    if host_header.startswith("["):
        return host_header[1:].split("]", 1)[0]
    return host_header.rsplit(":", 1)[0] if host_header.count(":") == 1 else host_header


class _Service:
    """What the routes share: the engine and its scheduler, the prompt tokenizer, the metrics and
    the server's limits. Each route is one method; ``create_app`` wires them to FastAPI."""

    def __init__(self, jk: Jakiro, method: str | None, s: ServeSettings):
        self.jk, self.engine = jk, jk.engine(method)
        self.name = s.model_name or served_name(jk.target_path)
        self.default_max_tokens, self.api_key = s.default_max_tokens, s.api_key
        self.max_body_bytes, self.allowed_hosts = s.max_body_bytes, s.allowed_hosts
        # the HTTP side renders prompts with its own tokenizer, on its own thread (off the event
        # loop, never concurrently with itself): the engine thread uses the other one
        self.tokenizer = load_tokenizer(jk.target_path)
        template = getattr(self.tokenizer, "chat_template", None) or ""
        self.template_has_tools = isinstance(template, str) and "tool_calls" in template
        self.cpu = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jakiro-encode")
        self.metrics = ServerMetrics(self.engine.proposer.max_tree_depth)
        self.scheduler = Scheduler(self.engine, s.max_queue, on_done=self.metrics.record,
                                   on_cancel=self.metrics.cancelled.inc, parallel=s.parallel,
                                   slot_tokens=s.slot_tokens, observer=self.metrics)
        self.metrics.track_queue(self.scheduler)
        self.created = P.now()

    @property
    def context(self) -> int:
        """The most tokens (prompt and answer) one request may take."""
        batch = self.scheduler.batch
        return batch.slot_tokens if batch is not None else self.jk.target.config.max_context

    def close(self) -> None:
        self.scheduler.close()
        self.cpu.shutdown(wait=False)

    def count(self, request: Request, status: int) -> None:
        if request.url.path in GENERATION_PATHS:
            self.metrics.requests.labels(request.url.path, str(status)).inc()

    # ------------------------------------------------------------------ checks without a body
    def refusal(self, request: Request) -> P.APIError | None:
        """Host, API key, media type and declared size."""
        host = _host_name(request.headers.get("host", ""))
        if self.allowed_hosts is not None and host not in self.allowed_hosts:
            return P.APIError(400, "this server does not answer for that Host header", None, "invalid_host")
        if self.api_key and request.url.path.startswith("/v1/") and not hmac.compare_digest(
                request.headers.get("authorization", "").encode(), f"Bearer {self.api_key}".encode()):
            return P.APIError(401, "a valid API key is required (Authorization: Bearer ...)", None,
                              "invalid_api_key", type="authentication_error")
        if request.method == "POST" and request.url.path in GENERATION_PATHS:
            ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
            length = request.headers.get("content-length")
            if ctype != "application/json":
                # also what keeps a page on another origin from posting here without a CORS preflight
                return P.APIError(415, "the request body must be sent as Content-Type: application/json",
                                  None, "unsupported_media_type")
            if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
                return P.APIError(413, f"the request body is larger than this server's limit "
                                  f"({self.max_body_bytes} bytes)", None, "request_too_large")
        return None

    # ------------------------------------------------------------------ read-only routes
    def health(self) -> JSONResponse:
        ok = self.scheduler.alive
        body = {"status": "ok" if ok else "engine stopped", "model": self.name, "method": self.engine.method,
                "waiting": self.scheduler.waiting, "max_queue": self.scheduler.max_queue,
                "busy": self.scheduler.busy, "running": self.scheduler.running,
                "parallel": self.scheduler.parallel}
        batch = self.scheduler.batch
        if batch is not None:
            body.update(slot_tokens=batch.slot_tokens, kv_cache_bytes=batch.kv_bytes)
        return JSONResponse(body, status_code=200 if ok else 503)

    def model_card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "jakiro",
                "method": self.engine.method, "max_context": self.jk.target.config.max_context}

    # ------------------------------------------------------------------ requests
    async def read_body(self, request: Request) -> bytes:
        """The body, refused with 413 as soon as it passes the limit (chunked bodies included)."""
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise P.APIError(413, f"the request body is larger than this server's limit "
                                 f"({self.max_body_bytes} bytes)", None, "request_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    def parse_and_prepare(self, raw: bytes, kind: str, param: str) -> tuple[P.GenRequest, list[int], int]:
        """JSON parsing, validation and tokenisation: CPU work, run on the encoder thread."""
        body = P.parse_body(raw)
        req = P.parse_chat(body, [self.name]) if kind == "chat" else P.parse_completion(body, [self.name])
        return (req, *self.prepare(req, param))

    def prepare(self, req: P.GenRequest, param: str) -> tuple[list[int], int]:
        prompt, tools = req.prompt, None
        if req.kind == "chat":
            prompt, tools = P.render_tools(req.prompt, req.tools, self.template_has_tools)
        try:
            ids = render_prompt(self.tokenizer, prompt, chat=req.kind == "chat", tools=tools)
        except JakiroError as exc:
            raise P.bad(str(exc), param) from None
        if not ids:
            raise P.bad("the prompt is empty", param)
        cfg = self.jk.target.config
        if max(ids) >= cfg.vocab_size:
            raise P.bad(f"token id {max(ids)} is outside the vocabulary ({cfg.vocab_size})", param)
        ctx = self.context
        max_tokens = req.max_tokens if req.max_tokens is not None else min(self.default_max_tokens, ctx - len(ids))
        if len(ids) + max(1, max_tokens) > ctx:
            asked = f"{max_tokens} completion tokens" if req.max_tokens is not None else "at least 1 completion token"
            whose = "this model's" if ctx == cfg.max_context else "this server's (per request)"
            raise P.APIError(400, f"{whose} maximum context length is {ctx} tokens; the prompt has "
                             f"{len(ids)} tokens and {asked} were requested",
                             "max_tokens" if req.max_tokens is not None else param, "context_length_exceeded")
        return ids, max_tokens

    async def handle(self, request: Request, kind: str, endpoint: str):
        param = "messages" if kind == "chat" else "prompt"
        loop = asyncio.get_running_loop()
        requests = self.metrics.requests
        try:
            raw = await self.read_body(request)
            req, ids, max_tokens = await loop.run_in_executor(self.cpu, self.parse_and_prepare, raw, kind, param)
            job = Job(ids, max_tokens, req.sampling, req.stop, loop, req.stream)
            try:
                self.scheduler.submit(job)
            except QueueFull:
                raise P.APIError(429, f"the server is busy ({self.scheduler.waiting} requests waiting for the "
                                 "engine); retry later", None, "rate_limit_exceeded",
                                 type="rate_limit_error") from None
        except P.APIError as exc:
            requests.labels(endpoint, str(exc.status)).inc()
            response = _error(exc)
            if exc.status == 429:
                response.headers["Retry-After"] = "1"
            return response
        rid, stamp = P.new_id(kind), P.now()
        if req.stream:
            return StreamingResponse(self.sse(job, req, rid, stamp, request, endpoint),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            while True:
                kind_, value = await _next_event(job, request)
                if kind_ == "done":
                    requests.labels(endpoint, "200").inc()
                    return P.response(req, rid, stamp, value)
                if kind_ == "error":
                    exc = _failure(value)
                    requests.labels(endpoint, str(exc.status)).inc()
                    return _error(exc)
                if kind_ == "cancelled":
                    raise _ClientGone()
        except _ClientGone:
            requests.labels(endpoint, "499").inc()
            return Response(status_code=499)
        except asyncio.CancelledError:
            requests.labels(endpoint, "499").inc()
            raise
        finally:
            job.cancel()  # no-op once done; frees the engine if the client went away

    async def sse(self, job: Job, req: P.GenRequest, rid: str, stamp: int, request: Request, endpoint: str):
        status = "499"
        try:
            if req.kind == "chat":
                yield _event(P.chunk(req, rid, stamp, first=True))
            last_check = time.monotonic()
            while True:
                kind_, value = await _next_event(job, request)
                if time.monotonic() - last_check > DISCONNECT_POLL_S:
                    last_check = time.monotonic()
                    if await request.is_disconnected():
                        raise _ClientGone()
                if kind_ == "text":
                    yield _event(P.chunk(req, rid, stamp, text=value))
                elif kind_ == "done":
                    yield _event(P.chunk(req, rid, stamp, finish_reason=value.finish_reason))
                    if req.include_usage:
                        yield _event(P.chunk(req, rid, stamp, usage_=P.usage(value)))
                    yield "data: [DONE]\n\n"
                    status = "200"
                    return
                elif kind_ == "error":
                    exc = _failure(value)
                    status = str(exc.status)
                    yield _event(exc.body())
                    yield "data: [DONE]\n\n"
                    return
                else:
                    return
        except _ClientGone:
            return
        finally:
            job.cancel()
            self.metrics.requests.labels(endpoint, status).inc()


async def _next_event(job: Job, request: Request):
    while True:
        try:
            return await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                raise _ClientGone() from None


def create_app(jk: Jakiro, method: str | None = None, settings: ServeSettings | None = None,
               **options) -> FastAPI:
    """The app serving ``method`` (default: the loaded one) as ``settings`` (``ServeSettings``)
    and ``options`` (its fields, changed) say. ``api_key``: required as ``Authorization: Bearer
    KEY`` on /v1 routes. ``allowed_hosts``: Host header names accepted (None: any), against DNS
    rebinding. ``docs``: serve the interactive API docs (/docs, /redoc, /openapi.json).
    ``parallel``: requests decoded together (continuous batching), each with room for
    ``slot_tokens`` tokens of prompt and answer (default: the model's context, at most 4,096).
    ``host``, ``port``, ``log_level``, ``header_timeout`` and ``max_connections`` are ``serve``'s."""
    s = settings_with(settings or ServeSettings(), options)
    svc = _Service(jk, method, s)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        svc.close()

    doc_routes = {} if s.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="jakiro", description="OpenAI-compatible speculative decoding server", lifespan=lifespan,
                  **doc_routes)
    app.state.scheduler, app.state.metrics, app.state.engine = svc.scheduler, svc.metrics, svc.engine
    _add_guards(app, svc)
    _add_routes(app, svc)
    return app


def _add_guards(app: FastAPI, svc: _Service) -> None:
    """Refusals before any route (``_Service.refusal``), and every error as an OpenAI error body."""
    @app.middleware("http")
    async def guard(request: Request, call_next):
        error = svc.refusal(request)
        if error is not None:
            svc.count(request, error.status)
            return _error(error)
        return await call_next(request)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        code = "not_found" if exc.status_code == 404 else None
        svc.count(request, exc.status_code)
        return JSONResponse(P.APIError(exc.status_code, str(exc.detail), None, code).body(),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        svc.count(request, 500)
        return JSONResponse(P.APIError(500, f"internal error: {type(exc).__name__}", type="server_error").body(),
                            status_code=500)


def _add_routes(app: FastAPI, svc: _Service) -> None:
    """/health, /metrics and the OpenAI-compatible /v1 routes."""
    @app.get("/health")
    async def health():
        return svc.health()

    @app.get("/metrics")
    async def prometheus():
        return Response(svc.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [svc.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != svc.name:
            return _error(P.APIError(404, f"the model '{P.clip(model_id)}' does not exist", "model",
                                     "model_not_found"))
        return svc.model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await svc.handle(request, "chat", "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await svc.handle(request, "completion", "/v1/completions")


def _failure(exc: BaseException) -> P.APIError:
    if isinstance(exc, JakiroError):
        return P.APIError(400, str(exc))
    return P.APIError(500, f"generation failed: {type(exc).__name__}: {exc}", type="server_error")


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def default_allowed_hosts(host: str) -> list[str] | None:
    """On loopback only loopback names are answered (a page cannot rebind its own name to us);
    on another address any Host is, unless the operator names them."""
    return list(LOOPBACK_HOSTS) if host in LOOPBACK_HOSTS else None


def serve(jk: Jakiro, settings: ServeSettings | None = None, method: str | None = None, **options) -> None:
    """Serve ``method`` (default: the loaded one) until interrupted, as ``settings`` and
    ``options`` (``ServeSettings`` fields) say; on a loopback ``host`` without ``allowed_hosts``
    only loopback Host names are answered."""
    import uvicorn

    from .transport import server_config
    s = settings_with(settings or ServeSettings(), options)
    if s.allowed_hosts is None:
        hosts = default_allowed_hosts(s.host)
        s = settings_with(s, {"allowed_hosts": tuple(hosts) if hosts else None})
    host, port = s.host, s.port
    app = create_app(jk, method, s)
    jk.engine(method).generate("Hello", 4)  # warm-up, so that the first client is not the slow one
    batch = app.state.scheduler.batch
    if batch is not None:
        print(f"[jakiro] --parallel {batch.slots}: {batch.slots} slots of {batch.slot_tokens} tokens, KV cache "
              f"{batch.kv_bytes / 2**20:.0f} MiB", file=sys.stderr, flush=True)
    config = server_config(app, host, port, s.log_level, s.header_timeout, s.max_connections,
                           timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    try:
        server.run()
    except KeyboardInterrupt:  # Ctrl-C: uvicorn re-raises it after a graceful shutdown
        pass
    if not server.started:
        raise JakiroError(f"could not serve on {host}:{port} (see the log above)")
