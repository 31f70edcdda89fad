"""What a regeneration run is asked for (``RegenSettings``), what it counts (``RegenStats``), and
how it spots a degenerate loop in an answer (``repeated_tail``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RegenSettings:
    mode: str = "greedy"  # greedy | sample
    max_len: int = 512  # tokens per conversation: prompts and answers together
    max_new_tokens: int = 256  # per answer
    batch: int = 32
    sample_share: float = 0.0  # greedy mode: share of conversations answered by sampling instead
    temperature: float = 0.8  # sampled answers
    top_p: float = 0.95
    seed: int = 0
    aux_layers: tuple[int, ...] = ()  # mid-layer streams kept with the features (``TargetModel.forward``)
    max_seconds: float = 0.0  # stop after this long (0: no limit), dropping the conversations in flight
    # user turns the target writes itself (a user message whose content is None): sampled thus
    prompt_temperature: float = 1.0
    prompt_top_p: float = 0.95
    max_prompt_tokens: int = 128
    # a new prompt's tokens ride in the batch, one per forward, instead of a prefill forward of
    # their own (None: on a GPU, where a forward over the batch costs about what one prefill
    # does; the CPU kernels prefill a prompt's tokens more cheaply than they decode them)
    feed_prompts: bool | None = None


@dataclass
class RegenStats:
    conversations: int = 0
    answers: int = 0
    generated_tokens: int = 0  # kept answer tokens
    cut_tokens: int = 0  # tokens removed from degenerate loops
    cut_answers: int = 0
    length_limited_answers: int = 0
    skipped_too_long: int = 0  # conversations whose first prompt leaves no room for an answer
    reused_prompt_tokens: int = 0  # a later turn's prompt tokens already in the slot (not fed again)
    fed_prompt_tokens: int = 0  # prompt tokens fed through the batch (``feed_prompts``)
    batch_forwards: int = 0  # forwards over the whole batch (one token per slot)
    prefill_forwards: int = 0  # forwards over one slot's prompt (none with ``feed_prompts``)
    feature_tokens_reused: int = 0  # training tokens whose features came out of the generation's forwards
    feature_tokens_computed: int = 0  # ... and those computed after the conversation ended
    stopped_in_flight: int = 0  # conversations dropped unfinished when the time limit came
    prompts_written: int = 0  # user turns the target wrote and kept
    prompts_rejected: int = 0  # ... and dropped: empty, cut (a loop, the length limit) or refused by ``admit``
    prompt_tokens: int = 0  # tokens of the kept ones (not training targets)
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return (self.generated_tokens + self.cut_tokens) / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["generated_tokens_per_s"] = round(self.tokens_per_s, 1)
        return d


def repeated_tail(ids: list[int], min_span: int = 16, max_period: int = 100) -> int | None:
    """Where to cut ``ids`` if they end in a degenerate loop: the same block of p tokens three
    times in a row (short blocks must repeat until the run spans ``min_span`` tokens). Returns
    the length that keeps two copies of the block, or None."""
    n = len(ids)
    limit = min(max_period, n // 3)
    if limit == 0:
        return None
    before = ids[n - 1 - limit:n - 1][::-1]  # before[p - 1] = ids[-1 - p]
    p = 0
    while True:  # each period p whose block could end like the answer (the search runs in C)
        try:
            p = before.index(ids[-1], p) + 1
        except ValueError:
            return None
        copies = max(3, -(-min_span // p))
        if copies * p > n:
            continue
        block = ids[n - p:]
        if all(ids[n - (r + 1) * p: n - r * p] == block for r in range(1, copies)):
            return n - (copies - 2) * p
