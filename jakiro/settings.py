"""Settings in one place: each a dataclass whose fields give the API's keyword arguments, the
command line's options (their defaults and help: ``cli_fields``), the server's and the
benchmark's. ``Runtime`` holds the choices that reach the kernels (threads, quantized blocks,
int8 activations); it is passed down to the models, and the environment only sets its defaults.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace

from .errors import JakiroError
from .methods import METHODS


def opt(default, help: str, **cli):
    """A dataclass field with its command-line help (and argparse extras: ``choices``, ``flag``
    for an option spelled otherwise, ``action``/``const`` for a switch that is not store_true)."""
    return field(default=default, metadata={"help": help, **cli})


def cli_fields(cls, skip: tuple[str, ...] = ()) -> list[tuple[str, str, object, dict]]:
    """(field name, option, default, argparse keyword arguments) for each documented field of
    ``cls`` but ``skip``."""
    out = []
    for f in fields(cls):
        if "help" not in f.metadata or f.name in skip:
            continue
        meta = dict(f.metadata)
        flag = meta.pop("flag", "--" + f.name.replace("_", "-"))
        out.append((f.name, flag, f.default, meta))
    return out


KV_CACHE_TYPES = ("float32", "float16")


def _at_least(cfg, minimum, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(cfg, name)
        if value is not None and value < minimum:
            raise JakiroError(f"--{name.replace('_', '-')} must be >= {minimum}, got {value}")


def check_max_new_tokens(value) -> None:
    """The one check of a request's ``max_new_tokens`` (the settings and the decoder's length check)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise JakiroError(f"max_new_tokens must be a positive integer, got {value!r}")


def _env_switch(name: str) -> bool | None:
    """An on/off environment variable: None when unset, empty or 'auto'."""
    value = os.environ.get(name, "auto").strip().lower()
    return None if value in ("", "auto") else value not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class Runtime:
    """How a process computes: passed to ``jakiro.load`` and ``TargetModel.from_folder`` (and from
    there to the kernels). ``from_env`` reads the defaults: ``JAKIRO_THREADS``,
    ``JAKIRO_QUANTIZED``, ``JAKIRO_INT8_ACTIVATIONS`` and ``JAKIRO_KV_CACHE``."""
    threads: int | None = None  # torch CPU threads (None: torch's choice)
    quantized: bool = True  # a GGUF target streams its own blocks (False: a float32 copy of its weights)
    int8_activations: bool | None = None  # the blocks take int8 inputs (None: where the CPU has the kernels)
    # how the target's KV cache holds keys and values: "float32", or "float16" (half the memory and
    # the bytes a long context costs each new token; a GGUF target run from its blocks only); None:
    # float16 where the inputs are int8 (as llama.cpp computes), float32 with float32-accurate ones
    kv_cache: str | None = None

    def __post_init__(self):
        _at_least(self, 1, ("threads",))
        if self.kv_cache is not None and self.kv_cache not in KV_CACHE_TYPES:
            raise JakiroError(f"the KV cache holds {' or '.join(KV_CACHE_TYPES)}, not {self.kv_cache!r}")

    @classmethod
    def from_env(cls, threads: int | None = None, quantized: bool | None = None,
                 int8_activations: bool | None = None, kv_cache: str | None = None) -> "Runtime":
        """The given choices, else the environment's, else the defaults."""
        env_threads = os.environ.get("JAKIRO_THREADS", "").strip()
        if threads is None and env_threads:
            try:
                threads = int(env_threads)
            except ValueError:
                raise JakiroError(f"JAKIRO_THREADS must be a number, got {env_threads!r}") from None
        if quantized is None:
            quantized = _env_switch("JAKIRO_QUANTIZED") is not False
        if int8_activations is None:
            int8_activations = _env_switch("JAKIRO_INT8_ACTIVATIONS")
        if kv_cache is None:
            kv_cache = os.environ.get("JAKIRO_KV_CACHE", "").strip() or None
        return cls(threads, quantized, int8_activations, kv_cache)

    def apply(self) -> "Runtime":
        """Set the process-wide part (torch's thread count); returns self."""
        if self.threads is not None:
            import torch
            torch.set_num_threads(self.threads)
        return self

    def but(self, **changes) -> "Runtime":
        return replace(self, **changes)


@dataclass(frozen=True)
class DecodeSettings:
    """One request's decoding: ``Jakiro.generate``/``stream``/``generate_batch``, ``jakiro
    generate`` and ``jakiro chat``."""
    max_new_tokens: int = opt(128, "tokens to generate at most")
    temperature: float = opt(0.0, "sampling temperature, 0 = greedy")
    top_p: float = opt(1.0, "nucleus sampling threshold (1 = off)")
    top_k: int = opt(0, "top-k sampling filter (0 = off)")
    seed: int | None = opt(None, "sampling seed (reproducible output for the same seed)", type=int)
    stop: tuple[str, ...] | list[str] = opt((), "stop string (repeatable)", action="append")

    def __post_init__(self):
        check_max_new_tokens(self.max_new_tokens)
        object.__setattr__(self, "stop", tuple(self.stop or ()))  # (the command line's: None or a list)
        self.sampling()  # the sampling parameters' own checks, at once

    def sampling(self):
        from .decoding.sampling import SamplingParams
        return SamplingParams(self.temperature, self.top_p, self.top_k, self.seed)


@dataclass(frozen=True)
class MethodSettings:
    """How a loaded target decodes: ``jakiro.load``'s and ``Jakiro.add_method``'s options, and the
    command line's method and tree options."""
    method: str | None = opt(None, "decoding method; +pld adds prompt-lookup branches to the draft's tree "
                             "(default: the draft's method; without --draft, plain decoding, and for serve and "
                             "chat jakiro where a draft ships for the target)", choices=METHODS)
    draft: str | None = opt(None, "draft checkpoint folder (default: the shipped draft for the method)")
    draft_model: str | None = opt(None, "method draft-model: the small model that drafts, a named model, .gguf "
                                  "file or folder sharing the target's tokenizer (default: the named target's "
                                  "own, e.g. qwen2.5-coder-0.5b for qwen2.5-coder-1.5b)")
    depth: int | None = opt(None, "draft tree depth (draft-model: its longest chain)", type=int)
    tree_top_k: int | None = opt(None, "children expanded per draft node (--top-k is the sampling filter)",
                                 type=int)
    total_tokens: int | None = opt(None, "draft tokens verified per cycle", type=int)
    candidate_mode: str | None = opt(None, "Jakiro candidate mode", flag="--candidates",
                                     choices=("decoupled", "blended"))
    parallel_decoding: bool | None = opt(None, "Jakiro: disable contrastive parallel decoding", flag="--no-parallel",
                                         action="store_const", const=False)
    tree: str | None = opt(None, "static:NAME|PATH: a static (EAGLE-1) tree, a preset (eagle1, chain2, cpu) or a "
                           "JSON list of rank paths, instead of the dynamic tree")
    adaptive: bool = opt(True, "drafts: verify the same tree every cycle instead of drafting only what pays "
                         "(explicit --depth/--tree-top-k/--total-tokens also fix the tree); pld: verify the whole "
                         "lookup chain every cycle (the classic prompt lookup)", flag="--no-adaptive",
                         action="store_false")
    prompt_vocab: bool = opt(True, "drafts: score only the draft vocabulary, not also the tokens of the request's "
                             "prompt that it lacks", flag="--no-prompt-vocab", action="store_false")
    prompt_cache: bool = opt(True, "prefill every prompt whole instead of starting from what the last request "
                             "left in the KV cache where the prompt starts the same way (a conversation's next turn, "
                             "a shared system prompt); the answer is bitwise the same either way",
                             flag="--no-prompt-cache", action="store_false")
    pld_tokens: int = 6  # prompt lookup: the longest chain it proposes

    def __post_init__(self):
        _at_least(self, 1, ("depth", "tree_top_k", "total_tokens", "pld_tokens"))


@dataclass(frozen=True)
class ServeSettings:
    """``jakiro serve`` and ``serve.app.create_app``/``serve``."""
    host: str = opt("127.0.0.1", "address to listen on (0.0.0.0: every interface)")
    port: int = opt(8000, "TCP port to listen on")
    model_name: str | None = opt(None, "model id served to clients (default: the target's name)")
    max_queue: int = opt(16, "requests that may wait; more get HTTP 429")
    default_max_tokens: int = opt(256, "completion length when a request gives no max_tokens")
    log_level: str = opt("info", "server log verbosity", choices=("critical", "error", "warning", "info", "debug"))
    api_key: str | None = opt(None, "require 'Authorization: Bearer KEY' on /v1 routes (default: $JAKIRO_API_KEY, "
                              "else none)")
    max_body_bytes: int = opt(4 << 20, "larger request bodies get HTTP 413 (the default is far above any prompt "
                              "that fits a context)")
    allowed_hosts: tuple[str, ...] | None = opt(None, "comma-separated Host header names to answer (default: "
                                                "loopback names when --host is loopback, any otherwise)")
    header_timeout: float = opt(10.0, "seconds a connection may take to send a request head")
    max_connections: int = opt(64, "concurrent connections; more get HTTP 503")
    docs: bool = opt(False, "serve the interactive API docs at /docs and /redoc")
    parallel: int = opt(1, "requests decoded together (continuous batching; each keeps its method's drafts, all "
                        "verified in one forward); 1: one at a time")
    slot_tokens: int | None = opt(None, "with --parallel > 1: tokens (prompt and answer) each request may take; "
                                  "its KV cache is allocated for every slot at start (default: the model's "
                                  "context, at most 4096)", type=int)

    def __post_init__(self):
        if not 0 < self.port < 65536:
            raise JakiroError(f"--port must be in 1..65535, got {self.port}")
        _at_least(self, 1, ("max_queue", "default_max_tokens", "max_body_bytes", "max_connections", "parallel"))
        _at_least(self, 2, ("slot_tokens",))
        if not self.header_timeout > 0:
            raise JakiroError(f"--header-timeout must be > 0, got {self.header_timeout}")
        if isinstance(self.allowed_hosts, str):  # the command line's comma-separated names
            names = tuple(h.strip() for h in self.allowed_hosts.split(",") if h.strip())
            object.__setattr__(self, "allowed_hosts", names or None)
        if self.api_key is None and os.environ.get("JAKIRO_API_KEY"):
            object.__setattr__(self, "api_key", os.environ["JAKIRO_API_KEY"])


def settings_with(settings, options: dict):
    """``settings`` with the fields named in ``options`` changed (a keyword that is no field: a
    TypeError naming the fields)."""
    names = {f.name for f in fields(settings)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise TypeError(f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} for "
                        f"{type(settings).__name__} (its fields: {', '.join(sorted(names))})")
    return replace(settings, **options) if options else settings
