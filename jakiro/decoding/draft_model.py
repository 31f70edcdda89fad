"""Classic speculative decoding: a small causal LM that shares the target's tokenizer (the same
family, e.g. Qwen2.5-Coder-0.5B for the 1.5B) drafts a chain of tokens, run by the same runtime
with a KV cache of its own.

Each cycle the draft model catches up on the tokens committed since its last proposal (its cache
keeps what it already read that the context still agrees with: the accepted part of its last
chain; of a very long prompt it reads only the last ``window`` tokens), then drafts token after
token while its own next-token probability stays at least ``min_prob`` (a confident draft is
usually right; an unsure one costs a forward for little), up to ``num_tokens``. Greedy requests
take its argmax; sampled ones draw each token from its distribution processed as the target's is
(temperature, top-k, top-p), which verification accepts with min(1, p / q): the output follows
the target's distribution either way."""

from __future__ import annotations

import torch

from ..errors import JakiroError
from .proposers import PromptLookupProposer, Proposer
from .sampling import SamplingParams, processed_probs, sample
from .tree import DRAFT, Tree, add_chain, chain_tree

# context tokens a draft model starts from: bounds its reading of a very long prompt. Not less: on
# the Spec-Bench questions with Qwen2.5-Coder-0.5B drafting for the 1.5B, a window of 256 sped
# up RAG (0.72 -> 0.88 x plain) but cost summarization its acceptance (tau 4.16 -> 1.62)
WINDOW = 2048


def check_same_tokenizer(target_tokenizer, draft_tokenizer, target_vocab: int, draft_vocab: int,
                         draft_name: str) -> None:
    """Refuse a draft model whose tokens mean something else than the target's, in one line."""
    if target_vocab != draft_vocab:
        raise JakiroError(f"draft model {draft_name} has a vocabulary of {draft_vocab} tokens, the target "
                          f"{target_vocab}: a draft model must share the target's tokenizer")
    if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise JakiroError(f"draft model {draft_name} has another tokenizer than the target: a draft model "
                          "must share the target's tokenizer (the same family, e.g. Qwen2.5-Coder-0.5B for 1.5B)")
    if target_tokenizer.eos_token_id != draft_tokenizer.eos_token_id:
        raise JakiroError(f"draft model {draft_name} ends text with another token than the target")


class DraftModelProposer(Proposer):
    """A chain of a small model's next tokens (see the module's docstring)."""

    name = "draft-model"

    def __init__(self, model, num_tokens: int = 5, min_prob: float = 0.5, lookup: PromptLookupProposer | None = None,
                 window: int = WINDOW, keep_context: bool = False):
        """``model``: a ``TargetModel`` (the draft model); ``num_tokens``: the longest chain;
        ``min_prob``: stop drafting after a token the model gave less probability than this;
        ``lookup``: also hang the prompt-lookup continuation under the root (``+pld``);
        ``window``: the most tokens of a request's context the model starts from;
        ``keep_context`` (the prompt cache): a request starts from what the model's cache holds of
        the last request's context where the two agree (a model whose every forward runs the
        one-call kernels computes those entries bitwise as it would anew, so drafts do not change)."""
        if num_tokens < 1 or not 0.0 <= min_prob <= 1.0 or window < 1:
            raise ValueError("a draft model needs num_tokens >= 1, 0 <= min_prob <= 1 and window >= 1")
        self.window = window
        self.keep_context = keep_context and model.blocks_only
        self._fresh = True  # the request has not proposed yet
        self.model, self.num_tokens, self.min_prob, self.lookup = model, num_tokens, min_prob, lookup
        extra = lookup.num_tokens if lookup else 0
        self.max_tree_tokens, self.max_tree_depth = num_tokens + 1 + extra, max(num_tokens, extra)
        if lookup:
            self.name = "draft-model+pld"
        self._cache = None
        self._held: list[int] = []  # the tokens whose keys and values the cache holds, in order:
        self._start = 0  # those of the context from this index on
        self._params: SamplingParams | None = None
        self._generator: torch.Generator | None = None

    def start(self, max_len: int) -> None:
        # room for the request's tokens, as far as the model's own context goes (``_catch_up``
        # starts afresh from the last tokens when a request outgrows it), and for a chain
        self._room = min(max_len, self.model.config.max_context - self.num_tokens - 1)
        need = self._room + self.num_tokens + 1
        self._fresh = True
        if self._cache is not None and self._cache.max_len >= need and self.keep_context:
            return  # ``_catch_up`` keeps what agrees with the new request's context
        if self._cache is None or self._cache.max_len < need:
            self._cache = self.model.new_cache(need)
        self._cache.truncate(0)
        self._held, self._start = [], 0

    def fork(self) -> "DraftModelProposer":
        twin = super().fork()
        twin._cache = None  # its own KV cache, made by ``start``
        return twin

    def set_sampling(self, params: SamplingParams | None, generator: torch.Generator | None = None) -> None:
        self._params, self._generator = params, generator

    def propose(self, context: list[int]) -> Tree:
        logits = self._catch_up(context)
        drafted: list[int] = []
        proposals = {}
        while True:
            if self._params is None:  # greedy: the argmax and its probability
                probs = torch.softmax(logits, -1)
                token = int(probs.argmax())
            else:  # drawn from the model's processed distribution q, kept for verification
                probs = processed_probs(logits.unsqueeze(0), self._params)[0]
                token = sample(probs, self._generator)
                proposals[len(drafted) + 1] = (torch.arange(probs.shape[0]), probs)
            drafted.append(token)
            if len(drafted) == self.num_tokens or float(probs[token]) < self.min_prob:
                break
            logits = self._forward([token])
        tree = chain_tree(context[-1], drafted)
        tree.sources = torch.tensor([0] + [DRAFT] * len(drafted))
        if proposals:
            tree.proposals = proposals
        if self.lookup is not None:
            chain = self.lookup.lookup(context)
            if chain:
                tree = add_chain(tree, chain)
        return tree

    def _catch_up(self, context: list[int]) -> torch.Tensor:
        """The model's next-token logits after ``context``: its cache keeps the longest prefix of
        what it holds that the context agrees with (at least the last token is read anew). It
        starts from the last ``window`` tokens, and afresh from the last ones when the context
        outgrows its cache (a request longer than the model's own context)."""
        begin = max(0, len(context) - min(self.window, self._room))  # where a request's first proposal starts
        if not self._held or len(context) - self._start > self._room or (self._fresh and self._start != begin):
            self._cache.truncate(0)
            self._held, self._start = [], begin
        self._fresh = False
        held, start, n = self._held, self._start, 0
        limit = min(len(held), len(context) - 1 - start)
        while n < limit and held[n] == context[start + n]:
            n += 1
        self._cache.truncate(n)
        del held[n:]
        return self._forward(context[start + n:])

    def _forward(self, tokens: list[int]) -> torch.Tensor:
        cache = self._cache
        logits, _ = self.model(torch.tensor(tokens), cache, logits_rows=slice(-1, None), chunked=True)
        cache.commit(len(tokens))
        self._held.extend(tokens)
        return logits[0]
