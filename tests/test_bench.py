"""The benchmark runner and tuner on a tiny model (behaviour, not timing)."""

import dataclasses
import json
import os
import shutil

import pytest
import torch

from helpers import make_tiny_target
from jakiro.errors import JakiroError


@pytest.fixture(scope="module")
def tiny_chat_target(tmp_path_factory, smol):
    """A tiny random Llama that uses SmolLM2's tokenizer and chat template."""
    folder = str(tmp_path_factory.mktemp("tiny_chat"))
    make_tiny_target(folder, "llama", vocab_size=49152, eos_token_id=2, bos_token_id=1)
    for name in os.listdir(smol.target_path):
        if name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(os.path.join(smol.target_path, name), folder)
    return folder


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory, tiny_chat_target):
    from jakiro.draft import DraftConfig, DraftModel, save_draft
    from jakiro.models.target import TargetModel
    target = TargetModel.from_folder(tiny_chat_target)
    cfg = DraftConfig.for_target(target.config, target.hf_config, "jakiro", draft_vocab_size=256)
    folder = str(tmp_path_factory.mktemp("tiny_draft"))
    torch.manual_seed(0)
    save_draft(DraftModel(cfg), folder)
    return folder


def write_questions(path):
    rows = [{"question_id": 1, "category": "writing", "turns": ["Write a line about rain.", "Now shorter."]},
            {"question_id": 2, "category": "math", "turns": ["What is 3 + 4?"]},
            {"question_id": 3, "category": "math", "turns": ["What is 10 / 2?"]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_bench_summary_is_consistent_and_plots_are_written(tmp_path, tiny_chat_target, tiny_draft):
    from jakiro.bench.runner import BenchConfig, run_bench
    cfg = BenchConfig(write_questions(tmp_path / "q.jsonl"), ["ar", "hf", "pld", "hf-pld", "jakiro", "jakiro-fixed"],
                      {"jakiro": tiny_draft}, max_new_tokens=12, out=str(tmp_path / "out"),
                      target=tiny_chat_target, warmup=0)
    summary = run_bench(cfg, progress=False)
    methods = summary["methods"]
    assert set(methods) == {"ar", "hf", "pld", "hf-pld", "jakiro", "jakiro-fixed"}
    for m, per_cat in methods.items():
        assert set(per_cat) == {"math", "writing", "all"}
        assert per_cat["all"]["answers"] == 4  # three questions, one with two turns
        assert per_cat["math"]["answers"] + per_cat["writing"]["answers"] == 4
        assert per_cat["all"]["new_tokens"] == per_cat["math"]["new_tokens"] + per_cat["writing"]["new_tokens"]
        assert per_cat["all"]["greedy_match"] == 1.0, m
    assert methods["ar"]["all"]["speedup"] == 1.0
    assert methods["ar"]["all"]["decode_speedup"] == 1.0 and "decode_speedup" not in methods["hf"]["all"]
    for m in ("ar", "pld", "jakiro"):  # the answer alone: faster than with the prompt's prefill
        a = methods[m]["all"]
        assert 0 < a["prefill_s"] < a["seconds"] and a["decode_tokens_per_s"] > a["tokens_per_s"], m
    assert methods["ar"]["all"]["tau"] == 1.0
    for m in ("pld", "jakiro", "jakiro-fixed"):  # τ·forwards = accepted draft tokens + one bonus per cycle
        a = methods[m]["all"]  # (an answer's last cycle may lose its bonus to the length limit)
        bonuses = round(a["tau"] * a["target_forwards"]) - sum(a["accepted_from"].values())
        assert a["target_forwards"] - a["answers"] <= bonuses <= a["target_forwards"], m
    fixed = methods["jakiro-fixed"]["all"]
    assert fixed["plain_steps"] == 0  # the fixed tree drafts every cycle
    cover = fixed["head_coverage"]  # a 256-token draft vocabulary; the prompt's tokens add to it
    assert 0 <= cover["draft_vocab"] <= cover["with_prompt"] <= cover["with_answer"] <= 1
    assert "head_coverage" not in methods["pld"]["all"]
    assert methods["ar"]["all"]["plain_steps"] == methods["ar"]["all"]["target_forwards"]
    assert set(summary["cost_tables"]) == {"pld", "jakiro"}  # the cost-aware engines (not the fixed tree)
    assert summary["cost_tables"]["jakiro"]["draft_ms"] and not summary["cost_tables"]["pld"]["draft_ms"]
    for name in ("summary.json", "summary.md", "speedup.png", "tau.png", "acceptance.png",
                 "answers_ar.jsonl", "answers_jakiro.jsonl"):
        assert os.path.getsize(tmp_path / "out" / name) > 0
    lines = open(tmp_path / "out" / "answers_jakiro.jsonl").read().splitlines()
    assert len(lines) == 3 and len(json.loads(lines[0])["turns"]) == 2


def test_a_tree_budget_fixes_the_drafts_tree_beside_the_baselines(tmp_path, tiny_chat_target, tiny_draft):
    from jakiro.bench.runner import BenchConfig, run_bench
    cfg = BenchConfig(write_questions(tmp_path / "q.jsonl"), ["ar", "pld", "jakiro", "jakiro-serial"],
                      {"jakiro": tiny_draft}, max_new_tokens=8, out=str(tmp_path / "out"), target=tiny_chat_target,
                      warmup=0, depth=3, tree_top_k=2, total_tokens=5)
    methods = run_bench(cfg, progress=False)["methods"]
    assert methods["jakiro"]["all"]["plain_steps"] == 0  # the user's tree: drafted every cycle
    assert methods["jakiro-serial"]["all"]["greedy_match"] == 1.0
    assert methods["ar"]["all"]["tau"] == 1.0 and methods["pld"]["all"]["greedy_match"] == 1.0
    assert methods["jakiro"]["all"]["greedy_match"] == 1.0


def test_malformed_question_file_names_the_line(tmp_path):
    from jakiro.data.questions import read_questions
    bad = tmp_path / "q.jsonl"
    bad.write_text('{"question_id": 1, "category": "a", "turns": ["hi"]}\n{"question_id": 2, "turns": "hi"}\n')
    with pytest.raises(JakiroError, match=r"q.jsonl:2: expected an object with a non-empty 'turns'"):
        read_questions(str(bad))
    bad.write_text('{"question_id": 1, "turns": ["hi"]}\n\n{not json\n')
    with pytest.raises(JakiroError, match=r"q.jsonl:3: invalid JSON"):
        read_questions(str(bad))


def test_tune_saves_a_choice_that_load_uses(tmp_path, tiny_chat_target, tiny_draft, monkeypatch):
    import jakiro
    from jakiro.bench import tune
    monkeypatch.setattr(tune, "CHAINS", [(2, 1, 2)])
    monkeypatch.setattr(tune, "TREES", [(3, 2, 6)])
    result = tune.run_tune(tiny_draft, tiny_chat_target, str(tmp_path / "cache"), max_new_tokens=8,
                           prompts=["Hello there."], progress=False)
    best = result["best"]
    # two trees with and without contrastive parallel decoding, then three reduced vocabularies
    assert len(result["grid"]) == 7
    assert {r.get("parallel_decoding") for r in result["grid"][:4]} == {True, False}
    assert [r.get("draft_vocab") for r in result["grid"][4:]] == [32, 64, 128]
    finalists = sorted(result["grid"], key=lambda r: r["tokens_per_s"], reverse=True)[:3]
    assert {k: best[k] for k in ("depth", "top_k", "total_tokens", "parallel_decoding")} in [
        {k: r[k] for k in ("depth", "top_k", "total_tokens", "parallel_decoding")} for r in finalists]
    assert os.path.exists(result["saved_to"])
    jk = jakiro.load(tiny_chat_target, tiny_draft, cache_dir=str(tmp_path / "cache"))
    proposer = jk.engine().proposer.inner  # the tuned tree is what cost-aware drafting cuts from
    budget = proposer.budget
    assert (budget.depth, budget.top_k, budget.total_tokens) == (best["depth"], best["top_k"], best["total_tokens"])
    assert proposer.parallel == best["parallel_decoding"]
    assert (proposer.head_vocab or 256) == best["draft_vocab"]
    assert jk.engine().tuned == result["saved_to"]  # says which record applied
    # the saved choice is for this draft only; an explicit option still wins over it
    assert jakiro.load(tiny_chat_target, tiny_draft, parallel_decoding=not best["parallel_decoding"],
                       cache_dir=str(tmp_path / "cache")).engine().proposer.inner.parallel != best["parallel_decoding"]
    explicit = jakiro.load(tiny_chat_target, tiny_draft, depth=5, cache_dir=str(tmp_path / "cache"))
    assert explicit.engine().proposer.budget.depth == 5 and explicit.engine().tuned is None  # fixed tree
    # the record follows the weights, not the folder; and it is for this thread count only
    copy = shutil.copytree(tiny_draft, tmp_path / "moved-draft")
    assert jakiro.load(tiny_chat_target, str(copy), cache_dir=str(tmp_path / "cache")).engine().tuned == result["saved_to"]
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert jakiro.load(tiny_chat_target, tiny_draft, cache_dir=str(tmp_path / "cache")).engine().tuned is None
    finally:
        torch.set_num_threads(threads)
    # ... and for the weights the target streams: quantized weights cost otherwise
    from jakiro.draft.tuning import tuning_path
    from jakiro.models import smallgemm
    cache = str(tmp_path / "cache")
    assert tuning_path(tiny_draft, cache, quantized=False, int8_activations=False) == result["saved_to"]
    if smallgemm.available():  # without the kernel nothing streams quantized weights
        assert tuning_path(tiny_draft, cache, quantized=True, int8_activations=False) != result["saved_to"]
        assert tuning_path(tiny_draft, cache, quantized=True, int8_activations=True) != tuning_path(
            tiny_draft, cache, quantized=True, int8_activations=False)


def test_a_drafts_default_tree_applies_where_this_machine_has_not_tuned_it(tmp_path, tiny_chat_target, tiny_draft):
    """`jakiro tune --save-default` writes the chosen tree into config.json; a machine without a
    tune record for the draft uses it (a record of its own, or explicit options, win), and a
    malformed one is refused with the file named."""
    import jakiro
    from jakiro.cli import main
    from jakiro.draft.tuning import default_tree, save_default_tree
    draft = str(shutil.copytree(tiny_draft, tmp_path / "draft"))
    cache = str(tmp_path / "cache")
    assert default_tree(draft) is None
    save_default_tree(draft, {"depth": 3, "top_k": 1, "total_tokens": 3, "draft_vocab": 64,
                              "parallel_decoding": False, "tokens_per_s": 1.0}, "test")
    assert default_tree(draft) == {"depth": 3, "top_k": 1, "total_tokens": 3, "draft_vocab": 64,
                                   "parallel_decoding": False}
    engine = jakiro.load(tiny_chat_target, draft, cache_dir=cache).engine()
    proposer = engine.proposer.inner
    assert (proposer.budget.depth, proposer.budget.top_k, proposer.budget.total_tokens) == (3, 1, 3)
    assert proposer.head_vocab == 64 and proposer.parallel is False
    assert engine.tuned.endswith("config.json (default_tree)")
    assert jakiro.load(tiny_chat_target, draft, depth=5, cache_dir=cache).engine().proposer.budget.depth == 5
    # the draft still loads as a draft (the extra key is no model setting)
    assert jakiro.load(tiny_chat_target, draft, cache_dir=cache).engine().proposer.inner.draft.config.method == "jakiro"
    cfg = json.loads((tmp_path / "draft" / "config.json").read_text())
    cfg["default_tree"] = {"depth": 0, "top_k": 1, "total_tokens": 3}
    (tmp_path / "draft" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(JakiroError, match=r"config.json: default_tree must give positive integers"):
        jakiro.load(tiny_chat_target, draft, cache_dir=cache)
    # tune --save-default: the record for this machine, and the draft's default
    cfg.pop("default_tree")
    (tmp_path / "draft" / "config.json").write_text(json.dumps(cfg))
    from jakiro.bench import tune
    saved = (tune.CHAINS, tune.TREES)
    tune.CHAINS, tune.TREES = [(2, 1, 2)], []
    try:
        assert main(["tune", "--target", tiny_chat_target, "--draft", draft, "--cache-dir", cache,
                     "--max-new-tokens", "8", "--save-default"]) == 0
    finally:
        tune.CHAINS, tune.TREES = saved
    assert default_tree(draft)["depth"] == 2 and default_tree(draft)["top_k"] == 1
    assert jakiro.load(tiny_chat_target, draft, cache_dir=cache).engine().tuned.endswith(".json")


def test_interrupted_tune_keeps_the_best_tree_so_far(tmp_path, tiny_chat_target, tiny_draft, monkeypatch):
    import jakiro
    from jakiro.bench import tune
    monkeypatch.setattr(tune, "CHAINS", [(2, 1, 2)])
    monkeypatch.setattr(tune, "TREES", [(3, 2, 6), (4, 2, 8)])
    calls = []
    real = tune._measure

    def measure(engine, prompts, tokens):
        calls.append(engine)
        if len(calls) == 5:  # plain decoding, then three screened trees: stopped during the fourth
            raise KeyboardInterrupt
        tps, tau = real(engine, prompts, tokens)
        budget = getattr(engine.proposer, "budget", None)
        return ({3: 10.0, 4: 30.0}.get(budget.depth, 20.0) if budget else tps), tau

    monkeypatch.setattr(tune, "_measure", measure)
    result = tune.run_tune(tiny_draft, tiny_chat_target, str(tmp_path / "cache"), max_new_tokens=8,
                           prompts=["Hello there."], progress=False)
    assert result["interrupted"] and not result["complete"] and len(result["grid"]) == 3
    saved = json.load(open(result["saved_to"]))
    assert saved["complete"] is False and saved["best"]["depth"] == 2  # 20 tokens/s beat the depth-3 trees
    budget = jakiro.load(tiny_chat_target, tiny_draft, cache_dir=str(tmp_path / "cache")).engine().proposer.inner.budget
    assert (budget.depth, budget.top_k, budget.total_tokens) == (2, 1, 2)


def test_interrupted_bench_resumes_and_other_settings_are_refused(tmp_path, tiny_chat_target, monkeypatch):
    from jakiro.bench import runner
    from jakiro.bench.runner import BenchConfig, run_bench
    questions = write_questions(tmp_path / "q.jsonl")
    out = str(tmp_path / "out")

    def config(**kw):
        return BenchConfig(questions, ["ar", "pld"], max_new_tokens=8, out=out, target=tiny_chat_target,
                           warmup=0, **kw)

    full = run_bench(config(), progress=False)
    reference = open(os.path.join(out, "answers_pld.jsonl")).read()
    # simulate a run killed during the third question: its line is cut short
    lines = open(os.path.join(out, runner.PROGRESS)).read().splitlines()
    assert len(lines) == 3
    with open(os.path.join(out, runner.PROGRESS), "w") as f:
        f.write(lines[0] + "\n" + lines[1] + "\n" + lines[2][:40])
    answered = []
    from jakiro.decoding.engine import Engine
    real_generate = Engine.generate

    def counting(self, ids, *a, **kw):
        answered.append(len(ids))
        return real_generate(self, ids, *a, **kw)
    monkeypatch.setattr(Engine, "generate", counting)
    resumed = run_bench(config(), progress=False)
    assert len(answered) == 2  # only the third question (one turn) again, for ar and pld
    again = open(os.path.join(out, "answers_pld.jsonl")).read().splitlines()
    before = reference.splitlines()
    assert again[:2] == before[:2]  # kept as they were
    assert [t["token_ids"] for t in json.loads(again[2])["turns"]] == \
        [t["token_ids"] for t in json.loads(before[2])["turns"]]
    assert resumed["methods"]["pld"]["all"]["answers"] == full["methods"]["pld"]["all"]["answers"] == 4
    assert len(open(os.path.join(out, runner.PROGRESS)).read().splitlines()) == 3
    answered.clear()
    run_bench(config(limit_per_category=1), progress=False)  # fewer questions: all answered already
    assert answered == []
    assert len(open(os.path.join(out, runner.PROGRESS)).read().splitlines()) == 3  # nothing dropped
    with pytest.raises(JakiroError, match="other settings \\(max_new_tokens\\)"):
        run_bench(BenchConfig(questions, ["ar", "pld"], max_new_tokens=9, out=out,
                              target=tiny_chat_target, warmup=0), progress=False)


def test_repeated_answers_keep_the_fastest_and_must_agree(tmp_path, tiny_chat_target, tiny_draft, monkeypatch):
    """``repeats``: each turn answered that many times per method, interleaved; the record kept is
    the fastest (every time listed), the tokens the same; a repeat that decodes differently is an
    error, and a count below one is refused before anything loads."""
    from jakiro.bench import runner
    from jakiro.bench.runner import BenchConfig, run_bench
    questions = write_questions(tmp_path / "q.jsonl")

    def config(out, **kw):
        return BenchConfig(questions, ["ar", "pld", "jakiro"], {"jakiro": tiny_draft}, max_new_tokens=8,
                           out=str(tmp_path / out), target=tiny_chat_target, warmup=0, **kw)

    order = []
    from jakiro.decoding.engine import Engine
    real_generate = Engine.generate

    def recording(self, ids, *a, **kw):
        order.append(self.method)
        return real_generate(self, ids, *a, **kw)
    monkeypatch.setattr(Engine, "generate", recording)
    once = run_bench(config("once"), progress=False)
    order.clear()
    twice = run_bench(config("twice", repeats=2), progress=False)
    assert order[:6] == ["ar", "pld", "jakiro"] * 2  # the first turn: methods interleaved, twice
    for m in ("ar", "pld", "jakiro"):
        rows = [json.loads(line) for line in open(tmp_path / "twice" / f"answers_{m}.jsonl")]
        ref = [json.loads(line) for line in open(tmp_path / "once" / f"answers_{m}.jsonl")]
        for row, ref_row in zip(rows, ref):
            for turn, ref_turn in zip(row["turns"], ref_row["turns"]):
                assert len(turn["repeat_s"]) == 2 and turn["total_s"] == min(turn["repeat_s"])
                assert turn["token_ids"] == ref_turn["token_ids"]
        assert twice["methods"][m]["all"]["new_tokens"] == once["methods"][m]["all"]["new_tokens"]
    assert json.load(open(tmp_path / "twice" / runner.RUN))["repeats"] == 2
    assert "repeats" not in json.load(open(tmp_path / "once" / runner.RUN))  # as runs before the option

    calls = {"n": 0}

    def unstable(self, ids, *a, **kw):
        calls["n"] += 1
        res = real_generate(self, ids, *a, **kw)
        if self.method == "pld" and calls["n"] > 3:
            res.token_ids = res.token_ids[:-1]
        return res
    monkeypatch.setattr(Engine, "generate", unstable)
    with pytest.raises(JakiroError, match="pld answered question 1 differently when repeated"):
        run_bench(config("unstable", repeats=2), progress=False)
    with pytest.raises(JakiroError, match="repeats must be a positive integer, got 0"):
        run_bench(config("zero", repeats=0), progress=False)


def test_bench_draft_option_is_a_folder_or_method_equals_folder(tiny_draft):
    from jakiro.cli import _bench_drafts
    assert _bench_drafts([tiny_draft]) == {"jakiro": tiny_draft}  # the method comes from the draft
    assert _bench_drafts([f"jakiro-blended={tiny_draft}"]) == {"jakiro-blended": tiny_draft}
    with pytest.raises(JakiroError, match="draft folder not found: /nonexistent/draft"):
        _bench_drafts(["/nonexistent/draft"])


def test_concurrency_bench_reports_levels_against_one_at_a_time(tmp_path, tiny_chat_target, tiny_draft):
    from jakiro.bench.concurrency import concurrency_table, parse_levels, run_concurrency
    from jakiro.bench.runner import BenchConfig
    cfg = BenchConfig(write_questions(tmp_path / "q.jsonl"), ["jakiro"], {"jakiro": tiny_draft}, max_new_tokens=6,
                      out=str(tmp_path / "out"), target=tiny_chat_target)
    summary = run_concurrency(cfg, parse_levels("3"), progress=False)
    assert summary["levels"] == [1, 3] and set(summary["methods"]) == {"ar", "jakiro"}
    for levels in summary["methods"].values():
        assert levels["1"]["vs_one_at_a_time"] == 1.0
        for row in levels.values():
            assert row["requests"] == 3 and row["same_as_alone"] and row["new_tokens"] > 0
    assert summary["first_token"]["ar"]["prompt_tokens"] <= 200 and summary["first_token"]["ar"]["running"] == 2
    table = concurrency_table(json.load(open(tmp_path / "out" / "concurrency.json")))
    assert "| jakiro | 3 |" in table and "first token" in table
    cached = run_concurrency(dataclasses.replace(cfg, prompt_cache=True), [1, 3], progress=False)
    assert set(cached["methods"]) == {"ar", "jakiro", "ar (prompt cache)", "jakiro (prompt cache)"}
    for label in ("ar (prompt cache)", "jakiro (prompt cache)"):  # the same answers (a Hugging Face folder's
        # prompts never come from the cache: tests/test_prompt_cache.py measures reuse on a GGUF target)
        assert all(row["same_as_alone"] and "cached_prompt_tokens" in row for row in cached["methods"][label].values())
    with pytest.raises(JakiroError, match="positive integers"):
        parse_levels("0,2")
    with pytest.raises(JakiroError, match="3 questions for 4 concurrent"):
        run_concurrency(cfg, parse_levels("4"), progress=False)
    with pytest.raises(JakiroError, match="not 'hf'"):
        run_concurrency(BenchConfig(cfg.questions, ["hf"], out=cfg.out, target=tiny_chat_target), [1, 2])
