"""Settings of dataset building and draft training: one definition each, read by the builders
and by the command line (its options, defaults and help come from here)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import JakiroError
from ..settings import opt
from ..data.conversations import CODE_SOURCE, TARGET_PROMPTS_SOURCE, prompts_only

STEP_DECAY = 0.8
P_WEIGHT = 0.1  # w_p: cross-entropy weight next to the feature regression
JAKIRO_LOSSES = ("separate", "full", "reference")


def _at_least_one(cfg, names: tuple[str, ...]) -> None:
    for name in names:
        if getattr(cfg, name) < 1:
            raise JakiroError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")


def parse_layers(text: str, option: str = "--aux-layers") -> tuple[int, ...]:
    """'3,15' -> (3, 15): increasing decoder-layer counts, each >= 1 ('' -> none)."""
    try:
        layers = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise JakiroError(f"{option} takes comma-separated layer counts such as 3,15, got {text!r}") from None
    if list(layers) != sorted(set(layers)) or any(a < 1 for a in layers):
        raise JakiroError(f"{option} must list increasing layer counts >= 1, got {text!r}")
    return layers


@dataclass
class DataConfig:
    target: str | None
    source: str = opt("sharegpt", "'sharegpt' (the installed package), '" + CODE_SOURCE + "' (its conversations "
                                  "whose first user turn is about code), 'sharegpt-tasks' (summarise / answer "
                                  "from a passage / extract / rewrite / translate prompts built from ShareGPT's "
                                  "texts; needs --regenerate; 'sharegpt-tasks-2' .. '-5' work on each "
                                  "conversation's 2nd .. 5th passage), '" + TARGET_PROMPTS_SOURCE + "' (the target "
                                  "writes each user turn itself, sampled from its chat template's user header, "
                                  "then answers it; needs --regenerate) or a JSONL file of {'conversations': "
                                  "[{from, value}]} or {'messages': [{role, content}]}, optionally .gz")
    max_records: int = opt(1000, "conversations to build (counting from --first-record)")
    first_record: int = opt(0, "skip this many records at the start of the source, usable or not (to "
                               "extend a dataset in a new folder: the earlier one's records_done, in its "
                               "state.json)")
    max_len: int = opt(512, "tokens per conversation (truncated)")
    shard_size: int = opt(64, "conversations per safetensors shard (the unit of resuming)")
    regenerate: str = opt("none", "replace assistant turns with the target's own answers",
                          choices=("none", "greedy", "sample"))
    regen_max_tokens: int = opt(256, "longest regenerated answer, in tokens")
    seed: int = opt(0, "seed of sampled regeneration")
    regen_batch: int = opt(32, "conversations regenerated together")
    regen_minutes: float = opt(0.0, "stop regenerating after about this long (0: no limit); the conversations "
                                    "then in flight are dropped, and the same command continues later")
    regen_prompts: str = opt("auto", "how a new prompt enters its slot: prefill (a forward of its own) or feed "
                                     "(one token per batch forward, beside the other slots' answers); auto: feed "
                                     "on a GPU, prefill on the CPU", choices=("auto", "prefill", "feed"))
    sample_share: float = opt(0.0, "with --regenerate greedy: share of conversations answered by sampling "
                                   "(T 0.8, top-p 0.95)")
    filter_evaluation: bool = opt(True, "drop conversations that touch MT-bench, Spec-Bench or HumanEval prompts")
    skip_bad: bool = opt(False, "skip malformed lines of a JSONL source (counted and reported) instead of "
                                "stopping at the first")
    aux_layers: str = opt("", "also store the target's residual stream after these decoder layers "
                              "(comma-separated counts, e.g. 3,15) for drafts with mid-layer inputs "
                              "(jakiro train --aux-layers); three times the storage for two layers")
    tokens_only: bool = opt(False, "store tokens and loss masks only, no features: `jakiro train` then computes "
                                   "the features with the target on the fly (on a GPU, cheaper than storing "
                                   "them; --aux-layers still names the streams the draft will read)")
    device: str = opt("", "where the target regenerates answers and computes features: cpu (its own kernels) "
                          "or a torch device such as cuda, where the same decoder stack runs in plain torch "
                          "(default: cuda when available, else cpu)")

    def check(self) -> None:
        """Refuse settings that cannot build a dataset (the command line and the API alike)."""
        _at_least_one(self, ("max_records", "max_len", "shard_size", "regen_max_tokens", "regen_batch"))
        if not self.regen_minutes >= 0:
            raise JakiroError(f"--regen-minutes must be >= 0, got {self.regen_minutes}")
        if not 0 <= self.sample_share <= 1:
            raise JakiroError(f"--sample-share must be in [0, 1], got {self.sample_share}")
        if self.regenerate not in ("none", "greedy", "sample"):
            raise JakiroError(f"unknown regeneration mode {self.regenerate!r}; choose none, greedy or sample")
        if self.regen_prompts not in ("auto", "prefill", "feed"):
            raise JakiroError(f"unknown --regen-prompts {self.regen_prompts!r}; choose auto, prefill or feed")
        if prompts_only(self.source) and self.regenerate == "none":
            raise JakiroError(f"--source {self.source} holds prompts only: add --regenerate greedy (or sample)")
        if self.first_record < 0:
            raise JakiroError(f"--first-record must be >= 0, got {self.first_record}")
        parse_layers(self.aux_layers)
        self.torch_device()
        if self.first_record and self.regenerate != "none":
            raise JakiroError("--first-record applies to a source read as it is; with --regenerate, "
                              "--max-records already continues the regenerated file")
        if self.source not in ("sharegpt", CODE_SOURCE) and not prompts_only(self.source) and not os.path.isfile(self.source):
            raise JakiroError(f"dataset not found: {self.source}")

    def torch_device(self):
        """The device of ``device`` (cuda when available for ''); refused when absent here."""
        import torch
        name = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        try:
            device = torch.device(name)
        except RuntimeError:
            raise JakiroError(f"--device {self.device!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise JakiroError(f"--device {self.device}: no CUDA device is available here")
        return device

    def regen_settings(self):
        from ..data.regenerate import RegenSettings
        return RegenSettings(mode=self.regenerate, max_len=self.max_len, max_new_tokens=self.regen_max_tokens,
                             batch=self.regen_batch, sample_share=self.sample_share, seed=self.seed,
                             max_seconds=60 * self.regen_minutes,
                             feed_prompts=None if self.regen_prompts == "auto" else self.regen_prompts == "feed",
                             aux_layers=parse_layers(self.aux_layers))


@dataclass
class TrainConfig:
    data: str
    out: str
    method: str = opt("jakiro", "draft architecture", choices=("eagle2", "jakiro", "eagle3"))
    num_experts: int = opt(2, "jakiro: number of experts N", flag="--experts")
    experts_per_token: int = opt(2, "jakiro: activated experts K (>= 2)", flag="--active")
    candidate_mode: str = opt("decoupled", "jakiro: tree candidates from each activated expert (decoupled) "
                                           "or from their blend", flag="--candidates",
                              choices=("decoupled", "blended"))
    parallel_decoding: bool = opt(True, "jakiro: train the contrastive branch (the last tree layer without "
                                        "another draft forward)")
    draft_vocab_size: int | None = opt(8192, "draft head vocabulary, the most frequent tokens of the data "
                                             "(0 = the full vocabulary)", flag="--draft-vocab")
    intermediate_size: int = opt(0, "width of the draft's MLP (each expert's for jakiro); 0 = the target's. "
                                    "A narrower MLP keeps a wide target's draft small and cheap to run")
    steps: int = opt(1000, "optimizer steps")
    batch_size: int = opt(8, "records per optimizer step (global, over all processes)")
    seq_len: int = opt(512, "tokens per record (longer records are cut)")
    lr: float = opt(1e-3, "peak learning rate (AdamW, betas 0.9/0.95)")
    warmup: int = opt(50, "linear warmup steps, then cosine decay to 0")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    grad_clip: float = opt(0.5, "gradient norm clip")
    noise: float = opt(0.2, "uniform noise in [-noise/2, noise/2] added to the input features")
    unroll: int = opt(4, "draft steps trained per position on the draft's own predictions "
                         "(training-time test); 1 = single-step training")
    step_decay: float = opt(STEP_DECAY, "loss weight of unrolled step s: step_decay ** (s - 1)")
    p_weight: float = opt(P_WEIGHT, "weight of the cross-entropy against the target's next-token "
                                    "distribution, next to the feature regression (weight 1)")
    jakiro_loss: str = opt("separate", "jakiro: separate = the first expert as a draft, the second on the "
                                       "tokens the first leaves, blend and contrastive; full = every expert "
                                       "toward the same target; reference = blend and contrastive only",
                           choices=JAKIRO_LOSSES)
    init_from: str | None = opt(None, "start from this draft's weights (same method and shape), e.g. to "
                                      "continue a single-step run with --unroll 4; a jakiro run may start "
                                      "from an eagle2 draft (every expert a copy of its MLP)",
                                metavar="DRAFT")
    aux_layers: str = opt("", "mid-layer inputs: the draft's first step also reads the target's residual "
                              "stream after these decoder layers (e.g. 3,15; the data must hold them: "
                              "jakiro data --aux-layers)")
    eval_every: int = opt(200, "held-out metrics every N steps")
    eval_records: int = opt(32, "held-out records (the dataset's last ones, at most 5 %%)")
    eval_steps: int = opt(4, "draft steps evaluated")
    tau_every: int = opt(0, "greedy decoding tau on held-out prompts every N steps (0 = never)")
    tau_prompts: int = opt(6, "held-out prompts decoded for --tau-every")
    tau_tokens: int = opt(48, "tokens decoded per prompt for --tau-every")
    checkpoint_every: int = opt(100, "checkpoint every N steps (--resume continues from the last)")
    minutes: float = opt(0.0, "train for about this long (after loading): after 11 steps the "
                              "step count is set from their pace so that the learning-rate schedule ends "
                              "on time (--steps stays the upper bound; 0 = no limit)")
    seed: int = opt(0, "seed of the initialisation, the data order and the noise")

    def check(self, world: int = 1) -> None:
        """Refuse settings that cannot train (the command line and the API alike); ``world``:
        the number of training processes."""
        if self.method not in ("eagle2", "jakiro", "eagle3"):
            raise JakiroError(f"unknown draft method {self.method!r}; choose eagle2, jakiro or eagle3")
        if self.jakiro_loss not in JAKIRO_LOSSES:
            raise JakiroError(f"unknown Jakiro loss {self.jakiro_loss!r}; choose from {', '.join(JAKIRO_LOSSES)}")
        if self.intermediate_size < 0:
            raise JakiroError(f"--intermediate-size must be >= 0, got {self.intermediate_size}")
        _at_least_one(self, ("steps", "batch_size", "seq_len", "eval_every", "checkpoint_every", "unroll",
                             "eval_steps"))
        if self.warmup >= self.steps:
            raise JakiroError(f"--warmup {self.warmup} must be below --steps {self.steps} "
                              "(the learning rate would never reach its peak)")
        if not self.p_weight >= 0:
            raise JakiroError(f"--p-weight must be >= 0, got {self.p_weight}")
        if not self.minutes >= 0:
            raise JakiroError(f"--minutes must be >= 0, got {self.minutes}")
        if not self.lr > 0:
            raise JakiroError(f"--lr must be > 0, got {self.lr}")
        parse_layers(self.aux_layers)
        if self.batch_size % world:
            raise JakiroError(f"batch size {self.batch_size} must be divisible by the {world} processes")
