"""Keep evaluation questions out of training data, and drop repeated prompts.

A training conversation is *contaminated* when one of its user turns equals an evaluation prompt
after normalisation (lower case, runs of non-alphanumerics to one space) or shares a run of
``NGRAM`` normalised words with one. The evaluation prompts are MT-bench (installed package), the
Spec-Bench development file (when present) and HumanEval (installed package).
"""

from __future__ import annotations

import hashlib
import json
import os
import re

from ..errors import JakiroError
from .questions import mtbench_path, read_humaneval, read_questions, spec_bench_path

NGRAM = 13  # words; the usual decontamination length for instruction data
# a file of the evaluation prompts' digests (``save_evaluation_filter``), for machines without
# the question packages (a GPU machine regenerating data): the filter reads it instead of them
FILTER_ENV = "JAKIRO_EVALUATION_FILTER"


def normalise_text(text: str) -> str:
    return re.sub(r"[^0-9a-z]+", " ", text.lower()).strip()


def _digest(text: str) -> int:
    """A stable 64-bit digest (Python's own string hash changes from process to process)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _ngrams(words: list[str], n: int = NGRAM):
    return (_digest(" ".join(words[i:i + n])) for i in range(len(words) - n + 1))


def evaluation_prompts() -> list[str]:
    """Every evaluation prompt this project benchmarks on that is installed or present here."""
    texts = [t for q in read_questions(mtbench_path()) for t in q["turns"]]
    spec = spec_bench_path()
    if spec:
        texts += [t for q in read_questions(spec) for t in q["turns"]]
    texts += [p["prompt"] for p in read_humaneval()]
    return texts


def save_evaluation_filter(path: str) -> int:
    """Write the digests of every evaluation prompt installed or present here to ``path`` (no
    prompt text): ``FILTER_ENV=path`` then filters with them where the packages are missing.
    Returns the number of prompts."""
    texts = evaluation_prompts()
    f = PromptFilter(texts)
    with open(path, "w") as out:
        json.dump({"prompts": len(texts), "ngram": NGRAM, "exact": sorted(f.exact), "ngrams": sorted(f.ngrams)}, out)
    return len(texts)


def evaluation_filter() -> "PromptFilter":
    """The filter of ``jakiro data``: from ``FILTER_ENV``'s digest file where it is set, else from
    the evaluation prompts installed here."""
    path = os.environ.get(FILTER_ENV)
    if not path:
        return PromptFilter(evaluation_prompts())
    try:
        with open(path) as f:
            saved = json.load(f)
        if saved["ngram"] != NGRAM:
            raise ValueError(f"made with {saved['ngram']}-word runs, not {NGRAM}")
        f = PromptFilter([])
        f.exact, f.ngrams = set(saved["exact"]), set(saved["ngrams"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise JakiroError(f"{FILTER_ENV}={path}: not an evaluation filter file ({exc})") from None
    return f


class PromptFilter:
    """Decides which conversations may enter training data; counts what it removed."""

    def __init__(self, evaluation: list[str]):
        self.exact = {_digest(normalise_text(t)) for t in evaluation}
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
            if _digest(text) in self.exact or any(h in self.ngrams for h in _ngrams(text.split())):
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
