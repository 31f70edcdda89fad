"""Self-distilled data: batched decoding equals one-at-a-time decoding, regenerated answers equal
the target's own greedy answers, loops are cut, evaluation prompts and duplicates are kept out,
and a killed regeneration resumes without duplicates."""

import json

import pytest
import torch

from helpers import make_tiny_target
from jakiro.data.decontaminate import PromptFilter, evaluation_prompts, normalise_text
from jakiro.data.questions import mtbench_path, read_questions
from jakiro.data.regenerate import RegenSettings, Regenerator, read_done, repeated_tail
from jakiro.errors import JakiroError
from jakiro.models.target import TargetModel


@pytest.mark.parametrize("ids, expected", [
    ([1, 2, 3, 4, 5, 6], None),  # no repetition
    ([9, 1, 2, 3, 4, 5] * 2 + [7], None),  # two copies are not a loop
    ([9] + [1, 2, 3, 4, 5, 6] * 3, 13),  # three copies: keep two
    ([9] + [1, 2, 3, 4, 5] * 3, None),  # 15 tokens: a short block must span 16 ...
    ([9] + [1, 2, 3, 4, 5] * 4, 11),  # ... so it needs four copies
    ([5] + [7] * 16, 3),  # one token repeated over 16 positions: keep two
    ([5] + [7] * 15, None),  # a short block must span 16 tokens
    ([3] + [1, 2] * 8, 5),  # period 2
])
def test_repeated_tail_table(ids, expected):
    assert repeated_tail(ids) == expected


def _repeated_tail_by_every_period(ids, min_span=16, max_period=100):
    for p in range(1, min(max_period, len(ids) // 3) + 1):
        copies = max(3, -(-min_span // p))
        if copies * p <= len(ids) and all(ids[len(ids) - (r + 1) * p: len(ids) - r * p] == ids[len(ids) - p:]
                                          for r in range(1, copies)):
            return len(ids) - (copies - 2) * p
    return None


def test_repeated_tail_agrees_with_trying_every_period():
    import random
    rng = random.Random(0)
    for _ in range(3000):
        alphabet = rng.choice((2, 3, 5, 50))
        ids = [rng.randrange(alphabet) for _ in range(rng.randrange(0, 160))]
        if ids and rng.random() < 0.5:  # end in a loop of some period
            p = rng.randrange(1, 40)
            ids += ids[-p:] * rng.randrange(1, 6)
        assert repeated_tail(ids) == _repeated_tail_by_every_period(ids), ids


def test_decode_batch_equals_single_sequence_forward(tmp_path):
    target = TargetModel.from_folder(make_tiny_target(str(tmp_path), "qwen2"))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 256, (n,), generator=g) for n in (7, 2, 13)]
    cache = target.new_batch_cache(3, 40)
    tokens = []
    for b, p in enumerate(prompts):
        logits, _ = target(p, cache.slot(b), logits_rows=slice(-1, None))
        cache.set_length(b, len(p))
        tokens.append(int(logits.argmax()))
    seqs = [p.tolist() + [t] for p, t in zip(prompts, tokens)]
    batched_logits = [[] for _ in prompts]
    for _ in range(6):
        logits, feats = target.decode_batch(torch.tensor([s[-1] for s in seqs]), cache)
        cache.advance()
        for b in range(3):
            batched_logits[b].append(logits[b])
            seqs[b].append(int(logits[b].argmax()))
    for b, p in enumerate(prompts):
        ref, _ = target(torch.tensor(seqs[b][:-1]), target.new_cache(40))
        torch.testing.assert_close(torch.stack(batched_logits[b]), ref[len(p):], atol=1e-4, rtol=1e-4)



def test_decode_batch_is_bitwise_one_sequence_decoding(tmp_path):
    """Each row of a batched step gets exactly the logits and features that decoding its sequence
    alone, one token per forward, gives (the one-call stack visits the same keys in the same
    order and its kernels never mix rows)."""
    target = TargetModel.from_folder(make_tiny_target(str(tmp_path), "llama"))
    if target._fused is None:
        pytest.skip("the one-call decoder stack is not built here")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 256, (n,), generator=g) for n in (5, 1, 9, 3)]
    cache = target.new_batch_cache(4, 32)
    singles, last = [], []
    for b, p in enumerate(prompts):
        target(p, cache.slot(b))
        cache.set_length(b, len(p))
        alone = target.new_cache(32)
        target(p, alone)
        alone.commit(len(p))
        singles.append(alone)
        last.append(int(p[-1]) + 1)
    for _ in range(4):
        tokens = torch.tensor(last)
        logits, feats = target.decode_batch(tokens, cache)
        cache.advance()
        for b, alone in enumerate(singles):
            ref_logits, ref_feats = target(tokens[b:b + 1], alone)
            alone.commit(1)
            assert torch.equal(logits[b], ref_logits[0]) and torch.equal(feats[b], ref_feats[0])
        last = logits.argmax(-1).tolist()

CONVERSATIONS = [
    [{"role": "user", "content": "Name three colours."}, {"role": "assistant", "content": "x"},
     {"role": "user", "content": "And three animals?"}, {"role": "assistant", "content": "y"}],
    [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "z"}],
    [{"role": "user", "content": "Write a short poem about the sea."}, {"role": "assistant", "content": "w"}],
    [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "v"}],
]


@pytest.mark.parametrize("feed", [False, True])
def test_regenerated_answers_equal_plain_greedy_answers(smol, feed):
    """Prompts prefilled on their own or fed one token per batch forward (``feed_prompts``, a
    GPU's default): the target's own greedy answers either way."""
    engine = smol.engine("ar")
    settings = RegenSettings(max_len=160, max_new_tokens=20, batch=3, feed_prompts=feed)
    records = []
    stats = Regenerator(smol.target, smol.tokenizer, engine.eos_ids, settings).run(
        iter(enumerate(CONVERSATIONS)), records.append)
    # feeding: no forward but the batch's, and every prompt token not already in its slot fed
    assert (stats.prefill_forwards == 0) == feed and (stats.fed_prompt_tokens > 0) == feed
    assert stats.batch_forwards > 0
    assert sorted(r["source_index"] for r in records) == [0, 1, 2, 3]
    for rec in records:
        msgs = rec["messages"]
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                assert m == CONVERSATIONS[rec["source_index"]][i]
                continue
            res = engine.generate(msgs[:i], 20)
            assert m["content"] == res.text  # the target's own greedy answer, turn by turn
            assert m.get("truncated", False) == (res.finish_reason == "length")
    assert len(records[[r["source_index"] for r in records].index(0)]["messages"]) == 4  # both turns
    assert stats.answers == 5 and stats.generated_tokens == sum(r["generated_tokens"] for r in records)


@pytest.mark.slow
def test_device_stack_regenerates_what_the_cpu_kernels_do(smol):
    """The plain-torch stack a GPU regenerates with (``DeviceTarget``, here on the CPU), feeding
    the prompts through the batch as on a GPU, gives the kernels' greedy answers (prompts
    prefilled) and the same features (float16 and summation order apart)."""
    import dataclasses

    from jakiro.models.device_target import DeviceTarget
    settings = RegenSettings(max_len=160, max_new_tokens=20, batch=3, aux_layers=(3, 15))
    runs = []
    for target, feed in ((smol.target, False), (DeviceTarget(smol.target_path, "cpu"), True)):
        settings = dataclasses.replace(settings, feed_prompts=feed)
        records, kept = [], {}
        Regenerator(target, smol.tokenizer, smol.engine("ar").eos_ids, settings,
                    tokenize=lambda m: _training_ids(smol, m),
                    collect=lambda rec, ids, mask, f: kept.__setitem__(rec["source_index"], (ids, f))).run(
            iter(enumerate(CONVERSATIONS)), records.append)
        runs.append(({r["source_index"]: r["messages"] for r in records}, kept))
    (native, native_feats), (device, device_feats) = runs
    assert device == native and sorted(device) == [0, 1, 2, 3]
    for i, (ids, f) in native_feats.items():
        assert device_feats[i][0] == ids and device_feats[i][1].device.type == "cpu"
        assert f.shape == device_feats[i][1].shape == (len(ids), 3 * 576)
        torch.testing.assert_close(device_feats[i][1].float(), f.float(), atol=5e-2, rtol=2e-3)


def _training_ids(jk, messages):
    from jakiro.train.records import tokenize_conversation
    return tokenize_conversation(jk.tokenizer, messages, 160)


@pytest.mark.slow
def test_device_stack_samples_reproducibly(smol):
    from jakiro.models.device_target import DeviceTarget
    target = DeviceTarget(smol.target_path, "cpu")
    outs = []
    for seed in (3, 3, 4):
        records = []
        Regenerator(target, smol.tokenizer, smol.engine("ar").eos_ids,
                    RegenSettings(mode="sample", max_len=96, max_new_tokens=16, batch=2, seed=seed)).run(
            iter(enumerate(CONVERSATIONS[1:3])), records.append)
        outs.append(sorted((r["source_index"], r["messages"][1]["content"]) for r in records))
    assert outs[0] == outs[1] and outs[0] != outs[2]
    assert all(r["mode"] == "sample" for r in records)


@pytest.mark.slow
def test_data_on_the_device_stack_resumes_and_builds_features(tmp_path, monkeypatch):
    """``jakiro data`` with a device (here the plain-torch path forced onto the CPU): it
    regenerates with ``DeviceTarget``, computes features with ``FeatureModel``, equal to the
    kernels' dataset; tokens-only keeps no features beside the file."""
    import os

    import jakiro.train.dataset as dataset
    from jakiro.train.dataset import DataConfig, build_dataset
    from jakiro.train.regeneration import FEATURES_PREFIX
    from jakiro.train.feature_dataset import FeatureDataset
    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS))
    cfg = dict(source=str(src), max_len=96, regenerate="greedy", regen_max_tokens=12, regen_batch=3)
    built = []
    for folder in ("kernels", "dev"):  # each stopped after two conversations and resumed
        if folder == "dev":
            monkeypatch.setattr(dataset, "_uses_device_stack", lambda device: True)
        build_dataset(str(tmp_path / folder), DataConfig(None, max_records=2, **cfg), progress=False)
        built.append(build_dataset(str(tmp_path / folder), DataConfig(None, max_records=4, **cfg), progress=False))
    assert built[0]["records"] == built[1]["records"] == 4
    assert "features_from_regeneration" in built[1]
    assert (tmp_path / "dev" / "regenerated.jsonl").read_text() == (tmp_path / "kernels" / "regenerated.jsonl").read_text()
    a, b = FeatureDataset(str(tmp_path / "kernels")), FeatureDataset(str(tmp_path / "dev"))
    assert torch.equal(a.ids, b.ids) and torch.equal(a.mask, b.mask)
    torch.testing.assert_close(b.features.float(), a.features.float(), atol=2e-3, rtol=2e-3)
    import shutil
    shutil.copy(tmp_path / "dev" / "regenerated.jsonl", tmp_path / "copy.jsonl")  # features computed anew
    copy = build_dataset(str(tmp_path / "copy"), DataConfig(None, source=str(tmp_path / "copy.jsonl"), max_len=96),
                         progress=False)
    assert "features_from_regeneration" not in copy and copy["feature_tokens_per_s"] > 0
    c = FeatureDataset(str(tmp_path / "copy"))
    assert torch.equal(a.ids, c.ids)
    torch.testing.assert_close(c.features.float(), a.features.float(), atol=2e-3, rtol=2e-3)
    build_dataset(str(tmp_path / "tok"), DataConfig(None, max_records=4, tokens_only=True, **cfg), progress=False)
    assert not [n for n in os.listdir(tmp_path / "tok") if n.startswith(FEATURES_PREFIX)]


@pytest.mark.slow
def test_the_target_writes_its_own_prompts_and_answers_them(smol, tmp_path):
    """``--source target-prompts``: each user turn is sampled from the chat template's user header
    alone, then answered as any other (greedy: the plain greedy answer to that prompt); a resumed
    run continues without repeating a prompt; the evaluation filter sees every written prompt."""
    from jakiro.train.dataset import DataConfig, build_dataset
    from jakiro.train.feature_dataset import FeatureDataset
    cfg = dict(source="target-prompts", regenerate="greedy", regen_max_tokens=12, regen_batch=2, max_len=160,
               tokens_only=True)
    out = tmp_path / "data"
    first = build_dataset(str(out), DataConfig(None, max_records=3, **cfg), progress=False)
    # resumed with the prompts fed through the batch (a GPU's way): the same kind of conversations
    state = build_dataset(str(out), DataConfig(None, max_records=5, regen_prompts="feed", **cfg), progress=False)
    records = [json.loads(x) for x in (out / "regenerated.jsonl").read_text().splitlines()]
    assert len(records) == 5 == state["records"] == len(FeatureDataset(str(out)))
    prompts = [r["messages"][0]["content"] for r in records]
    assert len(set(prompts)) == 5 and all(p.strip() for p in prompts)
    engine = smol.engine("ar")
    for r in records[:2] + records[3:]:
        user, answer = r["messages"]
        assert user["role"] == "user" and answer["role"] == "assistant" and r["mode"] == "greedy"
        assert answer["content"] == engine.generate([user], 12).text
    runs = [first["regeneration_runs"][-1], state["regeneration_runs"][-1]]
    assert runs[1]["prefill_forwards"] == 0 and runs[1]["fed_prompt_tokens"] > 0
    assert sum(r["prompts_written"] for r in runs) >= 5 and all("removed_evaluation" in r for r in runs)
    assert sum(r["generated_tokens"] for r in runs) == sum(r["generated_tokens"] for r in records)


@pytest.mark.slow
def test_prompts_the_filter_refuses_never_enter_and_an_endless_refusal_stops(smol, tmp_path, monkeypatch):
    from jakiro.data.decontaminate import PromptFilter
    from jakiro.train.dataset import DataConfig, build_dataset
    seen = []
    records, dropped = [], []
    stats = Regenerator(smol.target, smol.tokenizer, smol.engine("ar").eos_ids,
                RegenSettings(max_len=128, max_new_tokens=8, batch=2),
                admit=lambda messages: seen.append(messages) or False).run(
        iter(enumerate([[{"role": "user", "content": None}, {"role": "assistant", "content": ""}]] * 3)),
        records.append, dropped=dropped.append)
    assert records == [] and sorted(dropped) == [0, 1, 2] and len(seen) <= 3
    assert stats.prompts_rejected == 3 and stats.skipped_too_long == 0
    assert all(m[-1]["role"] == "user" and m[-1]["content"] for m in seen)
    monkeypatch.setattr(PromptFilter, "admit", lambda self, messages: False)
    monkeypatch.setattr("jakiro.train.regeneration.DROPS_IN_A_ROW", -15)  # 5 with one slot
    with pytest.raises(JakiroError, match="in a row ended without an answer"):
        build_dataset(str(tmp_path / "d"), DataConfig(None, source="target-prompts", regenerate="greedy",
                                                      regen_max_tokens=8, regen_batch=1, max_len=96,
                                                      max_records=2, tokens_only=True), progress=False)


def test_a_time_limit_stops_regeneration_and_the_same_command_continues(tmp_path):
    from jakiro.train.dataset import DataConfig, build_dataset
    from jakiro.train.feature_dataset import FeatureDataset
    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS))
    cfg = dict(source=str(src), max_len=96, regenerate="greedy", regen_max_tokens=12, regen_batch=2,
               max_records=4, tokens_only=True)
    out = str(tmp_path / "data")
    with pytest.raises(JakiroError, match="ran out before any conversation was finished; run the same command"):
        build_dataset(out, DataConfig(None, regen_minutes=1e-9, **cfg), progress=False)
    state = build_dataset(out, DataConfig(None, regen_prompts="feed", **cfg), progress=False)
    run = state["regeneration_runs"][-1]
    assert state["records"] == 4 and run["stopped_in_flight"] == 0
    assert run["prefill_forwards"] == 0 and run["fed_prompt_tokens"] > 0
    assert sorted(read_done(str(tmp_path / "data" / "regenerated.jsonl"))) == [0, 1, 2, 3]
    assert len(FeatureDataset(out)) == 4
    with pytest.raises(JakiroError, match="--regen-minutes must be >= 0"):
        build_dataset(str(tmp_path / "neg"), DataConfig(None, regen_minutes=-1, **cfg), progress=False)
    with pytest.raises(JakiroError, match="unknown --regen-prompts 'batch'; choose auto, prefill or feed"):
        build_dataset(str(tmp_path / "bad"), DataConfig(None, regen_prompts="batch", **cfg), progress=False)


@pytest.mark.parametrize("device, message", [("gpu0", "not a torch device"),
                                             ("cuda", "no CUDA device is available")])
def test_an_unusable_device_is_a_clear_error(device, message, tmp_path):
    from jakiro.train.dataset import DataConfig, build_dataset
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(JakiroError, match=message):
        build_dataset(str(tmp_path / "d"), DataConfig(None, regenerate="greedy", device=device), progress=False)
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("feed", [False, True])
def test_a_slot_keeps_what_the_next_conversation_shares_with_the_last(smol, feed):
    """A conversation taking over a slot prefills (or feeds) only what its prompt does not share
    with the tokens the slot holds (the template's system prompt), and still answers as plain
    decoding."""
    engine = smol.engine("ar")
    one = [CONVERSATIONS[1], CONVERSATIONS[2]]
    records = []
    stats = Regenerator(smol.target, smol.tokenizer, engine.eos_ids, RegenSettings(max_len=160, max_new_tokens=10,
                                                                                  batch=1, feed_prompts=feed)).run(
        iter(enumerate(one)), records.append)
    header = smol.tokenizer.apply_chat_template([{"role": "user", "content": "\u0000"}], tokenize=False)
    header_ids = smol.tokenizer(header[:header.index("\u0000")], add_special_tokens=False).input_ids
    assert len(header_ids) > 10 and stats.reused_prompt_tokens >= len(header_ids)
    for rec in records:
        assert rec["messages"][1]["content"] == engine.generate(rec["messages"][:1], 10).text


def test_prompt_too_long_for_the_budget_is_skipped(smol):
    settings = RegenSettings(max_len=64, max_new_tokens=8, batch=2)
    long = [{"role": "user", "content": "word " * 80}, {"role": "assistant", "content": "a"}]
    records = []
    stats = Regenerator(smol.target, smol.tokenizer, smol.engine("ar").eos_ids, settings).run(
        iter([(0, long), (1, CONVERSATIONS[3])]), records.append)
    assert [r["source_index"] for r in records] == [1] and stats.skipped_too_long == 1


def test_prompt_filter_removes_evaluation_questions_and_duplicates():
    mt = read_questions(mtbench_path())[0]["turns"][0]
    f = PromptFilter(evaluation_prompts())
    convo = lambda text: [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}]  # noqa: E731
    assert not f.admit(convo(mt.upper() + " !!"))  # normalised exact match
    words = normalise_text(mt).split()
    assert len(words) >= 14
    assert not f.admit(convo("Please help: " + " ".join(words[:14]) + " thanks"))  # 13-gram overlap
    assert f.admit(convo("How do I bake bread at home?"))
    assert not f.admit(convo("how do I bake bread at home"))  # same first turn
    assert (f.contaminated, f.duplicates) == (2, 1)


def test_a_saved_evaluation_filter_refuses_what_the_packages_do(tmp_path, monkeypatch):
    """Where the question packages are missing (a GPU machine), their digests, saved without any
    prompt text, filter the same conversations."""
    from jakiro.data.decontaminate import FILTER_ENV, evaluation_filter, save_evaluation_filter
    path = tmp_path / "filter.json"
    assert save_evaluation_filter(str(path)) == len(evaluation_prompts())
    mt = read_questions(mtbench_path())[2]["turns"][0]
    assert normalise_text(mt)[:40] not in path.read_text()  # digests only
    monkeypatch.setenv(FILTER_ENV, str(path))
    f = evaluation_filter()
    convo = lambda text: [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}]  # noqa: E731
    words = normalise_text(mt).split()
    assert not f.admit(convo(mt.lower())) and not f.admit(convo("so: " + " ".join(words[1:15])))
    assert f.admit(convo("How do I bake bread at home?")) and f.contaminated == 2
    path.write_text("{not json")
    with pytest.raises(JakiroError, match=f"{FILTER_ENV}=.*not an evaluation filter file"):
        evaluation_filter()


def test_truncated_answer_end_of_turn_is_not_a_training_target(smol):
    from jakiro.train.records import tokenize_conversation
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]
    ids, mask = tokenize_conversation(smol.tokenizer, msgs, 100)
    ids_t, mask_t = tokenize_conversation(smol.tokenizer, [msgs[0], dict(msgs[1], truncated=True)], 100)
    assert ids == ids_t
    end = smol.tokenizer.convert_tokens_to_ids("<|im_end|>")
    last = max(i for i, t in enumerate(ids) if t == end)
    assert mask[last] == 1 and mask_t[:last] == mask[:last] and not any(mask_t[last:])


def test_regeneration_resumes_after_a_kill_without_duplicates(tmp_path):
    from jakiro.train.dataset import DataConfig, build_dataset
    from jakiro.train.feature_dataset import FeatureDataset
    src = tmp_path / "src.jsonl"
    mt = read_questions(mtbench_path())[1]["turns"][0]
    rows = CONVERSATIONS + [[{"role": "user", "content": mt}, {"role": "assistant", "content": "u"}],
                            CONVERSATIONS[1]]
    src.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    cfg = dict(source=str(src), max_len=96, regenerate="greedy", regen_max_tokens=12, regen_batch=2)
    out = tmp_path / "data"
    build_dataset(str(out), DataConfig(None, max_records=2, **cfg), progress=False)
    regen = out / "regenerated.jsonl"
    with open(regen, "a") as f:
        f.write('{"source_index": 3, "messa')  # killed in the middle of a line
    state = build_dataset(str(out), DataConfig(None, max_records=6, **cfg), progress=False)
    lines = regen.read_text().splitlines()
    assert sorted(json.loads(x)["source_index"] for x in lines) == [0, 1, 2, 3]
    assert read_done(str(regen)) == {0, 1, 2, 3}
    # the MT-bench question (index 4) and the repeated conversation (index 5) never enter
    assert state["regeneration_runs"][-1]["removed_evaluation"] == 1
    assert state["records"] == 4 and len(FeatureDataset(str(out))) == 4
    fresh = build_dataset(str(tmp_path / "fresh"), DataConfig(None, max_records=4, **cfg), progress=False)
    assert fresh["records"] == 4
    assert (tmp_path / "fresh" / "regenerated.jsonl").read_text() != ""



def test_features_taken_in_the_regeneration_pass_equal_a_separate_pass(tmp_path):
    """The features a regenerated dataset takes from the generation's own forwards are those a
    separate pass over the regenerated file computes (float16 rounding apart), on the same ids
    and loss masks; a conversation whose stored ids differ is computed again."""
    import os
    import shutil

    from jakiro.train.dataset import DataConfig, build_dataset
    from jakiro.train.regeneration import FEATURES_PREFIX
    from jakiro.train.feature_dataset import FeatureDataset
    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS))
    cfg = dict(source=str(src), max_len=96, regenerate="greedy", regen_max_tokens=12, regen_batch=3)
    out = tmp_path / "data"
    state = build_dataset(str(out), DataConfig(None, max_records=4, **cfg), progress=False)
    assert state["features_from_regeneration"] == 4
    run = state["regeneration_runs"][-1]
    assert run["feature_tokens_reused"] > 5 * run["feature_tokens_computed"] > 0  # closing tokens only
    # as after a kill between the regeneration and the dataset pass, one line edited since
    again = tmp_path / "again"
    again.mkdir()
    lines = (out / "regenerated.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    first["messages"][1]["content"] += " Edited."
    (again / "regenerated.jsonl").write_text("\n".join([json.dumps(first)] + lines[1:]) + "\n")
    for name in os.listdir(out):
        if name.startswith(FEATURES_PREFIX):
            shutil.copy(out / name, again / name)
    recomputed = build_dataset(str(again), DataConfig(None, max_records=4, **cfg), progress=False)
    assert recomputed["features_from_regeneration"] == 3 and recomputed["records"] == 4
    a, b = FeatureDataset(str(out)), FeatureDataset(str(again))
    assert torch.equal(a.ids[a.offsets[1]:], b.ids[b.offsets[1]:])
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    shutil.copy(out / "regenerated.jsonl", fresh / "regenerated.jsonl")
    separate = build_dataset(str(fresh), DataConfig(None, max_records=4, **cfg), progress=False)
    assert "features_from_regeneration" not in separate
    c = FeatureDataset(str(fresh))
    assert torch.equal(a.ids, c.ids) and torch.equal(a.mask, c.mask)
    torch.testing.assert_close(a.features.float(), c.features.float(), atol=2e-3, rtol=2e-3)
    # a dataset built later from the regenerated file, in another folder and from its third line
    later = build_dataset(str(tmp_path / "later"), DataConfig(None, source=str(out / "regenerated.jsonl"),
                                                              max_records=4, max_len=96, first_record=2),
                          progress=False)
    assert later["records"] == 2 and later["features_from_regeneration"] == 2
    d = FeatureDataset(str(tmp_path / "later"))
    assert torch.equal(d.features, a.features[a.offsets[2]:])

def test_mid_layer_streams_come_out_of_the_regeneration_pass(tmp_path):
    """With --aux-layers the regeneration keeps the residual streams with the features: equal to
    a separate pass over the file; a dataset without them (or with other ones) built from the
    same file computes its own."""
    import shutil

    from jakiro.train.dataset import DataConfig, build_dataset
    from jakiro.train.feature_dataset import FeatureDataset
    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS[:3]))
    out = tmp_path / "data"
    state = build_dataset(str(out), DataConfig(None, source=str(src), max_len=96, regenerate="greedy",
                                               regen_max_tokens=12, regen_batch=3, aux_layers="3,15"),
                          progress=False)
    assert state["features_from_regeneration"] == 3 and state["identity"]["aux_layers"] == [3, 15]
    a = FeatureDataset(str(out))
    assert a.aux_layers == (3, 15) and a.features.shape[1] == 3 * 576
    shutil.copy(out / "regenerated.jsonl", tmp_path / "copy.jsonl")  # no stored features beside it
    separate = build_dataset(str(tmp_path / "separate"), DataConfig(None, source=str(tmp_path / "copy.jsonl"),
                                                                    max_len=96, aux_layers="3,15"), progress=False)
    assert "features_from_regeneration" not in separate
    b = FeatureDataset(str(tmp_path / "separate"))
    assert torch.equal(a.ids, b.ids)
    torch.testing.assert_close(a.features.float(), b.features.float(), atol=2e-3, rtol=2e-3)
    plain = build_dataset(str(tmp_path / "plain"), DataConfig(None, source=str(out / "regenerated.jsonl"),
                                                              max_len=96), progress=False)
    assert "features_from_regeneration" not in plain  # the stored features are wider: not these
    c = FeatureDataset(str(tmp_path / "plain"))
    assert c.aux_layers == () and c.features.shape[1] == 576
    torch.testing.assert_close(c.features.float(), a.features[:, :576].float(), atol=2e-3, rtol=2e-3)
    with pytest.raises(JakiroError, match="increasing layer counts in 1..29"):
        build_dataset(str(tmp_path / "deep"), DataConfig(None, source=str(src), max_len=96, aux_layers="3,30"),
                      progress=False)
    assert not (tmp_path / "deep").exists()


def test_full_disk_while_writing_a_shard_is_a_clear_error(tmp_path, monkeypatch):
    import os

    import safetensors.torch

    from jakiro.train.dataset import _write_shard
    record = ([1, 2, 3], [0, 1, 1], torch.zeros(3, 4))
    _write_shard(str(tmp_path), 0, [record])

    def full_disk(tensors, path):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(JakiroError, match="No space left on device.*earlier shards are intact"):
        _write_shard(str(tmp_path), 1, [record])
    assert sorted(os.listdir(tmp_path)) == ["shard-00000.safetensors"]  # no torn shard


def test_sources_gzip_and_non_utf8(tmp_path):
    import gzip

    from jakiro.data.conversations import iter_conversations
    from jakiro.errors import JakiroError
    rows = [{"messages": m} for m in CONVERSATIONS[:2]]
    gz = tmp_path / "c.jsonl.gz"
    with gzip.open(gz, "wt", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    assert list(iter_conversations(str(gz))) == CONVERSATIONS[:2]
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(json.dumps(rows[0]).encode() + b"\n" + '{"messages": "caf\xe9"}'.encode("latin-1") + b"\n")
    with pytest.raises(JakiroError, match=r"latin1.jsonl:2: not UTF-8 text"):
        list(iter_conversations(str(bad)))


def _conversation(question: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


PASSAGE = ("The harbour town grew around a small fishing fleet. In the nineteenth century a railway "
           "line reached it, and merchants built warehouses along the quay. Tourism arrived later: "
           "hotels replaced two of the warehouses, and the fleet shrank to a handful of boats that "
           "now sell their catch to the restaurants on the seafront. The old lighthouse is a museum.")


def test_task_prompts_rotate_over_usable_texts_and_keep_positions():
    from jakiro.data.tasks import ANSWER_PLACEHOLDER, TRANSLATE, task_conversations
    german = ("Ich habe eine Frage zu meinem Vertrag. Die Firma hat mir nicht gesagt, dass die "
              "Kündigungsfrist drei Monate ist, und ich möchte wissen, ob das für mich gilt und was ich tun kann.")
    source = [
        _conversation("Tell me about the town.", PASSAGE),
        None,  # an unusable source record
        _conversation("Short?", "Yes."),  # no passage of 60-220 words
        _conversation("Write code.", "```python\n" + "x = 1\n" * 80 + "```"),  # code is no passage
        _conversation("And its history?", PASSAGE),
        _conversation(german, "Ja."),
        _conversation("Once more?", PASSAGE),
        _conversation("And again?", PASSAGE),
    ]
    out = list(task_conversations(source))
    assert len(out) == len(source)  # one item per source record: positions stay countable
    assert [o is None for o in out] == [False, True, True, True, False, False, False, False]
    prompts = [o[0]["content"] for o in out if o is not None]
    assert all(o[1] == {"role": "assistant", "content": ANSWER_PLACEHOLDER} for o in out if o is not None)
    assert prompts[0].startswith("Summarize the following text") and PASSAGE in prompts[0]
    assert prompts[1].startswith("Answer the question using only the passage") and prompts[1].endswith(
        "Question: And its history?")
    assert prompts[2] == TRANSLATE[2].format(passage=german)
    # the translation took the third turn of the rotation (extract); then rewrite, then the next
    # round of summaries with the next template
    assert prompts[3].startswith("Rewrite the following") and prompts[4].startswith("Write a one-paragraph")
    assert list(task_conversations(source)) == out  # the same sequence every time


def test_later_passages_make_their_own_task_sequence():
    """sharegpt-tasks-N works on each conversation's N-th passage: conversations with fewer give
    None (positions stay countable), translations stay with the first passage, and the first
    passage's sequence is unchanged by the others."""
    from jakiro.data.tasks import task_conversations
    other = PASSAGE.replace("harbour town", "mountain village")
    german = ("Ich habe eine Frage zu meinem Vertrag. Die Firma hat mir nicht gesagt, dass die "
              "Kündigungsfrist drei Monate ist, und ich möchte wissen, ob das für mich gilt und was ich tun kann.")
    two = _conversation("Tell me about the town.", PASSAGE) + _conversation("And the village?", other)
    source = [two, _conversation("Only one?", PASSAGE), _conversation(german, "Ja.") + _conversation("Noch?", other),
              two]
    first = list(task_conversations(source))
    second = list(task_conversations(source, passage=2))
    assert [o is None for o in second] == [False, True, True, False]
    assert other in second[0][0]["content"] and PASSAGE not in second[0][0]["content"]
    # the rotation starts one kind on: answer from the passage, then extract
    assert second[0][0]["content"].startswith("Answer the question using only the passage")
    assert second[0][0]["content"].endswith("Question: And the village?")
    assert second[3][0]["content"].startswith("Extract every name")
    assert first[0][0]["content"].startswith("Summarize the following text") and PASSAGE in first[0][0]["content"]
    assert first == list(task_conversations(source, passage=1))
    with pytest.raises(ValueError, match="1..5"):
        list(task_conversations(source, passage=6))


def test_foreign_text_detection():
    from jakiro.data.tasks import is_foreign
    assert is_foreign("这是一个关于机器学习的问题，请帮我解释一下梯度下降的原理和应用场景。谢谢你的帮助！")
    assert is_foreign("Je voudrais savoir comment fonctionne le système de paiement et pour que les clients "
                      "puissent payer avec une carte dans le magasin, est-ce que c'est possible avec le logiciel?")
    assert not is_foreign(PASSAGE)
    assert not is_foreign("Résumé: café")  # too short to tell


def test_task_source_needs_regeneration():
    from jakiro.errors import JakiroError
    from jakiro.train.config import DataConfig
    with pytest.raises(JakiroError, match="prompts only"):
        DataConfig(None, source="sharegpt-tasks").check()
    DataConfig(None, source="sharegpt-tasks", regenerate="greedy").check()
    with pytest.raises(JakiroError, match="sharegpt-tasks-3 holds prompts only"):
        DataConfig(None, source="sharegpt-tasks-3").check()
    DataConfig(None, source="sharegpt-tasks-5", regenerate="greedy").check()
    with pytest.raises(JakiroError, match="target-prompts holds prompts only"):
        DataConfig(None, source="target-prompts").check()
    DataConfig(None, source="target-prompts", regenerate="sample").check()
    for name in ("sharegpt-tasks-1", "sharegpt-tasks-6", "sharegpt-tasks-x"):  # no such source (nor file)
        with pytest.raises(JakiroError, match=f"dataset not found: {name}"):
            DataConfig(None, source=name, regenerate="greedy").check()


def test_task_source_reads_the_installed_sharegpt_package():
    from jakiro.data.conversations import iter_conversations
    first = []
    for messages in iter_conversations("sharegpt-tasks"):
        if messages is not None:
            first.append(messages[0]["content"])
        if len(first) == 8:
            break
    assert len(first) == 8 and len(set(first)) == 8
    assert PromptFilter(evaluation_prompts()).admit([{"role": "user", "content": first[0]}])


def test_code_source_keeps_sharegpts_conversations_about_code():
    """``sharegpt-code``: the ShareGPT conversations whose first user turn holds code or asks
    about it, at their positions in the whole file (other records are None), so resuming counts
    the same records."""
    from itertools import islice

    from jakiro.data.conversations import is_about_code, iter_conversations

    def user(text):
        return [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}]

    for text in ("Write a Python function that reverses a list.", "Why does this fail?\n```\nx = [1, 2\n```",
                 "SELECT name FROM users WHERE id = 3 returns nothing", "How do I undo a git commit?",
                 "int main() {"):
        assert is_about_code(user(text)), text
    for text in ("Write a short poem about the sea.", "What is the capital of France?",
                 "Give me three ideas for a birthday party."):
        assert not is_about_code(user(text)), text
    whole = list(islice(iter_conversations("sharegpt"), 300))
    code = list(islice(iter_conversations("sharegpt-code"), 300))
    assert [c is not None for c in code] == [w is not None and is_about_code(w) for w in whole]
    assert [c for c in code if c] == [w for w in whole if w and is_about_code(w)]
    assert 30 <= sum(c is not None for c in code) <= 200  # a part of the file, not all or nothing
