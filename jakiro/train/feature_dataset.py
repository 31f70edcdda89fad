"""A training set from ``jakiro data`` (one folder or several): its records' token ids, loss masks
and target features (or tokens only, featurized per batch), checked against the target and
draft it trains."""

from __future__ import annotations

import os

import torch

from ..errors import JakiroError
from .dataset import STATE_FILE, _read_state, _target_keys


class FeatureDataset:
    """All records of one or more built datasets in memory: ids [N] int64, mask [N] bool,
    features [N, width] (float16; None for datasets built with ``--tokens-only``), and per-record
    offsets. ``folders``: a folder, a list of them, or
    a comma-separated string (``--data A,B``); they must have been built for the same target,
    and ``parts`` says how many records each contributed, in order."""

    def __init__(self, folders: str | list[str]):
        from safetensors.torch import load_file
        if isinstance(folders, str):
            folders = [f for f in folders.split(",") if f]
        if not folders:
            raise JakiroError("no dataset folder given")
        self.folder = ",".join(folders)
        ids, masks, feats, offsets = [], [], [], [0]
        self.parts: list[int] = []
        self.token_counts: dict[int, int] = {}
        for folder in folders:
            state = _read_state(folder)
            if state is None:
                raise JakiroError(f"{folder} is not a jakiro dataset (no {STATE_FILE}); build one with `jakiro data`")
            if not state["shards"]:
                raise JakiroError(f"dataset {folder} is empty")
            ident = state["identity"]
            if self.parts and _target_keys(ident) != _target_keys(self.identity):
                raise JakiroError(f"datasets {folders[0]} and {folder} were built for different targets "
                                  f"({self.identity['target_name']} and {ident['target_name']})")
            if self.parts and bool(ident.get("tokens_only")) != self.tokens_only:
                raise JakiroError(f"datasets {folders[0]} and {folder} differ in holding features (one was built "
                                  f"with jakiro data --tokens-only); build them alike")
            if self.parts and ident.get("aux_layers", []) != self.identity.get("aux_layers", []):
                raise JakiroError(f"datasets {folders[0]} and {folder} hold different mid-layer streams "
                                  f"({self.identity.get('aux_layers', [])} and {ident.get('aux_layers', [])}); "
                                  f"build them with the same jakiro data --aux-layers")
            if not self.parts:
                self.identity = ident
                self.tokens_only = bool(ident.get("tokens_only"))
            records = len(offsets)
            for name in state["shards"]:
                try:
                    shard = load_file(os.path.join(folder, name))
                except Exception as exc:
                    raise JakiroError(f"cannot read dataset shard {name} of {folder}: {exc}") from None
                base = offsets[-1]
                ids.append(shard["input_ids"].long())
                masks.append(shard["loss_mask"].bool())
                if not self.tokens_only:
                    feats.append(shard["features"])
                offsets.extend((shard["offsets"][1:] + base).tolist())
            self.parts.append(len(offsets) - records)
            for k, v in state["token_counts"].items():
                self.token_counts[int(k)] = self.token_counts.get(int(k), 0) + v
        self.ids = torch.cat(ids)
        self.mask = torch.cat(masks)
        # float16, converted per batch; None for tokens-only datasets (the trainer computes them)
        self.features = torch.cat(feats) if feats else None
        self.offsets = torch.tensor(offsets)

    @property
    def aux_layers(self) -> tuple[int, ...]:
        """The layers whose residual streams follow each token's final feature (``jakiro data --aux-layers``)."""
        return tuple(self.identity.get("aux_layers", ()))

    def check_draft(self, draft_config) -> None:
        """Refuse a draft that reads mid-layer streams this dataset does not hold."""
        if draft_config.aux_layers and tuple(draft_config.aux_layers) != self.aux_layers:
            held = f"the streams after layers {list(self.aux_layers)}" if self.aux_layers else "no mid-layer streams"
            raise JakiroError(f"the draft reads the target's residual streams after layers {draft_config.aux_layers} "
                              f"but dataset {self.folder} holds {held}; rebuild it with "
                              f"jakiro data --aux-layers {','.join(map(str, draft_config.aux_layers))}")

    def check_target(self, target) -> None:
        """Refuse a target whose features or vocabulary differ from the one this dataset was built
        with (a TargetModel)."""
        ident, cfg = self.identity, target.config
        if (ident["hidden_size"], ident["vocab_size"]) != (cfg.hidden_size, cfg.vocab_size):
            raise JakiroError(f"dataset {self.folder} was built for {ident['target_name']} "
                              f"(hidden {ident['hidden_size']}, vocab {ident['vocab_size']}), "
                              f"not for this target ({cfg.name})")

    def __len__(self) -> int:
        return self.offsets.shape[0] - 1

    @property
    def width(self) -> int:
        """Feature values per token: the final feature, then each mid-layer stream."""
        return (1 + len(self.aux_layers)) * self.identity["hidden_size"]

    def featurizer(self, target_dir: str, device: str | torch.device = "cpu"):
        """What computes this dataset's features per batch: None where they are stored, else the
        target's decoder stack (``FeatureModel``) on ``device``, with the streams the data names."""
        if self.features is not None:
            return None
        from ..models.features import FeatureModel
        return FeatureModel(target_dir, self.aux_layers, device)

    def record(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.ids[a:b], self.mask[a:b], None if self.features is None else self.features[a:b]

    def frequent_tokens(self, n: int) -> torch.Tensor:
        """The n most frequent token ids (ties by id); pads with the lowest unused ids."""
        ranked = sorted(self.token_counts, key=lambda t: (-self.token_counts[t], t))[:n]
        if len(ranked) < n:
            seen = set(ranked)
            ranked += [t for t in range(self.identity["vocab_size"]) if t not in seen][: n - len(ranked)]
        return torch.tensor(ranked, dtype=torch.long)
