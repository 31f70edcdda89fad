"""Mid-layer draft inputs (``--aux-layers``): the target's residual streams after chosen decoder
layers, returned by every forward path as Hugging Face computes them, kept in datasets, trained
into the first draft step's input, and lossless in decoding."""

import pytest
import torch

from helpers import make_tiny_target
from jakiro.decoding.engine import Engine
from jakiro.decoding.proposers import TreeBudget
from jakiro.decoding.draft_proposer import DraftProposer
from jakiro.draft import DraftConfig, DraftModel, load_draft, save_draft
from jakiro.errors import JakiroError
from jakiro.models.target import TargetModel
from jakiro.train.config import TrainConfig, parse_layers
from jakiro.train.feature_dataset import FeatureDataset
from jakiro.train.trainer import Trainer
from test_speculative_greedy import N_TOKENS, assert_same
from test_train import config, make_feature_dataset, weights

AUX = (1, 3)


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """A tiny four-layer target and a dataset holding the streams after layers 1 and 3."""
    root = tmp_path_factory.mktemp("mid")
    target = make_tiny_target(str(root / "target"), "llama", num_hidden_layers=4)
    return target, make_feature_dataset(str(root / "data"), target, aux_layers=AUX)


def test_every_forward_path_returns_the_streams_hugging_face_computes(deep):
    from transformers import AutoModelForCausalLM
    folder, _ = deep
    m = TargetModel.from_folder(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    d = m.config.hidden_size
    ids = torch.randint(2, 256, (30,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = hf(ids[None], output_hidden_states=True).hidden_states  # [0] = embeddings
    want = torch.cat([hidden[a][0] for a in AUX], -1)

    plain_cache, cache = m.new_cache(40), m.new_cache(40)
    _, plain = m(ids[:24], plain_cache)
    logits, wide = m(ids[:24], cache, aux_layers=AUX)  # a prompt
    assert wide.shape == (24, 3 * d)
    assert torch.equal(wide[:, :d], plain)  # the final feature is untouched
    torch.testing.assert_close(wide[:, d:], want[:24], rtol=1e-4, atol=1e-4)
    cache.commit(24)
    rows = []
    for i in range(24, 27):  # one token at a time (the small-batch path where it exists)
        _, f = m(ids[i:i + 1], cache, aux_layers=AUX)
        cache.commit(1)
        rows.append(f)
    _, tree = m(ids[27:30], cache, aux_layers=AUX, position_ids=torch.arange(27, 30),
                tree_mask=torch.ones(3, 3, dtype=torch.bool).tril())  # a chain as a tree
    rows.append(tree)
    torch.testing.assert_close(torch.cat(rows)[:, d:], want[24:], rtol=1e-4, atol=1e-4)

    batch = m.new_batch_cache(2, 8)
    for i in range(4):  # batched decoding: two sequences, the first is ids[:4]
        _, f = m.decode_batch(torch.stack((ids[i], ids[i + 10])), batch, aux_layers=AUX)
        batch.advance()
        torch.testing.assert_close(f[0, d:], want[i], rtol=1e-4, atol=1e-4)
    for bad in [(3, 1), (0,), (4,)]:
        with pytest.raises(JakiroError, match="increasing layer counts in 1..3"):
            m(ids[:2], m.new_cache(4), aux_layers=bad)


def _aux_draft(root, target, name, scale):
    cfg = DraftConfig.for_target(target.config, target.hf_config, "eagle2", aux_layers=[1])
    torch.manual_seed(7)
    model = DraftModel(cfg)
    model.reset_parameters(std=0.3)
    with torch.no_grad():
        model.aux_proj.weight.normal_(std=scale)
    save_draft(model, str(root / name))
    return load_draft(str(root / name), target)


@pytest.mark.slow
def test_decoding_with_mid_layer_inputs_is_lossless_and_reads_them(tiny):
    """Greedy output equals plain decoding; a zero map drafts exactly as the draft without
    mid-layer inputs, a non-zero one drafts differently."""
    root, target, tok, prompts, reference = tiny
    budget = TreeBudget(4, 2, 8)

    def accepted(draft):
        engine = Engine(target, tok, DraftProposer(draft, budget))
        return [(lambda m: m.committed - m.target_forwards)(engine.generate(p, N_TOKENS).metrics) for p in prompts[:4]]

    strong = _aux_draft(root, target, "aux-strong", 0.3)
    assert strong.config.aux_layers == [1] and strong.feature_width == 2 * target.config.hidden_size
    assert_same(Engine(target, tok, DraftProposer(strong, budget)), prompts, reference)
    zero = _aux_draft(root, target, "aux-zero", 0.0)
    plain = DraftModel(DraftConfig.for_target(target.config, target.hf_config, "eagle2"))
    plain.load_state_dict({k: v for k, v in zero.state_dict().items() if k != "aux_proj.weight"})
    plain.attach_target(target.embed, target.lm_head.weight).eval()
    assert accepted(zero) == accepted(plain)
    assert accepted(strong) != accepted(zero)


def test_training_learns_the_mid_layer_map_and_checks_the_data(tmp_path, deep):
    target, data = deep
    trainer = Trainer(config(tmp_path / "mid", data, method="eagle2", unroll=2, aux_layers="1,3"), target,
                      progress=False)
    assert not trainer.model.aux_proj.weight.any()  # starts as the draft without mid-layer inputs
    trainer.run()
    assert trainer.model.aux_proj.weight.abs().sum() > 0
    draft = load_draft(str(tmp_path / "mid"), TargetModel.from_folder(target))
    assert draft.config.aux_layers == [1, 3]
    # a draft without mid-layer inputs trains on such data too (it reads the final feature), and
    # one may gain them from --init-from (the map starts at zero, the rest is copied)
    plain = Trainer(config(tmp_path / "plain", data, method="eagle2", unroll=1), target, progress=False)
    plain.run()
    grown = Trainer(config(tmp_path / "grown", data, method="eagle2", unroll=1, aux_layers="1,3",
                           init_from=str(tmp_path / "plain")), target, progress=False)
    assert grown.evaluate()["top1"] == pytest.approx(plain.evaluate()["top1"])
    assert torch.equal(weights(grown)["fc.weight"], weights(plain)["fc.weight"])
    with pytest.raises(JakiroError, match=r"after layers \[1, 3\]; this run's --aux-layers is none"):
        Trainer(config(tmp_path / "x", data, method="eagle2", init_from=str(tmp_path / "mid")), target,
                progress=False)
    with pytest.raises(JakiroError, match="holds the streams after layers \\[1, 3\\]; rebuild it with "
                                          "jakiro data --aux-layers 2"):
        Trainer(config(tmp_path / "y", data, method="eagle2", aux_layers="2"), target, progress=False)
    flat = make_feature_dataset(str(tmp_path / "flat"), target, n_records=4)
    with pytest.raises(JakiroError, match="holds no mid-layer streams"):
        Trainer(config(tmp_path / "z", flat, method="eagle2", aux_layers="1,3"), target, progress=False)
    with pytest.raises(JakiroError, match="hold different mid-layer streams"):
        FeatureDataset(f"{data},{flat}")
    shallow = make_tiny_target(str(tmp_path / "shallow"), "llama", num_hidden_layers=2)
    with pytest.raises(JakiroError, match="reads the residual stream after layer 3, the target has 2 decoder layers"):
        load_draft(str(tmp_path / "mid"), TargetModel.from_folder(shallow))


@pytest.mark.parametrize("text, message", [("3,x", "comma-separated layer counts"),
                                           ("15,3", "increasing layer counts"), ("0", "increasing layer counts")])
def test_bad_layer_lists_are_refused(tmp_path, text, message):
    with pytest.raises(JakiroError, match=message):
        parse_layers(text)
    with pytest.raises(JakiroError, match=message):
        TrainConfig(data="d", out=str(tmp_path), aux_layers=text).check()
    assert parse_layers("") == () and parse_layers("3, 15") == (3, 15)
