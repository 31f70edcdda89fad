"""Keep evaluation questions out of training data, and drop repeated prompts.

A training conversation is *contaminated* when one of its user turns equals an evaluation prompt
after normalisation (lower case, runs of non-alphanumerics to one space) or shares a run of
``NGRAM`` normalised words with one. The evaluation prompts are MT-bench (installed package), the
Spec-Bench development file (when present) and HumanEval (installed package).
"""

from __future__ import annotations

import re

from .questions import mtbench_path, read_humaneval, read_questions, spec_bench_path

NGRAM = 13  # words; the usual decontamination length for instruction data


def normalise_text(text: str) -> str:
    return re.sub(r"[^0-9a-z]+", " ", text.lower()).strip()


def _ngrams(words: list[str], n: int = NGRAM):
    return (hash(tuple(words[i:i + n])) for i in range(len(words) - n + 1))


def evaluation_prompts() -> list[str]:
    """Every evaluation prompt this project benchmarks on that is installed or present here."""
    texts = [t for q in read_questions(mtbench_path()) for t in q["turns"]]
    spec = spec_bench_path()
    if spec:
        texts += [t for q in read_questions(spec) for t in q["turns"]]
    texts += [p["prompt"] for p in read_humaneval()]
    return texts


class PromptFilter:
    """Decides which conversations may enter training data; counts what it removed."""

    def __init__(self, evaluation: list[str]):
        self.exact = {normalise_text(t) for t in evaluation}
        self.ngrams: set[int] = set()
        for t in evaluation:
            self.ngrams.update(_ngrams(normalise_text(t).split()))
        self.seen_first_turns: set[str] = set()
        self.contaminated = 0
        self.duplicates = 0

    def is_contaminated(self, messages: list[dict]) -> bool:
        for m in messages:
            if m["role"] != "user":
                continue
            text = normalise_text(m["content"])
            if text in self.exact or any(h in self.ngrams for h in _ngrams(text.split())):
                return True
        return False

    def admit(self, messages: list[dict]) -> bool:
        """False (and counted) for a conversation that touches an evaluation prompt or whose
        first user turn was already admitted."""
        if self.is_contaminated(messages):
            self.contaminated += 1
            return False
        first = next((normalise_text(m["content"]) for m in messages if m["role"] == "user"), "")
        if first in self.seen_first_turns:
            self.duplicates += 1
            return False
        self.seen_first_turns.add(first)
        return True
