"""Training sets for a target: tokenised conversations with an assistant-only loss mask and the
target's final-norm features, cached in safetensors shards. Resumable: a shard is written
atomically, then the state file records how many source records it covered."""

from __future__ import annotations

import json
import os
import time

import torch

from ..settings import Runtime
from ..data.decontaminate import evaluation_filter
from ..errors import JakiroError
from ..models.target import half_features
from .config import DataConfig, parse_layers
from .records import REGENERATED_FILE, _admitted, tokenize_conversation
from .regeneration import _GeneratedFeatures, regenerate_conversations

STATE_FILE = "state.json"


def _write_shard(folder: str, index: int, records: list[tuple[list[int], list[int], torch.Tensor]]) -> str:
    from safetensors.torch import save_file
    name = f"shard-{index:05d}.safetensors"
    offsets = [0]
    for ids, _, _ in records:
        offsets.append(offsets[-1] + len(ids))
    tensors = {
        "input_ids": torch.tensor([t for ids, _, _ in records for t in ids], dtype=torch.int32),
        "loss_mask": torch.tensor([m for _, mask, _ in records for m in mask], dtype=torch.uint8),
        "offsets": torch.tensor(offsets, dtype=torch.int64),
    }
    if records[0][2] is not None:  # a tokens-only dataset (``--tokens-only``) stores no features
        tensors["features"] = half_features(torch.cat([f for _, _, f in records]))
    tmp = os.path.join(folder, name + ".tmp")
    try:
        save_file(tensors, tmp)
        os.replace(tmp, os.path.join(folder, name))
    except OSError as exc:  # e.g. a full disk: the earlier shards and the state stay as they were
        if os.path.exists(tmp):
            os.remove(tmp)
        raise JakiroError(f"cannot write dataset shard {os.path.join(folder, name)}: {exc.strerror or exc}; "
                          f"earlier shards are intact, rerun the same command to resume") from None
    return name


def _target_keys(identity: dict) -> tuple:
    return identity["target_name"], identity["hidden_size"], identity["vocab_size"]


def _read_state(folder: str) -> dict | None:
    path = os.path.join(folder, STATE_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def build_dataset(out: str, cfg: DataConfig, cache_dir: str | None = None, progress: bool = True,
                  runtime: Runtime | None = None) -> dict:
    """Build (or continue building) the dataset in ``out`` with the target computed as ``runtime``
    says (default ``Runtime.from_env()``); returns the state dict."""
    from ..api import load

    cfg.check()
    device = cfg.torch_device()
    runtime = runtime or Runtime.from_env()
    if _uses_device_stack(device) and runtime.int8_activations is None:
        runtime = runtime.but(int8_activations=False)  # a device's decoder stack is float32
    jk = load(cfg.target, cache_dir=cache_dir, runtime=runtime, prompt_cache=False)
    if getattr(jk.target, "int8_activations", False) and _uses_device_stack(device):
        raise JakiroError(f"--int8-activations is the CPU kernels' computation; --device {device} runs the "
                          f"float32 decoder stack: drop one of them")
    if not getattr(jk.tokenizer, "chat_template", None):
        raise JakiroError("the target's tokenizer has no chat template; cannot build chat training data")
    created = not os.path.exists(out)
    os.makedirs(out, exist_ok=True)
    try:
        return _build_in(out, cfg, jk, progress, device)
    except BaseException:
        if created and not os.listdir(out):  # a failed first attempt leaves no empty folder behind
            os.rmdir(out)
        raise


def _uses_device_stack(device: torch.device) -> bool:
    """Whether regeneration and features run the decoder stack in plain torch on ``device``
    (``DeviceTarget``, ``FeatureModel``) rather than the CPU's kernels (``TargetModel``)."""
    return device.type != "cpu"


def _identity(cfg: DataConfig, target) -> dict:
    """What makes two runs the same dataset (a resumed run must match it)."""
    identity = {"target_name": target.config.name, "hidden_size": target.config.hidden_size,
                "vocab_size": target.config.vocab_size, "source": cfg.source, "max_len": cfg.max_len,
                "regenerate": cfg.regenerate, "seed": cfg.seed}
    if cfg.regenerate != "none":
        identity.update(regen_max_tokens=cfg.regen_max_tokens, sample_share=cfg.sample_share)
    if cfg.first_record:
        identity["first_record"] = cfg.first_record
    if cfg.tokens_only:
        identity["tokens_only"] = True
    if getattr(target, "int8_activations", False):  # answers and features of that computation
        identity["int8_activations"] = True
    if getattr(target, "kv_dtype", torch.float32) == torch.float16:  # likewise
        identity["kv_cache"] = "float16"
    aux_layers = parse_layers(cfg.aux_layers)
    if aux_layers:
        target.check_aux_layers(aux_layers)
        identity["aux_layers"] = list(aux_layers)
    return identity


def _open_state(out: str, identity: dict) -> dict:
    """The folder's state to continue, or a new one; a folder of another dataset is refused."""
    state = _read_state(out)
    if state is None:
        if any(f.startswith("shard-") and f.endswith(".safetensors") for f in os.listdir(out)):
            raise JakiroError(f"{out} holds shards but no {STATE_FILE}: refusing to mix datasets")
        return {"identity": identity, "records_done": 0, "records": 0, "tokens": 0,
                "loss_tokens": 0, "shards": [], "token_counts": {}}
    if state["identity"] != identity:
        raise JakiroError(f"{out} already holds a dataset built with different settings "
                          f"({state['identity']}); use another --out")
    return state


def _source_records(out: str, cfg: DataConfig, jk, state: dict, progress: bool, device: torch.device):
    """(the source file, its admitted records past what earlier runs and --first-record took,
    the evaluation filter still to apply, the skipped-lines list or None): a regeneration first
    answers the prompts and its file becomes the source."""
    prompt_filter = evaluation_filter() if cfg.filter_evaluation else None
    source = cfg.source
    if cfg.regenerate != "none":
        source = os.path.join(out, REGENERATED_FILE)
        generator = None
        if _uses_device_stack(device):
            from ..models.device_target import DeviceTarget
            generator = DeviceTarget(jk.target_path, device)
        state.setdefault("regeneration_runs", []).append(
            regenerate_conversations(jk, cfg, source, prompt_filter, progress, generator))
        del generator
        prompt_filter = None  # the regenerated file holds admitted conversations only
    skipped: list[int] | None = [] if cfg.skip_bad and cfg.regenerate == "none" else None
    records = _admitted(source, prompt_filter, skipped)
    for _ in range(cfg.first_record):  # conversations left to another dataset
        if next(records, None) is None:
            raise JakiroError(f"{cfg.source} holds fewer than {cfg.first_record} records: "
                              f"nothing after --first-record {cfg.first_record}")
    for _ in range(state["records_done"]):  # resume: skip what the shards already cover
        if next(records, None) is None:
            break
    return source, records, prompt_filter, skipped


class _Features:
    """A record's target features: those a regeneration kept beside its file, else computed by
    the CPU target (or the device stack's ``FeatureModel``); None with --tokens-only."""

    def __init__(self, cfg: DataConfig, jk, source: str, device: torch.device):
        self.cfg, self.target, self.device = cfg, jk.target, device
        self.aux_layers = parse_layers(cfg.aux_layers)
        self.width = (1 + len(self.aux_layers)) * jk.target.config.hidden_size  # features, then streams
        self.generated = (_GeneratedFeatures(os.path.dirname(source))
                          if os.path.basename(source) == REGENERATED_FILE and not cfg.tokens_only else None)
        self.featurizer = None
        if _uses_device_stack(device) and not cfg.tokens_only:
            from ..models.features import FeatureModel
            self.featurizer = FeatureModel(jk.target_path, self.aux_layers, device)
        self.computed_tokens = self.reused = 0

    def __call__(self, line: int, ids: list[int]) -> torch.Tensor | None:
        feats = self.generated.get(line, ids, self.width) if self.generated is not None else None
        if feats is not None:
            self.reused += 1
            return feats
        if self.cfg.tokens_only:
            return None
        with torch.inference_mode():
            if self.featurizer is not None:
                feats = self.featurizer(torch.tensor([ids], device=self.device))[0].cpu()
            else:
                cache = self.target.new_cache(len(ids))
                _, feats = self.target(torch.tensor(ids), cache, logits_rows=slice(0, 0), aux_layers=self.aux_layers)
        self.computed_tokens += len(ids)
        return feats


def _build_in(out: str, cfg: DataConfig, jk, progress: bool, device: torch.device) -> dict:
    from tqdm import tqdm

    state = _open_state(out, _identity(cfg, jk.target))
    source, records, prompt_filter, skipped = _source_records(out, cfg, jk, state, progress, device)
    features = _Features(cfg, jk, source, device)
    consumed = state["records_done"]
    pending: list = []
    bar = tqdm(total=cfg.max_records, initial=state["records"], desc="features", unit="rec",
               disable=not progress)
    t0 = time.time()
    counts = torch.zeros(jk.target.config.vocab_size, dtype=torch.long)
    while state["records"] + len(pending) < cfg.max_records:
        item = next(records, None)
        if item is None:
            break
        consumed += 1
        tok = None if item[1] is None else tokenize_conversation(jk.tokenizer, item[1], cfg.max_len)
        if tok is None:
            continue
        ids, mask = tok
        reused = features.reused
        pending.append((ids, mask, features(item[0], ids)))
        if features.reused > reused:
            state["features_from_regeneration"] = state.get("features_from_regeneration", 0) + 1
        bar.update(1)
        if len(pending) == cfg.shard_size or state["records"] + len(pending) >= cfg.max_records:
            _flush(out, state, pending, consumed, counts)
            pending = []
    if pending:
        _flush(out, state, pending, consumed, counts)
    bar.close()
    _finish_state(out, cfg, state, time.time() - t0, features.computed_tokens, prompt_filter, skipped)
    return state


def _finish_state(out: str, cfg: DataConfig, state: dict, seconds: float, feature_tokens: int, prompt_filter,
                  skipped: list[int] | None) -> None:
    if state["records"] == 0:
        if state.get("regeneration_runs") and state["regeneration_runs"][-1].get("stopped_in_flight"):
            raise JakiroError(f"--regen-minutes {cfg.regen_minutes} ran out before any conversation was "
                              f"finished; run the same command again (with more minutes) to continue")
        raise JakiroError(f"no usable conversations in {cfg.source}")
    state["seconds"] = state.get("seconds", 0) + seconds
    if prompt_filter is not None:
        state["removed_evaluation"] = prompt_filter.contaminated
        state["removed_duplicates"] = prompt_filter.duplicates
    if skipped is not None:  # lines read in this run, resumed ones included
        state["skipped_bad_lines"] = len(skipped)
    state["feature_tokens_per_s"] = round(feature_tokens / seconds, 1) if feature_tokens else None
    _save_state(out, state)


def _flush(out, state, pending, consumed, counts) -> None:
    name = _write_shard(out, len(state["shards"]), pending)
    state["shards"].append(name)
    state["records"] += len(pending)
    state["records_done"] = consumed
    for ids, mask, _ in pending:
        state["tokens"] += len(ids)
        state["loss_tokens"] += sum(mask)
        counts += torch.bincount(torch.tensor(ids), minlength=counts.shape[0])
    merged = {int(k): v for k, v in state["token_counts"].items()}
    for tok in torch.nonzero(counts).flatten().tolist():
        merged[tok] = merged.get(tok, 0) + int(counts[tok])
    counts.zero_()
    state["token_counts"] = {str(k): v for k, v in merged.items()}
    _save_state(out, state)


def _save_state(out: str, state: dict) -> None:
    tmp = os.path.join(out, STATE_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(state, f)
    os.replace(tmp, os.path.join(out, STATE_FILE))
