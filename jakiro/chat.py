"""``jakiro chat``: an interactive terminal chat with streamed replies, conversation history,
``/reset``, ``/stats`` and per-turn tau and tokens/s."""

from __future__ import annotations

import importlib
import sys
from typing import TextIO

from .decoding.engine import Metrics
from .settings import DecodeSettings
from .errors import JakiroError

HELP = "commands: /reset (forget the conversation), /stats (session figures), /help, /quit"


class ChatSession:
    def __init__(self, engine, settings: DecodeSettings | None = None, system: str | None = None):
        """``settings``: each reply's decoding (``DecodeSettings``); ``system``: the system prompt."""
        settings = settings or DecodeSettings()
        self.engine, self.sampling = engine, settings.sampling()
        self.max_new_tokens, self.system, self.stop = settings.max_new_tokens, system, list(settings.stop)
        self.reset()

    def reset(self) -> None:
        self.history: list[dict] = [{"role": "system", "content": self.system}] if self.system else []
        self.turns = 0
        self.total = Metrics()  # the session's turns together

    def _fit(self, messages: list[dict]) -> tuple[list[int], int]:
        """Token ids of the conversation, dropping the oldest exchanges (in place) until the reply
        fits; returns the ids and how many earlier messages were dropped."""
        ctx = self.engine.target.config.max_context
        keep_system = 1 if self.system else 0
        dropped = 0
        while True:
            ids = self.engine.encode(messages)
            if len(ids) + self.max_new_tokens <= ctx:
                return ids, dropped
            if len(messages) - keep_system <= 1:
                raise JakiroError(f"this message ({len(ids)} tokens) and a {self.max_new_tokens}-token reply "
                                  f"do not fit in the model's context ({ctx} tokens)")
            del messages[keep_system:keep_system + 2]  # the oldest user/assistant exchange
            dropped += 2

    def ask(self, text: str, out: TextIO) -> dict:
        messages = self.history + [{"role": "user", "content": text}]
        ids, dropped = self._fit(messages)  # drops from ``messages`` what no longer fits
        if dropped:
            out.write(f"[context full: the {dropped} oldest messages are left out]\n")
        stream = self.engine.stream(ids, self.max_new_tokens, self.sampling, self.stop)
        reply, interrupted, result = [], False, None
        try:
            while True:
                try:
                    delta = next(stream)
                except StopIteration as done:
                    result = done.value
                    break
                reply.append(delta)
                out.write(delta)
                out.flush()
        except KeyboardInterrupt:
            stream.close()
            interrupted = True
        text_out = "".join(reply)
        self.history = messages + [{"role": "assistant", "content": text_out}]
        if interrupted:
            out.write(" [interrupted]\n")
            return {"interrupted": True}
        m = result.metrics
        self.turns += 1
        self.total.merge(m)
        cached = f", {m.cached_tokens} of {m.prompt_tokens} prompt tokens from the cache" if m.cached_tokens else ""
        out.write(f"\n[{m.new_tokens} tokens, {m.tokens_per_s:.1f} tokens/s, tau {m.tau:.2f}, "
                  f"{result.method}; first token after {m.prefill_s:.2f} s{cached}]\n")
        return {"text": text_out, "token_ids": result.token_ids, "tau": m.tau, "tokens_per_s": m.tokens_per_s}

    def stats(self) -> str:
        tau, rate = self.total.tau, self.total.tokens_per_s
        context = len(self.engine.encode(self.history)) if any(m["role"] == "user" for m in self.history) else 0
        return (f"[session: {self.turns} turns, {self.total.new_tokens} tokens, {rate:.1f} tokens/s, tau {tau:.2f}, "
                f"{len(self.history)} messages in history ({context} tokens), method {self.engine.method}]")


def run_chat(session: ChatSession, inp: TextIO = sys.stdin, out: TextIO = sys.stdout) -> int:
    interactive = inp.isatty() and out.isatty()
    if interactive:
        try:
            importlib.import_module("readline")  # line editing and history for input()
        except ImportError:
            pass
    out.write(f"jakiro chat ({session.engine.method}). {HELP}\n")
    out.flush()
    while True:
        try:
            if interactive:
                line = input("you> ")
            else:
                out.write("you> ")
                out.flush()
                line = inp.readline()
                if not line:
                    break
        except (EOFError, KeyboardInterrupt):
            break
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            cmd = line.split()[0].lower()
            if cmd in ("/quit", "/exit"):
                break
            elif cmd == "/reset":
                session.reset()
                out.write("[conversation cleared]\n")
            elif cmd == "/stats":
                out.write(session.stats() + "\n")
            elif cmd == "/help":
                out.write(HELP + "\n")
            else:
                out.write(f"unknown command {cmd}; {HELP}\n")
            out.flush()
            continue
        out.write("bot> ")
        out.flush()
        try:
            session.ask(line, out)
        except JakiroError as exc:
            out.write(f"\nerror: {exc}\n")
        except KeyboardInterrupt:  # before the reply started streaming
            out.write(" [interrupted]\n")
        out.flush()
    out.write("\nbye\n")
    out.flush()
    return 0
