"""Draft checkpoints: a folder with config.json and model.safetensors, validated on load."""

from __future__ import annotations

import json
import os

import torch

from ..errors import JakiroError
from .config import DraftConfig
from .eagle3_format import EMBEDDING, is_eagle3_folder, read_eagle3
from .model import DraftModel


def save_draft(model: DraftModel, folder: str, extra: dict | None = None) -> None:
    from safetensors.torch import save_file
    os.makedirs(folder, exist_ok=True)
    cfg = model.config.to_json_dict()
    if extra:
        cfg.update(extra)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    tmp = os.path.join(folder, "model.safetensors.tmp")
    save_file(state, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def read_draft_config(folder: str) -> DraftConfig:
    """A draft folder's config: jakiro's own, or an EAGLE-3 folder in the public layout (one that
    does not name its streams needs its target: ``load_draft``)."""
    path = os.path.join(folder, "config.json")
    if not os.path.isdir(folder):
        raise JakiroError(f"draft folder not found: {folder}")
    if not os.path.exists(path):
        raise JakiroError(f"{folder} is not a draft checkpoint (no config.json)")
    if is_eagle3_folder(folder):
        return read_eagle3(folder, weights=False)[0]
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise JakiroError(f"cannot read draft config {path}: {exc}") from None
    return DraftConfig.from_json_dict(data)


def draft_method(folder: str) -> str:
    """The method a draft folder runs (``eagle3`` for an EAGLE-3 folder in the public layout)."""
    return "eagle3" if is_eagle3_folder(folder) else read_draft_config(folder).method


def check_compatible(config: DraftConfig, target_config) -> None:
    """A draft only works with the target whose features and vocabulary it was trained on."""
    problems = []
    if config.hidden_size != target_config.hidden_size:
        problems.append(f"hidden size {config.hidden_size} != target's {target_config.hidden_size}")
    if config.vocab_size != target_config.vocab_size:
        problems.append(f"vocabulary {config.vocab_size} != target's {target_config.vocab_size}")
    if config.aux_layers and max(config.aux_layers) >= target_config.num_layers:
        problems.append(f"it reads the residual stream after layer {max(config.aux_layers)}, the target has "
                        f"{target_config.num_layers} decoder layers")
    if problems:
        name = f" ({config.target_name})" if config.target_name else ""
        raise JakiroError(f"draft does not match the target: {'; '.join(problems)}; "
                          f"it was trained for another model{name}")


def load_draft(folder: str, target=None) -> DraftModel:
    """Load and validate a draft; with ``target`` (a TargetModel) check it matches and attach the
    target's embedding and LM head."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if is_eagle3_folder(folder):  # trained elsewhere, in the layout vLLM, SGLang and llama.cpp load
        config, state = read_eagle3(folder, None if target is None else target.config)
        embedding = state.pop(EMBEDDING, None)
        if target is not None:
            check_compatible(config, target.config)
            if embedding is not None:
                _check_embedding(folder, embedding, target)
        return _finish(DraftModel(config), state, target)
    config = read_draft_config(folder)
    if target is not None:
        check_compatible(config, target.config)
    weights = os.path.join(folder, "model.safetensors")
    if not os.path.exists(weights):
        raise JakiroError(f"draft weights missing: {weights}")
    try:
        state = load_file(weights)
    except (SafetensorError, OSError, ValueError) as exc:
        raise JakiroError(f"corrupted draft weights {weights}: {exc}") from None
    return _finish(DraftModel(config), state, target)


def _check_embedding(folder: str, embedding: torch.Tensor, target) -> None:
    """A draft that carries a token embedding runs on the target's: they must be the same (to
    the rounding of a bfloat16 checkpoint)."""
    own = target.dense_embedding()
    if tuple(embedding.shape) != tuple(own.shape):
        raise JakiroError(f"{folder}: its own token embedding is {tuple(embedding.shape)}, the target's "
                          f"{tuple(own.shape)}: it was trained for another model")
    if (embedding.float() - own).abs().max() > 1e-2 * own.abs().max():
        raise JakiroError(f"{folder}: its own token embedding differs from the target's (jakiro drafts with the "
                          f"target's embedding): it was trained for another model or trained its embedding")


def _finish(model: DraftModel, state: dict, target) -> DraftModel:
    """Check ``state`` against the model its config describes, load it and attach the target."""
    config = model.config
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing)}")
        if unexpected:
            parts.append(f"unexpected {', '.join(unexpected)}")
        raise JakiroError(f"draft weights do not match its config.json: {'; '.join(parts)}")
    for key, tensor in state.items():
        if tensor.shape != expected[key].shape:
            raise JakiroError(f"draft weight {key} has shape {tuple(tensor.shape)}, "
                              f"config says {tuple(expected[key].shape)}")
    model.load_state_dict(state)
    if config.draft_vocab_size is not None and int(model.d2t.max()) >= config.vocab_size:
        raise JakiroError("draft vocabulary map points outside the target vocabulary")
    model.eval()
    if target is not None:
        model.attach_target(target.embed, target.head_rows, target.lm_head.quantized)
        model.quantized = target.quantized_matrices > 0
    return model
