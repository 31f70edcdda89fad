"""Self-distilled conversations: the target answers the user turns of many conversations at once.

Continuous batching: ``batch`` conversations are decoded together, one token per conversation per
target forward (``TargetModel.decode_batch``, per-sequence KV and lengths, no padding); when an
answer ends, its slot goes on with the conversation's next user turn, or with the next
conversation: its prompt is prefilled (only what the slot does not hold already: the earlier turns,
the chat template's system prompt) or, on a GPU (``feed_prompts``), fed one token per forward
beside the other slots' answers, so that it costs no forward of its own: there a forward over the
batch takes about as long as one over a single prompt, and a separate prefill per finished answer
took most of the time. Each conversation keeps its multi-turn structure and is bounded by
``max_len`` tokens (what training reads). Degenerate loops (a block of tokens repeated three times
in a row) are cut after the second copy and counted. Finished conversations are appended to a
JSONL file, so a killed run resumes where it stopped and features can be rebuilt from the file.

The target's features come out of the same forwards (``collect``): a slot keeps the feature of
every token whose key it holds, and a finished conversation, tokenised as training reads it,
takes them for the tokens it shares with what the slot decoded (all but the template's closing
tokens, as a rule), the rest from one short forward on the slot's cache. No second pass over the
conversation is needed.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from ..decoding.sampling import SamplingParams, processed_probs, sample_rows
from ..models.target import half_features
from .regen_settings import RegenSettings, RegenStats, repeated_tail

MIN_ANSWER_ROOM = 16  # tokens an answer must be allowed before a turn is worth prefilling


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class _Conversation:
    index: int
    source: list[dict]
    sampled: bool
    out: list[dict] = field(default_factory=list)
    pos: int = 0  # next source message
    prompt_len: int = 0
    answer: list[int] = field(default_factory=list)
    generated: int = 0
    cut: int = 0
    truncated: bool = False  # the current answer was cut (loop) or hit a length limit
    writing_user: bool = False  # the slot is writing a user turn (``answer`` holds its tokens)
    prompt_rejected: bool = False  # the user turn it wrote was dropped (the conversation ends)
    fed: list[int] = field(default_factory=list)  # the tokens whose keys and values the slot holds
    pending: list[int] = field(default_factory=list)  # prompt tokens still to feed, last first


# a finished conversation's training ids, loss mask and features [n, d] (float16), by the
# position of its line in the output file
Collect = Callable[[dict, list[int], list[int], torch.Tensor], None]


class Regenerator:
    """Runs the batched generation loop for one target and tokenizer. ``tokenize`` (messages ->
    (ids, loss mask) or None, as training reads a conversation) and ``collect`` together turn on
    the features of finished conversations (see the module docstring)."""

    def __init__(self, target, tokenizer, eos_ids: set[int], settings: RegenSettings,
                 tokenize: Callable[[list[dict]], tuple[list[int], list[int]] | None] | None = None,
                 collect: Collect | None = None, admit: Callable[[list[dict]], bool] | None = None):
        """``admit`` (the messages so far, ending in a user turn the target wrote -> keep it?): the
        evaluation filter for prompts that exist only once written."""
        self.target, self.tokenizer, self.eos_ids, self.s = target, tokenizer, eos_ids, settings
        self.admit = admit
        self._dropped: Callable[[int], None] | None = None
        self.sampling = SamplingParams(settings.temperature, settings.top_p)
        self.prompt_sampling = SamplingParams(settings.prompt_temperature, settings.prompt_top_p)
        # on the target's device (a ``DeviceTarget`` keeps its logits there)
        self.device = getattr(target, "device", torch.device("cpu"))
        self.generator = torch.Generator(device=self.device).manual_seed(settings.seed)
        self.stats = RegenStats()
        self.tokenize, self.collect = tokenize, collect
        # mid-layer streams are asked of the target only where features are collected
        self.aux_layers = settings.aux_layers if collect is not None else ()
        self.slot_features: torch.Tensor | None = None  # [batch, max_len + 1, d] float16
        self.feed_prompts = settings.feed_prompts if settings.feed_prompts is not None else self.device.type != "cpu"

    def run(self, jobs: Iterator[tuple[int, list[dict]]], write: Callable[[dict], None],
            on_step: Callable[[RegenStats], None] | None = None,
            dropped: Callable[[int], None] | None = None) -> RegenStats:
        """Answer every conversation that ``jobs`` yields ((source index, messages)); ``write``
        receives each finished conversation, ``dropped`` the index of each one that ends with
        no answer (its prompt too long, or a prompt the target wrote refused)."""
        self._dropped = dropped
        s = self.s
        B = s.batch
        cache = self.target.new_batch_cache(B, s.max_len + 1)
        if self.collect is not None:
            width = (1 + len(self.aux_layers)) * self.target.config.hidden_size
            self.slot_features = torch.zeros(B, s.max_len + 1, width, dtype=torch.float16, device=self.device)
        slots: list[_Conversation | None] = [None] * B
        # the tokens whose keys and values each slot holds: a new conversation prefills only what
        # its prompt does not share with them (the chat template's system prompt, as a rule)
        self._slot_fed: list[list[int]] = [[] for _ in range(B)]
        tokens = torch.zeros(B, dtype=torch.long)
        t0 = time.perf_counter()
        for b in range(B):
            self._refill(b, slots, cache, tokens, jobs, write)
        rows = torch.arange(B, device=self.device)
        while any(slots):
            if s.max_seconds and time.perf_counter() - t0 > s.max_seconds:
                self.stats.stopped_in_flight = sum(c is not None for c in slots)
                break
            logits, features = self.target.decode_batch(tokens, cache, self.aux_layers)  # [B, vocab], [B, width]
            self.stats.batch_forwards += 1
            if self.slot_features is not None:
                self.slot_features[rows, cache.device_lengths()[0]] = half_features(features)
            cache.advance()
            chosen = self._choose(logits, slots).tolist()
            fed = tokens.tolist()
            for b, conv in enumerate(slots):
                if conv is None:
                    cache.set_length(b, 0)
                    continue
                conv.fed.append(fed[b])
                if conv.pending:  # still feeding its prompt: what it would choose is not asked yet
                    tokens[b] = conv.pending.pop()
                elif self._accept(conv, chosen[b]):
                    tokens[b] = chosen[b]
                else:
                    self._next_turn(b, slots, cache, tokens, jobs, write)
            self.stats.seconds = time.perf_counter() - t0
            if on_step:
                on_step(self.stats)
        return self.stats

    # ------------------------------------------------------------------ per slot
    def _choose(self, logits: torch.Tensor, slots) -> torch.Tensor:
        chosen = logits.argmax(-1)
        for params, writing_user, sampled in ((self.sampling, False, True), (self.prompt_sampling, True, None)):
            rows = [b for b, c in enumerate(slots) if c is not None and not c.pending
                    and c.writing_user == writing_user and (sampled is None or c.sampled)]
            if rows:
                chosen[rows] = sample_rows(processed_probs(logits[rows], params), self.generator)
        return chosen

    def _accept(self, conv: _Conversation, tok: int) -> bool:
        """Add a token to the answer; False when the answer is complete."""
        if tok in self.eos_ids:
            return False
        conv.answer.append(tok)
        cut = repeated_tail(conv.answer)
        if cut is not None:
            conv.cut += len(conv.answer) - cut
            del conv.answer[cut:]
            self.stats.cut_answers += 1
            conv.truncated = True
            return False
        limit = self.s.max_prompt_tokens if conv.writing_user else self.s.max_new_tokens
        if len(conv.answer) >= limit or conv.prompt_len + len(conv.answer) >= self.s.max_len:
            self.stats.length_limited_answers += not conv.writing_user
            conv.truncated = True
            return False
        return True

    def _end_answer(self, conv: _Conversation) -> bool:
        """Store the finished answer; False when the conversation cannot go on."""
        truncated, conv.truncated = conv.truncated, False
        text = self.tokenizer.decode(conv.answer, skip_special_tokens=True)
        if conv.writing_user:  # a user turn the target wrote: kept whole and admitted, or the end
            conv.writing_user = False
            message = {"role": "user", "content": text.strip()}
            if truncated or not message["content"] or (self.admit is not None and not self.admit(conv.out + [message])):
                self.stats.prompts_rejected += 1
                conv.prompt_rejected = True
                return False
            conv.out.append(message)
            conv.pos += 1
            self.stats.prompts_written += 1
            self.stats.prompt_tokens += len(conv.answer)
            return True
        if not text.strip():
            return False
        message = {"role": "assistant", "content": text}
        if truncated:
            message["truncated"] = True
        conv.out.append(message)
        conv.generated += len(conv.answer)
        self.stats.answers += 1
        self.stats.generated_tokens += len(conv.answer)
        conv.pos += 1  # the source's own answer is replaced
        return True

    def _start_turn(self, b: int, conv: _Conversation, cache, tokens) -> bool:
        """Prefill the conversation up to its next answer (or a user turn the target writes) into
        slot b; False when it has no further user turn or no room for one."""
        while conv.pos < len(conv.source) and conv.source[conv.pos]["role"] != "assistant":
            if conv.source[conv.pos]["role"] == "user" and conv.source[conv.pos].get("content") is None:
                conv.writing_user = True
                return self._prefill(b, conv, cache, tokens, self._user_header(conv.out))
            conv.out.append(conv.source[conv.pos])
            conv.pos += 1
        if conv.pos >= len(conv.source):
            return False
        return self._prefill(b, conv, cache, tokens,
                             self.tokenizer.apply_chat_template(conv.out, add_generation_prompt=True, tokenize=False))

    def _user_header(self, messages: list[dict]) -> str:
        """The chat template's text before a new user turn's content (its default system prompt
        included where it adds one)."""
        mark = "\u0000USER\u0000"
        text = self.tokenizer.apply_chat_template(messages + [{"role": "user", "content": mark}], tokenize=False)
        return text[:text.index(mark)]

    def _prefill(self, b: int, conv: _Conversation, cache, tokens, text: str) -> bool:
        """Start slot b on ``text`` (the conversation so far, ending where the target writes) and
        choose what the target writes first, at once or (``feed_prompts``) after its tokens have
        been fed one per forward; False when there is no room for what follows."""
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        if len(ids) + MIN_ANSWER_ROOM > self.s.max_len:
            return False
        # the slot already holds the conversation so far where the new prompt repeats it token for
        # token (the earlier turns, as prefilled and answered): only the rest is prefilled
        keep = min(_common_prefix(conv.fed, ids), len(ids) - 1)
        self.stats.reused_prompt_tokens += keep
        conv.prompt_len, conv.answer, conv.truncated = len(ids), [], False
        if self.feed_prompts:
            cache.set_length(b, keep)
            conv.fed, conv.pending = ids[:keep], ids[:keep:-1]  # ids[keep + 1:], last first
            tokens[b] = ids[keep]
            self.stats.fed_prompt_tokens += len(ids) - keep
            return True
        slot = cache.slot(b)
        slot.length = keep
        logits, features = self.target(torch.tensor(ids[keep:]), slot, logits_rows=slice(-1, None), chunked=True,
                                       aux_layers=self.aux_layers)
        self.stats.prefill_forwards += 1
        if self.slot_features is not None:
            self.slot_features[b, keep:len(ids)] = half_features(features)
        cache.set_length(b, len(ids))
        conv.fed = ids
        first = int(self._choose(logits, [conv])[0])
        if not self._accept(conv, first):
            return self._end_answer(conv) and self._start_turn(b, conv, cache, tokens)
        tokens[b] = first
        return True

    def _next_turn(self, b, slots, cache, tokens, jobs, write) -> None:
        conv = slots[b]
        if self._end_answer(conv) and self._start_turn(b, conv, cache, tokens):
            return
        self._finish(b, conv, cache, write)
        self._refill(b, slots, cache, tokens, jobs, write)

    def _finish(self, b: int, conv: _Conversation, cache, write) -> None:
        self.stats.cut_tokens += conv.cut
        self._slot_fed[b] = conv.fed
        answered = [m for m in conv.out if m.get("role") == "assistant"]
        if not answered:
            if self._dropped is not None:
                self._dropped(conv.index)
            return
        while conv.out and conv.out[-1].get("role") != "assistant":
            conv.out.pop()  # a trailing user turn that got no answer
        self.stats.conversations += 1
        record = {"source_index": conv.index, "messages": conv.out, "generated_tokens": conv.generated,
                  "cut_tokens": conv.cut, "mode": "sample" if conv.sampled else "greedy"}
        write(record)
        if self.collect is not None:
            self._collect(b, conv, cache, record)

    def _collect(self, b: int, conv: _Conversation, cache, record: dict) -> None:
        """Hand the finished conversation's training ids, mask and features to ``collect``: the
        slot's features where its tokens agree with the training tokenisation, one forward on the
        slot's cache for the rest (the closing tokens the decoding never fed)."""
        tok = self.tokenize(conv.out)
        if tok is None:
            return
        ids, mask = tok
        common = _common_prefix(conv.fed, ids)
        features = self.slot_features[b, :common]
        if common < len(ids):
            slot = cache.slot(b)
            slot.length = common
            _, rest = self.target(torch.tensor(ids[common:]), slot, logits_rows=slice(0, 0),
                                  aux_layers=self.aux_layers)
            features = torch.cat((features, half_features(rest)))
            self.slot_features[b, common:len(ids)] = features[common:]
            self._slot_fed[b] = ids  # the slot now holds the training tokens
            self.stats.feature_tokens_computed += len(ids) - common
        self.stats.feature_tokens_reused += common
        self.collect(record, ids, mask, features.to("cpu", copy=True))

    def _refill(self, b, slots, cache, tokens, jobs, write) -> None:
        for index, messages in jobs:
            conv = _Conversation(index, messages, self._sampled(index), fed=self._slot_fed[b])
            if self._start_turn(b, conv, cache, tokens):
                slots[b] = conv
                return
            if not conv.prompt_rejected and not any(m.get("role") == "assistant" for m in conv.out):
                self.stats.skipped_too_long += 1
            self._finish(b, conv, cache, write)
        slots[b] = None
        cache.set_length(b, 0)

    def _sampled(self, index: int) -> bool:
        if self.s.mode == "sample":
            return True
        if self.s.sample_share <= 0:
            return False
        # a fixed, seed-dependent choice per conversation, so that a resumed run agrees
        g = torch.Generator().manual_seed(self.s.seed * 1_000_003 + index)
        return float(torch.rand(1, generator=g)) < self.s.sample_share


def read_done(path: str) -> set[int]:
    """Source indices already regenerated in ``path``; a torn last line (killed mid-write) is
    removed so that appending continues cleanly."""
    if not os.path.exists(path):
        return set()
    with open(path, "rb") as f:
        data = f.read()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
    done = set()
    for line in data[:end].splitlines():
        if line.strip():
            done.add(int(json.loads(line)["source_index"]))
    return done
