"""Text at the edges of the engine: prompts rendered to token ids (chat templates, tools) and
answers turned back into text incrementally, with stop strings. The engine itself works on ids."""

from __future__ import annotations

from ..errors import JakiroError


def render_prompt(tokenizer, prompt, chat: bool = True, tools: list | None = None) -> list[int]:
    """Token ids for a string (wrapped in the chat template when the tokenizer has one and
    ``chat``), a list of {role, content} messages, or a list of token ids (returned as given).
    ``tools`` (OpenAI function tools) are passed to templates that render them."""
    tok = tokenizer
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


class TextTracker:
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

    def tokens_before(self, generated: list[int], cut: int, skip: set[int]) -> int:
        """The fewest leading tokens of ``generated`` whose text reaches character ``cut`` (where
        a stop string starts): the token holding the stop string's first character is the last
        one kept, or none when the stop string starts on a token boundary. ``skip``: ids that
        produce no text (end-of-sequence tokens)."""
        keep = len(generated)
        while keep > 0 and len(self.tokenizer.decode(
                [t for t in generated[:keep - 1] if t not in skip], skip_special_tokens=True)) >= cut:
            keep -= 1
        return keep
