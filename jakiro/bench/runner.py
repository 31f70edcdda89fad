"""Spec-Bench-style benchmark runner: every method answers every question (multi-turn questions
as conversations), methods interleaved per question so machine drift cancels; answers JSONL per
method, summary.json, a Markdown table and PNG plots."""

from __future__ import annotations

import json
import os
import time

import torch

from ..errors import JakiroError
from ..methods import METHODS
from ..settings import Runtime
from ..data.questions import read_questions
from .config import LOADED_TARGET_FIELDS, BenchConfig
from .summary import markdown_table, plot_summary, summarize  # noqa: F401 (markdown_table: imported from here too)

HF_METHODS = ("hf", "hf-pld")
LLAMACPP_METHODS = ("llamacpp", "llamacpp-pld", "llamacpp-draft", "llamacpp-eagle3")  # llama.cpp's server on the same GGUF file (bench.llamacpp)
# benchmark names for a method with options: Jakiro's blended candidates, drafts on their fixed tree
VARIANTS = {"jakiro-blended": ("jakiro", {"candidate_mode": "blended"}),
            "eagle2-fixed": ("eagle2", {"adaptive": False}), "jakiro-fixed": ("jakiro", {"adaptive": False}),
            # Jakiro whose last draft step is a real one, not the contrastive branch's (the paper's ablation)
            "jakiro-serial": ("jakiro", {"parallel_decoding": False}),
            # the static tree of --static-tree
            "eagle2-static": ("eagle2", {"tree": None}), "jakiro-static": ("jakiro", {"tree": None})}
KNOWN = METHODS + tuple(VARIANTS) + HF_METHODS + LLAMACPP_METHODS


def select_questions(questions: list[dict], limit: int | None) -> list[dict]:
    if not limit:
        return questions
    seen: dict[str, int] = {}
    out = []
    for q in questions:
        if seen.get(q["category"], 0) < limit:
            seen[q["category"]] = seen.get(q["category"], 0) + 1
            out.append(q)
    return out


class _HFRunner:
    """Hugging Face ``generate`` (plain or prompt lookup) on the same converted model."""

    def __init__(self, path: str):
        from ..models.gguf_file import hugging_face_model
        self.model = hugging_face_model(path)

    def generate(self, ids: list[int], max_new_tokens: int, temperature: float, seed: int,
                 prompt_lookup: bool, eos_ids: set[int]) -> tuple[list[int], float]:
        kwargs = dict(max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                      eos_token_id=sorted(eos_ids) or None, pad_token_id=sorted(eos_ids)[0] if eos_ids else 0)
        if temperature > 0:
            kwargs.update(temperature=temperature, top_p=1.0, top_k=0)
        if prompt_lookup:
            kwargs["prompt_lookup_num_tokens"] = 10
        t0 = time.perf_counter()
        # generate samples from torch's global generator: seed a private copy of it
        with torch.random.fork_rng(devices=[]), torch.inference_mode():
            torch.manual_seed(seed)
            out = self.model.generate(torch.tensor([ids]), **kwargs)
        return out[0, len(ids):].tolist(), time.perf_counter() - t0


def run_bench(cfg: BenchConfig, progress: bool = True, runtime: Runtime | None = None) -> dict:
    """Answer every selected question with every method (resuming an interrupted run in
    ``cfg.out``), then write the answers, summary.json, summary.md and the plots."""
    from ..api import load

    if isinstance(cfg.repeats, bool) or not isinstance(cfg.repeats, int) or cfg.repeats < 1:
        raise JakiroError(f"repeats must be a positive integer, got {cfg.repeats!r}")
    if cfg.prompt_cache:
        raise JakiroError("--prompt-cache applies to --concurrency runs: the benchmark prefills every prompt whole")
    for m in cfg.methods:
        if m not in KNOWN:
            raise JakiroError(f"unknown method {m!r} (choose from {', '.join(KNOWN)})")
    if "ar" not in cfg.methods:
        cfg.methods = ["ar"] + list(cfg.methods)  # the speedup baseline
    questions = select_questions(read_questions(cfg.questions), cfg.limit_per_category)
    jk = load(cfg.target, cache_dir=cfg.cache_dir, runtime=runtime, prompt_cache=False)  # every prompt whole
    cfg.int8_activations = jk.target.int8_activations
    cfg.quantized_weights = jk.target.quantized_matrices > 0
    cfg.kv_cache = jk.target.runtime.kv_cache
    os.makedirs(cfg.out, exist_ok=True)
    records, done = _resume(cfg, questions)
    answerer = _Answerer(cfg, jk)
    try:
        for m in cfg.methods:  # warm-up: one short answer per method, not recorded
            for _ in range(cfg.warmup):
                answerer(m, [{"role": "user", "content": "Say hello."}], 0)
        _answer_all(cfg, questions, records, done, answerer, progress)
    finally:
        answerer.close()
    return _write_results(cfg, questions, records, answerer.cost_tables())


class _Answerer:
    """One engine per benchmarked method on the shared target (and Hugging Face ``generate``
    for the hf methods); ``answerer(method, messages, seed)`` -> one answer record."""

    def __init__(self, cfg: BenchConfig, jk):
        self.cfg, self.jk = cfg, jk
        tree = dict(depth=cfg.depth, tree_top_k=cfg.tree_top_k, total_tokens=cfg.total_tokens)  # None: tuned/default
        self.engines = {}
        for m in cfg.methods:
            if m in HF_METHODS or m in LLAMACPP_METHODS:
                continue
            method, options = VARIANTS.get(m, (m, {}))
            if "tree" in options:
                options = dict(options, tree=cfg.static_tree)
            draft = cfg.drafts.get(m) or cfg.drafts.get(method.removesuffix("+pld"))
            # the tree options are the drafts' (the baselines run beside them as they are)
            self.engines[m] = jk.add_method(method, draft=draft, draft_model=cfg.draft_model,
                                            **(tree if method not in ("ar", "pld") else {}), **options)
        self.hf = _HFRunner(jk.target_path) if any(m in HF_METHODS for m in cfg.methods) else None
        self.llama = {}
        for m in cfg.methods:
            if m in LLAMACPP_METHODS:
                from ..models.gguf_file import source_file
                from .llamacpp import CHAIN, DRAFT_FILE, EAGLE3_FILE, SERVER_OPTIONS, LlamaServer
                options = SERVER_OPTIONS[m]
                if DRAFT_FILE in options:  # the same small model as our draft-model method
                    draft_file = self.draft_model_file(cfg, jk)
                    options = tuple(draft_file if o == DRAFT_FILE else o for o in options)
                if EAGLE3_FILE in options:  # the same draft as our eagle3 method
                    fill = {EAGLE3_FILE: self.eagle3_file(cfg, jk), CHAIN: str(cfg.depth or 3)}
                    options = tuple(fill.get(o, o) for o in options)
                self.llama[m] = LlamaServer(source_file(jk.target_path), torch.get_num_threads(), options,
                                            cache=cfg.cache_dir)

    @staticmethod
    def draft_model_file(cfg: BenchConfig, jk) -> str:
        """The GGUF file of the draft-model methods' small model (``--draft-model``, default the
        named target's own), for llama.cpp's speculative decoding."""
        from ..models import registry
        from ..models.gguf_file import is_gguf_folder, source_file
        from ..models.hub import resolve_target
        name = cfg.draft_model or registry.default_draft_for(jk.target_path)
        if name is None:
            raise JakiroError("llamacpp-draft needs a draft model: pass --draft-model NAME|PATH")
        folder = resolve_target(name, cfg.cache_dir)
        if not is_gguf_folder(folder):
            raise JakiroError(f"llamacpp-draft needs the draft model as a GGUF file, not {folder}")
        return source_file(folder)

    @staticmethod
    def eagle3_file(cfg: BenchConfig, jk) -> str:
        """Our eagle3 draft (``--draft eagle3=PATH``, default the shipped one) as the GGUF llama.cpp's
        draft-eagle3 loads, written into the run's folder."""
        from ..api import shipped_draft
        from ..draft.eagle3_format import export
        draft = cfg.drafts.get("eagle3") or shipped_draft("eagle3", jk.target_path)
        if draft is None:
            raise JakiroError("llamacpp-eagle3 needs an eagle3 draft for this target: pass --draft eagle3=PATH")
        return export(draft, "gguf", os.path.join(cfg.out, "eagle3-draft.gguf"), jk.target_path, cfg.cache_dir)[0]

    def close(self) -> None:
        for server in self.llama.values():
            server.close()

    def cost_tables(self) -> dict:
        """Each cost-aware engine's cost table (``decoding.costs.CostTable.as_dict``)."""
        return {m: e.proposer.costs.as_dict() for m, e in self.engines.items()
                if getattr(e.proposer, "costs", None) is not None}

    def __call__(self, m: str, messages: list[dict], seed: int) -> dict:
        from ..decoding.sampling import SamplingParams
        cfg, ar = self.cfg, self.engines["ar"]
        ids = ar.encode(messages)
        if m in HF_METHODS:
            toks, secs = self.hf.generate(ids, cfg.max_new_tokens, cfg.temperature, seed, m == "hf-pld", ar.eos_ids)
            text = self.jk.tokenizer.decode(toks, skip_special_tokens=True)
            return {"text": text, "token_ids": toks, "new_tokens": len(toks), "total_s": secs}
        if m in LLAMACPP_METHODS:  # its own timings: the prompt's and the answer's, without the HTTP round trip
            out = self.llama[m].complete(ids, cfg.max_new_tokens, cfg.temperature, seed)
            toks = out["token_ids"]  # as ours: the EOS that ended the answer included
            return {"text": self.jk.tokenizer.decode(toks, skip_special_tokens=True), "token_ids": toks,
                    "new_tokens": len(out["token_ids"]), "prefill_s": out["prefill_s"],
                    "total_s": out["prefill_s"] + out["decode_s"],
                    "llamacpp_drafted": out["draft_tokens"], "llamacpp_accepted": out["accepted_tokens"]}
        engine = self.engines[m]
        res = engine.generate(ids, cfg.max_new_tokens, SamplingParams(cfg.temperature, seed=seed))
        d = res.metrics.as_dict()
        d.update(text=res.text, token_ids=res.token_ids)
        drafter = getattr(engine.proposer, "inner", engine.proposer)
        if hasattr(drafter, "prompt_tokens") and res.token_ids:
            d["head_coverage"] = head_coverage(drafter, ids, res.token_ids)
        return d


def head_coverage(drafter, prompt: list[int], answer: list[int]) -> dict:
    """How many of an answer's tokens a draft's head could propose at all: with the draft
    vocabulary in use alone, with the prompt's tokens added (``DraftProposer.prompt_tokens``),
    and with the answer's earlier tokens too (the head takes them in as they come, up to
    ``answer_vocab``; counted as if at once)."""
    answer_t = torch.tensor(answer)
    base = drafter.draft.head_ids(drafter.head_vocab)
    with_prompt = drafter.draft.head_ids(drafter.head_vocab, drafter.prompt_tokens(prompt))
    held = torch.isin(answer_t, with_prompt)
    seen, with_answer = set(), 0
    for t, h in zip(answer, held.tolist()):
        with_answer += h or (t in seen and drafter.answer_vocab > 0)
        seen.add(t)
    return {"tokens": len(answer), "draft_vocab": int(torch.isin(answer_t, base).sum()),
            "with_prompt": int(held.sum()), "with_answer": with_answer}


def _answer_all(cfg: BenchConfig, questions: list[dict], records: dict, done: set, answerer: _Answerer,
                progress: bool) -> None:
    """Methods interleaved per turn, so that machine drift cancels; each finished question is
    appended to progress.jsonl (the unit of resuming)."""
    from tqdm import tqdm
    bar = tqdm(total=len(questions) * len(cfg.methods), initial=len(done) * len(cfg.methods),
               desc="bench", disable=not progress)
    with open(os.path.join(cfg.out, PROGRESS), "a") as progress_file:
        for qi, q in enumerate(questions):
            if q["question_id"] in done:
                continue
            histories = {m: [] for m in cfg.methods}
            turns_out = {m: [] for m in cfg.methods}
            for turn_i, turn in enumerate(q["turns"]):
                fastest: dict[str, dict] = {}
                for _ in range(cfg.repeats):
                    for m in cfg.methods:
                        messages = histories[m] + [{"role": "user", "content": turn}]
                        _keep_fastest(fastest, m, answerer(m, messages, cfg.seed + 1000 * qi + turn_i), q)
                for m in cfg.methods:
                    rec = fastest[m]
                    histories[m] = histories[m] + [{"role": "user", "content": turn},
                                                   {"role": "assistant", "content": rec["text"]}]
                    turns_out[m].append(rec)
            row = {m: {"question_id": q["question_id"], "category": q["category"], "turns": turns_out[m]}
                   for m in cfg.methods}
            progress_file.write(json.dumps(row) + "\n")
            progress_file.flush()
            for m in cfg.methods:
                records[m].append(row[m])
                bar.update(1)
    bar.close()


def _keep_fastest(fastest: dict, m: str, rec: dict, question: dict) -> None:
    """Keep the faster of ``rec`` and the answer already kept for method ``m`` (with every
    answer's time in ``repeat_s``): repeats of one seeded request commit the same tokens, only
    the machine's pace differs, and the fastest is the least disturbed measurement of it."""
    kept = fastest.get(m)
    if kept is None:
        fastest[m] = dict(rec, repeat_s=[rec["total_s"]])
        return
    if rec["token_ids"] != kept["token_ids"]:
        raise JakiroError(f"{m} answered question {question['question_id']} differently when repeated; "
                          "the same seeded request must decode the same way (run with --repeats 1)")
    times = kept["repeat_s"] + [rec["total_s"]]
    if rec["total_s"] < kept["total_s"]:
        fastest[m] = dict(rec, repeat_s=times)
    else:
        kept["repeat_s"] = times


def _write_results(cfg: BenchConfig, questions: list[dict], records: dict, cost_tables: dict | None = None) -> dict:
    order = {q["question_id"]: i for i, q in enumerate(questions)}
    for rows in records.values():
        rows.sort(key=lambda r: order[r["question_id"]])
    for m, rows in records.items():
        with open(os.path.join(cfg.out, f"answers_{m}.jsonl"), "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    summary = summarize(records, cfg)
    if cost_tables:  # what this run's cost-aware engines measured at load (their decisions follow it)
        summary["cost_tables"] = cost_tables
    with open(os.path.join(cfg.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    with open(os.path.join(cfg.out, "summary.md"), "w") as f:
        f.write(markdown_table(summary))
    plot_summary(summary, cfg.out)
    return summary


PROGRESS = "progress.jsonl"
RUN = "run.json"


def _resume(cfg: BenchConfig, questions: list[dict]) -> tuple[dict[str, list[dict]], set]:
    """Answers already in ``cfg.out`` from an interrupted run with the same settings are kept (one
    line per finished question in progress.jsonl); a folder holding another run is refused. The
    number of questions per category may change: a run can be extended to more questions later."""
    settings = {k: v for k, v in cfg.__dict__.items()
                if k not in ("out", "limit_per_category", *LOADED_TARGET_FIELDS)}
    settings["threads"] = torch.get_num_threads()
    if cfg.quantized_weights:  # (absent otherwise, as in runs recorded before the option existed)
        settings["quantized_weights"] = True
    if cfg.int8_activations:  # likewise
        settings["int8_activations"] = True
    if cfg.kv_cache != "float32":  # likewise
        settings["kv_cache"] = cfg.kv_cache
    if cfg.repeats == 1:  # likewise
        del settings["repeats"]
    if cfg.draft_model is None:  # likewise
        del settings["draft_model"]
    settings = json.loads(json.dumps(settings))  # as it reads back from run.json
    run_path = os.path.join(cfg.out, RUN)
    records: dict[str, list[dict]] = {m: [] for m in cfg.methods}
    done: set = set()
    if os.path.exists(run_path):
        with open(run_path) as f:
            previous = json.load(f)
        if previous != settings:
            changed = sorted(k for k in set(previous) | set(settings) if previous.get(k) != settings.get(k))
            raise JakiroError(f"{cfg.out} holds a benchmark run with other settings ({', '.join(changed)}); "
                              "use another --out or remove that folder")
        wanted = {q["question_id"] for q in questions}
        kept, seen = [], set()
        with open(os.path.join(cfg.out, PROGRESS)) as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    break  # a line cut short by an interruption: that question is run again
                qid = row[cfg.methods[0]]["question_id"]
                if qid in seen:
                    continue
                seen.add(qid)
                kept.append(line if line.endswith("\n") else line + "\n")
                if qid in wanted:  # answers outside this selection stay in the file for later runs
                    done.add(qid)
                    for m in cfg.methods:
                        records[m].append(row[m])
        with open(os.path.join(cfg.out, PROGRESS), "w") as f:
            f.writelines(kept)
    else:
        with open(run_path, "w") as f:
            json.dump(settings, f, indent=2)
        open(os.path.join(cfg.out, PROGRESS), "w").close()
    return records, done
