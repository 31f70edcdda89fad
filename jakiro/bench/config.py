"""A benchmark run's settings: one definition for ``run_bench``/``run_concurrency`` and for the
``jakiro bench`` options (their defaults and help come from here)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..settings import opt

# what the loaded target turned out to run (``run_bench`` sets them): recorded beside a run's
# settings, not among them
LOADED_TARGET_FIELDS = ("int8_activations", "quantized_weights", "kv_cache")


@dataclass
class BenchConfig:
    questions: str
    methods: list[str]
    drafts: dict[str, str] = field(default_factory=dict)  # method -> draft folder (``--draft``)
    temperature: float = opt(0.0, "sampling temperature, 0 = greedy")
    max_new_tokens: int = opt(256, "tokens per answer at most")
    limit_per_category: int | None = opt(None, "questions per category at most (default: all)", type=int)
    out: str = opt("bench_out", "folder for answers, progress (resumable) and the summary")
    target: str | None = None
    cache_dir: str | None = None
    depth: int | None = opt(None, "draft tree depth (draft-model: chain length)", type=int)
    tree_top_k: int | None = opt(None, "children expanded per draft node", type=int)
    total_tokens: int | None = opt(None, "draft tokens verified per cycle", type=int)
    seed: int = opt(0, "sampling seed of every answer")
    warmup: int = 1  # untimed short answers per method before the run
    static_tree: str = opt("static:cpu", "tree of the -static methods (static:NAME|PATH)")
    repeats: int = opt(1, "answer each turn this many times per method (interleaved) and keep the fastest: "
                          "steadier speedups on a shared machine, same tokens")
    draft_model: str | None = opt(None, "the small model of the draft-model methods (default: the named "
                                        "target's own)")
    prompt_cache: bool = opt(False, "with --concurrency: also measure each method, in the same rounds, as serve runs "
                             "it: a request starts from what the last request in its slot left in the KV cache where "
                             "their prompts start the same way (without it every prompt is prefilled whole, as "
                             "llama.cpp's server with cache_prompt false)")
    int8_activations: bool = False  # the loaded target's input mode (``run_bench`` sets it)
    quantized_weights: bool = False  # whether it streams a GGUF file's blocks (likewise)
    kv_cache: str = "float32"  # how its KV cache holds keys and values (likewise)
