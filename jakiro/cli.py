"""The ``jakiro`` command: one entry point, one sub-command per job."""

from __future__ import annotations

import argparse
import json
import sys

from .errors import JakiroError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        self.exit(2, f"{self.prog}: error: {message}\n")


def _add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="Hugging Face folder or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--cache-dir", help="where converted models are cached (default: $JAKIRO_CACHE "
                                       "or ~/.cache/jakiro)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")


def _add_tree_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft", help="draft checkpoint folder (default: the shipped draft for the method)")
    p.add_argument("--depth", type=int, help="draft tree depth")
    p.add_argument("--tree-top-k", dest="tree_top_k", type=int,
                   help="children expanded per draft node (--top-k is the sampling filter)")
    p.add_argument("--total-tokens", type=int, help="draft tokens verified per cycle")
    p.add_argument("--candidates", choices=("decoupled", "blended"), help="Jakiro candidate mode")
    p.add_argument("--no-parallel", action="store_true", help="Jakiro: disable contrastive parallel decoding")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", dest="sample_top_k", type=int, default=0,
                   help="top-k sampling filter (0 = off)")
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="jakiro", description="Lossless speculative decoding with Jakiro drafts.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text for one prompt")
    g.add_argument("--prompt", required=True)
    g.add_argument("--method", choices=("ar", "pld", "eagle2", "jakiro"))
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--compare", action="store_true",
                   help="also run plain decoding on the same prompt and report the speedup")
    _add_target_args(g)
    _add_tree_args(g)
    _add_sampling_args(g)

    c = sub.add_parser("bench-cost", help="target forward cost curve and plain decoding vs HF generate")
    _add_target_args(c)
    c.add_argument("--context", type=int, default=256)
    c.add_argument("--repeats", type=int, default=10)
    c.add_argument("--new-tokens", type=int, default=64, help="tokens per plain decoding run")
    c.add_argument("--rounds", type=int, default=3, help="alternating ours/HF decoding rounds")
    c.add_argument("--out", default="cost_curve.json")
    return parser


def _setup_threads(args) -> None:
    if getattr(args, "threads", None) is not None:
        if args.threads < 1:
            raise JakiroError(f"--threads must be >= 1, got {args.threads}")
        import torch
        torch.set_num_threads(args.threads)


def cmd_generate(args) -> int:
    from . import load
    from .decoding.sampling import SamplingParams

    params = SamplingParams(args.temperature, args.top_p, args.sample_top_k, args.seed)  # validate early
    if args.method in (None, "ar") and args.draft is None and any(
            v is not None for v in (args.depth, args.tree_top_k, args.total_tokens)):
        raise JakiroError("--depth/--tree-top-k/--total-tokens apply to eagle2 and jakiro drafts")
    jk = load(args.target, args.draft, args.method, args.depth, args.tree_top_k, args.total_tokens,
              args.candidates, False if args.no_parallel else None, args.cache_dir)
    engine = jk.engine()
    stream_out = not args.json
    result = engine.generate(args.prompt, args.max_new_tokens, params, args.stop, not args.raw,
                             on_text=(lambda t: print(t, end="", flush=True)) if stream_out else None)
    out = {"method": result.method, "text": result.text, "token_ids": result.token_ids,
           "finish_reason": result.finish_reason, **result.metrics.as_dict()}
    if hasattr(engine.proposer, "budget"):
        b = engine.proposer.budget
        out["tree"] = {"depth": b.depth, "top_k": b.top_k, "total_tokens": b.total_tokens,
                       "candidate_mode": engine.proposer.mode, "parallel_decoding": engine.proposer.parallel}
    if args.compare and result.method != "ar":
        base = jk.engine("ar").generate(args.prompt, args.max_new_tokens, params, args.stop, not args.raw)
        out["ar_tokens_per_s"] = base.metrics.tokens_per_s
        out["speedup"] = result.metrics.tokens_per_s / base.metrics.tokens_per_s
        out["same_as_ar"] = base.token_ids == result.token_ids
    if args.json:
        print(json.dumps(out))
    else:
        m = result.metrics
        line = (f"\n\n[{result.method}] {m.new_tokens} tokens in {m.total_s:.2f} s: "
                f"{m.tokens_per_s:.1f} tokens/s, tau {m.tau:.2f} ({m.target_forwards} target forwards)")
        if "speedup" in out:
            line += (f"; plain decoding {out['ar_tokens_per_s']:.1f} tokens/s -> "
                     f"speedup {out['speedup']:.2f}x")
        print(line)
    return 0


def cmd_bench_cost(args) -> int:
    from .bench.cost_curve import run_cost_curve
    report = run_cost_curve(args.target, args.cache_dir, args.context, args.repeats,
                            args.new_tokens, args.rounds)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))
    return 0


COMMANDS = {"generate": cmd_generate, "bench-cost": cmd_bench_cost}


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
