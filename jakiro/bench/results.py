"""The results page, generated from benchmark JSON: ``python -m jakiro.bench.results`` reads
``docs/results/sources.json`` (which runs make which table, with the command that produced each
and the machine), writes ``docs/results/README.md`` and replaces the README's table between its
``<!-- results:NAME -->`` and ``<!-- /results:NAME -->`` markers. Nothing in a table is typed by
hand: rerun the commands, copy their JSON into ``docs/results/data/``, regenerate."""

from __future__ import annotations

import argparse
import json
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(path: str, root: str = ROOT) -> dict:
    with open(os.path.join(root, path)) as f:
        return json.load(f)


def _x(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}×"


def _num(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def plain_decoding_table(runs: list[dict], root: str) -> list[str]:
    """One row per bench-cost run: plain decoding against llama.cpp and Hugging Face, the
    one-token forward against the memory floor (timed in the same rounds where the run did so)."""
    rows = ["| model | inputs | ours tokens/s | llama.cpp tokens/s | ours ÷ llama.cpp | ours ÷ HF generate "
            "| 1-token forward ÷ memory floor | 8 tokens ÷ 1 token |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    for run in runs:
        d = _load(run["file"], root)
        llama = d.get("llamacpp_plain_decoding", {})
        rows.append(f"| {run['model']} | {'int8' if d['int8_activations'] else 'float32-accurate'} "
                    f"| {_num(llama.get('ours_tokens_per_s'))} | {_num(llama.get('llamacpp_tokens_per_s'))} "
                    f"| {_x(llama.get('ours_over_llamacpp'))} | {_x(d['plain_decoding']['ratio'], 1)} "
                    f"| {_x(d.get('paired', {}).get('forward_1_x_floor', d['forward_x_floor']['1']))} "
                    f"| {_x(d['forward_x_t1']['8'])} |")
    return rows


def _run_data(runs: list[dict], root: str):
    """Each run with its JSON and the input mode it ran in."""
    for run in runs:
        d = _load(run["file"], root)
        yield run, d, "int8" if d.get("int8_activations") else "float32-accurate"


def methods_table(runs: list[dict], root: str) -> list[str]:
    """One row per method of each ``jakiro bench`` run: tokens/s (prompts' prefill included),
    the speedup over our plain decoding in the same run, τ, and the answers' agreement with it."""
    rows = ["| model | inputs | method | tokens/s | speedup | τ | same text as plain |",
            "|---|---|---|---:|---:|---:|---:|"]
    for run, d, mode in _run_data(runs, root):
        for method, per_cat in d["methods"].items():
            agg = per_cat["all"]
            same = agg.get("greedy_match")
            rows.append(f"| {run['model']} | {mode} | {method} | {_num(agg['tokens_per_s'])} | {_x(agg['speedup'])} "
                        f"| {_num(agg.get('tau'), 2) if agg.get('tau') else '-'} "
                        f"| {'-' if same is None else f'{same:.0%}'} |")
    return rows


def concurrency_table(runs: list[dict], root: str) -> list[str]:
    """One row per method and level of each ``jakiro bench --concurrency`` run: aggregate tokens/s,
    against one request at a time (same method) and against plain decoding one at a time, τ, and
    whether every answer equals its answer alone; then the first token of a 200-token prompt
    arriving at an idle engine and while the others decode."""
    rows = ["| model | inputs | method | requests together | aggregate tokens/s | × one at a time "
            "| × plain, one at a time | τ | answers as alone |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    first = ["| model | inputs | method | first token, idle | first token, others decoding | ratio |",
             "|---|---|---|---:|---:|---:|"]
    for run, d, mode in _run_data(runs, root):
        for method, levels in d["methods"].items():
            for n, r in levels.items():
                rows.append(f"| {run['model']} | {mode} | {method} | {n} | {_num(r['tokens_per_s'])} "
                            f"| {_x(r['vs_one_at_a_time'])} | {_x(r['vs_plain_one_at_a_time'])} "
                            f"| {_num(r['tau'], 2)} | {'yes' if r['same_as_alone'] else 'no'} |")
        for method, f in d.get("first_token", {}).items():
            first.append(f"| {run['model']} | {mode} | {method} | {f['idle_s'] * 1000:.0f} ms "
                         f"| {f['loaded_s'] * 1000:.0f} ms ({f['running']} running) | {_x(f['ratio'])} |")
    return rows + ([""] + first if len(first) > 2 else [])


def engines_table(runs: list[dict], root: str) -> list[str]:
    """One row per method of a ``jakiro bench`` run that holds llama.cpp beside us (one draft in
    both engines): tokens/s (prefill included), the decoding speed against the same engine's plain
    decoding (answers alone, after the prompt), the share of drafted tokens accepted, and whether
    the engine's text equals its own plain decoding's."""
    rows = ["| model | inputs | method | tokens/s | decoding × the engine's plain | acceptance "
            "| same text as the engine's plain |", "|---|---|---|---:|---:|---:|---:|"]
    for run, d, mode in _run_data(runs, root):
        plain = {m: d["methods"].get(m, {}).get("all", {}).get("decode_tokens_per_s") for m in ("ar", "llamacpp")}
        for method, per_cat in d["methods"].items():
            agg = per_cat["all"]
            own = "llamacpp" if method.startswith("llamacpp") else "ar"
            same = None if method == own else agg.get("llamacpp_match" if own == "llamacpp" else "greedy_match")
            dec = agg.get("decode_tokens_per_s")
            rows.append(f"| {run['model']} | {mode} | {method} | {_num(agg['tokens_per_s'])} "
                        f"| {_x(dec / plain[own] if dec and plain[own] else None)} "
                        f"| {_num(agg.get('acceptance'), 2) if agg.get('acceptance') is not None else '-'} "
                        f"| {'-' if same is None else f'{same:.0%}'} |")
    return rows


TABLES = {"plain-decoding": plain_decoding_table, "methods": methods_table, "concurrency": concurrency_table,
          "engines": engines_table}


def render(source: dict, root: str) -> list[str]:
    lines = TABLES[source["kind"]](source["runs"], root)
    commands = sorted({run["command"] for run in source["runs"]})
    lines += ["", f"{source['machine']}. Produced by:", "", "```bash", *commands, "```"]
    return lines


def generate(root: str = ROOT) -> dict[str, list[str]]:
    sources = _load(os.path.join("docs", "results", "sources.json"), root)
    tables = {s["id"]: render(s, root) for s in sources}
    page = ["# Results", "",
            "Generated by `python -m jakiro.bench.results` from the JSON in `docs/results/data/` (each table "
            "names the commands that wrote it). Compare figures within a table: they were measured in one run, "
            "the methods interleaved on the same machine. A run whose JSON names no `kv_cache` held its keys and "
            "values as float32 (so far every run; int8 inputs now default to float16 ones, as llama.cpp holds "
            "them: [docs/design/runtime.md](../design/runtime.md#keys-and-values-float16-or-float32)).", ""]
    for s in sources:
        page += [f"## {s['title']}", "", s.get("note", ""), "", *tables[s["id"]], ""]
    with open(os.path.join(root, "docs", "results", "README.md"), "w") as f:
        f.write("\n".join(line for line in page).rstrip() + "\n")
    readme_path = os.path.join(root, "README.md")
    with open(readme_path) as f:
        readme = f.read()
    for name, lines in tables.items():
        pattern = re.compile(rf"(<!-- results:{re.escape(name)} -->\n).*?(<!-- /results:{re.escape(name)} -->)", re.S)
        readme = pattern.sub(lambda m: m.group(1) + "\n".join(lines) + "\n" + m.group(2), readme)
    with open(readme_path, "w") as f:
        f.write(readme)
    return tables


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    tables = generate()
    print(f"docs/results/README.md and README.md: {len(tables)} tables")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
