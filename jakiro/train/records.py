"""A training set's records: the source's admitted conversations and their tokenisation with an
assistant-only loss mask."""

from __future__ import annotations

from typing import Iterator

from ..data.conversations import iter_conversations


def tokenize_conversation(tokenizer, messages: list[dict], max_len: int) -> tuple[list[int], list[int]] | None:
    """Token ids and a loss mask that is 1 on assistant content (and its end-of-turn token, unless
    the answer is marked ``truncated``), 0 on the template's headers and on user/system text."""
    ids: list[int] = []
    mask: list[int] = []
    rendered = ""
    for i, msg in enumerate(messages):
        if msg["role"] == "assistant":
            header = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True, tokenize=False)
            full = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
            answer = full[len(header):]
            if msg.get("truncated"):
                # an answer cut short (length limit, degenerate loop): the model did not end its
                # turn there, so the template's end-of-turn is context, not a training target
                cut = answer.find(msg["content"]) + len(msg["content"])
                pieces = [(header[len(rendered):], 0), (answer[:cut], 1), (answer[cut:], 0)]
            else:
                pieces = [(header[len(rendered):], 0), (answer, 1)]
        else:
            full = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
            pieces = [(full[len(rendered):], 0)]
        for text, label in pieces:
            piece = tokenizer(text, add_special_tokens=False).input_ids
            ids.extend(piece)
            mask.extend([label] * len(piece))
        rendered = full
        if len(ids) >= max_len:
            break
    ids, mask = ids[:max_len], mask[:max_len]
    return (ids, mask) if sum(mask) > 0 else None


REGENERATED_FILE = "regenerated.jsonl"


def _admitted(source: str, prompt_filter, skipped: list[int] | None = None
              ) -> Iterator[tuple[int, list[dict] | None]]:
    """(source index, messages or None) for every source record; None for records that are
    unusable, touch an evaluation prompt or repeat an earlier first user turn. ``skipped``:
    collect malformed lines there instead of stopping (``--skip-bad``)."""
    for index, messages in enumerate(iter_conversations(source, skipped)):
        if messages is not None and prompt_filter is not None and not prompt_filter.admit(messages):
            messages = None
        yield index, messages
