"""Task prompts built from ShareGPT's own texts: summarise, answer from a passage, extract,
rewrite, translate.

ShareGPT's user turns are mostly open questions and coding requests, so a draft trained on the
target's answers to them rarely sees the target *working on a text in its prompt* (summarising
it, answering from it, translating it), where its answer copies and condenses what the prompt
says. Such prompts are built here from the conversations' own passages (an assistant answer of a
readable length, with the user question that asked for it; a user turn in another language for
translation), one task per usable conversation in a fixed rotation, so that the source is the
same package and the sequence is the same on every machine. The answers come from the target
(``jakiro data --source sharegpt-tasks --regenerate greedy``); the prompts pass the same
evaluation filter as every other source.

A conversation often holds several such passages: ``sharegpt-tasks`` works on the first,
``sharegpt-tasks-N`` (N = 2 .. MAX_PASSAGE) on the N-th, each in its own fixed sequence, so that
the sources can be regenerated one after another without changing what an earlier one holds.
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

MIN_WORDS, MAX_WORDS = 60, 220  # passages: long enough to work on, short enough to fit with an answer
ANSWER_PLACEHOLDER = "(answered by the target)"

SUMMARISE = (
    "Summarize the following text in a few sentences.\n\n{passage}",
    "Write a one-paragraph summary of this:\n\n{passage}",
    "{passage}\n\nTL;DR:",
    "Give me the main points of the text below as a short bulleted list.\n\n{passage}",
)
ANSWER = (
    "Answer the question using only the passage below.\n\nPassage:\n{passage}\n\nQuestion: {question}",
    "Context:\n{passage}\n\nBased on the context above, {question}",
    "Read the following document and answer the question.\n\nDocument: {passage}\n\nQuestion: {question}\nAnswer:",
)
EXTRACT = (
    "Extract every name, number and technical term mentioned in the following text, as a list.\n\n{passage}",
    "From the text below, list the key facts as \"key: value\" lines.\n\n{passage}",
    "What are the steps or items described in this text? Quote them briefly.\n\n{passage}",
)
REWRITE = (
    "Rewrite the following text in simpler words.\n\n{passage}",
    "Paraphrase this paragraph:\n\n{passage}",
    "Make the following text more formal.\n\n{passage}",
)
TRANSLATE = (
    "Translate the following text into English.\n\n{passage}",
    "Translate to English:\n{passage}",
    "{passage}\n\nTranslate the text above into English.",
)
KINDS = ("summarise", "answer", "extract", "rewrite")


def _words(text: str) -> int:
    return len(text.split())


def is_foreign(text: str) -> bool:
    """Mostly letters outside ASCII (Chinese, Korean, Russian, ...) or a Latin-script text
    heavy with German, French or Spanish function words: a text worth translating to English."""
    letters = [c for c in text if c.isalpha()]
    if len(letters) < 20:
        return False
    if sum(ord(c) > 127 for c in letters) / len(letters) > 0.3:
        return True
    words = re.findall(r"[a-zäöüßéèàçñ]+", text.lower())
    marker = sum(w in _FOREIGN_WORDS for w in words)
    return len(words) >= 15 and marker / len(words) > 0.12


_FOREIGN_WORDS = frozenset(
    "der die das und ist nicht ich sie wir mit auf für ein eine zu den von dem des auch "
    "le la les et est une des du dans pour que qui pas sur avec "
    "el los las y es en por con para una que del se no".split())


def _passage(text: str) -> str | None:
    """The text, if it is a readable passage: 60-220 words, not mostly code."""
    n = _words(text)
    if not MIN_WORDS <= n <= MAX_WORDS or text.count("```") or text.count("{") > 4:
        return None
    return text.strip()


MAX_PASSAGE = 5


def task_conversations(conversations: Iterable[list[dict] | None], passage: int = 1
                       ) -> Iterator[list[dict] | None]:
    """One task conversation (a user prompt and a placeholder answer for the target to replace)
    per source conversation that has a usable text, else None (positions stay countable). The
    task kind rotates over the usable conversations; templates rotate within a kind.
    ``passage``: work on the conversation's N-th usable passage (translations, made from the
    first user turn, belong to the first)."""
    if not 1 <= passage <= MAX_PASSAGE:
        raise ValueError(f"task passage must be in 1..{MAX_PASSAGE}, got {passage}")
    used = 0
    for messages in conversations:
        prompt = None if messages is None else _task_prompt(messages, used, passage)
        if prompt is None:
            yield None
            continue
        used += 1
        yield [{"role": "user", "content": prompt}, {"role": "assistant", "content": ANSWER_PLACEHOLDER}]


def _task_prompt(messages: list[dict], used: int, nth: int = 1) -> str | None:
    first_user = next((m["content"] for m in messages if m["role"] == "user"), "")
    if is_foreign(first_user) and _words(first_user) <= MAX_WORDS and len(first_user) >= 40:
        if nth > 1:
            return None
        template = TRANSLATE[used % len(TRANSLATE)]
        return template.format(passage=first_user.strip())
    seen = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i == 0:
            continue
        passage = _passage(m["content"])
        if passage is None or is_foreign(passage):
            continue
        seen += 1
        if seen < nth:
            continue
        question = messages[i - 1]["content"].strip()
        kind = KINDS[(used + nth - 1) % len(KINDS)]  # a later passage starts the rotation one kind on
        if kind == "answer" and (_words(question) > 60 or not question):
            kind = "summarise"
        templates = {"summarise": SUMMARISE, "answer": ANSWER, "extract": EXTRACT, "rewrite": REWRITE}[kind]
        template = templates[(used // len(KINDS)) % len(templates)]
        if kind == "answer":
            question = question[0].lower() + question[1:] if template.startswith("Context") else question
            return template.format(passage=passage, question=question)
        return template.format(passage=passage)
    return None
