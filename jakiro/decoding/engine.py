"""The text layer over the id core (``decoder``): prompts rendered to token ids, answers streamed
back as text with stop strings; used by the API, the server, chat and the benchmark."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

from ..errors import JakiroError
from ..settings import DecodeSettings
from .batch import BatchDecoder
from .decoder import Decoded, Decoder, Metrics  # noqa: F401 (Metrics: imported from here too)
from .proposers import Proposer
from .sampling import SamplingParams
from .text import TextTracker, render_prompt


DEFAULT_MAX_NEW_TOKENS = DecodeSettings.max_new_tokens  # (a plain default: the dataclass's class attribute)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    metrics: Metrics
    method: str


class Engine:
    """A target's decoder with its tokenizer: text (or messages, or ids) in, text out."""

    def __init__(self, target, tokenizer, proposer: Proposer | None = None, tuned: str | None = None,
                 prompt_cache: bool = False):
        """``tuned``: the `jakiro tune` record whose tree the proposer drafts, if any (reported);
        ``prompt_cache``: a request starts from what the last one left in the KV cache where its
        prompt starts the same way (``decoding.prompt_cache``)."""
        self.tokenizer = tokenizer
        self.decoder = Decoder(target, proposer, _eos_ids(target, tokenizer), prompt_cache)
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

    def generate(self, prompt, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, sampling: SamplingParams | None = None,
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

    def stream(self, prompt, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, sampling: SamplingParams | None = None,
               stop: list[str] | None = None, chat: bool = True) -> Iterator[str]:
        """Yield text as it is committed; the generator's return value is the GenerationResult."""
        ids = self.encode(prompt, chat)
        text = self.text_of(stop)
        run = self.decoder.run(ids, max_new_tokens, sampling, text.stop_rule)
        while True:
            try:
                next(run)
            except StopIteration as done:
                answer: Decoded = done.value
                break
            delta = text.take()
            if delta:
                yield delta
        delta, result = text.finish(answer)
        if delta:
            yield delta
        return result

    def text_of(self, stop: list[str] | None = None) -> "AnswerText":
        """The text layer for one answer decoded on ids (by ``decoder`` or a ``BatchDecoder``)."""
        return AnswerText(self, stop or [])

    def batch(self, slots: int, slot_tokens: int | None = None) -> BatchDecoder:
        """A continuous-batching decoder over this engine's target and proposer (``batch``)."""
        return BatchDecoder(self.decoder, slots, slot_tokens)

    def generate_batch(self, prompts: list, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, sampling=None,
                       stop: list[str] | None = None, chat: bool = True, parallel: int | None = None,
                       slot_tokens: int | None = None) -> list[GenerationResult]:
        """Every prompt's answer, ``parallel`` requests decoded together (default: all of them);
        ``sampling``: one ``SamplingParams`` for all, or one per prompt. Each answer is the one
        ``generate`` gives alone (greedy), or draws from its own seeded generator."""
        if not prompts:
            return []
        params = sampling if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
        if len(params) != len(prompts):
            raise JakiroError(f"{len(params)} sampling settings for {len(prompts)} prompts")
        ids = [self.encode(p, chat) for p in prompts]
        for i in ids:
            self.check_length(len(i), max_new_tokens)
        longest = max(len(i) for i in ids) + max_new_tokens
        batch = self.batch(min(parallel or len(prompts), len(prompts)), slot_tokens or longest)
        texts = [self.text_of(stop) for _ in prompts]
        answers = batch.decode([(i, max_new_tokens, p, t.stop_rule) for i, p, t in zip(ids, params, texts)])
        return [t.finish(a)[1] for t, a in zip(texts, answers)]


class AnswerText:
    """One answer's text as its ids are committed: incremental detokenisation, stop strings as
    the decode core's stop rule (``stop_rule``), the released text (``take``) and the result."""

    def __init__(self, engine: Engine, stop: list[str]):
        self.engine = engine
        self.tracker = TextTracker(engine.tokenizer, stop)
        self._released: list[str] = []

    def stop_rule(self, generated: list[int]) -> int | None:
        """Stop strings on the text of the ids: how many ids to keep when one appears."""
        eos = self.engine.eos_ids
        delta, cut = self.tracker.update([t for t in generated if t not in eos])
        self._released.append(delta)
        return None if cut is None else self.tracker.tokens_before(generated, cut, eos)

    def take(self) -> str:
        """The text released since the last call."""
        text = "".join(self._released)
        self._released.clear()
        return text

    def finish(self, answer: Decoded) -> tuple[str, GenerationResult]:
        """The last of the text and the whole result."""
        delta = self.take() + self.tracker.flush()
        return delta, GenerationResult(self.tracker.text, answer.token_ids, answer.finish_reason, answer.metrics,
                                       self.engine.method)


def _eos_ids(target, tokenizer) -> set[int]:
    ids: set[int] = set()
    for value in (getattr(target.hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids
