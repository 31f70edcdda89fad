"""The Python API: ``jakiro.load(...)`` returns a ready speculative generator."""

from __future__ import annotations

import os
from typing import Callable, Iterator

from .decoding.engine import Engine, GenerationResult
from .decoding.proposers import PromptLookupProposer, Proposer, TreeBudget
from .decoding.draft_proposer import DraftProposer
from .errors import JakiroError
from .methods import METHODS
from .settings import DecodeSettings, MethodSettings, Runtime, settings_with

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

    def __init__(self, target, tokenizer, target_path: str, cache_dir: str | None = None, prompt_cache: bool = True):
        """``prompt_cache``: the default of the methods added (``MethodSettings.prompt_cache``)."""
        self.target, self.tokenizer, self.target_path = target, tokenizer, target_path
        self.cache_dir, self.prompt_cache = cache_dir, prompt_cache
        self.engines: dict[str, Engine] = {}
        self.default_method = "ar"

    def add_method(self, method: str, settings: MethodSettings | None = None, **options) -> Engine:
        """Set up ``method`` with ``settings`` (``MethodSettings``; ``options``: its fields, changed).
        Without an explicit tree (depth, tree_top_k, total_tokens) a draft uses the tree saved by
        ``jakiro tune`` for it, else the default tree. With ``adaptive`` (the default, for drafts
        without an explicit tree or static tree: the user's tree wins) each cycle drafts only
        what pays on this machine (``decoding.adaptive``). ``tree``: ``static:NAME|PATH``, a
        static (EAGLE-1) tree instead of the dynamic one. ``prompt_vocab`` (default on): a draft
        also scores the tokens of each request's prompt that its vocabulary lacks. ``prompt_cache``
        (default on): a request starts from what the last one left in the KV cache where its prompt
        starts the same way (the answer is bitwise the same; benchmarks turn it off). ``draft_model``
        (method ``draft-model``): a named model, GGUF file or folder sharing the target's tokenizer
        (default: the named target's own, e.g. qwen2.5-coder-0.5b for qwen2.5-coder-1.5b)."""
        s = settings_with(settings or MethodSettings(prompt_cache=self.prompt_cache), options)
        budget = tree_budget(s.depth, s.tree_top_k, s.total_tokens)
        check_method_options(method, budget, s.tree)
        static = None
        if s.tree is not None:
            from .decoding.static_tree import parse_tree
            static = parse_tree(s.tree)
        name, lookup = method, method.endswith("+pld")
        method = method.removesuffix("+pld")
        cache_dir = self.cache_dir
        proposer: Proposer
        source = None  # where the draft's tree came from (tuned for this machine, or its config)
        if method == "ar":
            proposer = Proposer()
        elif method == "draft-model":
            proposer = self._draft_model_proposer(s.draft_model, budget,
                                                  PromptLookupProposer(num_tokens=s.pld_tokens) if lookup else None,
                                                  s.prompt_cache)
        elif method == "pld":
            proposer = PromptLookupProposer(num_tokens=s.pld_tokens)
            if s.adaptive:  # verify only as much of the chain as pays on this machine
                from .decoding.adaptive import AdaptiveProposer
                proposer = AdaptiveProposer(None, self.target, lookup=proposer, keep_costs=True, cache_dir=cache_dir)
        else:
            explicit = budget is not None or static is not None
            proposer, source = self._draft_proposer(method, s, budget, static)
            if (s.adaptive and not explicit) or lookup:
                from .decoding.adaptive import AdaptiveProposer
                proposer = AdaptiveProposer(proposer, self.target, adaptive=s.adaptive and not explicit,
                                            lookup=PromptLookupProposer(num_tokens=s.pld_tokens) if lookup else None,
                                            keep_costs=True, cache_dir=cache_dir)
        engine = Engine(self.target, self.tokenizer, proposer, tuned=source, prompt_cache=s.prompt_cache)
        self.engines[name] = engine
        return engine

    def _draft_proposer(self, method: str, s: MethodSettings, budget: TreeBudget | None,
                        static) -> tuple[DraftProposer, str | None]:
        """A trained draft's proposer (the shipped one for ``method`` without ``s.draft``) on the
        tree asked for, else the one tuned for this machine, else the draft's default tree; and
        where that tree came from."""
        from .draft.tuning import DEFAULT_TREE_KEY, default_tree, load_tuning
        from .draft import load_draft
        draft = s.draft or shipped_draft(method, self.target_path)
        parallel_decoding = s.parallel_decoding
        if draft is None:
            raise JakiroError(f"method {method} needs a draft: none ships for this target; pass --draft PATH "
                              f"(jakiro train makes one)")
        model = load_draft(draft, self.target)
        if model.config.method != method:
            raise JakiroError(f"{draft} is a {model.config.method} draft, not {method}")
        tuned = source = None
        if budget is None and static is None:
            record = load_tuning(draft, self.cache_dir, quantized=self.target.quantized_matrices > 0,
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
            return DraftProposer(model, budget or TreeBudget(), s.candidate_mode, parallel_decoding, static,
                                 head_vocab=tuned.get("draft_vocab") if tuned else None,
                                 prompt_vocab=s.prompt_vocab), source
        except ValueError as exc:
            raise JakiroError(str(exc)) from None

    def _draft_model_proposer(self, draft_model: str | None, budget: TreeBudget | None,
                              lookup: PromptLookupProposer | None, keep_context: bool = False):
        from .decoding.draft_model import DraftModelProposer, check_same_tokenizer
        from .models import registry, smallgemm
        from .models.hub import resolve_target
        from .models.target import TargetModel
        if draft_model is None:
            draft_model = registry.default_draft_for(self.target_path)
            if draft_model is None:
                raise JakiroError("method draft-model needs a draft model: pass --draft-model NAME|PATH "
                                  "(a smaller model of the target's family)")
        path = resolve_target(draft_model, self.cache_dir)
        from .models.gguf_file import is_gguf_folder
        # a draft's proposals need not be exact: int8 inputs where the file and the CPU allow them
        blocks = is_gguf_folder(path) and smallgemm.available()
        int8 = blocks and smallgemm.int8_activations_usable()
        # and the target's kind of KV cache where the kernels run it
        kv = self.target.runtime.kv_cache if blocks else "float32"
        model = TargetModel.from_folder(path, Runtime(quantized=True, int8_activations=int8, kv_cache=kv))
        check_same_tokenizer(self.tokenizer, load_tokenizer(path), self.target.config.vocab_size,
                             model.config.vocab_size, os.path.basename(path))
        return DraftModelProposer(model, num_tokens=budget.depth if budget else 5, lookup=lookup,
                                  keep_context=keep_context)

    def engine(self, method: str | None = None) -> Engine:
        method = method or self.default_method
        if method not in self.engines:
            self.add_method(method)
        return self.engines[method]

    def generate(self, prompt, settings: DecodeSettings | None = None, *, method: str | None = None,
                 chat: bool = True, on_text: Callable[[str], None] | None = None, **options) -> GenerationResult:
        """The answer to ``prompt`` (a user message, a list of chat messages, or with ``chat=False``
        text to continue or token ids) by ``method`` (default: the loaded one). ``settings``
        (``DecodeSettings``) and ``options``, its fields changed: ``max_new_tokens``,
        ``temperature`` (0 = greedy), ``top_p``, ``top_k``, ``seed``, ``stop`` (strings)."""
        d = settings_with(settings or DecodeSettings(), options)
        return self.engine(method).generate(prompt, d.max_new_tokens, d.sampling(), list(d.stop), chat, on_text)

    def generate_batch(self, prompts: list, settings: DecodeSettings | None = None, *, method: str | None = None,
                       chat: bool = True, parallel: int | None = None, **options) -> list[GenerationResult]:
        """Answers to many prompts decoded together (continuous batching, ``parallel`` at a time,
        default all), each the answer ``generate`` gives it alone: greedy exactly; sampled with
        ``seed``, the same draws (every prompt's generator seeded with it)."""
        d = settings_with(settings or DecodeSettings(), options)
        return self.engine(method).generate_batch(list(prompts), d.max_new_tokens, d.sampling(), list(d.stop), chat,
                                                  parallel)

    def stream(self, prompt, settings: DecodeSettings | None = None, *, method: str | None = None,
               chat: bool = True, **options) -> Iterator[str]:
        """``generate``'s text as it is committed; the generator's return value is its result."""
        d = settings_with(settings or DecodeSettings(), options)
        return self.engine(method).stream(prompt, d.max_new_tokens, d.sampling(), list(d.stop), chat)


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


def load(target: str | None = None, draft: str | None = None, method: str | None = None, *,
         runtime: Runtime | None = None, cache_dir: str | None = None, settings: MethodSettings | None = None,
         **options) -> Jakiro:
    """Load a target (default: SmolLM2-135M-Instruct; a named model, a .gguf file or a Hugging
    Face folder) and set up ``method`` (default: the draft's method when a draft is given, else
    plain decoding). ``runtime`` (``Runtime``; default ``Runtime.from_env()``): threads, whether a
    GGUF target streams its own blocks (``quantized``) and takes int8 inputs
    (``int8_activations``: faster, as llama.cpp computes; the target's text is then that
    computation's). ``settings`` (``MethodSettings``) and ``options``, its fields changed:
    ``draft_model``, ``depth``, ``tree_top_k``, ``total_tokens``, ``candidate_mode``,
    ``parallel_decoding``, ``tree`` (``"static:eagle1"``: a static tree), ``adaptive``
    (False: the draft's fixed tree every cycle), ``prompt_vocab``, ``prompt_cache``, ``pld_tokens``
    (see ``Jakiro.add_method``)."""
    from .models.hub import resolve_target
    from .models.target import TargetModel

    s = settings_with(settings or MethodSettings(), options)
    draft = draft or s.draft
    method = method or s.method
    if method is None and draft is not None:
        from .draft.checkpoint import draft_method
        method = draft_method(draft)
    method = method or "ar"
    s = settings_with(s, {"method": method, "draft": draft})
    check_method_options(method, tree_budget(s.depth, s.tree_top_k, s.total_tokens), s.tree)  # fail fast
    runtime = (runtime or Runtime.from_env()).apply()
    path = resolve_target(target, cache_dir)
    model = TargetModel.from_folder(path, runtime)
    jk = Jakiro(model, load_tokenizer(path), path, cache_dir, s.prompt_cache)
    jk.add_method(method, s)
    jk.default_method = method
    return jk
