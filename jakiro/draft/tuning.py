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


def tuning_path(draft: str, cache: str | None = None, threads: int | None = None, *,
                quantized: bool, int8_activations: bool) -> str:
    """The record of ``draft`` tuned on this machine for a target that streams quantized weights
    (``quantized``) taking int8 inputs (``int8_activations``), or not."""
    from ..models import smallgemm
    threads = threads or torch.get_num_threads()
    kernels = "-amx" if smallgemm.tiles_enabled() else "-int8" if smallgemm.int8_enabled() else ""
    kind = f"quantized{kernels}{'-int8act' if int8_activations else ''}" if quantized else "smallgemm"
    kernel = f"{kind}-{smallgemm.build_id()}" if smallgemm.available() else "torch"
    return os.path.join(cache_dir(cache), "tuning", f"{weights_digest(draft)}-{threads}threads-{kernel}.json")


def load_tuning(draft: str, cache: str | None = None, *, quantized: bool, int8_activations: bool) -> dict | None:
    """The saved record for this draft at the current thread count (with ``path`` added), if any."""
    if draft is None or not os.path.exists(os.path.join(draft, "model.safetensors")):
        return None
    path = tuning_path(draft, cache, quantized=quantized, int8_activations=int8_activations)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise JakiroError(f"unreadable tuning file {path} for {draft}: {exc}") from None
    record["path"] = path
    return record


DEFAULT_TREE_KEY = "default_tree"
_TREE_FIELDS = ("depth", "top_k", "total_tokens", "draft_vocab", "parallel_decoding")


def default_tree(draft: str | None) -> dict | None:
    """The tree a draft's ``config.json`` recommends where this machine has no ``jakiro tune``
    record for it (``jakiro tune --save-default`` writes it: the tree tuned on the machine the
    draft was made on), or None."""
    if draft is None or not os.path.exists(os.path.join(draft, "config.json")):
        return None
    path = os.path.join(draft, "config.json")
    try:
        with open(path) as f:
            tree = json.load(f).get(DEFAULT_TREE_KEY)
    except (OSError, json.JSONDecodeError) as exc:
        raise JakiroError(f"cannot read draft config {path}: {exc}") from None
    if tree is None:
        return None
    ints = ("depth", "top_k", "total_tokens")
    if (not isinstance(tree, dict) or any(not isinstance(tree.get(k), int) or tree[k] < 1 for k in ints)
            or not (tree.get("draft_vocab") is None or (isinstance(tree["draft_vocab"], int) and tree["draft_vocab"] > 0))
            or tree.get("parallel_decoding") not in (None, True, False)):
        raise JakiroError(f"{path}: {DEFAULT_TREE_KEY} must give positive integers depth, top_k, total_tokens "
                          f"(and optionally draft_vocab, parallel_decoding true/false), got {tree!r}")
    return {k: tree.get(k) for k in _TREE_FIELDS}


def save_default_tree(draft: str, best: dict, note: str) -> None:
    """Write ``best`` (a tune record's choice) into the draft's config.json as its default tree."""
    path = os.path.join(draft, "config.json")
    with open(path) as f:
        data = json.load(f)
    data[DEFAULT_TREE_KEY] = {**{k: best.get(k) for k in _TREE_FIELDS}, "note": note}
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=2)
    os.replace(path + ".tmp", path)
