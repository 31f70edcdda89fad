"""Tokens-only datasets (``jakiro data --tokens-only``) and features computed while training
(``models.features.FeatureModel``), and training for a time budget (``--minutes``)."""

import json
import os

import pytest
import torch

from helpers import make_tiny_target, write_conversations
from jakiro.errors import JakiroError
from jakiro.models.features import FeatureModel
from jakiro.models.target import TargetModel
from jakiro.train.config import TrainConfig
from jakiro.train.dataset import STATE_FILE, _write_shard
from jakiro.train.feature_dataset import FeatureDataset
from jakiro.train.batches import make_batch
from jakiro.train.trainer import CALIBRATION_STEPS, Trainer
from test_train import config, make_feature_dataset, weights

AUX = (1, 3)


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """A tiny four-layer target, a dataset with its features and the streams after layers 1 and
    3, and the same records as a tokens-only dataset."""
    root = tmp_path_factory.mktemp("online")
    target = make_tiny_target(str(root / "target"), "llama", num_hidden_layers=4)
    stored = make_feature_dataset(str(root / "stored"), target, aux_layers=AUX)
    return target, stored, tokens_only_copy(stored, str(root / "tokens"))


def tokens_only_copy(folder: str, out: str) -> str:
    """The records of a dataset folder as ``--tokens-only`` stores them."""
    ds = FeatureDataset(folder)
    os.makedirs(out)
    half = len(ds) // 2
    records = [(ds.record(i)[0].tolist(), ds.record(i)[1].int().tolist(), None) for i in range(len(ds))]
    with open(os.path.join(folder, STATE_FILE)) as f:
        state = json.load(f)
    state["identity"]["tokens_only"] = True
    state["shards"] = [_write_shard(out, 0, records[:half]), _write_shard(out, 1, records[half:])]
    with open(os.path.join(out, STATE_FILE), "w") as f:
        json.dump(state, f)
    return out


def test_feature_model_gives_the_runtimes_features_for_a_padded_batch(deep):
    target_dir = deep[0]
    runtime = TargetModel.from_folder(target_dir)
    model = FeatureModel(target_dir, AUX)
    assert model.width == 3 * runtime.config.hidden_size
    g = torch.Generator().manual_seed(3)
    long, short = torch.randint(2, 256, (30,), generator=g), torch.randint(2, 256, (17,), generator=g)
    ids = torch.zeros(2, 30, dtype=torch.long)
    ids[0], ids[1, :17] = long, short
    ids[1, 17:] = 7  # padding after a sequence changes nothing before it
    got = model(ids)
    # with the lengths, each sequence runs without its padding (on the CPU), which comes back as zeros
    by_length = model(ids, torch.tensor([30, 17]))
    assert by_length.shape == got.shape and not by_length[1, 17:].any()
    for row, seq in ((0, long), (1, short)):
        _, want = runtime(seq, runtime.new_cache(len(seq)), aux_layers=AUX)
        torch.testing.assert_close(got[row, :len(seq)], want, atol=1e-4, rtol=1e-3)  # float32 sums in another order
        torch.testing.assert_close(by_length[row, :len(seq)], want, atol=1e-4, rtol=1e-3)
    with pytest.raises(JakiroError, match="increasing layer counts"):
        FeatureModel(target_dir, (3, 1))


def test_a_tokens_only_dataset_trains_as_its_stored_features_do(tmp_path, deep):
    target, stored, tokens = deep
    ds = FeatureDataset(tokens)
    assert ds.features is None and ds.tokens_only and ds.aux_layers == AUX
    assert torch.equal(ds.ids, FeatureDataset(stored).ids)
    runs = []
    for name, data in (("stored", stored), ("tokens", tokens)):
        trainer = Trainer(config(tmp_path / name, data, method="eagle2", unroll=2, aux_layers="1,3", steps=4,
                                 eval_every=4), target, progress=False)
        assert (trainer.featurizer is None) == (name == "stored")
        losses = [trainer.train_step(trainer.batch_indices(s))["loss"] for s in range(3)]
        runs.append((losses, trainer.evaluate(), weights(trainer)))
    (loss_a, eval_a, w_a), (loss_b, eval_b, w_b) = runs
    # the stored features are float16: the same training within its rounding
    assert loss_b == pytest.approx(loss_a, rel=2e-3)
    assert eval_b["top1"] == pytest.approx(eval_a["top1"], abs=0.02)
    for k in w_a:
        torch.testing.assert_close(w_b[k], w_a[k], atol=2e-3, rtol=2e-2)


def test_tokens_only_and_stored_features_are_not_mixed_and_need_a_target(deep):
    _, stored, tokens = deep
    with pytest.raises(JakiroError, match="differ in holding features"):
        FeatureDataset(f"{stored},{tokens}")
    with pytest.raises(JakiroError, match="holds no features"):
        make_batch(FeatureDataset(tokens), [0, 1], 64, "cpu")


def test_data_build_with_tokens_only_stores_what_the_features_build_does(tmp_path):
    """The default target: the tokens and masks of a normal build, no features; the feature
    model then gives the features the normal build stored (float16)."""
    from jakiro.models.hub import resolve_target
    from jakiro.train.dataset import DataConfig, build_dataset
    src = tmp_path / "conv.jsonl"
    write_conversations(src, [[("human", f"What is {i} times {i + 2}?"), ("gpt", f"{i} times {i + 2} is {i * (i + 2)}.")]
                              for i in range(3)])
    full = DataConfig(None, str(src), max_records=3, aux_layers="3")
    build_dataset(str(tmp_path / "full"), full, progress=False)
    only = DataConfig(None, str(src), max_records=3, aux_layers="3", tokens_only=True)
    state = build_dataset(str(tmp_path / "only"), only, progress=False)
    assert state["identity"]["tokens_only"] and state["records"] == 3
    a, b = FeatureDataset(str(tmp_path / "full")), FeatureDataset(str(tmp_path / "only"))
    assert torch.equal(a.ids, b.ids) and torch.equal(a.mask, b.mask) and torch.equal(a.offsets, b.offsets)
    assert b.features is None and b.width == a.features.shape[1]
    model = FeatureModel(resolve_target(), (3,))
    for i in range(3):
        ids, _, want = a.record(i)
        got = model(ids.unsqueeze(0))[0]
        torch.testing.assert_close(got.half().float(), want.float(), atol=2e-2, rtol=1e-2)


def test_minutes_sets_the_step_count_from_the_first_steps(tmp_path, deep):
    target, stored, _ = deep
    # a budget spent before the pace is known: the run ends right after the timed steps, finished
    trainer = Trainer(config(tmp_path / "short", stored, method="eagle2", steps=500, warmup=2, eval_every=100,
                             minutes=1e-4), target, progress=False)
    assert trainer.run()["steps"] == CALIBRATION_STEPS + 2
    with open(tmp_path / "short" / "config.json") as f:
        assert json.load(f)["training"]["steps"] == CALIBRATION_STEPS + 2
    # a budget beyond what --steps needs: --steps stays the bound
    roomy = Trainer(config(tmp_path / "roomy", stored, method="eagle2", steps=14, warmup=2, eval_every=7,
                           minutes=30), target, progress=False)
    assert roomy.run()["steps"] == 14
    with pytest.raises(JakiroError, match="--minutes must be >= 0"):
        TrainConfig(data=stored, out=str(tmp_path / "bad"), minutes=-1).check()
