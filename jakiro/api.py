"""The Python API: ``jakiro.load(...)`` returns a ready speculative generator."""

from __future__ import annotations

import os
from typing import Callable, Iterator

from .decoding.engine import Engine, GenerationResult
from .decoding.proposers import PromptLookupProposer, Proposer, TreeBudget
from .decoding.draft_proposer import DraftProposer
from .decoding.sampling import SamplingParams
from .errors import JakiroError
from .methods import METHODS

SHIPPED_DRAFTS_DIR = os.path.join(os.path.dirname(__file__), "drafts")


def shipped_draft(method: str, target: str | None = None) -> str | None:
    """The draft of ``method`` the package ships for ``target`` (None: the default model; else a
    named model, its GGUF file or its converted folder), if any."""
    from .models.registry import named_for
    model = named_for(target)
    if model is None:
        return None
    path = os.path.join(SHIPPED_DRAFTS_DIR, f"{model.name}-{method}")
    return path if os.path.exists(os.path.join(path, "config.json")) else None


def load_tokenizer(folder: str):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as exc:
        raise JakiroError(f"cannot load the tokenizer from {folder}: {exc}") from None


def check_method_options(method: str, budget: "TreeBudget | None", tree: str | None) -> None:
    """The one rule for which tree options a method takes (API, command line and server alike)."""
    if method not in METHODS:
        raise JakiroError(f"unknown method {method!r} (choose from {', '.join(METHODS)})")
    if method in ("ar", "pld") and (budget is not None or tree is not None):
        raise JakiroError("--depth/--tree-top-k/--total-tokens/--tree apply to eagle2 and jakiro drafts")
    if method.startswith("draft-model") and tree is not None:
        raise JakiroError("a draft model drafts a chain: --tree does not apply (--depth sets its longest chain)")
    if tree is not None and budget is not None:
        raise JakiroError("a static --tree fixes the tree: drop --depth/--tree-top-k/--total-tokens")


class Jakiro:
    """A target model, its tokenizer, and one engine per decoding method (sharing the target)."""

    def __init__(self, target, tokenizer, target_path: str):
        self.target, self.tokenizer, self.target_path = target, tokenizer, target_path
        self.engines: dict[str, Engine] = {}
        self.default_method = "ar"

    def add_method(self, method: str, draft: str | None = None, budget: TreeBudget | None = None,
                   candidate_mode: str | None = None, parallel_decoding: bool | None = None,
                   pld_tokens: int = 6, cache_dir: str | None = None, adaptive: bool = True,
                   tree: str | None = None, prompt_vocab: bool = True, draft_model: str | None = None) -> Engine:
        """Set up ``method``. Without an explicit ``budget`` a draft uses the tree saved by
        ``jakiro tune`` for it, else the default tree. With ``adaptive`` (the default, for drafts
        without an explicit budget or static tree: the user's tree wins) each cycle drafts only
        what pays on this machine (``decoding.adaptive``). ``tree``: ``static:NAME|PATH``, a
        static (EAGLE-1) tree instead of the dynamic one. ``prompt_vocab`` (default on): a draft
        also scores the tokens of each request's prompt that its vocabulary lacks. ``draft_model``
        (method ``draft-model``): a named model, GGUF file or folder sharing the target's tokenizer
        (default: the named target's own, e.g. qwen2.5-coder-0.5b for qwen2.5-coder-1.5b)."""
        check_method_options(method, budget, tree)
        static = None
        if tree is not None:
            from .decoding.static_tree import parse_tree
            static = parse_tree(tree)
        name, lookup = method, method.endswith("+pld")
        method = method.removesuffix("+pld")
        proposer: Proposer
        source = None  # where the draft's tree came from (tuned for this machine, or its config)
        if method == "ar":
            proposer = Proposer()
        elif method == "draft-model":
            proposer = self._draft_model_proposer(draft_model, budget, cache_dir,
                                                  PromptLookupProposer(num_tokens=pld_tokens) if lookup else None)
        elif method == "pld":
            proposer = PromptLookupProposer(num_tokens=pld_tokens)
            if adaptive:  # verify only as much of the chain as pays on this machine
                from .decoding.adaptive import AdaptiveProposer
                proposer = AdaptiveProposer(None, self.target, lookup=proposer, keep_costs=True, cache_dir=cache_dir)
        else:
            explicit = budget is not None or static is not None
            proposer, source = self._draft_proposer(method, draft, budget, static, candidate_mode, parallel_decoding,
                                                    cache_dir, prompt_vocab)
            if (adaptive and not explicit) or lookup:
                from .decoding.adaptive import AdaptiveProposer
                proposer = AdaptiveProposer(proposer, self.target, adaptive=adaptive and not explicit,
                                            lookup=PromptLookupProposer(num_tokens=pld_tokens) if lookup else None,
                                            keep_costs=True, cache_dir=cache_dir)
        engine = Engine(self.target, self.tokenizer, proposer, tuned=source)
        self.engines[name] = engine
        return engine

    def _draft_proposer(self, method: str, draft: str | None, budget: TreeBudget | None, static,
                        candidate_mode: str | None, parallel_decoding: bool | None, cache_dir: str | None,
                        prompt_vocab: bool) -> tuple[DraftProposer, str | None]:
        """A trained draft's proposer (the shipped one for ``method`` without ``draft``) on the
        tree asked for, else the one tuned for this machine, else the draft's default tree; and
        where that tree came from."""
        from .draft.tuning import DEFAULT_TREE_KEY, default_tree, load_tuning
        from .draft import load_draft
        draft = draft or shipped_draft(method, self.target_path)
        if draft is None:
            raise JakiroError(f"method {method} needs a draft: none ships for this target; pass --draft PATH "
                              f"(jakiro train makes one)")
        model = load_draft(draft, self.target)
        if model.config.method != method:
            raise JakiroError(f"{draft} is a {model.config.method} draft, not {method}")
        tuned = source = None
        if budget is None and static is None:
            record = load_tuning(draft, cache_dir, quantized=self.target.quantized_matrices > 0,
                                 int8_activations=self.target.int8_activations)
            if record:
                tuned, source = record["best"], record["path"]
            else:  # no record for this machine: the tree the draft's config recommends, if any
                tuned = default_tree(draft)
                source = f"{os.path.join(draft, 'config.json')} ({DEFAULT_TREE_KEY})" if tuned else None
            budget = TreeBudget(tuned["depth"], tuned["top_k"], tuned["total_tokens"]) if tuned else TreeBudget()
            if tuned and parallel_decoding is None:
                parallel_decoding = tuned.get("parallel_decoding")
        try:
            return DraftProposer(model, budget or TreeBudget(), candidate_mode, parallel_decoding, static,
                                 head_vocab=tuned.get("draft_vocab") if tuned else None,
                                 prompt_vocab=prompt_vocab), source
        except ValueError as exc:
            raise JakiroError(str(exc)) from None

    def _draft_model_proposer(self, draft_model: str | None, budget: TreeBudget | None, cache_dir: str | None,
                              lookup: PromptLookupProposer | None):
        from .decoding.draft_model import DraftModelProposer, check_same_tokenizer
        from .models import registry, smallgemm
        from .models.hub import resolve_target
        from .models.target import TargetModel
        if draft_model is None:
            draft_model = registry.default_draft_for(self.target_path)
            if draft_model is None:
                raise JakiroError("method draft-model needs a draft model: pass --draft-model NAME|PATH "
                                  "(a smaller model of the target's family)")
        path = resolve_target(draft_model, cache_dir)
        from .models.gguf_file import is_gguf_folder
        # a draft's proposals need not be exact: int8 inputs where the file and the CPU allow them
        int8 = is_gguf_folder(path) and smallgemm.available() and smallgemm.int8_activations_usable()
        model = TargetModel.from_folder(path, int8_activations=int8)
        check_same_tokenizer(self.tokenizer, load_tokenizer(path), self.target.config.vocab_size,
                             model.config.vocab_size, os.path.basename(path))
        return DraftModelProposer(model, num_tokens=budget.depth if budget else 5, lookup=lookup)

    def engine(self, method: str | None = None) -> Engine:
        method = method or self.default_method
        if method not in self.engines:
            self.add_method(method)
        return self.engines[method]

    def generate(self, prompt, max_new_tokens: int = 128, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 stop: list[str] | None = None, chat: bool = True, method: str | None = None,
                 on_text: Callable[[str], None] | None = None) -> GenerationResult:
        params = SamplingParams(temperature, top_p, top_k, seed)
        return self.engine(method).generate(prompt, max_new_tokens, params, stop, chat, on_text)

    def generate_batch(self, prompts: list, max_new_tokens: int = 128, temperature: float = 0.0,
                       top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                       stop: list[str] | None = None, chat: bool = True, method: str | None = None,
                       parallel: int | None = None) -> list[GenerationResult]:
        """Answers to many prompts decoded together (continuous batching, ``parallel`` at a time,
        default all), each the answer ``generate`` gives it alone: greedy exactly; sampled with
        ``seed``, the same draws (every prompt's generator seeded with it)."""
        params = SamplingParams(temperature, top_p, top_k, seed)
        return self.engine(method).generate_batch(list(prompts), max_new_tokens, params, stop, chat, parallel)

    def stream(self, prompt, max_new_tokens: int = 128, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
               stop: list[str] | None = None, chat: bool = True,
               method: str | None = None) -> Iterator[str]:
        params = SamplingParams(temperature, top_p, top_k, seed)
        return self.engine(method).stream(prompt, max_new_tokens, params, stop, chat)


def tree_budget(depth: int | None = None, top_k: int | None = None,
                total_tokens: int | None = None) -> TreeBudget | None:
    """The tree for explicit options (defaults for the ones not given), or None when no option is
    given, so that a draft uses its tuned tree."""
    if all(v is None for v in (depth, top_k, total_tokens)):
        return None
    defaults = TreeBudget()
    try:
        return TreeBudget(depth or defaults.depth, top_k or defaults.top_k, total_tokens or defaults.total_tokens)
    except ValueError as exc:
        raise JakiroError(str(exc)) from None


def load(target: str | None = None, draft: str | None = None, method: str | None = None,
         depth: int | None = None, top_k: int | None = None, total_tokens: int | None = None,
         candidate_mode: str | None = None, parallel_decoding: bool | None = None,
         cache_dir: str | None = None, adaptive: bool = True, tree: str | None = None,
         quantized: bool | None = None, prompt_vocab: bool = True,
         int8_activations: bool | None = None, draft_model: str | None = None) -> Jakiro:
    """Load a target (default: SmolLM2-135M-Instruct) and set up ``method`` (default: the draft's
    method when a draft is given, else plain decoding). ``adaptive=False`` keeps the draft's
    fixed tree every cycle; ``tree="static:eagle1"`` (a preset or a JSON file of paths) drafts a
    static tree. ``quantized`` (default: on unless ``JAKIRO_QUANTIZED=0``): a target converted from a GGUF
    file streams its quantized blocks in decoding steps and trees (``models.quant``);
    ``int8_activations`` (default: ``JAKIRO_INT8_ACTIVATIONS``, else on where the CPU has AVX-512 VNNI
    or AMX): they take their inputs as int8, as llama.cpp does (faster; the target's text is then
    that computation's); False keeps float32-accurate inputs.
    ``prompt_vocab=False``: a draft scores only its own vocabulary, not also the prompt's tokens.
    ``draft_model``: the small model of ``method="draft-model"`` (see ``Jakiro.add_method``)."""
    from .models.hub import resolve_target
    from .models.target import TargetModel

    if method is None and draft is not None:
        from .draft.checkpoint import draft_method
        method = draft_method(draft)
    method = method or "ar"
    budget = tree_budget(depth, top_k, total_tokens)
    check_method_options(method, budget, tree)  # before the target loads: bad options fail fast
    path = resolve_target(target, cache_dir)
    model = TargetModel.from_folder(path, quantized=quantized, int8_activations=int8_activations)
    jk = Jakiro(model, load_tokenizer(path), path)
    jk.add_method(method, draft, budget, candidate_mode, parallel_decoding,
                  cache_dir=cache_dir, adaptive=adaptive, tree=tree, prompt_vocab=prompt_vocab, draft_model=draft_model)
    jk.default_method = method
    return jk
