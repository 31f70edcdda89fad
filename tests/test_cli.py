"""The command line: JSON output and one-line errors for bad input."""

import json
import os
import re
import subprocess
import sys

import pytest


def run_cli(*args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "jakiro", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_generate_json():
    res = run_cli("generate", "--prompt", "What is 2+2?", "--max-new-tokens", "8", "--json",
                  "--threads", "1")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    for key in ("text", "token_ids", "new_tokens", "tokens_per_s", "method", "tau", "target_forwards",
                "accept_rate_per_depth"):
        assert key in out
    assert out["method"] == "ar" and out["new_tokens"] == len(out["token_ids"]) <= 8


@pytest.mark.parametrize("args, message", [
    (["--target", "/nonexistent/model"], "target model not found: /nonexistent/model"),
    (["--max-new-tokens", "9000"], "exceeds the model's context length"),
    (["--temperature", "-1"], "temperature must be a finite number >= 0"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--top-k", "2.5"], "argument --top-k: invalid int value: '2.5'"),
    (["--method", "jakiro", "--draft", "/nonexistent/draft"], "draft folder not found"),
    (["--method", "pld", "--tree", "static:cpu"], "--tree apply to eagle2 and jakiro drafts"),
    (["--method", "pld", "--depth", "3"], "--total-tokens/--tree apply to eagle2 and jakiro drafts"),
    (["--depth", "3"], "--total-tokens/--tree apply to eagle2 and jakiro drafts"),
    (["--method", "jakiro", "--tree", "static:nowhere.json"], "neither a preset"),
    (["--method", "jakiro", "--tree", "static:cpu", "--depth", "3"], "a static --tree fixes the tree"),
    (["--method", "banana"], "argument --method: invalid choice"),
    (["--method", "eagle2", "--compare", "--compare-rounds", "0"], "--compare-rounds must be >= 1, got 0"),
])
def test_bad_input_gives_one_line_error(args, message):
    res = run_cli("generate", "--prompt", "hi", *args)
    assert res.returncode != 0
    assert "Traceback" not in res.stderr
    lines = [line for line in res.stderr.splitlines() if line.startswith("jakiro")]
    assert len(lines) == 1 and message in lines[0], res.stderr


def test_unsupported_architecture_cli(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    res = run_cli("generate", "--prompt", "hi", "--target", str(tmp_path))
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "unsupported architecture 'gpt2'" in res.stderr


def test_unreadable_gguf(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file")
    res = run_cli("generate", "--prompt", "hi", "--target", str(bad), "--cache-dir", str(tmp_path / "c"))
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "is not a readable GGUF file" in res.stderr and len(res.stderr.strip().splitlines()) == 1



@pytest.mark.slow
def test_generate_with_a_static_tree_and_with_lookup_branches():
    res = run_cli("generate", "--prompt", "Repeat: one two three, one two three.", "--method", "jakiro+pld",
                  "--json", "--compare", "--max-new-tokens", "24", "--threads", "1")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["method"] == "jakiro+pld" and out["same_as_ar"] is True and out["tree"]["adaptive"] is True
    bonuses = round(out["tau"] * out["target_forwards"]) - sum(out["accepted_from"].values())
    assert bonuses in (out["target_forwards"] - 1, out["target_forwards"])  # the last may be cut
    res = run_cli("generate", "--prompt", "Name three primary colors.", "--method", "eagle2", "--json", "--compare",
                  "--tree", "static:eagle1", "--max-new-tokens", "16", "--threads", "1")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["same_as_ar"] is True and out["tree"]["adaptive"] is False
    assert out["tree"]["static"][:4] == [[0], [1], [2], [3]] and len(out["tree"]["static"]) == 25
    assert out["tree"]["prompt_vocab"] is True


@pytest.mark.slow
def test_generate_text_summary_line_counts_forwards_and_plain_steps():
    """Without --json the answer streams, then one line: tokens, τ, the target forwards (and how
    many were plain steps, when cost-aware drafting took any), the median tokens/s of the method
    and of plain decoding over the interleaved runs, the speedup."""
    res = run_cli("generate", "--prompt", "Name three primary colors.", "--method", "eagle2", "--compare",
                  "--max-new-tokens", "16", "--threads", "1")
    assert res.returncode == 0, res.stderr
    line = res.stdout.strip().splitlines()[-1]
    found = re.fullmatch(r"\[eagle2\] (\d+) tokens, tau ([\d.]+) \((\d+) target "
                         r"forwards(?:, (\d+) of them plain steps where speculating would not pay)?\): "
                         r"([\d.]+) tokens/s against plain decoding's ([\d.]+) \(medians of 3 interleaved runs "
                         r"each\) -> speedup ([\d.]+)x", line)
    assert found, line
    assert float(found[7]) == pytest.approx(float(found[5]) / float(found[6]), abs=0.006)
    tokens, tau, forwards = int(found[1]), float(found[2]), int(found[3])
    assert 0 < forwards < tokens <= 16 and tau == pytest.approx((tokens - 1) / forwards, abs=0.006)
    assert found[4] is None or 0 < int(found[4]) <= forwards


@pytest.mark.slow
def test_inputs_default_to_int8_where_the_cpu_has_the_kernels(monkeypatch):
    """A GGUF target takes int8 inputs by default where the CPU has AVX-512 VNNI or AMX (as
    llama.cpp computes these files), float32-accurate ones elsewhere; --float32-inputs and
    --int8-activations (JAKIRO_INT8_ACTIVATIONS=0 / 1) choose; the JSON says which ran."""
    from jakiro.models import quant, smallgemm
    from jakiro.settings import Runtime
    capable = smallgemm.available() and smallgemm.int8_activations_usable()
    assert quant.int8_activations_default() is capable  # what an open choice (None) becomes
    for value, expected in ((None, None), ("auto", None), ("0", False), ("1", True)):
        if value is None:
            monkeypatch.delenv("JAKIRO_INT8_ACTIVATIONS", raising=False)
        else:
            monkeypatch.setenv("JAKIRO_INT8_ACTIVATIONS", value)
        assert Runtime.from_env().int8_activations is expected, value
    monkeypatch.delenv("JAKIRO_INT8_ACTIVATIONS", raising=False)
    for flags, expected in (((), capable), (("--float32-inputs",), False)):
        res = run_cli("generate", "--prompt", "Hi.", "--max-new-tokens", "4", "--json", "--threads", "1", *flags)
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["int8_activations"] is expected
    res = run_cli("generate", "--prompt", "Hi.", "--int8-activations", "--float32-inputs")
    assert res.returncode == 2 and "not allowed with argument" in res.stderr

@pytest.mark.slow
def test_generate_with_the_draft_vocabulary_alone():
    res = run_cli("generate", "--prompt", "Summarize: Zorblax met Quindle at the Vexmoor fair.", "--method",
                  "eagle2", "--json", "--compare", "--no-adaptive", "--no-prompt-vocab", "--max-new-tokens", "16",
                  "--threads", "1")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["same_as_ar"] is True and out["tree"]["prompt_vocab"] is False


@pytest.mark.slow
def test_generate_with_shipped_jakiro_draft_reports_tree_tau_and_speedup():
    res = run_cli("generate", "--prompt", "Name three primary colors.", "--method", "jakiro", "--json",
                  "--compare", "--max-new-tokens", "24", "--threads", "1")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["method"] == "jakiro" and out["same_as_ar"] is True
    assert out["tau"] == pytest.approx((out["new_tokens"] - 1) / out["target_forwards"])
    # the speedup is the ratio of the medians over the interleaved runs; the first run is the one reported
    runs, ar_runs = out["compare"]["tokens_per_s"], out["compare"]["ar_tokens_per_s"]
    assert out["compare"]["rounds"] == 3 and len(runs) == len(ar_runs) == 3 and runs[0] == out["tokens_per_s"]
    assert out["median_tokens_per_s"] == sorted(runs)[1] and out["ar_tokens_per_s"] == sorted(ar_runs)[1]
    assert out["speedup"] == pytest.approx(out["median_tokens_per_s"] / out["ar_tokens_per_s"])
    assert set(out["tree"]) >= {"depth", "top_k", "total_tokens", "candidate_mode", "draft_vocab", "tuned", "adaptive"}
    # cost-aware drafting may take only plain steps here; τ still accounts for every kept token
    assert out["tree"]["adaptive"] is True and out["plain_steps"] <= out["target_forwards"]
    bonuses = round(out["tau"] * out["target_forwards"]) - sum(out["accepted_from"].values())
    assert bonuses in (out["target_forwards"] - 1, out["target_forwards"])


def test_every_option_has_help():
    """Each command's options and arguments say what they do in --help."""
    import argparse
    from jakiro.cli import build_parser

    def bare(parser, name):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():
                    yield from bare(sub, f"{name} {sub_name}")
            elif not action.help and action.dest != "help":
                yield f"{name} {'/'.join(action.option_strings) or action.dest}"

    assert list(bare(build_parser(), "jakiro")) == []
