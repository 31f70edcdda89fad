"""Training sets for a target: tokenised conversations with an assistant-only loss mask and the
target's final-norm features, cached in safetensors shards. Resumable: a shard is written
atomically, then the state file records how many source records it covered."""

from __future__ import annotations

import json
import os
import time
from typing import Iterator

import torch

from ..data.conversations import TARGET_PROMPTS_SOURCE, iter_conversations
from ..data.decontaminate import evaluation_filter
from ..errors import JakiroError
from ..models.target import half_features
from .config import DataConfig, parse_layers

STATE_FILE = "state.json"


def tokenize_conversation(tokenizer, messages: list[dict], max_len: int) -> tuple[list[int], list[int]] | None:
    """Token ids and a loss mask that is 1 on assistant content (and its end-of-turn token, unless
    the answer is marked ``truncated``), 0 on the template's headers and on user/system text."""
    ids: list[int] = []
    mask: list[int] = []
    rendered = ""
    for i, msg in enumerate(messages):
        if msg["role"] == "assistant":
            header = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True, tokenize=False)
            full = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
            answer = full[len(header):]
            if msg.get("truncated"):
                # an answer cut short (length limit, degenerate loop): the model did not end its
                # turn there, so the template's end-of-turn is context, not a training target
                cut = answer.find(msg["content"]) + len(msg["content"])
                pieces = [(header[len(rendered):], 0), (answer[:cut], 1), (answer[cut:], 0)]
            else:
                pieces = [(header[len(rendered):], 0), (answer, 1)]
        else:
            full = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
            pieces = [(full[len(rendered):], 0)]
        for text, label in pieces:
            piece = tokenizer(text, add_special_tokens=False).input_ids
            ids.extend(piece)
            mask.extend([label] * len(piece))
        rendered = full
        if len(ids) >= max_len:
            break
    ids, mask = ids[:max_len], mask[:max_len]
    return (ids, mask) if sum(mask) > 0 else None


REGENERATED_FILE = "regenerated.jsonl"


def _admitted(source: str, prompt_filter, skipped: list[int] | None = None
              ) -> Iterator[tuple[int, list[dict] | None]]:
    """(source index, messages or None) for every source record; None for records that are
    unusable, touch an evaluation prompt or repeat an earlier first user turn. ``skipped``:
    collect malformed lines there instead of stopping (``--skip-bad``)."""
    for index, messages in enumerate(iter_conversations(source, skipped)):
        if messages is not None and prompt_filter is not None and not prompt_filter.admit(messages):
            messages = None
        yield index, messages


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
    from tqdm import tqdm

    from ..data.regenerate import Regenerator, read_done

    done = read_done(path)
    written = len(done)
    if written >= cfg.max_records:
        return {"conversations": 0, "already_regenerated": written}
    in_flight = streak = 0
    skipped: list[int] | None = [] if cfg.skip_bad else None
    # prompts the target writes pass the filter once written (``Regenerator``'s admit), the
    # kept ones of an earlier run included, so that a resumed run repeats none of them
    admit, job_filter = None, prompt_filter
    if cfg.source == TARGET_PROMPTS_SOURCE and prompt_filter is not None:
        for messages in iter_conversations(path) if done else ():
            prompt_filter.admit(messages)
        admit, job_filter = prompt_filter.admit, None

    records = _admitted(cfg.source, job_filter, skipped)

    class Jobs:
        """What a free slot takes next: nothing while the conversations asked for are written or
        in flight, though a later one that ends unanswered frees its place (unlike a generator,
        this iterator goes on after a StopIteration)."""

        def __iter__(self):
            return self

        def __next__(self):
            nonlocal in_flight
            if written + in_flight >= cfg.max_records:
                raise StopIteration
            for index, messages in records:
                if messages is not None and index not in done:
                    in_flight += 1
                    return index, messages
            raise StopIteration

    folder = os.path.dirname(path)
    group: list[tuple[int, list[int], list[int], torch.Tensor]] = []
    last_line = -1

    def collect(record, ids, mask, features) -> None:
        group.append((last_line, ids, mask, features))
        if len(group) == FEATURE_GROUP:
            _write_feature_group(folder, group)

    tokenize = lambda messages: tokenize_conversation(jk.tokenizer, messages, cfg.max_len)  # noqa: E731
    regen = Regenerator(target if target is not None else jk.target, jk.tokenizer, jk.engine("ar").eos_ids,
                        cfg.regen_settings(), tokenize=tokenize, collect=None if cfg.tokens_only else collect,
                        admit=admit)
    bar = tqdm(total=cfg.max_records, initial=written, desc="regenerate", unit="conv", disable=not progress)
    with open(path, "a", encoding="utf-8") as f:
        def write(record: dict) -> None:
            nonlocal written, in_flight, last_line, streak
            try:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
                f.flush()
            except OSError as exc:
                raise JakiroError(f"cannot append to {path}: {exc.strerror or exc}; the conversations "
                                  f"already written are kept, rerun the same command to resume") from None
            last_line = written
            written += 1
            streak = 0
            in_flight -= 1
            bar.update(1)

        def on_step(stats) -> None:
            bar.set_postfix(tok_s=f"{stats.tokens_per_s:.0f}", cut=stats.cut_tokens, refresh=False)

        def dropped(index: int) -> None:  # ended without an answer: another job takes its place
            nonlocal in_flight, streak
            in_flight -= 1
            streak += 1
            if streak > DROPS_IN_A_ROW + 20 * cfg.regen_batch:  # an endless source must not spin forever
                raise JakiroError(f"{streak} conversations in a row ended without an answer (prompts too long "
                                  f"for --max-len {cfg.max_len}, or prompts the target wrote all refused); "
                                  f"the {written} written are kept")

        stats = regen.run(Jobs(), write, on_step, dropped)
    if group:
        _write_feature_group(folder, group)
    bar.close()
    report = stats.as_dict()
    if prompt_filter is not None:
        report.update(removed_evaluation=prompt_filter.contaminated, removed_duplicates=prompt_filter.duplicates)
    if skipped is not None:
        report["skipped_bad_lines"] = len(skipped)
    return report


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


def build_dataset(out: str, cfg: DataConfig, cache_dir: str | None = None, progress: bool = True) -> dict:
    """Build (or continue building) the dataset in ``out``; returns the state dict."""
    from ..api import load

    cfg.check()
    device = cfg.torch_device()
    from ..models.quant import int8_activations_setting
    # a device's decoder stack is float32: int8 inputs only where asked for (then refused below)
    float32 = _uses_device_stack(device) and int8_activations_setting() is None
    jk = load(cfg.target, cache_dir=cache_dir, int8_activations=False if float32 else None)
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


def _build_in(out: str, cfg: DataConfig, jk, progress: bool, device: torch.device) -> dict:
    from tqdm import tqdm

    target, tokenizer = jk.target, jk.tokenizer
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
    aux_layers = parse_layers(cfg.aux_layers)
    if aux_layers:
        target.check_aux_layers(aux_layers)
        identity["aux_layers"] = list(aux_layers)
    state = _read_state(out)
    if state is None:
        if any(f.startswith("shard-") and f.endswith(".safetensors") for f in os.listdir(out)):
            raise JakiroError(f"{out} holds shards but no {STATE_FILE}: refusing to mix datasets")
        state = {"identity": identity, "records_done": 0, "records": 0, "tokens": 0,
                 "loss_tokens": 0, "shards": [], "token_counts": {}}
    elif state["identity"] != identity:
        raise JakiroError(f"{out} already holds a dataset built with different settings "
                          f"({state['identity']}); use another --out")
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
    # the features a regeneration kept beside its file (here, or beside a --source that is one)
    generated = (_GeneratedFeatures(os.path.dirname(source))
                 if os.path.basename(source) == REGENERATED_FILE and not cfg.tokens_only else None)
    records = _admitted(source, prompt_filter, skipped)
    featurizer = None
    if _uses_device_stack(device) and not cfg.tokens_only:
        from ..models.features import FeatureModel
        featurizer = FeatureModel(jk.target_path, aux_layers, device)
    for _ in range(cfg.first_record):  # conversations left to another dataset
        if next(records, None) is None:
            raise JakiroError(f"{cfg.source} holds fewer than {cfg.first_record} records: "
                              f"nothing after --first-record {cfg.first_record}")
    for _ in range(state["records_done"]):  # resume: skip what the shards already cover
        if next(records, None) is None:
            break
    consumed = state["records_done"]
    pending: list = []
    bar = tqdm(total=cfg.max_records, initial=state["records"], desc="features", unit="rec",
               disable=not progress)
    t0 = time.time()
    feature_tokens = 0
    counts = torch.zeros(target.config.vocab_size, dtype=torch.long)
    width = (1 + len(aux_layers)) * target.config.hidden_size  # values per token: features, then streams
    while state["records"] + len(pending) < cfg.max_records:
        item = next(records, None)
        if item is None:
            break
        consumed += 1
        messages = item[1]
        if messages is None:
            continue
        tok = tokenize_conversation(tokenizer, messages, cfg.max_len)
        if tok is None:
            continue
        ids, mask = tok
        feats = generated.get(item[0], ids, width) if generated is not None else None
        if feats is None and not cfg.tokens_only:
            with torch.inference_mode():
                if featurizer is not None:
                    feats = featurizer(torch.tensor([ids], device=device))[0].cpu()
                else:
                    cache = target.new_cache(len(ids))
                    _, feats = target(torch.tensor(ids), cache, logits_rows=slice(0, 0), aux_layers=aux_layers)
            feature_tokens += len(ids)
        elif feats is not None:
            state["features_from_regeneration"] = state.get("features_from_regeneration", 0) + 1
        pending.append((ids, mask, feats))
        bar.update(1)
        if len(pending) == cfg.shard_size or state["records"] + len(pending) >= cfg.max_records:
            _flush(out, state, pending, consumed, counts)
            pending = []
    if pending:
        _flush(out, state, pending, consumed, counts)
    bar.close()
    if state["records"] == 0:
        if state.get("regeneration_runs") and state["regeneration_runs"][-1].get("stopped_in_flight"):
            raise JakiroError(f"--regen-minutes {cfg.regen_minutes} ran out before any conversation was "
                              f"finished; run the same command again (with more minutes) to continue")
        raise JakiroError(f"no usable conversations in {cfg.source}")
    seconds = time.time() - t0
    state["seconds"] = state.get("seconds", 0) + seconds
    if prompt_filter is not None:
        state["removed_evaluation"] = prompt_filter.contaminated
        state["removed_duplicates"] = prompt_filter.duplicates
    if skipped is not None:  # lines read in this run, resumed ones included
        state["skipped_bad_lines"] = len(skipped)
    state["feature_tokens_per_s"] = round(feature_tokens / seconds, 1) if feature_tokens else None
    _save_state(out, state)
    return state


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
