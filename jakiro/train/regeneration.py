"""Regeneration: the target answers a source's prompts itself (``--regenerate greedy|sample``),
its answers replace the source's, and the features of its own forwards are kept beside the file
for the dataset to reuse."""

from __future__ import annotations

import json
import os

import torch

from ..data.conversations import TARGET_PROMPTS_SOURCE, iter_conversations
from ..errors import JakiroError
from .config import DataConfig
from .records import _admitted, tokenize_conversation

DROPS_IN_A_ROW = 100  # (plus 20 per slot) unanswered conversations in a row that stop a regeneration
FEATURES_PREFIX = "regenerated-features-"  # features that came out of the regeneration's own forwards
FEATURE_GROUP = 64  # conversations per such file


def regenerate_conversations(jk, cfg: DataConfig, path: str, prompt_filter, progress: bool = True,
                             target=None) -> dict:
    """Append the target's own answers to ``cfg.source``'s conversations to ``path`` (JSONL)
    until it holds ``cfg.max_records`` conversations; resumes from what the file holds. The
    features of each finished conversation, taken in the same forwards, are kept next to it
    (``FEATURES_PREFIX`` files, keyed by the line), so the dataset pass need not compute them
    (not for a tokens-only dataset). ``target``: what generates (default ``jk.target``; a
    ``DeviceTarget`` on a GPU)."""
    from ..data.regenerate import Regenerator, read_done

    done = read_done(path)
    if len(done) >= cfg.max_records:
        return {"conversations": 0, "already_regenerated": len(done)}
    skipped: list[int] | None = [] if cfg.skip_bad else None
    # prompts the target writes pass the filter once written (``Regenerator``'s admit), the
    # kept ones of an earlier run included, so that a resumed run repeats none of them
    admit, job_filter = None, prompt_filter
    if cfg.source == TARGET_PROMPTS_SOURCE and prompt_filter is not None:
        for messages in iter_conversations(path) if done else ():
            prompt_filter.admit(messages)
        admit, job_filter = prompt_filter.admit, None
    run = _Run(cfg, path, done, _admitted(cfg.source, job_filter, skipped), progress)
    tokenize = lambda messages: tokenize_conversation(jk.tokenizer, messages, cfg.max_len)  # noqa: E731
    regen = Regenerator(target if target is not None else jk.target, jk.tokenizer, jk.engine("ar").eos_ids,
                        cfg.regen_settings(), tokenize=tokenize, collect=None if cfg.tokens_only else run.collect,
                        admit=admit)
    with open(path, "a", encoding="utf-8") as run.file:
        stats = regen.run(run, run.write, run.on_step, run.dropped)
    run.close()
    report = stats.as_dict()
    if prompt_filter is not None:
        report.update(removed_evaluation=prompt_filter.contaminated, removed_duplicates=prompt_filter.duplicates)
    if skipped is not None:
        report["skipped_bad_lines"] = len(skipped)
    return report


class _Run:
    """One regeneration run's bookkeeping: the jobs a free slot takes next (an iterator that
    yields nothing while the conversations asked for are written or in flight, though a later
    one that ends unanswered frees its place: unlike a generator it goes on after a
    StopIteration), the lines it appends, the features it groups into files, its progress bar."""

    def __init__(self, cfg: DataConfig, path: str, done: set[int], records, progress: bool):
        from tqdm import tqdm
        self.cfg, self.path, self.done, self.records = cfg, path, done, records
        self.written, self.in_flight, self.streak, self.last_line = len(done), 0, 0, -1
        self.folder = os.path.dirname(path)
        self.group: list[tuple[int, list[int], list[int], torch.Tensor]] = []
        self.file = None
        self.bar = tqdm(total=cfg.max_records, initial=self.written, desc="regenerate", unit="conv",
                        disable=not progress)

    def __iter__(self):
        return self

    def __next__(self) -> tuple[int, list[dict]]:
        if self.written + self.in_flight >= self.cfg.max_records:
            raise StopIteration
        for index, messages in self.records:
            if messages is not None and index not in self.done:
                self.in_flight += 1
                return index, messages
        raise StopIteration

    def collect(self, record, ids, mask, features) -> None:
        self.group.append((self.last_line, ids, mask, features))
        if len(self.group) == FEATURE_GROUP:
            _write_feature_group(self.folder, self.group)

    def write(self, record: dict) -> None:
        try:
            self.file.write(json.dumps(record, ensure_ascii=False) + "\n")
            self.file.flush()
        except OSError as exc:
            raise JakiroError(f"cannot append to {self.path}: {exc.strerror or exc}; the conversations "
                              f"already written are kept, rerun the same command to resume") from None
        self.last_line = self.written
        self.written += 1
        self.streak = 0
        self.in_flight -= 1
        self.bar.update(1)

    def on_step(self, stats) -> None:
        self.bar.set_postfix(tok_s=f"{stats.tokens_per_s:.0f}", cut=stats.cut_tokens, refresh=False)

    def dropped(self, index: int) -> None:
        """A conversation ended without an answer: another job takes its place."""
        self.in_flight -= 1
        self.streak += 1
        if self.streak > DROPS_IN_A_ROW + 20 * self.cfg.regen_batch:  # an endless source must not spin forever
            raise JakiroError(f"{self.streak} conversations in a row ended without an answer (prompts too long "
                              f"for --max-len {self.cfg.max_len}, or prompts the target wrote all refused); "
                              f"the {self.written} written are kept")

    def close(self) -> None:
        if self.group:
            _write_feature_group(self.folder, self.group)
        self.bar.close()


def _write_feature_group(folder: str, group: list) -> None:
    """Store and clear a group of (line, ids, mask, features); atomically, so a killed run leaves
    whole files only (its last conversations' features are then computed by the dataset pass)."""
    from safetensors.torch import save_file
    existing = [n for n in os.listdir(folder) if n.startswith(FEATURES_PREFIX) and n.endswith(".safetensors")]
    name = os.path.join(folder, f"{FEATURES_PREFIX}{len(existing):05d}.safetensors")
    offsets = [0]
    for _, ids, _, _ in group:
        offsets.append(offsets[-1] + len(ids))
    tensors = {"lines": torch.tensor([line for line, *_ in group], dtype=torch.int64),
               "input_ids": torch.tensor([t for _, ids, _, _ in group for t in ids], dtype=torch.int32),
               "loss_mask": torch.tensor([m for _, _, mask, _ in group for m in mask], dtype=torch.uint8),
               "features": torch.cat([feats for *_, feats in group]),
               "offsets": torch.tensor(offsets, dtype=torch.int64)}
    try:
        save_file(tensors, name + ".tmp")
        os.replace(name + ".tmp", name)
    except OSError as exc:
        if os.path.exists(name + ".tmp"):
            os.remove(name + ".tmp")
        raise JakiroError(f"cannot write {name}: {exc.strerror or exc}; the regenerated conversations are "
                          f"kept, rerun the same command to resume") from None
    group.clear()


class _GeneratedFeatures:
    """The features the regeneration kept, by line of the regenerated file: ``get(line, ids)``
    returns them where they were stored for exactly these training ids, else None."""

    def __init__(self, folder: str):
        from safetensors import safe_open
        self.where: dict[int, tuple[str, int, int]] = {}
        names = sorted(n for n in os.listdir(folder) if n.startswith(FEATURES_PREFIX) and n.endswith(".safetensors"))
        self.files = {}
        for name in names:
            path = os.path.join(folder, name)
            handle = safe_open(path, "pt")
            self.files[path] = handle
            offsets = handle.get_tensor("offsets").tolist()
            for i, line in enumerate(handle.get_tensor("lines").tolist()):
                self.where[line] = (path, offsets[i], offsets[i + 1])

    def get(self, line: int, ids: list[int], width: int) -> torch.Tensor | None:
        """``width``: values per token wanted (the final feature and any mid-layer streams)."""
        found = self.where.get(line)
        if found is None:
            return None
        path, a, b = found
        handle = self.files[path]
        features = handle.get_slice("features")
        if features.get_shape()[1] != width or handle.get_slice("input_ids")[a:b].tolist() != ids:
            return None
        return features[a:b]
