"""Many requests decoded together (continuous batching) on token ids. Each request keeps its own
proposer (a ``fork`` of the decoder's: chain or tree, prompt lookup, draft) and its own slot of one
KV cache; every step verifies all the requests' trees in one target forward
(``TargetModel.forward_rows``), and a request joins or leaves between steps. A new request's prompt
goes in by pieces, one per step, so the running ones keep flowing.

Each request's greedy answer is the one it gets alone: a row's sums do not depend on the rows
beside it (the kernels never mix rows), a tree the one-call stack would not take alone is verified
alone, and a prompt goes in by pieces only where the one-call stack takes it whole. Cost-aware
drafting prices a tree by what it adds to the batched forward (``Proposer.in_batch``), which
changes trees, not greedy answers; a sampled request with a seed keeps its trees as alone and
draws from its own generator, so it draws what it draws alone.

With the prompt cache (the decoder's ``prompt_cache``) each slot keeps what its last request left
in it, and a new request takes the free slot whose entries share the longest start with its
prompt (``prompt_cache``)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..errors import JakiroError
from ..models.linear import SMALL_ROWS
from .decoder import Decoded, Decoder, Sequence, StopRule
from .prompt_cache import Retained, reusable
from .sampling import SamplingParams

PREFILL_PIECE = 4 * SMALL_ROWS  # prompt tokens a joining request takes in per step


@dataclass
class Step:
    """What one step did to one request: the ids it committed and, once it ended, its answer."""

    sequence: Sequence
    new_ids: list[int]
    done: Decoded | None = None


class BatchDecoder:
    """Up to ``slots`` requests at once over ``decoder``'s target and proposer, each with room for
    ``slot_tokens`` tokens (prompt and answer; default: the model's context, at most 4,096)."""

    def __init__(self, decoder: Decoder, slots: int, slot_tokens: int | None = None,
                 prefill_piece: int = PREFILL_PIECE):
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise JakiroError(f"the number of parallel requests must be a positive integer, got {slots!r}")
        if prefill_piece < 1 or prefill_piece % SMALL_ROWS:
            raise JakiroError(f"prompt pieces must be a positive multiple of {SMALL_ROWS} tokens")
        target = decoder.target
        ctx = target.config.max_context
        self.slot_tokens = min(slot_tokens or min(ctx, 4096), ctx)
        self.decoder, self.target = decoder, target
        self.prefill_piece = prefill_piece
        decoder.proposer.for_batch(slots)  # before the requests' forks: they share its cost table
        self.cache = target.new_batch_cache(slots, self.slot_tokens, scratch=decoder.proposer.max_tree_tokens)
        self._free = list(range(slots))
        self._retained: list[Retained | None] = [None] * slots  # per slot, with the prompt cache
        self.running: list[Sequence] = []  # in arrival order

    @property
    def slots(self) -> int:
        return self.cache.batch

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def kv_bytes(self) -> int:
        """The KV cache's size: every slot's room, allocated once."""
        return self.cache.data.numel() * self.cache.data.element_size()

    def add(self, ids: list[int], max_new_tokens: int, sampling: SamplingParams | None = None,
            stop: StopRule | None = None) -> Sequence:
        """Start a request in a free slot; it takes its first step with the next ``step``."""
        if not self._free:
            raise JakiroError(f"all {self.slots} slots are busy")
        if len(ids) + max_new_tokens > self.slot_tokens:
            self.decoder.check_length(len(ids), max_new_tokens)  # the model's own limit first
            raise JakiroError(f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds a "
                              f"slot's room ({self.slot_tokens} tokens)")
        slot, n = self._slot_for(ids)
        retained = self._retained[slot]
        self._retained[slot] = None  # a request that fails leaves nothing behind
        seq = Sequence(self.decoder, ids, max_new_tokens, sampling, stop, self.decoder.proposer.fork(),
                       self.cache.slot(slot, n), retain=self.decoder.prompt_cache)
        if n:
            seq.resume(retained, n)
        self._free.remove(slot)
        seq.slot = slot
        self.running.append(seq)
        return seq

    def _slot_for(self, ids: list[int]) -> tuple[int, int]:
        """The free slot to take (the lowest of those whose cached entries share the longest start
        with ``ids``) and how many of its entries the request starts from."""
        best, most = self._free[0], 0
        for slot in self._free:
            n = reusable(self._retained[slot], ids, self.decoder)
            if n > most:
                best, most = slot, n
        return best, most

    def remove(self, seq: Sequence, keep: bool = False) -> None:
        """Free a request's slot (it finished, or its client left); ``keep``: with the prompt
        cache, the slot keeps what the request left in it for the next one."""
        if seq in self.running:
            self.running.remove(seq)
            self._free.append(seq.slot)
            self._free.sort()
            if keep and self.decoder.prompt_cache:
                self._retained[seq.slot] = seq.retained()

    @torch.inference_mode()
    def step(self) -> list[Step]:
        """One step for every running request: a prompt piece for those still taking theirs in
        (the first new token with the last piece), one draft -> verify cycle for the others, all
        the trees in one target forward. Finished requests leave and free their slots."""
        out: list[Step] = []
        ready = []
        for seq in list(self.running):
            if seq.pending or seq.prefilled == len(seq.ids):
                ready.append(seq)
                continue
            whole = not self.target.fused_rows(len(seq.ids), tree=False)
            if seq.prefill(None if whole else self.prefill_piece):
                out.append(self._advance(seq))
        live = [seq for seq in ready if not seq.finish]
        for seq in live:  # a plain step's share of the batch is what a draft competes with; a
            # seeded sampled request keeps its trees as alone, so that its draws are too
            seeded = not seq.params.greedy and seq.params.seed is not None
            seq.proposer.in_batch(0 if seeded else len(live) - 1)
        trees = [(seq, seq.propose()) for seq in live]
        together = []
        for seq, tree in trees:
            if self.target.fused_rows(tree.size):
                together.append((seq, tree))
            else:
                seq.verify_alone(tree)
        if together:
            self._verify_together(together)
        out.extend(self._advance(seq) for seq, _ in trees)
        return out

    def _verify_together(self, batch) -> None:
        tokens, seqs, at, prefix, positions, masks, rows = [], [], [], [], [], [], []
        for seq, tree in batch:
            length, n = seq.cache.length, tree.size
            seq.cache.check_room(n)
            tokens.append(tree.tokens)
            seqs.append(torch.full((n,), seq.slot, dtype=torch.long))
            at.append(torch.arange(length, length + n))
            prefix.append(torch.full((n,), length, dtype=torch.long))
            positions.append(length + tree.depths)
            masks.append(tree.tree_mask if n > 1 else torch.ones(1, 1, dtype=torch.bool))
            rows.append(n)
        t0 = time.perf_counter()
        logits, feats = self.target.forward_rows(
            torch.cat(tokens), self.cache.data, torch.cat(seqs), torch.cat(at), torch.cat(prefix),
            torch.cat(positions), torch.block_diag(*masks), aux_layers=self.decoder.proposer.aux_layers)
        elapsed = time.perf_counter() - t0
        start = 0
        for (seq, tree), n in zip(batch, rows):
            seq.settle(tree, logits[start:start + n], feats[start:start + n], elapsed)
            start += n

    def _advance(self, seq: Sequence) -> Step:
        new = seq.advance()
        if not seq.finish:
            return Step(seq, new)
        self.remove(seq, keep=True)
        return Step(seq, new, seq.result())

    def decode(self, requests: list[tuple[list[int], int, SamplingParams | None, StopRule | None]]) -> list[Decoded]:
        """Every request to its end, ``slots`` at a time (a new one starts as soon as a slot
        frees): the answers in the requests' order."""
        queue = list(enumerate(requests))
        answers: dict[int, Decoded] = {}
        index: dict[int, int] = {}
        while queue or self.running:
            while queue and self._free:
                i, (ids, max_new, sampling, stop) = queue.pop(0)
                index[id(self.add(ids, max_new, sampling, stop))] = i
            for event in self.step():
                if event.done is not None:
                    answers[index.pop(id(event.sequence))] = event.done
        return [answers[i] for i in range(len(requests))]
