"""OpenAI request validation and response objects for ``/v1/completions`` and
``/v1/chat/completions``. Validation is explicit so that every bad field gets a 400 naming it."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from ..decoding.sampling import SamplingParams
from ..errors import JakiroError

MAX_STOP = 4
ROLES = ("system", "developer", "user", "assistant", "tool", "function")
MAX_ECHO = 64  # characters of a client-supplied name quoted back in an error message


class APIError(Exception):
    """An error returned to the client as ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


@dataclass
class GenRequest:
    """A validated request, ready for the engine (prompt as token ids or chat messages)."""
    kind: str  # "chat" or "completion"
    model: str
    prompt: object  # messages (chat), a string or token ids (completion)
    max_tokens: int | None
    sampling: SamplingParams
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    tools: list | None = None  # OpenAI function tools, for templates that render them


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, integers over the digit limit
        raise bad(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise bad("the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    _reject_lone_surrogates(body)
    return body


def _reject_lone_surrogates(body) -> None:
    """JSON may escape half a UTF-16 pair (``"\\ud800"``), which no tokenizer (or UTF-8 encoder)
    accepts: refuse it here, naming the field."""
    stack = [(body, None)]
    while stack:
        value, field_ = stack.pop()
        if isinstance(value, dict):
            for k, v in value.items():
                stack.append((k, field_ or k))
                stack.append((v, field_ or k))
        elif isinstance(value, list):
            stack.extend((v, field_) for v in value)
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise bad("the request contains a lone UTF-16 surrogate (invalid Unicode text)", field_) from None


def clip(text: str) -> str:
    return text if len(text) <= MAX_ECHO else text[:MAX_ECHO] + "..."


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _optional(body: dict, name: str, check, what: str, default=None):
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise bad(f"'{name}' must be {what}, got {json.dumps(value)[:80]}", name)
    return value


def _sampling(body: dict) -> SamplingParams:
    temperature = _optional(body, "temperature", _is_number, "a number", 1.0)
    if not 0 <= temperature <= 2:
        raise bad(f"'temperature' must be between 0 and 2, got {temperature}", "temperature")
    top_p = _optional(body, "top_p", _is_number, "a number", 1.0)
    if not 0 < top_p <= 1:
        raise bad(f"'top_p' must be in (0, 1], got {top_p}", "top_p")
    top_k = _optional(body, "top_k", lambda v: _is_int(v) and v >= 0 or v == -1, "a non-negative integer", 0)
    seed = _optional(body, "seed", _is_int, "an integer")
    try:
        return SamplingParams(float(temperature), float(top_p), max(0, top_k), seed)
    except JakiroError as exc:
        raise bad(str(exc), str(exc).split(" ", 1)[0] if str(exc).startswith("seed") else None) from None


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad("'stop' must be a string or a list of strings", "stop")
    if len(stop) > MAX_STOP:
        raise bad(f"'stop' takes at most {MAX_STOP} sequences, got {len(stop)}", "stop")
    return [s for s in stop if s]


def _unsupported(body: dict) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise bad("only n = 1 is supported", "n")
    for name in ("frequency_penalty", "presence_penalty"):
        v = body.get(name)
        if v is not None and v != 0:
            raise bad(f"'{name}' is not supported (lossless speculative decoding samples the model as is)", name)
    if body.get("logprobs") not in (None, False, 0):
        raise bad("'logprobs' is not supported", "logprobs")
    if body.get("echo"):
        raise bad("'echo' is not supported", "echo")
    if body.get("suffix"):
        raise bad("'suffix' is not supported", "suffix")


def _common(body: dict, kind: str, prompt, served: list[str]) -> GenRequest:
    model = body.get("model")
    if model is None:
        raise bad("you must provide a model parameter", "model")
    if not isinstance(model, str):
        raise bad("'model' must be a string", "model")
    if model not in served:
        raise APIError(404, f"the model '{clip(model)}' does not exist (this server has: {', '.join(served)})",
                       "model", "model_not_found")
    _unsupported(body)
    names = ("max_completion_tokens", "max_tokens") if kind == "chat" else ("max_tokens",)
    max_tokens = None
    for name in names:
        value = _optional(body, name, _is_int, "an integer")
        if value is not None:
            if value < 1:
                raise bad(f"'{name}' must be at least 1, got {value}", name)
            max_tokens = value
            break
    stream = _optional(body, "stream", lambda v: isinstance(v, bool), "a boolean", False)
    options = _optional(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise bad("'stream_options.include_usage' must be a boolean", "stream_options")
    tools = _optional(body, "tools", lambda v: isinstance(v, list) and all(isinstance(t, dict) for t in v),
                      "a list of tool objects")
    return GenRequest(kind, model, prompt, max_tokens, _sampling(body), _stop(body), stream, include_usage,
                      tools or None)


def _message_text(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"messages[{i}].content: only text parts are supported", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"messages[{i}].content must be a string or a list of text parts", "messages")


def parse_chat(body: dict, served: list[str]) -> GenRequest:
    messages = body.get("messages")
    if messages is None:
        raise bad("'messages' is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object with 'role' and 'content'", "messages")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {json.dumps(role)[:MAX_ECHO]}",
                      "messages")
        calls = m.get("tool_calls")
        if calls is not None and (role != "assistant" or not isinstance(calls, list)
                                  or not all(isinstance(c, dict) for c in calls)):
            raise bad(f"messages[{i}].tool_calls must be a list of objects on an assistant message", "messages")
        if m.get("content") is None and not (role == "assistant" and (calls or m.get("function_call"))):
            raise bad(f"messages[{i}].content is required", "messages")
        out = {"role": "system" if role == "developer" else role,
               "content": "" if m.get("content") is None else _message_text(m["content"], i)}
        if calls:
            out["tool_calls"] = [_tool_call(c, i) for c in calls]
        elif isinstance(m.get("function_call"), dict):  # the older single-call form
            out["tool_calls"] = [_tool_call({"type": "function", "function": m["function_call"]}, i)]
        for key in ("name", "tool_call_id"):
            if isinstance(m.get(key), str):
                out[key] = m[key]
        clean.append(out)
    return _common(body, "chat", clean, served)


def _tool_call(call: dict, i: int) -> dict:
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad(f"messages[{i}].tool_calls: each call needs a function with a name", "messages")
    args = fn.get("arguments", "{}")
    if not isinstance(args, str):
        args = json.dumps(args)
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def render_tools(messages: list[dict], tools: list | None, template_has_tools: bool) -> tuple[list[dict], list | None]:
    """Messages and tools for the chat template. A template that renders tools gets them as they
    are (arguments parsed back to objects, as Hugging Face templates expect). Otherwise the plain
    rendering: tool calls are appended to the assistant's text as ``<tool_call>{json}</tool_call>``,
    tool and function results become user turns wrapped in ``<tool_response>`` tags, and the
    tools are listed in a system message (the Hermes/Qwen2.5 conventions)."""
    if template_has_tools:
        out = []
        for m in messages:
            m = dict(m)
            if "tool_calls" in m:
                m["tool_calls"] = [{**c, "function": {"name": c["function"]["name"],
                                                      "arguments": _loads_or_text(c["function"]["arguments"])}}
                                   for c in m["tool_calls"]]
            out.append(m)
        return out, tools
    out = []
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        out.append({"role": "system", "content": "You may call these functions. To call one, answer with "
                    "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.\n" + listing})
    for m in messages:
        if m["role"] in ("tool", "function"):
            name = f' name="{m["name"]}"' if m.get("name") else ""
            out.append({"role": "user", "content": f"<tool_response{name}>\n{m['content']}\n</tool_response>"})
        elif m.get("tool_calls"):
            calls = "".join(f"\n<tool_call>{json.dumps({'name': c['function']['name'], 'arguments': _loads_or_text(c['function']['arguments'])}, ensure_ascii=False)}</tool_call>"
                            for c in m["tool_calls"])
            out.append({"role": m["role"], "content": (m["content"] + calls).lstrip("\n")})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return out, None


def _loads_or_text(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def parse_completion(body: dict, served: list[str]) -> GenRequest:
    prompt = body.get("prompt")
    if prompt is None:
        raise bad("'prompt' is required", "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if not prompt or not all(_is_int(t) and t >= 0 for t in prompt):
            raise bad("'prompt' must be a string, a list of token ids, or a list with one of those "
                      "(batches of several prompts are not supported)", "prompt")
    elif not isinstance(prompt, str) or not prompt:
        raise bad("'prompt' must be a non-empty string or a list of token ids", "prompt")
    return _common(body, "completion", prompt, served)


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(result) -> dict:
    m = result.metrics
    return {"prompt_tokens": m.prompt_tokens, "completion_tokens": m.new_tokens,
            "total_tokens": m.prompt_tokens + m.new_tokens,
            "prompt_tokens_details": {"cached_tokens": m.cached_tokens},
            "tau": round(m.tau, 4), "target_forwards": m.target_forwards,
            "accepted_tokens": max(0, m.committed - m.target_forwards),
            "accept_rate_per_depth": [round(r, 4) for r in m.accept_rate_per_depth],
            "tokens_per_s": round(m.tokens_per_s, 2), "method": result.method}


def response(req: GenRequest, rid: str, created: int, result) -> dict:
    if req.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": result.text},
                  "logprobs": None, "finish_reason": result.finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": result.finish_reason}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [choice],
            "usage": usage(result)}


def chunk(req: GenRequest, rid: str, created: int, text: str | None = None,
          finish_reason: str | None = None, first: bool = False, usage_: dict | None = None) -> dict:
    if usage_ is not None:
        choices = []
    elif req.kind == "chat":
        delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text is not None else {})
        choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
    else:
        choices = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}]
    out = {"id": rid, "object": "chat.completion.chunk" if req.kind == "chat" else "text_completion",
           "created": created, "model": req.model, "choices": choices}
    if usage_ is not None:
        out["usage"] = usage_
    return out


def now() -> int:
    return int(time.time())
