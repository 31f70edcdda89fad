"""A request's draft head: the draft vocabulary in use, plus the tokens of the request's prompt
and answer that it lacks, taken in as they come (``DraftProposer`` mixes this in)."""

from __future__ import annotations

import torch

PROMPT_VOCAB_MAX = 512  # at most this many of a prompt's tokens join the draft head (a long
# prompt's rarest tokens would cost head rows for little)
ANSWER_VOCAB_MAX = 512  # at most this many tokens of a request's own answer join its head beyond
# the prompt's: an answer repeats the names and rare words it introduced (the README's first
# prompt: 0.72 of its answer's tokens are in the tuned 2,048-token head, 0.85 once the answer's
# earlier tokens join it: docs/experiments/answer_vocab_ab.py)


class RequestHead:
    """The head rows a ``DraftProposer``'s request scores (its ``draft``, ``head_vocab`` and
    ``answer_vocab``; reset by its ``start``)."""

    @property
    def head(self):
        """The draft head rows this request scores (a ``DraftHead``)."""
        if self._head is None:
            self._head = self.draft.head(self.head_vocab)
        return self._head

    @property
    def answer_rows(self) -> int:
        """Tokens of this request's answer its head has taken in (``answer_vocab`` at most)."""
        return self._answer_rows

    def prompt_tokens(self, context: list[int]) -> torch.Tensor:
        """The tokens of a prompt ``context`` that the draft vocabulary in use (its first
        ``head_vocab`` entries) lacks, the most repeated first, at most ``PROMPT_VOCAB_MAX``.
        Answers copy names, numbers and rare words from their prompt (summaries, extraction,
        RAG): on Spec-Bench answers of SmolLM2-135M-Instruct a 2,048-token head holds 0.77 of the
        answer tokens, with the prompt's tokens 0.91 (``jakiro bench``'s ``head_coverage``)."""
        uniq, counts = torch.tensor(context, dtype=torch.long).unique(return_counts=True)
        absent = ~torch.isin(uniq, self.draft.head(self.head_vocab).ids)
        uniq, counts = uniq[absent], counts[absent]
        return uniq[torch.argsort(counts, descending=True, stable=True)[:PROMPT_VOCAB_MAX]]

    def prompt_head(self, context: list[int]):
        """The head for a request whose prompt is ``context``: the draft vocabulary in use plus
        ``prompt_tokens(context)``."""
        return self.draft.head(self.head_vocab, extra=self.prompt_tokens(context))

    def _take_in(self, context: list[int]) -> None:
        """The request's head takes in the tokens committed since its last proposal that the
        draft vocabulary in use lacks (at most ``answer_vocab`` over the request), after the
        prompt's (``prompt_tokens``, at its first proposal): the rows it had keep their layout
        (``DraftModel.extend_head``)."""
        if self._grown_to is None:
            extra = self.prompt_tokens(context)
            self._extra = extra.tolist()
            self._head_tokens = set(self.draft.head(self.head_vocab).ids.tolist()) | set(self._extra)
            self._head = self.draft.head(self.head_vocab, extra=extra)  # ``prompt_head(context)``
        else:
            room = self.answer_vocab - self._answer_rows
            new = [t for t in dict.fromkeys(context[self._grown_to:]) if t not in self._head_tokens][:max(room, 0)]
            if new:
                self._extra += new
                self._head_tokens.update(new)
                self._answer_rows += len(new)
                self._head = self.draft.extend_head(self._head, torch.tensor(self._extra, dtype=torch.long),
                                                    self.head_vocab)
        self._grown_to = len(context)
