"""Training: losses on hand-computed cases, a step that learns, DDP equivalence, exact resume,
dataset resume, and clear errors for bad input."""

import json
import os
import socket

import pytest
import torch

from helpers import make_tiny_target, write_conversations
from jakiro.draft.checkpoint import load_draft
from jakiro.errors import JakiroError
from jakiro.models.target import TargetModel
from jakiro.train.dataset import STATE_FILE, _write_shard
from jakiro.train.losses import branch_loss, carried_feature, draft_loss, heldout_metrics, second_expert_loss, unroll
from jakiro.train.trainer import TrainConfig, Trainer


def test_branch_loss_hand_computed():
    pred = torch.tensor([[0.0, 2.0]])
    target = torch.tensor([[0.5, 0.0]])
    head = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    probs = torch.tensor([[0.25, 0.75]])
    # SmoothL1: |0.5| < 1 -> 0.5 * 0.25 = 0.125; |2| >= 1 -> 2 - 0.5 = 1.5; mean = 0.8125
    logits = torch.tensor([0.0, 2.0])
    logp = logits - torch.logsumexp(logits, 0)
    ce = -(0.25 * logp[0] + 0.75 * logp[1])
    expected = 0.8125 + 0.1 * ce
    got = branch_loss(pred, target, probs, head, torch.tensor([1.0]))
    assert abs(float(got) - float(expected)) < 1e-6
    assert float(branch_loss(pred, target, probs, head, torch.tensor([0.0]))) == 0.0


def test_second_expert_learns_only_what_the_first_leaves():
    head = torch.eye(4)
    pred_a = torch.tensor([[5.0, 4.0, 0.0, 0.0]])  # the first expert's top-2: tokens 0 and 1
    pred_b = torch.tensor([[1.0, 0.0, 3.0, 0.0]], requires_grad=True)
    feat = pred_b.detach().clone()  # no feature term
    agreeing = torch.tensor([[0.6, 0.4, 0.0, 0.0]])  # the target has nothing beyond the first's picks
    taken = torch.topk(pred_a @ head.T, 2).indices
    loss = second_expert_loss(taken, pred_b, feat, agreeing, head)
    assert float(loss.detach()) == 0.0
    other = torch.tensor([[0.5, 0.1, 0.3, 0.1]])
    loss = second_expert_loss(taken, pred_b, feat, other, head)
    # cross-entropy over tokens 2 and 3 only, weighted by the target's mass there
    logp = torch.log_softmax(torch.tensor([3.0, 0.0]), 0)
    assert abs(float(loss.detach()) - float(-0.1 * (0.3 * logp[0] + 0.1 * logp[1]))) < 1e-6
    loss.backward()
    assert pred_b.grad[0, 0] == 0 and pred_b.grad[0, 1] == 0  # the first expert's tokens are not its job


def _random_draft(method: str, target_dir: str, seed: int = 0):
    from jakiro.draft import DraftConfig, DraftModel
    target = TargetModel.from_folder(target_dir)
    kw = dict(num_experts=3, experts_per_token=2, parallel_decoding=True) if method == "jakiro" else {}
    torch.manual_seed(seed)
    draft = DraftModel(DraftConfig.for_target(target.config, target.hf_config, method, **kw))
    draft.reset_parameters(std=0.2)
    return draft.attach_target(target.embed, target.lm_head.weight)


def _random_sequence(draft, length: int, seed: int, first_loss: int):
    """One random record: ids [1, L], features [1, L, d], loss mask from ``first_loss`` on."""
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(1, length, draft.config.hidden_size, generator=g)
    ids = torch.randint(0, 256, (1, length), generator=g)
    mask = torch.zeros(1, length, dtype=torch.bool)
    mask[0, first_loss:] = True
    return ids, feats, mask


@pytest.mark.parametrize("method,loss_at", [("eagle2", None), ("jakiro", None), ("eagle2", (7, 8, 12)),
                                            ("jakiro", (7, 8, 12))])
def test_unrolled_training_steps_equal_drafting_with_a_cache(tiny_setup, method, loss_at):
    """Step s of row j in training computes exactly what drafting computes s steps deep from root j:
    the target's features up to j, then the draft's own carried features and the path's tokens.
    With loss on a few positions only (``loss_at``), each step computes only the rows whose own
    or later predictions land there, and those rows are still exact."""
    target, _ = tiny_setup
    draft = _random_draft(method, target).eval()
    L, d = 14, draft.config.hidden_size
    ids, feats, mask = _random_sequence(draft, L, seed=1, first_loss=0)
    if loss_at is not None:
        mask[:] = False
        mask[0, list(loss_at)] = True
    with torch.no_grad():
        steps = {rows.step: rows for rows in unroll(draft, ids, feats, mask, 3)}
        roots = (0, 4, 9)
        if loss_at is not None:  # step s computes root j when j + s .. j + 3 holds a loss position
            for s, rows in steps.items():
                assert sorted(rows.j.tolist()) == [j for j in range(L - 1)
                                                   if any(j + s <= p <= j + 3 for p in loss_at)]
            roots = (4, 5, 9)  # computed at every step
        for root in roots:
            cache = draft.new_cache(64)
            out = draft(feats[:, :root + 1], ids[:, 1:root + 2], torch.arange(root + 1), cache)
            cache.commit(root + 1)
            row, carried = out.blend[0, -1], None
            for s in (1, 2, 3):
                if s > 1:  # one more step on the carried feature, attending to the cache and itself
                    out = draft(carried.view(1, 1, d), ids[:, root + s:root + s + 1],
                                torch.tensor([root + s - 1]), cache)
                    cache.commit(1)
                    row = out.blend[0, -1]
                rows = steps[s]
                at = int(torch.nonzero((rows.b == 0) & (rows.j == root))[0])
                torch.testing.assert_close(rows.out.blend[at], row, atol=1e-4, rtol=1e-4)
                if out.contrastive is not None:
                    torch.testing.assert_close(rows.out.contrastive[at], out.contrastive[0, -1], atol=1e-4, rtol=1e-4)
                carried = carried_feature(draft, out)[0, -1]


@pytest.mark.parametrize("jakiro_loss", ["full", "separate", "reference"])
def test_single_step_loss_is_the_sum_of_branch_losses(tiny_setup, jakiro_loss):
    """The loss and its gradients equal the branch losses written out on a plain forward (the
    trainer takes the blend's head product from the experts' where it has them)."""
    target, _ = tiny_setup
    draft = _random_draft("jakiro", target)
    L = 12
    ids, feats, mask = _random_sequence(draft, L, seed=2, first_loss=5)
    total, parts = draft_loss(draft, ids, feats, mask, steps=1, jakiro_loss=jakiro_loss)
    grads = torch.autograd.grad(total, list(draft.parameters()), allow_unused=True)
    out = draft(feats[:, :-1], ids[:, 1:], torch.arange(L - 1))
    head = draft.head_weight
    probs = torch.softmax(feats[0] @ head.T, -1)
    expect_blend = branch_loss(out.blend[0, 4:], feats[0, 5:], probs[5:], head)
    experts = out.features[0, 4:]
    if jakiro_loss == "full":
        expect_experts = sum(branch_loss(experts[:, k], feats[0, 5:], probs[5:], head, out.weights[0, 4:, k])
                             for k in range(2))
    elif jakiro_loss == "separate":
        taken = torch.topk((experts[:, 0] @ head.T).detach(), 2, dim=-1).indices
        expect_experts = branch_loss(experts[:, 0], feats[0, 5:], probs[5:], head) + \
            second_expert_loss(taken, experts[:, 1], feats[0, 5:], probs[5:], head)
    else:
        expect_experts = 0.0
    expect_con = 0.5 * branch_loss(out.contrastive[0, 3:L - 2], feats[0, 5:], probs[5:], head)  # two ahead
    expect = expect_blend + expect_experts + expect_con
    torch.testing.assert_close(total, expect)
    assert parts["blend"] == pytest.approx(float(expect_blend.detach()), rel=1e-5)
    for got, want in zip(grads, torch.autograd.grad(expect, list(draft.parameters()), allow_unused=True)):
        assert (got is None) == (want is None)
        if got is not None:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_cross_entropy_weight_scales_only_the_token_term(tiny_setup):
    target, _ = tiny_setup
    draft = _random_draft("eagle2", target)
    ids, feats, mask = _random_sequence(draft, 12, seed=4, first_loss=5)
    feature_only, _ = draft_loss(draft, ids, feats, mask, steps=2, p_weight=0.0)
    default, _ = draft_loss(draft, ids, feats, mask, steps=2)
    heavy, _ = draft_loss(draft, ids, feats, mask, steps=2, p_weight=1.0)
    # the loss is linear in the weight: feature term + w * cross-entropy term
    from jakiro.train.config import P_WEIGHT
    ce_at_default = (default - feature_only) / P_WEIGHT
    torch.testing.assert_close(heavy, feature_only + ce_at_default, rtol=1e-4, atol=1e-4)
    assert ce_at_default.item() > 0


def test_negative_cross_entropy_weight_is_refused(tmp_path):
    with pytest.raises(JakiroError, match="--p-weight must be >= 0"):
        TrainConfig(data=str(tmp_path), out=str(tmp_path / "run"), p_weight=-1.0).check()


def test_heldout_metrics_count_what_drafting_would_propose(tiny_setup):
    target, _ = tiny_setup
    draft = _random_draft("jakiro", target)
    full_head = TargetModel.from_folder(target).lm_head.weight
    L = 16
    ids, feats, mask = _random_sequence(draft, L, seed=3, first_loss=6)
    ev = heldout_metrics(draft, [(ids, feats, mask)], 2, full_head)
    assert set(ev) == {"top1", "contrastive_top1", "expert_same_top1", "expert_cos"}
    with torch.no_grad():
        out = draft(feats[:, :-1], ids[:, 1:], torch.arange(L - 1))
        best = draft.to_target_ids(draft.head_logits(out.features[0, :, 0]).argmax(-1))  # row j -> x_{j+2}
        con = draft.to_target_ids(draft.head_logits(out.contrastive[0]).argmax(-1))  # row j -> x_{j+3}
        target_tok = (feats[0] @ full_head.T).argmax(-1)  # position p -> x_{p+1}
        tops = draft.head_logits(out.features[0]).argmax(-1)
    assert ev["top1"][0] == pytest.approx(float((best[5:] == target_tok[6:]).double().mean()))
    assert ev["contrastive_top1"][0] == pytest.approx(float((con[5:L - 2] == target_tok[7:]).double().mean()))
    same = rows_same = (tops[:, 0] == tops[:, 1]).double()
    assert ev["expert_same_top1"][0] == pytest.approx(float(rows_same[5:].mean()))
    assert 0 <= min(ev["top1"]) and max(ev["top1"]) <= 1 and same.numel() == L - 1


def make_feature_dataset(folder: str, target_dir: str, n_records: int = 12, seed: int = 0,
                         aux_layers: tuple[int, ...] = ()) -> str:
    """A dataset in `jakiro data` format from a tiny target's real features (and the residual
    streams after ``aux_layers``)."""
    target = TargetModel.from_folder(target_dir)
    g = torch.Generator().manual_seed(seed)
    records = []
    counts = {}
    for _ in range(n_records):
        n = int(torch.randint(20, 40, (1,), generator=g))
        ids = torch.randint(2, 256, (n,), generator=g)
        with torch.inference_mode():
            _, feats = target(ids, target.new_cache(n), aux_layers=aux_layers)
        mask = [0] * 5 + [1] * (n - 5)
        records.append((ids.tolist(), mask, feats))
        for t in ids.tolist():
            counts[str(t)] = counts.get(str(t), 0) + 1
    os.makedirs(folder, exist_ok=True)
    shards = [_write_shard(folder, 0, records[: n_records // 2]), _write_shard(folder, 1, records[n_records // 2:])]
    state = {"identity": {"target_name": target.config.name, "hidden_size": 64, "vocab_size": 256,
                          "source": "test", "max_len": 64, "regenerate": "none", "seed": 0},
             "records_done": n_records, "records": n_records, "tokens": 0, "loss_tokens": 0,
             "shards": shards, "token_counts": counts}
    if aux_layers:
        state["identity"]["aux_layers"] = list(aux_layers)
    with open(os.path.join(folder, STATE_FILE), "w") as f:
        json.dump(state, f)
    return folder


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    target = make_tiny_target(str(root / "target"), "llama")
    data = make_feature_dataset(str(root / "data"), target)
    return target, data


def config(out, data, **kw):
    base = dict(data=data, out=str(out), method="jakiro", num_experts=3, experts_per_token=2,
                draft_vocab_size=64, steps=6, batch_size=4, seq_len=64, lr=3e-3, warmup=2,
                eval_every=3, eval_records=2, eval_steps=2, checkpoint_every=2)
    base.update(kw)
    return TrainConfig(**base)


def weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.parametrize("method", ["eagle2", "jakiro"])
def test_steps_change_weights_and_lower_loss_on_a_fixed_batch(tmp_path, tiny_setup, method):
    target, data = tiny_setup
    trainer = Trainer(config(tmp_path / "run", data, method=method, warmup=1), target, progress=False)
    before = weights(trainer)
    batch = trainer.batch_indices(0)
    losses = []
    for _ in range(8):
        trainer.step = 0  # same lr, same noise, same batch every time
        losses.append(trainer.train_step(batch)["loss"])
    after = weights(trainer)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert losses[-1] < losses[0] * 0.9


def test_a_narrower_mlp_trains_saves_and_loads_at_its_width(tmp_path, tiny_setup):
    target, data = tiny_setup
    trainer = Trainer(config(tmp_path / "run", data, method="eagle2", intermediate_size=24, steps=2, warmup=1),
                      target, progress=False)
    trainer.run()
    tm = TargetModel.from_folder(target)
    assert trainer.model.down.shape[-1] == 24 and tm.config.intermediate_size != 24
    draft = load_draft(str(tmp_path / "run"), tm)
    assert draft.config.intermediate_size == 24
    for k, v in weights(trainer).items():
        assert torch.equal(draft.state_dict()[k].to(v.device), v), k


def test_kill_and_resume_gives_the_same_weights(tmp_path, tiny_setup):
    target, data = tiny_setup
    straight = Trainer(config(tmp_path / "a", data), target, progress=False)
    straight.run()
    interrupted = Trainer(config(tmp_path / "b", data), target, progress=False)
    interrupted.run(stop_after=3)  # checkpoint at step 2 and at the stop (step 3)
    del interrupted
    resumed = Trainer(config(tmp_path / "b", data), target, resume=True, progress=False)
    assert resumed.step == 3
    resumed.run()
    for k, v in weights(straight).items():
        torch.testing.assert_close(weights(resumed)[k], v, atol=1e-6, rtol=1e-6)
    log = json.load(open(tmp_path / "b" / "train_log.json"))
    assert len(log["heldout_top1_per_step"]) == 2
    assert os.path.exists(tmp_path / "b" / "train_plot.png")
    from jakiro.draft import load_draft
    draft = load_draft(str(tmp_path / "b"), TargetModel.from_folder(target))
    assert draft.config.method == "jakiro" and draft.config.draft_vocab_size == 64


def _ddp_worker(rank, world, port, target, data, out, result_file):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    trainer = Trainer(config(out, data, steps=3), target, progress=False, device="cpu")
    trainer.run()
    torch.save(weights(trainer), f"{result_file}.{rank}")
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_two_process_gloo_matches_single_process(tmp_path, tiny_setup):
    import torch.multiprocessing as mp
    target, data = tiny_setup
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = str(tmp_path / "w")
    mp.spawn(_ddp_worker, args=(2, port, target, data, str(tmp_path / "ddp"), result), nprocs=2)
    w0, w1 = torch.load(result + ".0"), torch.load(result + ".1")
    single = Trainer(config(tmp_path / "single", data, steps=3), target, progress=False)
    single.run()
    ref = weights(single)
    for k in ref:
        assert torch.equal(w0[k], w1[k]), k
        torch.testing.assert_close(w0[k], ref[k], atol=1e-5, rtol=1e-4)


def test_output_folder_with_a_different_run_is_refused(tmp_path, tiny_setup):
    target, data = tiny_setup
    Trainer(config(tmp_path / "run", data), target, progress=False).run(stop_after=1)
    with pytest.raises(JakiroError, match="already holds a different run"):
        Trainer(config(tmp_path / "run", data, lr=1e-4), target, progress=False)
    with pytest.raises(JakiroError, match="pass --resume"):
        Trainer(config(tmp_path / "run", data), target, progress=False)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(JakiroError, match="not empty and holds no jakiro run"):
        Trainer(config(tmp_path / "other", data), target, progress=False)
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


def test_resume_with_another_target_is_refused(tmp_path, tiny_setup):
    target, data = tiny_setup
    Trainer(config(tmp_path / "run", data), target, progress=False).run(stop_after=1)
    other = make_tiny_target(str(tmp_path / "wide"), "llama", hidden_size=96)
    with pytest.raises(JakiroError, match="was built for"):
        Trainer(config(tmp_path / "run", data), other, resume=True, progress=False)


def test_empty_and_malformed_datasets(tmp_path):
    from jakiro.data.conversations import iter_conversations
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
                   '{"messages": [oops\n')
    with pytest.raises(JakiroError, match=r"bad.jsonl:2: invalid JSON"):
        list(iter_conversations(str(bad)))
    no_assistant = tmp_path / "na.jsonl"
    no_assistant.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(JakiroError, match=r"na.jsonl:1: expected"):
        list(iter_conversations(str(no_assistant)))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(JakiroError, match="not a jakiro dataset"):
        from jakiro.train.feature_dataset import FeatureDataset
        FeatureDataset(str(empty))


def test_truncated_json_array_is_parsed_object_by_object(tmp_path):
    from jakiro.data.conversations import iter_json_array
    path = tmp_path / "t.json"
    path.write_text('[{"id": 1, "x": "a"}, {"id": 2, "x": "b, ]"},\n {"id": 3, "x": "trunc')
    assert [o["id"] for o in iter_json_array(str(path), chunk_size=7)] == [1, 2]


@pytest.mark.slow
def test_data_build_resumes_without_duplicating_records(tmp_path, monkeypatch):
    from jakiro.models import smallgemm
    from jakiro.train.dataset import DataConfig, build_dataset
    from jakiro.train.feature_dataset import FeatureDataset
    src = tmp_path / "conv.jsonl"
    write_conversations(src, [[("human", f"Question number {i}: what is {i} plus {i}?"),
                               ("gpt", f"{i} plus {i} is {2 * i}.")] for i in range(7)]
                        + [[("gpt", "starts with the assistant")]])
    fresh = build_dataset(str(tmp_path / "fresh"), DataConfig(None, str(src), max_records=6, shard_size=2),
                          progress=False)
    build_dataset(str(tmp_path / "resumed"), DataConfig(None, str(src), max_records=3, shard_size=2),
                  progress=False)
    resumed = build_dataset(str(tmp_path / "resumed"), DataConfig(None, str(src), max_records=6, shard_size=2),
                            progress=False)
    assert fresh["records"] == resumed["records"] == 6
    a, b = FeatureDataset(str(tmp_path / "fresh")), FeatureDataset(str(tmp_path / "resumed"))
    assert torch.equal(a.ids, b.ids) and torch.equal(a.offsets, b.offsets)
    torch.testing.assert_close(a.features, b.features)
    texts = [a.ids[a.offsets[i]:a.offsets[i + 1]] for i in range(len(a))]
    assert len({tuple(t.tolist()) for t in texts}) == 6  # no record twice
    with pytest.raises(JakiroError, match="different settings"):
        build_dataset(str(tmp_path / "resumed"), DataConfig(None, str(src), max_records=6, max_len=99),
                      progress=False)

    if smallgemm.int8_enabled() or smallgemm.tiles_enabled():  # int8 activations are another target
        monkeypatch.setenv("JAKIRO_INT8_ACTIVATIONS", "1")
        with pytest.raises(JakiroError, match="different settings"):
            build_dataset(str(tmp_path / "resumed"), DataConfig(None, str(src), max_records=6, shard_size=2),
                          progress=False)
        with pytest.raises(JakiroError, match="--int8-activations is the CPU kernels' computation"):
            build_dataset(str(tmp_path / "gpu"), DataConfig(None, str(src), device="meta"), progress=False)
        monkeypatch.delenv("JAKIRO_INT8_ACTIVATIONS")

    # --first-record: a new folder continues with the records another dataset left
    tail = build_dataset(str(tmp_path / "tail"), DataConfig(None, str(src), max_records=3, first_record=3,
                                                            shard_size=2), progress=False)
    assert tail["records"] == 3
    c = FeatureDataset(str(tmp_path / "tail"))
    assert torch.equal(c.ids, a.ids[a.offsets[3]:]) and torch.equal(c.offsets, a.offsets[3:] - a.offsets[3])
    with pytest.raises(JakiroError, match="different settings"):
        build_dataset(str(tmp_path / "tail"), DataConfig(None, str(src), max_records=3, first_record=2),
                      progress=False)
    with pytest.raises(JakiroError, match="fewer than 9 records"):
        build_dataset(str(tmp_path / "past"), DataConfig(None, str(src), first_record=9, skip_bad=True),
                      progress=False)
    assert not (tmp_path / "past").exists()
    with pytest.raises(JakiroError, match="--first-record applies to a source read as it is"):
        DataConfig(None, str(src), first_record=2, regenerate="greedy").check()
    with pytest.raises(JakiroError, match="--first-record must be >= 0"):
        DataConfig(None, str(src), first_record=-1).check()


def test_decoding_tau_during_training_is_real_greedy_decoding(tmp_path, tiny_setup, monkeypatch):
    """The learning curve's τ is what greedy decoding with the draft of that step achieves on the
    held-out prompts: rerunning the saved draft through an engine gives the same τ."""
    from helpers import CharTokenizer
    from jakiro.decoding.engine import Engine
    from jakiro.decoding.proposers import TreeBudget
    from jakiro.decoding.draft_proposer import DraftProposer
    from jakiro.draft import load_draft
    import jakiro.api
    monkeypatch.setattr(jakiro.api, "load_tokenizer", lambda folder: CharTokenizer())
    target, data = tiny_setup
    trainer = Trainer(config(tmp_path / "run", data, steps=4, tau_every=2, tau_prompts=2, tau_tokens=12,
                             eval_records=2), target, progress=False)
    trainer.run()
    assert [r["step"] for r in trainer.log if "tau" in r] == [2, 4]
    model = TargetModel.from_folder(target)
    engine = Engine(model, CharTokenizer(), DraftProposer(load_draft(str(tmp_path / "run"), model), TreeBudget()))
    committed = forwards = 0
    for i in trainer.eval_idx[:2]:
        ids, mask, _ = trainer.ds.record(i)
        m = engine.generate(ids[:int(torch.nonzero(mask)[0])].tolist(), 12).metrics
        committed, forwards = committed + m.committed, forwards + m.target_forwards
    assert trainer.log[-1]["tau"] == pytest.approx(committed / forwards)
    assert "tau" in json.load(open(tmp_path / "run" / "train_log.json"))["log"][-1]


def test_init_from_another_draft_starts_from_its_weights(tmp_path, tiny_setup):
    target, data = tiny_setup
    first = Trainer(config(tmp_path / "first", data, unroll=1), target, progress=False)
    first.run()
    second = Trainer(config(tmp_path / "second", data, unroll=2, init_from=str(tmp_path / "first")), target,
                     progress=False)
    for k, v in weights(first).items():
        assert torch.equal(weights(second)[k], v), k
    with pytest.raises(JakiroError, match=r"different draft \(differs in: .*method"):
        Trainer(config(tmp_path / "third", data, method="eagle2", init_from=str(tmp_path / "first")), target,
                progress=False)
    # the same model converted on another machine has another cache folder in its name
    path = tmp_path / "first" / "config.json"
    saved = json.loads(path.read_text())
    saved["jakiro"]["target_name"] += "-elsewhere"
    path.write_text(json.dumps(saved))
    fourth = Trainer(config(tmp_path / "fourth", data, unroll=1, init_from=str(tmp_path / "first")), target,
                     progress=False)
    assert torch.equal(weights(fourth)["fc.weight"], weights(first)["fc.weight"])


def test_jakiro_upcycled_from_an_eagle2_draft_drafts_as_it_does(tmp_path, tiny_setup):
    """--init-from an eagle2 draft for a jakiro run: shared layers copied, every expert a copy of
    the dense MLP, so every expert (and the blend) proposes what the dense draft proposes; a
    draft of another vocabulary size is refused, and the run then trains the experts apart."""
    target, data = tiny_setup
    dense = Trainer(config(tmp_path / "dense", data, method="eagle2", unroll=1), target, progress=False)
    dense.run()
    up = Trainer(config(tmp_path / "up", data, unroll=1, init_from=str(tmp_path / "dense")), target,
                 progress=False)
    for k, v in weights(dense).items():
        w = weights(up)[k]
        assert torch.equal(w, v.expand_as(w)), k  # gate_up/down: one copy per expert
    ids, _, feats = up.ds.record(up.eval_idx[0])
    ids, feats, pos = ids[None], feats[None].float(), torch.arange(len(ids) - 1)
    with torch.no_grad():
        a = dense.model.eval()(feats[:, :-1], ids[:, 1:], pos)
        b = up.model.eval()(feats[:, :-1], ids[:, 1:], pos)
    for e in range(b.features.shape[-2]):
        torch.testing.assert_close(b.features[..., e, :], a.blend, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.blend, a.blend, rtol=1e-5, atol=1e-5)
    assert up.evaluate()["top1"][0] == pytest.approx(dense.evaluate()["top1"][0])
    with pytest.raises(JakiroError, match="cannot upcycle: .* draft vocabulary 64"):
        Trainer(config(tmp_path / "other", data, unroll=1, draft_vocab_size=32, init_from=str(tmp_path / "dense")),
                target, progress=False)
    up.run()
    g = weights(up)["gate_up"]
    assert not torch.equal(g[0], g[1])


def test_warmup_beyond_steps_and_resume_beyond_steps_are_refused(tmp_path, tiny_setup):
    target, data = tiny_setup
    with pytest.raises(JakiroError, match="--warmup 6 must be below --steps 6"):
        Trainer(config(tmp_path / "w", data, warmup=6), target, progress=False)
    Trainer(config(tmp_path / "run", data, steps=3, warmup=1, unroll=1), target, progress=False).run()
    with pytest.raises(JakiroError, match="already at step 3, beyond --steps 2"):
        Trainer(config(tmp_path / "run", data, steps=2, warmup=1, unroll=1), target, resume=True, progress=False)
    ident = json.load(open(tmp_path / "run" / "run.json"))
    assert ident["unroll"] == 1 and ident["jakiro_loss"] == "separate"
    Trainer(config(tmp_path / "dense", data, steps=3, method="eagle2"), target, progress=False)
    assert "num_experts" not in json.load(open(tmp_path / "dense" / "run.json"))


def test_runs_written_before_multi_step_training_resume_as_single_step(tmp_path, tiny_setup):
    target, data = tiny_setup
    Trainer(config(tmp_path / "run", data, steps=3, warmup=1, method="eagle2", unroll=1), target,
            progress=False).run(stop_after=2)
    ident = json.load(open(tmp_path / "run" / "run.json"))
    for k in ("unroll", "step_decay", "init_from"):  # an earlier version's run.json ...
        del ident[k]
    ident.update(num_experts=1, experts_per_token=1, candidate_mode="decoupled", parallel_decoding=False)
    json.dump(ident, open(tmp_path / "run" / "run.json", "w"))
    resumed = Trainer(config(tmp_path / "run", data, steps=3, warmup=1, method="eagle2", unroll=1), target,
                      resume=True, progress=False)  # ... was single-step training
    assert resumed.step == 2
    with pytest.raises(JakiroError, match=r"differs in: unroll"):
        Trainer(config(tmp_path / "run", data, steps=3, warmup=1, method="eagle2", unroll=2), target,
                resume=True, progress=False)


@pytest.mark.parametrize("change, message", [
    (dict(steps=0), "--steps must be >= 1, got 0"),
    (dict(unroll=0), "--unroll must be >= 1, got 0"),
    (dict(batch_size=0), "--batch-size must be >= 1"),
    (dict(lr=0.0), "--lr must be > 0"),
    (dict(jakiro_loss="blend"), "unknown Jakiro loss 'blend'"),
    (dict(method="medusa"), "unknown draft method 'medusa'"),
    (dict(intermediate_size=-8), "--intermediate-size must be >= 0, got -8"),
])
def test_training_settings_are_checked_in_one_place(tmp_path, change, message):
    with pytest.raises(JakiroError, match=message):
        TrainConfig(data=str(tmp_path), out=str(tmp_path / "run"), **change).check()


@pytest.mark.parametrize("flag, value, message", [
    ("--steps", "0", "--steps must be >= 1, got 0"),
    ("--unroll", "0", "--unroll must be >= 1, got 0"),
    ("--lr", "-1", "--lr must be > 0"),
])
def test_train_command_refuses_bad_settings_before_creating_anything(tmp_path, capsys, flag, value, message):
    from jakiro.cli import main
    assert main(["train", "--data", str(tmp_path), "--out", str(tmp_path / "run"), flag, value]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_failed_first_build_leaves_no_folder_and_an_existing_one_stays(tmp_path):
    from jakiro.train.dataset import DataConfig, build_dataset
    with pytest.raises(JakiroError, match="dataset not found"):  # refused before the target loads
        build_dataset(str(tmp_path / "a"), DataConfig(None, source=str(tmp_path / "missing.jsonl")), progress=False)
    assert not (tmp_path / "a").exists()
    src = tmp_path / "empty.jsonl"
    src.write_text('{"messages": []}\n')
    with pytest.raises(JakiroError, match="at least one assistant turn"):
        build_dataset(str(tmp_path / "b"), DataConfig(None, source=str(src)), progress=False)
    assert not (tmp_path / "b").exists()
    (tmp_path / "c").mkdir()
    with pytest.raises(JakiroError, match="at least one assistant turn"):
        build_dataset(str(tmp_path / "c"), DataConfig(None, source=str(src)), progress=False)
    assert (tmp_path / "c").is_dir()


def test_skip_bad_skips_and_counts_malformed_lines(tmp_path):
    from jakiro.cli import build_parser
    from jakiro.data.conversations import iter_conversations
    from jakiro.train.dataset import DataConfig, build_dataset
    def good(question):
        return json.dumps({"messages": [{"role": "user", "content": question},
                                        {"role": "assistant", "content": "Hi!"}]}).encode()
    src = tmp_path / "mixed.jsonl"
    src.write_bytes(good("Say hi.") + b"\n{oops\n" + '{"messages": "caf\xe9"}'.encode("latin-1")
                    + b"\n\n" + good("Greet me.") + b"\n")
    with pytest.raises(JakiroError, match=r"mixed.jsonl:2: invalid JSON .*--skip-bad skips such lines"):
        list(iter_conversations(str(src)))
    skipped: list[int] = []
    assert [m is not None for m in iter_conversations(str(src), skipped)] == [True, False, False, True]
    assert skipped == [2, 3]
    args = build_parser().parse_args(["data", "--out", str(tmp_path / "d"), "--source", str(src), "--skip-bad"])
    assert args.skip_bad is True
    state = build_dataset(str(tmp_path / "d"), DataConfig(None, source=str(src), max_len=64, skip_bad=True),
                          progress=False)
    assert state["records"] == 2 and state["skipped_bad_lines"] == 2


def test_eval_draft_reproduces_the_trainers_heldout_metrics_and_tau(tmp_path, tiny_setup, capsys, monkeypatch):
    from helpers import CharTokenizer
    from jakiro.cli import main
    from jakiro.train.evaluate import evaluate_drafts
    import jakiro.api
    monkeypatch.setattr(jakiro.api, "load_tokenizer", lambda folder: CharTokenizer())
    target, data = tiny_setup
    cfg = config(tmp_path / "run", data, unroll=1, tau_every=6, tau_prompts=2, tau_tokens=8)
    trainer = Trainer(cfg, target, progress=False)
    trainer.run()
    last = trainer.log[-1]
    rows = evaluate_drafts(data, [cfg.out], target, prompts=2, tokens=8, eval_records=cfg.eval_records,
                           steps=cfg.eval_steps, seq_len=cfg.seq_len)
    assert rows[0]["top1"] == [round(x, 4) for x in last["eval"]["top1"]]
    assert rows[0]["contrastive_top1"] == [round(x, 4) for x in last["eval"]["contrastive_top1"]]
    assert rows[0]["tau_fixed_default_tree"] == round(last["tau"], 3)
    assert main(["eval-draft", "--target", target, "--data", data, "--prompts", "0", cfg.out]) == 0
    captured = capsys.readouterr()
    printed = json.loads(captured.out.strip().splitlines()[-1])
    assert printed["draft"] == cfg.out and "tau_fixed_default_tree" not in printed
    assert printed["heldout_records"] == 1  # the last 5 % of 12 records, at least one
    assert main(["eval-draft", "--target", target, "--data", data, "--prompts", "0", "--all-records", cfg.out]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["heldout_records"] == 12
    with pytest.raises(JakiroError, match="draft folder not found"):
        evaluate_drafts(data, [str(tmp_path / "nowhere")], target)


def test_several_dataset_folders_train_together_and_each_holds_out_its_last_records(tmp_path, tiny_setup):
    from jakiro.train.feature_dataset import FeatureDataset
    from jakiro.train.batches import heldout_split
    target, data = tiny_setup
    other = make_feature_dataset(str(tmp_path / "other"), target, n_records=40, seed=1)
    one, two = FeatureDataset(data), FeatureDataset(other)
    both = FeatureDataset(f"{data},{other}")
    assert both.parts == [len(one), len(two)] == [12, 40]
    assert len(both) == 52
    for i in (0, 11):
        assert all(torch.equal(a, b) for a, b in zip(both.record(i), one.record(i)))
    for i in (0, 39):
        assert all(torch.equal(a, b) for a, b in zip(both.record(12 + i), two.record(i)))
    assert both.token_counts[5] == one.token_counts.get(5, 0) + two.token_counts.get(5, 0)
    train, held = heldout_split(both.parts, eval_records=3)
    assert held == [11, 50, 51]  # at most 5 % of each part: 1 of 12, 2 of 40
    assert sorted(train + held) == list(range(52))
    assert heldout_split(12, 3) == (list(range(11)), [11])  # one folder: as before
    trainer = Trainer(config(tmp_path / "run", f"{data},{other}", steps=3, warmup=1, eval_every=3), target, progress=False)
    assert trainer.eval_idx == [11, 50, 51] and len(trainer.train_idx) == 49
    trainer.run()
    with open(tmp_path / "run" / "config.json") as f:
        assert json.load(f)["training"]["records"] == 49


def test_datasets_of_different_targets_are_not_mixed(tmp_path, tiny_setup):
    from jakiro.train.feature_dataset import FeatureDataset
    _, data = tiny_setup
    other = make_tiny_target(str(tmp_path / "target2"), "qwen2")
    folder = make_feature_dataset(str(tmp_path / "other"), other, n_records=4)
    with pytest.raises(JakiroError, match="different targets"):
        FeatureDataset(f"{data},{folder}")
    with pytest.raises(JakiroError, match="not a jakiro dataset"):
        FeatureDataset(f"{data},{tmp_path}")
