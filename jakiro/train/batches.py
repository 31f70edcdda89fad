"""A training set's batches: records padded to a common length with their input noise, the
held-out split, and the held-out measurements the trainer and ``jakiro eval-draft`` share."""

from __future__ import annotations

import torch

from ..errors import JakiroError
from .feature_dataset import FeatureDataset


def make_batch(ds: FeatureDataset, indices: list[int], seq_len: int, device,
               noise: float = 0.0, noise_seed: int = 0, featurizer=None) -> tuple:
    """Pad records to a common length: ids [B, T], feats [B, T, width] float32, mask [B, T] bool,
    and the input noise [B, T, d]. A record's noise depends only on (noise_seed, its index), so a
    batch is the same however it is split over processes and however often training resumes.
    A tokens-only dataset's features come from ``featurizer`` (a ``FeatureModel`` on ``device``),
    zero past each record's end as stored ones are."""
    recs = [ds.record(i) for i in indices]
    T = min(seq_len, max(r[0].shape[0] for r in recs))
    B, d = len(recs), ds.identity["hidden_size"]
    ids = torch.zeros(B, T, dtype=torch.long)
    stored = ds.features is not None
    feats = torch.zeros(B, T, ds.width) if stored else None  # wider than d with mid-layer streams
    mask = torch.zeros(B, T, dtype=torch.bool)
    lengths = torch.zeros(B, dtype=torch.long)
    noises = torch.zeros(B, T, d)
    for b, (i, m, f) in enumerate(recs):
        n = lengths[b] = min(T, i.shape[0])
        ids[b, :n], mask[b, :n] = i[:n], m[:n]
        if stored:
            feats[b, :n] = f[:n].float()
        if noise > 0:
            g = torch.Generator().manual_seed(noise_seed * 1_000_003 + indices[b])
            noises[b, :n] = (torch.rand(n, d, generator=g) - 0.5) * noise
    ids = ids.to(device)
    if stored:
        feats = feats.to(device)
    else:
        if featurizer is None:
            raise JakiroError(f"dataset {ds.folder} holds no features (jakiro data --tokens-only) and no target "
                              f"was given to compute them")
        feats = featurizer(ids, lengths)
    return ids, feats, mask.to(device), noises.to(device)


def heldout_split(parts: int | list[int], eval_records: int) -> tuple[list[int], list[int]]:
    """(training, held-out) record indices: of each part (the records of one dataset folder, in
    order), the last ``eval_records`` records, at most 5 %, are held out."""
    train, held = [], []
    start = 0
    for n_records in [parts] if isinstance(parts, int) else parts:
        n_eval = min(eval_records, max(1, n_records // 20))
        train += range(start, start + n_records - n_eval)
        held += range(start + n_records - n_eval, start + n_records)
        start += n_records
    return train, held


def heldout_tau(engine, ds: FeatureDataset, indices: list[int], tokens: int) -> float:
    """τ of greedy decoding with ``engine`` on the first user turn of each record in ``indices``
    (everything before the first answer token): committed tokens per target forward."""
    from ..decoding.engine import Metrics
    total = Metrics()
    for i in indices:
        ids, mask, _ = ds.record(i)
        start = int(torch.nonzero(mask)[0]) if mask.any() else len(ids)
        total.merge(engine.generate(ids[:start].tolist(), tokens).metrics)
    return total.tau


def heldout_batches(ds: FeatureDataset, indices: list[int], seq_len: int, device, size: int = 8, featurizer=None):
    for start in range(0, len(indices), size):
        ids, feats, mask, _ = make_batch(ds, indices[start:start + size], seq_len, device, featurizer=featurizer)
        yield ids, feats, mask
