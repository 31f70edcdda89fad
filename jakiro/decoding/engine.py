"""The text layer over the id core (``decoder``): prompts rendered to token ids, answers streamed
back as text with stop strings; used by the API, the server, chat and the benchmark."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

from .decoder import Decoded, Decoder, Metrics  # noqa: F401 (Metrics: imported from here too)
from .proposers import Proposer
from .sampling import SamplingParams
from .text import TextTracker, render_prompt


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    metrics: Metrics
    method: str


class Engine:
    """A target's decoder with its tokenizer: text (or messages, or ids) in, text out."""

    def __init__(self, target, tokenizer, proposer: Proposer | None = None, tuned: str | None = None):
        """``tuned``: the `jakiro tune` record whose tree the proposer drafts, if any (reported)."""
        self.tokenizer = tokenizer
        self.decoder = Decoder(target, proposer, _eos_ids(target, tokenizer))
        self.target, self.proposer, self.eos_ids = target, self.decoder.proposer, self.decoder.eos_ids
        self.tuned = tuned

    @property
    def method(self) -> str:
        return self.decoder.method

    def encode(self, prompt, chat: bool = True, tools: list | None = None) -> list[int]:
        """The prompt's token ids (``text.render_prompt`` with this engine's tokenizer)."""
        return render_prompt(self.tokenizer, prompt, chat, tools)

    def check_length(self, prompt_len: int, max_new_tokens: int) -> None:
        self.decoder.check_length(prompt_len, max_new_tokens)

    def generate(self, prompt, max_new_tokens: int = 128, sampling: SamplingParams | None = None,
                 stop: list[str] | None = None, chat: bool = True,
                 on_text: Callable[[str], None] | None = None) -> GenerationResult:
        stream = self.stream(prompt, max_new_tokens, sampling, stop, chat)
        while True:
            try:
                delta = next(stream)
            except StopIteration as done:
                return done.value
            if on_text is not None and delta:
                on_text(delta)

    def stream(self, prompt, max_new_tokens: int = 128, sampling: SamplingParams | None = None,
               stop: list[str] | None = None, chat: bool = True) -> Iterator[str]:
        """Yield text as it is committed; the generator's return value is the GenerationResult."""
        ids = self.encode(prompt, chat)
        tracker = TextTracker(self.tokenizer, stop or [])
        released: list[str] = []

        def stop_rule(generated: list[int]) -> int | None:
            """Stop strings on the text of the ids: how many ids to keep when one appears."""
            delta, cut = tracker.update([t for t in generated if t not in self.eos_ids])
            released.append(delta)
            return None if cut is None else tracker.tokens_before(generated, cut, self.eos_ids)

        run = self.decoder.run(ids, max_new_tokens, sampling, stop_rule)
        while True:
            try:
                next(run)
            except StopIteration as done:
                answer: Decoded = done.value
                break
            text = "".join(released)
            released.clear()
            if text:
                yield text
        text = "".join(released) + tracker.flush()
        if text:
            yield text
        return GenerationResult(tracker.text, answer.token_ids, answer.finish_reason, answer.metrics, self.method)


def _eos_ids(target, tokenizer) -> set[int]:
    ids: set[int] = set()
    for value in (getattr(target.hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids
