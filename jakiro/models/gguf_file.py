"""GGUF files as targets, with no float32 copy: the file's metadata (architecture, tensor table,
tokenizer) is read once with the ``gguf`` library into a small folder in the cache (a Hugging
Face ``config.json`` and tokenizer, and ``jakiro-gguf.json``), and each tensor is read from the
file by its offset when the runtime needs it: its raw blocks for the kernels, float32 only for
the reference paths (training features, Hugging Face comparisons, ``--float32``)."""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import torch

from ..errors import JakiroError

META_FILE = "jakiro-gguf.json"
META_VERSION = 1
# GGUF architectures the runtime runs (Mistral's files say "llama"), as Hugging Face model types
ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}
# tensor types a matrix may have (norms and biases: F32, F16 or BF16)
MATRIX_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias", "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
              "output_norm.weight": "model.norm.weight"}


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face state-dict key of a GGUF tensor (None for one this runtime has no slot for)."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def llama_row_order(rows: int, heads: int) -> np.ndarray:
    """Row order GGUF's Llama converter gives Q and K (for llama.cpp's interleaved rotary): the
    rows of the Hugging Face (rotate-half) weight are the GGUF rows taken in this order."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(2, 1).reshape(rows)


# ------------------------------------------------------------------ reading the file once
def _field(reader, key, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return value


def describe(gguf_path: str) -> dict:
    """The metadata of a GGUF file: its architecture as a Hugging Face config, and every tensor's
    name, type, shape (rows, columns) and byte range. A file this runtime cannot run (another
    architecture, a tensor type it has no kernel for, a truncated file) is refused here."""
    from gguf import GGML_QUANT_SIZES, GGUFReader
    size = os.path.getsize(gguf_path)
    try:
        reader = GGUFReader(gguf_path)
    except Exception as exc:  # a truncated or corrupted file
        raise JakiroError(f"{gguf_path} is not a readable GGUF file: truncated or corrupted "
                          f"({type(exc).__name__}: {exc})") from None
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise JakiroError(f"{os.path.basename(gguf_path)}: architecture {arch!r} is not supported "
                          f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    tensors = []
    for t in reader.tensors:
        shape = [int(s) for s in reversed(t.shape)]  # GGUF lists the fastest dimension first
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise JakiroError(f"{gguf_path} is truncated: tensor {t.name} ends at byte {end}, the file has {size}")
        kind = t.tensor_type.name
        if hf_name(t.name) is None and t.name != "rope_freqs.weight":
            raise JakiroError(f"{os.path.basename(gguf_path)}: tensor {t.name!r} has no place in the {arch} "
                              "layers this runtime runs (an unsupported variant of the architecture?)")
        if len(shape) == 2 and kind not in MATRIX_TYPES:
            raise JakiroError(f"{os.path.basename(gguf_path)}: tensor {t.name} is {kind}, which jakiro has no "
                              f"kernel for (supported: {', '.join(MATRIX_TYPES)})")
        block = GGML_QUANT_SIZES[t.tensor_type][0]
        if shape[-1] % block:
            raise JakiroError(f"{os.path.basename(gguf_path)}: tensor {t.name} has rows of {shape[-1]} values, "
                              f"not whole {kind} blocks of {block}")
        if len(shape) == 1 and kind not in FLOAT_TYPES:
            raise JakiroError(f"{os.path.basename(gguf_path)}: tensor {t.name} is {kind}; vectors must be "
                              "F32, F16 or BF16")
        tensors.append({"name": t.name, "type": kind, "shape": shape, "offset": int(t.data_offset),
                        "bytes": int(t.n_bytes)})
    names = {t["name"] for t in tensors}
    if "token_embd.weight" not in names:
        raise JakiroError(f"{os.path.basename(gguf_path)} has no token embedding (token_embd.weight)")
    return {"version": META_VERSION, "gguf": os.path.abspath(gguf_path), "size": size, "architecture": arch,
            "config": _hf_config(reader, arch, tensors), "tensors": tensors}


def _hf_config(reader, arch: str, tensors: list[dict]) -> dict:
    """The Hugging Face config of the model (as ``transformers``' own GGUF loading builds it)."""
    def key(name, default=None):
        return _field(reader, f"{arch}.{name}", default)
    by_name = {t["name"]: t for t in tensors}
    heads = key("attention.head_count")
    cfg = {
        "model_type": ARCHITECTURES[arch],
        "num_hidden_layers": key("block_count"),
        "max_position_embeddings": key("context_length"),
        "hidden_size": key("embedding_length"),
        "intermediate_size": key("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6),
        "vocab_size": by_name["token_embd.weight"]["shape"][0],
        "tie_word_embeddings": "output.weight" not in by_name,
        "rope_theta": key("rope.freq_base", 10000.0),
    }
    if None in cfg.values():
        missing = [k for k, v in cfg.items() if v is None]
        raise JakiroError(f"the GGUF file lacks the {arch} settings {', '.join(missing)}")
    head_dim = key("attention.key_length")
    if head_dim and head_dim != cfg["hidden_size"] // heads or arch == "qwen3":
        cfg["head_dim"] = head_dim or cfg["hidden_size"] // heads
    if any(t["name"].endswith("attn_q.bias") for t in tensors) and arch != "qwen2":
        cfg["attention_bias"] = True
    window = key("attention.sliding_window")
    if window:
        cfg["sliding_window"] = window
    scaling = key("rope.scaling.type")
    if scaling in ("linear", "yarn"):
        rope = {"rope_type": scaling, "factor": key("rope.scaling.factor", 1.0), "rope_theta": cfg["rope_theta"]}
        if scaling == "yarn":
            rope["original_max_position_embeddings"] = key("rope.scaling.original_context_length")
        cfg["rope_scaling"] = rope
    elif scaling not in (None, "none"):
        raise JakiroError(f"RoPE scaling {scaling!r} of this GGUF file is not supported")
    for name, token in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        value = _field(reader, f"tokenizer.ggml.{token}_token_id")
        if value is not None:
            cfg[name] = int(value)
    return cfg


def prepare_folder(gguf_path: str, out_dir: str, log) -> None:
    """Write the metadata, a Hugging Face config and the tokenizer of a GGUF file into ``out_dir``
    (once; a folder an earlier version filled with a float32 copy loses that copy)."""
    from transformers import CONFIG_MAPPING, AutoTokenizer
    folder, name = os.path.split(os.path.abspath(gguf_path))
    meta = describe(gguf_path)
    log(f"read {name} (once; its metadata and tokenizer are kept in {out_dir})")
    os.makedirs(out_dir, exist_ok=True)
    cfg = dict(meta["config"])
    CONFIG_MAPPING[cfg.pop("model_type")](**cfg).save_pretrained(out_dir)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as exc:
        raise JakiroError(f"cannot read the tokenizer of {gguf_path}: {exc}") from None
    tokenizer.save_pretrained(out_dir)
    for stale in os.listdir(out_dir):  # an earlier version's float32 copy of the weights
        if stale.endswith((".safetensors", ".safetensors.index.json", ".blocks")) or stale == "jakiro-source.json":
            os.remove(os.path.join(out_dir, stale))
    tmp = os.path.join(out_dir, META_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(meta, f)
    os.replace(tmp, os.path.join(out_dir, META_FILE))


def is_gguf_folder(folder: str) -> bool:
    return os.path.exists(os.path.join(folder, META_FILE))


def current(folder: str, gguf_path: str) -> bool:
    """Whether ``folder`` holds this file's metadata in the current format."""
    try:
        with open(os.path.join(folder, META_FILE)) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return False
    return (meta.get("version") == META_VERSION and meta.get("gguf") == os.path.abspath(gguf_path)
            and meta.get("size") == os.path.getsize(gguf_path))


def source_file(folder: str) -> str:
    """The GGUF file a prepared folder describes (a clear error for a Hugging Face folder)."""
    if not is_gguf_folder(folder):
        raise JakiroError(f"{folder} is not a GGUF file's model: llama.cpp runs GGUF files only")
    with open(os.path.join(folder, META_FILE)) as f:
        return json.load(f)["gguf"]


def hugging_face_model(folder: str):
    """The Hugging Face float32 model of a model folder: its safetensors, or for a GGUF file's
    folder the file as ``transformers`` loads it (dequantized): the reference the runtime is
    compared with."""
    from transformers import AutoModelForCausalLM
    if not is_gguf_folder(folder):
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    path = source_file(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                    dtype=torch.float32).eval()


# ------------------------------------------------------------------ reading tensors
class GGUFWeights:
    """The tensors of the GGUF file a prepared folder describes, read by offset."""

    def __init__(self, folder: str):
        with open(os.path.join(folder, META_FILE)) as f:
            meta = json.load(f)
        self.path = meta["gguf"]
        self.architecture = meta["architecture"]
        if not os.path.exists(self.path):
            raise JakiroError(f"the GGUF file of this model is gone: {self.path}")
        if os.path.getsize(self.path) != meta["size"]:
            raise JakiroError(f"{self.path} changed since it was read ({os.path.getsize(self.path)} bytes, "
                              f"was {meta['size']}): pass it again to read it anew")
        self.tensors = {t["name"]: t for t in meta["tensors"]}
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def type(self, name: str) -> str:
        return self.tensors[name]["type"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name]["shape"])

    def raw(self, name: str, copy: bool = False) -> torch.Tensor:
        """The tensor as the file holds it: quantized [rows, blocks, block bytes] uint8, float
        [rows, cols] or [n]. Without ``copy`` a view of the memory-mapped file (read only; only
        the rows used become resident); with it, a private copy read from the file."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        t = self.tensors[name]
        if copy:
            data = np.empty(t["bytes"], dtype=np.uint8)
            with open(self.path, "rb") as f:
                f.seek(t["offset"])
                if f.readinto(memoryview(data)) != t["bytes"]:
                    raise JakiroError(f"{self.path} is truncated (tensor {name})")
        else:
            data = self._map[t["offset"]:t["offset"] + t["bytes"]]
        kind, shape = t["type"], t["shape"]
        with warnings.catch_warnings():  # a read-only view: never written to
            warnings.simplefilter("ignore")
            bytes_ = torch.from_numpy(data)
        if kind in FLOAT_TYPES:
            return bytes_.view(FLOAT_TYPES[kind]).view(*shape)
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
        return bytes_.view(shape[0], shape[1] // block, size)

    def dense(self, name: str) -> torch.Tensor:
        """The tensor in float32 (quantized blocks as GGUF's reference dequantization gives them)."""
        raw = self.raw(name)
        if raw.dtype != torch.uint8:
            return raw.to(torch.float32)
        from . import smallgemm
        if smallgemm.available():
            return smallgemm.gguf_rows(raw, torch.arange(raw.shape[0]))
        from gguf import GGMLQuantizationType, dequantize
        flat = raw.numpy().reshape(raw.shape[0], -1)
        return torch.from_numpy(dequantize(flat, GGMLQuantizationType[self.type(name)]).astype(np.float32))

    def state_dict(self, num_heads: int, num_kv_heads: int) -> dict[str, torch.Tensor]:
        """Every weight in float32 under its Hugging Face name, Llama's Q and K rows put back in
        the rotate-half order (the float32 model ``transformers`` builds from the file)."""
        state = {}
        for name in self.tensors:
            key = hf_name(name)
            if key is None:
                continue
            value = self.dense(name)
            if self.architecture == "llama" and name.endswith((".attn_q.weight", ".attn_k.weight")):
                heads = num_heads if ".attn_q." in name else num_kv_heads
                value = value[torch.from_numpy(llama_row_order(value.shape[0], heads))].contiguous()
            state[key] = value
        return state
