"""The ``jakiro`` command: one entry point, one sub-command per job."""

from __future__ import annotations

import json
import os
import statistics
import sys

from .bench.config import BenchConfig
from .cli_options import _config_from, build_parser, runtime_from  # noqa: F401 (build_parser: imported from here too)
from .errors import JakiroError
from .settings import DecodeSettings, MethodSettings, ServeSettings, settings_with
from .train.config import DataConfig, TrainConfig


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


def _load(args, method: str | None = None, **changes):
    """The target and method the options ask for (``method``: instead of ``--method``; ``changes``:
    other ``MethodSettings`` fields set by the command)."""
    from . import load
    settings = _config_from(args, MethodSettings)
    if method is not None:
        changes["method"] = method
    return load(args.target, runtime=args.runtime, cache_dir=args.cache_dir, settings=settings_with(settings, changes))


def cmd_generate(args) -> int:
    decode = _config_from(args, DecodeSettings)  # checked before the target loads
    params, stop = decode.sampling(), list(decode.stop)
    if args.compare_rounds < 1:
        raise JakiroError(f"--compare-rounds must be >= 1, got {args.compare_rounds}")
    jk = _load(args, prompt_cache=False)  # --compare's runs each prefill the prompt whole
    engine = jk.engine()
    stream_out = not args.json
    if args.compare and engine.method != "ar":
        # untimed warm-up of both engines, so that neither side of the comparison pays the
        # process's one-time costs (kernel selection, first allocations)
        for e in (engine, jk.engine("ar")):
            e.generate(args.prompt, 8, params, stop, not args.raw)
    result = engine.generate(args.prompt, decode.max_new_tokens, params, stop, not args.raw,
                             on_text=(lambda t: print(t, end="", flush=True)) if stream_out else None)
    out = {"method": result.method, "text": result.text, "token_ids": result.token_ids,
           "finish_reason": result.finish_reason, "int8_activations": jk.target.int8_activations,
           **result.metrics.as_dict()}
    tree = _tree_of(engine)
    if tree:
        out["tree"] = tree
    if args.compare and result.method != "ar":
        # plain decoding after each run of the method, the method's later runs silent: the medians
        # compare the two under the same moments of a shared machine
        def again(e):
            return e.generate(args.prompt, decode.max_new_tokens, params, stop, not args.raw)

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
    print(json.dumps(out) if args.json else _summary_line(result, out, args.compare_rounds))
    return 0


def _tree_of(engine) -> dict | None:
    """The tree a draft method drafts (``generate --json``'s ``tree``), None for the others."""
    drafter = getattr(engine.proposer, "inner", engine.proposer)  # the draft inside cost-aware drafting
    if not hasattr(drafter, "budget"):
        return None
    b = drafter.budget
    return {"depth": b.depth, "top_k": b.top_k, "total_tokens": b.total_tokens,
            "candidate_mode": drafter.mode, "parallel_decoding": drafter.parallel,
            "draft_vocab": drafter.head_vocab or drafter.draft.config.draft_vocab_size,
            "prompt_vocab": drafter.prompt_vocab,
            "tuned": engine.tuned, "adaptive": getattr(engine.proposer, "adaptive", False),
            "static": drafter.static.as_list() if drafter.static else None}


def _summary_line(result, out: dict, rounds: int) -> str:
    """The line after the streamed answer: tokens, τ and speed (and the speedup with --compare)."""
    m = result.metrics
    plain = (f", {m.plain_steps} of them plain steps where speculating would not pay"
             if m.plain_steps and result.method != "ar" else "")
    if "speedup" in out:
        how = f"medians of {rounds} interleaved runs each" if rounds > 1 else "one run each"
        return (f"\n\n[{result.method}] {m.new_tokens} tokens, tau {m.tau:.2f} ({m.target_forwards} target "
                f"forwards{plain}): {out['median_tokens_per_s']:.1f} tokens/s against plain decoding's "
                f"{out['ar_tokens_per_s']:.1f} ({how}) -> speedup {out['speedup']:.2f}x")
    return (f"\n\n[{result.method}] {m.new_tokens} tokens in {m.total_s:.2f} s: "
            f"{m.tokens_per_s:.1f} tokens/s, tau {m.tau:.2f} ({m.target_forwards} target forwards{plain})")


def _load_for_session(args):
    """Target + method for serve/chat: the draft's method if one is given, Jakiro with the shipped
    draft for the default model, plain decoding otherwise."""
    from .api import shipped_draft
    method = None
    if args.method is None and args.draft is None:
        method = "jakiro" if shipped_draft("jakiro", args.target) else "ar"
    return _load(args, method)


def cmd_serve(args) -> int:
    from .serve.app import serve
    settings = _config_from(args, ServeSettings)  # checked before the target loads
    serve(_load_for_session(args), settings)
    return 0


def cmd_chat(args) -> int:
    from .chat import ChatSession, run_chat
    decode = _config_from(args, DecodeSettings)  # checked before the target loads
    session = ChatSession(_load_for_session(args).engine(), decode, args.system)
    return run_chat(session)


def cmd_bench_cost(args) -> int:
    from .bench.cost_curve import run_cost_curve
    report = run_cost_curve(args.target, args.cache_dir, args.context, args.repeats,
                            args.new_tokens, args.rounds, args.compare_kernels, args.llamacpp, args.runtime)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))
    return 0


def cmd_data(args) -> int:
    from .train.dataset import build_dataset
    cfg = _config_from(args, DataConfig, target=args.target, filter_evaluation=not args.no_eval_filter)
    state = build_dataset(args.out, cfg, args.cache_dir, runtime=args.runtime)
    keys = ("records", "tokens", "loss_tokens", "records_done", "removed_evaluation", "removed_duplicates",
            "skipped_bad_lines", "feature_tokens_per_s", "regeneration_runs")
    print(json.dumps({k: state[k] for k in keys if k in state}))
    return 0


def cmd_train(args) -> int:
    from .train.trainer import Trainer
    cfg = _config_from(args, TrainConfig, data=args.data, out=args.out, parallel_decoding=not args.no_parallel,
                       draft_vocab_size=args.draft_vocab_size or None,
                       init_from=os.path.abspath(args.init_from) if args.init_from else None)
    trainer = Trainer(cfg, args.target, args.cache_dir, args.runtime, resume=args.resume, device=args.device)
    result = trainer.run()
    if trainer.rank == 0:
        print(json.dumps(result))
    return 0


def _bench_drafts(items: list[str]) -> dict[str, str]:
    """bench --draft values: a draft folder (used for its own method) or METHOD=FOLDER."""
    from .draft.checkpoint import draft_method
    drafts = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or os.path.isdir(item):
            name, path = draft_method(item), item
        drafts[name] = path
    return drafts


def cmd_eval_draft(args) -> int:
    from .train.evaluate import evaluate_drafts
    for row in evaluate_drafts(args.data, args.drafts, args.target, args.cache_dir, args.prompts, args.tokens,
                               all_records=args.all_records, runtime=args.runtime):
        print(json.dumps(row), flush=True)
    return 0


def cmd_bench(args) -> int:
    from .bench.runner import run_bench
    from .decoding.sampling import SamplingParams
    SamplingParams(args.temperature)
    runtime = args.runtime
    if runtime.threads is None:  # benchmarks default to one thread: stable, comparable figures
        runtime = runtime.but(threads=1)  # (applied where the benchmark loads the target)
    cfg = _config_from(args, BenchConfig, questions=args.questions, drafts=_bench_drafts(args.draft),
                       methods=[m.strip() for m in args.methods.split(",") if m.strip()],
                       target=args.target, cache_dir=args.cache_dir)
    if args.concurrency:
        from .bench.concurrency import concurrency_table, parse_levels, run_concurrency
        print(concurrency_table(run_concurrency(cfg, parse_levels(args.concurrency), runtime=runtime)))
        return 0
    from .bench.summary import markdown_table
    summary = run_bench(cfg, runtime=runtime)
    print(markdown_table(summary))
    return 0


def cmd_tune(args) -> int:
    from .api import shipped_draft
    from .bench.tune import run_tune
    draft = args.draft or shipped_draft("jakiro", args.target)
    if draft is None:
        raise JakiroError("no draft to tune: pass --draft PATH")
    result = run_tune(draft, args.target, args.cache_dir, args.max_new_tokens, runtime=args.runtime)
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


def cmd_export(args) -> int:
    from .draft.eagle3_format import export
    for path in export(args.draft, args.format, args.out, args.target, args.cache_dir, args.dtype):
        print(path)
    return 0


COMMANDS = {"serve": cmd_serve, "chat": cmd_chat, "tune": cmd_tune, "bench": cmd_bench, "generate": cmd_generate, "bench-cost": cmd_bench_cost, "data": cmd_data, "train": cmd_train,
            "eval-draft": cmd_eval_draft, "models": cmd_models, "export": cmd_export}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.runtime = runtime_from(args).apply()
        return COMMANDS[args.command](args)
    except JakiroError as exc:
        print(f"jakiro: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("jakiro: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
