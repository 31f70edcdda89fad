"""The tree chosen by ``jakiro tune`` for a draft on this machine: one record per draft weights
(by content, so a copied or moved draft keeps it and retrained weights do not) and thread count
(a tree measured with two threads is not the best with one) and kernel build, quantized weights
included (the best tree depends on what a tree forward costs)."""

from __future__ import annotations

import hashlib
import json
import os

import torch

from ..errors import JakiroError
from ..models.hub import cache_dir


def weights_digest(draft: str) -> str:
    """sha256 of the draft's weights file (first 16 hex digits)."""
    h = hashlib.sha256()
    with open(os.path.join(draft, "model.safetensors"), "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def tuning_path(draft: str, cache: str | None = None, threads: int | None = None,
                quantized: bool | None = None) -> str:
    """``quantized``: whether the target streams quantized weights (default: on unless ``JAKIRO_QUANTIZED=0``)."""
    from ..models import quant, smallgemm
    threads = threads or torch.get_num_threads()
    quantized = quant.enabled() if quantized is None else quantized
    kind = ("quantized-amx" if smallgemm.tiles_enabled() else "quantized") if quantized else "smallgemm"
    kernel = f"{kind}-{smallgemm.build_id()}" if smallgemm.available() else "torch"
    return os.path.join(cache_dir(cache), "tuning", f"{weights_digest(draft)}-{threads}threads-{kernel}.json")


def load_tuning(draft: str, cache: str | None = None, quantized: bool | None = None) -> dict | None:
    """The saved record for this draft at the current thread count (with ``path`` added), if any."""
    if draft is None or not os.path.exists(os.path.join(draft, "model.safetensors")):
        return None
    path = tuning_path(draft, cache, quantized=quantized)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise JakiroError(f"unreadable tuning file {path} for {draft}: {exc}") from None
    record["path"] = path
    return record
