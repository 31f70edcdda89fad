"""The decode loop shared by every method: prefill, then draft -> verify -> commit cycles, with
stop rules (EOS, stop strings, max new tokens), streaming and per-request metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from ..errors import JakiroError
from .proposers import Proposer
from .sampling import SamplingParams, next_token
from .tree import DRAFT, LOOKUP
from . import verify as _verify


@dataclass
class Metrics:
    """One request's counts and times, or the sum of many (``merge``): the one definition of τ,
    acceptance per depth and tokens/s used by the CLI, the benchmark, the server, chat and tune."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    target_forwards: int = 0  # verification forwards (prefill excluded)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    target_s: float = 0.0
    total_s: float = 0.0
    committed: int = 0  # tokens committed by verification forwards (bonus included)
    plain_steps: int = 0  # verification forwards with no draft token (cost-aware drafting backed off)
    accepted_from: dict = field(default_factory=lambda: {"draft": 0, "lookup": 0, "both": 0})
    depth_tried: list[int] = field(default_factory=list)  # cycles whose tree reached depth d+1 ...
    depth_accepted: list[int] = field(default_factory=list)  # ... and the path got past depth d+1

    @property
    def tau(self) -> float:
        """Tokens committed per target verification forward, bonus token included."""
        return self.committed / self.target_forwards if self.target_forwards else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def accept_rate_per_depth(self) -> list[float]:
        return [a / t if t else 0.0 for a, t in zip(self.depth_accepted, self.depth_tried)]

    def record_cycle(self, tree_depth: int, accept_length: int) -> None:
        while len(self.depth_tried) < tree_depth:
            self.depth_tried.append(0)
            self.depth_accepted.append(0)
        for d in range(min(tree_depth, accept_length + 1)):
            self.depth_tried[d] += 1
            if accept_length > d:
                self.depth_accepted[d] += 1

    def merge(self, other: "Metrics") -> "Metrics":
        """Add ``other``'s counts and times to these (in place; returns self)."""
        for name in ("prompt_tokens", "new_tokens", "target_forwards", "prefill_s", "draft_s", "target_s",
                     "total_s", "committed", "plain_steps"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for src, n in other.accepted_from.items():
            self.accepted_from[src] = self.accepted_from.get(src, 0) + n
        for mine, theirs in ((self.depth_tried, other.depth_tried), (self.depth_accepted, other.depth_accepted)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for d, n in enumerate(theirs):
                mine[d] += n
        return self

    @classmethod
    def total(cls, many) -> "Metrics":
        out = cls()
        for m in many:
            out.merge(m)
        return out

    def as_dict(self) -> dict:
        """Every count and time (enough to rebuild the object with ``from_dict``) and the derived
        rates."""
        return {
            "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
            "tokens_per_s": self.tokens_per_s, "tau": self.tau, "committed": self.committed,
            "target_forwards": self.target_forwards, "plain_steps": self.plain_steps,
            "accepted_from": dict(self.accepted_from),
            "accept_rate_per_depth": self.accept_rate_per_depth,
            "depth_tried": list(self.depth_tried), "depth_accepted": list(self.depth_accepted),
            "prefill_s": self.prefill_s, "draft_s": self.draft_s, "target_s": self.target_s,
            "total_s": self.total_s,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Metrics":
        names = cls.__dataclass_fields__
        return cls(**{k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v)
                      for k, v in d.items() if k in names})


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    metrics: Metrics
    method: str


class _TextTracker:
    """Incremental detokenisation with stop strings; releases only text that can no longer be
    cut by a stop string or completed by a later token.

    Each update decodes only the tokens since the last complete character, with a few tokens of
    context before them (so that tokenizers which drop a leading space at the start of a decode
    still produce it): linear in the answer's length, where decoding the whole answer every cycle
    was quadratic."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.emitted = 0
        self.text = ""
        self._prefix = self._read = 0  # token offsets: decode context start, first undecoded token
        self._ids: list[int] = []
        self._stopped = False  # a stop string ended the text

    def _decode_new(self, final: bool = False) -> None:
        ids, decode = self._ids, self.tokenizer.decode
        before = decode(ids[self._prefix:self._read], skip_special_tokens=True)
        after = decode(ids[self._prefix:], skip_special_tokens=True)
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(ids)

    def update(self, ids: list[int]) -> tuple[str, int | None]:
        """``ids``: the answer so far (it only grows); return (new releasable text, index where a
        stop string starts)."""
        self._ids = ids
        self._decode_new()
        cut = None
        for s in self.stop:
            i = self.text.find(s, max(0, self.emitted - len(s)))
            if i >= 0 and (cut is None or i < cut):
                cut = i
        if cut is not None:
            self.text = self.text[:cut]
            self._stopped = True
            return self.flush(), cut
        safe = len(self.text) - self.holdback
        delta = self.text[self.emitted:safe] if safe > self.emitted else ""
        self.emitted += len(delta)
        return delta, None

    def flush(self, final: bool = True) -> str:
        """The rest of the text (with ``final``, also an incomplete last character)."""
        if final and not self._stopped:
            self._decode_new(final=True)
        delta = self.text[self.emitted:]
        self.emitted = len(self.text)
        return delta


class Engine:
    """Runs one request at a time for a target, its tokenizer and a proposer."""

    def __init__(self, target, tokenizer, proposer: Proposer | None = None):
        self.target, self.tokenizer = target, tokenizer
        self.proposer = proposer or Proposer()
        self.eos_ids = _eos_ids(target, tokenizer)
        self.tuned: str | None = None  # the `jakiro tune` record whose tree the proposer drafts

    @property
    def method(self) -> str:
        return self.proposer.name

    def encode(self, prompt, chat: bool = True, tools: list | None = None) -> list[int]:
        """A string (wrapped in the chat template when the tokenizer has one and ``chat``), a
        list of {role, content} messages, or a list of token ids. ``tools`` (OpenAI function
        tools) are passed to templates that render them."""
        tok = self.tokenizer
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if isinstance(prompt, str):
            if not chat or not getattr(tok, "chat_template", None):
                return tok(prompt, add_special_tokens=True).input_ids
            prompt = [{"role": "user", "content": prompt}]
        if not isinstance(prompt, (list, tuple)) or not prompt or not all(
                isinstance(m, dict) and isinstance(m.get("content"), str) and isinstance(m.get("role"), str)
                for m in prompt):
            raise JakiroError("prompt must be a string, token ids, or a non-empty list of "
                              "{'role': str, 'content': str} messages")
        if not getattr(tok, "chat_template", None):
            raise JakiroError("this tokenizer has no chat template: pass a plain string prompt")
        text = tok.apply_chat_template(list(prompt), tools=tools, add_generation_prompt=True, tokenize=False)
        return tok(text, add_special_tokens=False).input_ids

    def check_length(self, prompt_len: int, max_new_tokens: int) -> None:
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise JakiroError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        ctx = self.target.config.max_context
        if prompt_len + max_new_tokens > ctx:
            raise JakiroError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) "
                              f"exceeds the model's context length ({ctx})")

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

    def _tokens_before(self, generated: list[int], cut: int) -> int:
        """The fewest leading tokens of ``generated`` whose text reaches character ``cut`` (where
        a stop string starts): the token holding the stop string's first character is the last
        one kept, or none when the stop string starts on a token boundary."""
        keep = len(generated)
        while keep > 0 and len(self.tokenizer.decode(
                [t for t in generated[:keep - 1] if t not in self.eos_ids], skip_special_tokens=True)) >= cut:
            keep -= 1
        return keep

    @torch.inference_mode()
    def stream(self, prompt, max_new_tokens: int = 128, sampling: SamplingParams | None = None,
               stop: list[str] | None = None, chat: bool = True) -> Iterator[str]:
        """Yield text as it is committed; the generator's return value is the GenerationResult."""
        params = sampling or SamplingParams()
        ids = self.encode(prompt, chat)
        if not ids:
            raise JakiroError("the prompt is empty")
        self.check_length(len(ids), max_new_tokens)
        generator = params.generator()
        target, proposer = self.target, self.proposer
        metrics = Metrics(prompt_tokens=len(ids))
        tracker = _TextTracker(self.tokenizer, stop or [])
        t_start = time.perf_counter()
        cache = target.new_cache(len(ids) + max_new_tokens, scratch=proposer.max_tree_tokens)
        proposer.start(len(ids) + max_new_tokens)
        logits, feats = target(torch.tensor(ids), cache, logits_rows=slice(-1, None))
        cache.commit(len(ids))
        first = next_token(logits[0], params, generator)
        metrics.prefill_s = time.perf_counter() - t_start
        if proposer.needs_features:
            proposer.observe(feats, torch.tensor(ids[1:] + [first]))
        context = list(ids)
        generated: list[int] = []
        finish = None
        pending, pending_sources = [first], [None]
        sources: list[str | None] = []  # per generated token: which proposal it was accepted from
        while True:
            # commit pending tokens one by one so that stop rules cut at the exact token
            for tok, src in zip(pending, pending_sources):
                generated.append(tok)
                sources.append(src)
                context.append(tok)
                if tok in self.eos_ids:
                    finish = "stop"
                    break
                if len(generated) >= max_new_tokens:
                    finish = "length"
                    break
            delta, cut = tracker.update([t for t in generated if t not in self.eos_ids])
            if delta:
                yield delta
            if cut is not None:
                finish = "stop"
                kept = self._tokens_before(generated, cut)
                del generated[kept:]  # token ids end where the text does
                del sources[kept:]
            if finish:
                break
            t0 = time.perf_counter()
            tree = proposer.propose(context)
            t1 = time.perf_counter()
            if tree.size > 1:
                logits, feats = target(tree.tokens, cache, position_ids=cache.length + tree.depths,
                                       tree_mask=tree.tree_mask)
            else:
                logits, feats = target(tree.tokens, cache)
            verdict = _verify.verify(tree, logits, params, generator)
            proposer.feedback(tree, verdict)
            cache.keep(verdict.accepted)
            t2 = time.perf_counter()
            metrics.draft_s += t1 - t0
            metrics.target_s += t2 - t1
            metrics.target_forwards += 1
            metrics.plain_steps += tree.size == 1
            pending = tree.tokens[verdict.accepted[1:]].tolist() + [verdict.bonus]
            pending_sources = ([_SOURCE_NAMES[s] for s in tree.sources[verdict.accepted[1:]].tolist()]
                               if tree.sources is not None else [None] * verdict.accept_length) + [None]
            metrics.record_cycle(int(tree.depths.max()), verdict.accept_length)
            if proposer.needs_features:
                proposer.observe(feats[verdict.accepted], torch.tensor(pending))
        tail = tracker.flush()
        if tail:
            yield tail
        metrics.new_tokens = len(generated)
        # every kept token but the prefill's first came from a verification cycle: τ counts those
        # (not tokens verified past EOS, the length limit or a stop string)
        metrics.committed = max(0, len(generated) - 1)
        for src in sources:
            if src is not None:
                metrics.accepted_from[src] += 1
        metrics.total_s = time.perf_counter() - t_start
        return GenerationResult(tracker.text, generated, finish, metrics, self.method)


_SOURCE_NAMES = {DRAFT: "draft", LOOKUP: "lookup", DRAFT | LOOKUP: "both"}


def _eos_ids(target, tokenizer) -> set[int]:
    ids: set[int] = set()
    for value in (getattr(target.hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids
