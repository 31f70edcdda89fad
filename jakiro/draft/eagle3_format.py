"""Drafts in the formats other engines load.

``--format eagle3``: the Hugging Face folder vLLM (``Eagle3LlamaForCausalLM``), SGLang
(``LlamaForCausalLMEagle3``), SpecForge and llama.cpp's converter read: ``fc`` [H, 3H] over the
target's three residual streams, one decoder layer under ``midlayer.`` whose attention reads
cat(input_layernorm(embedding), hidden_norm(g)), a final ``norm``, its own ``lm_head`` over the
draft vocabulary, ``d2t`` as offsets (target id = i + d2t[i]) and ``t2d`` as a mask of the target
vocabulary. ``--format gguf``: the file llama.cpp's ``--spec-type draft-eagle3`` loads
(architecture ``eagle3``, the target's tokenizer copied from its GGUF). The same folder layout
trained elsewhere loads back as a draft (``read_eagle3``).

Our EAGLE-2 and Jakiro layouts have no such slots (an input norm on the fused feature, the
mid-layer projection, the experts): they are refused with the parts named.
"""

from __future__ import annotations

import json
import os

import torch

from ..errors import JakiroError
from .config import EAGLE3_STREAMS, DraftConfig

FORMATS = ("eagle3", "gguf", "eagle")
# names the public loaders give the EAGLE-3 architecture (any of them marks a folder as one)
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3DraftModel", "Eagle3Speculator")
ARCHITECTURE = "LlamaForCausalLMEagle3"

# our state dict name -> the EAGLE-3 checkpoint's (gate_up and the vocabulary map are split apart)
_NAMES = {
    "fc.weight": "fc.weight",
    "input_norm": "midlayer.input_layernorm.weight",
    "hidden_norm": "midlayer.hidden_norm.weight",
    "q_proj.weight": "midlayer.self_attn.q_proj.weight",
    "k_proj.weight": "midlayer.self_attn.k_proj.weight",
    "v_proj.weight": "midlayer.self_attn.v_proj.weight",
    "o_proj.weight": "midlayer.self_attn.o_proj.weight",
    "post_norm": "midlayer.post_attention_layernorm.weight",
    "norm": "norm.weight",
    "lm_head": "lm_head.weight",
}
# the token embedding a checkpoint may carry (the target's, saved with the draft by some trainers)
EMBEDDING = "embed_tokens.weight"
# the prefixes checkpoints use for the decoder layer (SpecForge/EAGLE: midlayer., vLLM/speculators)
_LAYER_PREFIXES = ("midlayer.", "model.layers.0.", "layers.0.")
# the same tensors in llama.cpp's GGUF names
_GGUF_NAMES = {
    "fc.weight": "fc.weight",
    "input_norm": "blk.0.attn_norm.weight",
    "hidden_norm": "blk.0.attn_norm_2.weight",
    "q_proj.weight": "blk.0.attn_q.weight",
    "k_proj.weight": "blk.0.attn_k.weight",
    "v_proj.weight": "blk.0.attn_v.weight",
    "o_proj.weight": "blk.0.attn_output.weight",
    "post_norm": "blk.0.ffn_norm.weight",
    "norm": "output_norm.weight",
    "lm_head": "output.weight",
}


def no_slots(config: DraftConfig) -> list[str]:
    """What a draft holds that the EAGLE-1/2 layout the public loaders know has no place for."""
    if config.method == "eagle3":
        return []
    parts = ["the input norm on the fused feature (EAGLE-1/2 layers skip it)"]
    if config.aux_layers:
        parts.append(f"the projection of the target's residual streams after layers {config.aux_layers}")
    if config.method == "jakiro":
        parts.append(f"the {config.num_experts} experts and their router"
                     + (" and the contrastive branch" if config.parallel_decoding else ""))
    return parts


def refuse_unless_eagle3(config: DraftConfig, fmt: str) -> None:
    if config.method == "eagle3":
        return
    what = "; ".join(no_slots(config))
    raise JakiroError(
        f"this is a {config.method} draft: the {fmt} format has no slot for {what}. Only a draft in the EAGLE-3 "
        f"layout exports (jakiro train --method eagle3); vLLM, SGLang and llama.cpp no longer load EAGLE-1/2 drafts")


# ---------------------------------------------------------------------------------------- folder
def eagle3_config(config: DraftConfig, dtype: str = "float32") -> dict:
    """config.json of the Hugging Face EAGLE-3 folder."""
    rope = dict(config.rope_parameters or {})
    theta = rope.pop("rope_theta", 10000.0)
    scaling = None if rope.get("rope_type", "default") == "default" else rope
    layers = list(config.aux_layers)
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size or config.vocab_size,
        "target_hidden_size": config.hidden_size,
        "eagle_aux_hidden_state_layer_ids": layers,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": layers, "use_aux_hidden_state": True},
        "torch_dtype": dtype,
        "jakiro_target_name": config.target_name,
    }


def eagle3_state(model) -> dict[str, torch.Tensor]:
    """The draft's weights under the EAGLE-3 checkpoint's names, with ``d2t`` (offsets) and
    ``t2d`` (a mask of the target vocabulary)."""
    c = model.config
    refuse_unless_eagle3(c, "eagle3")
    state = {k: v.detach() for k, v in model.state_dict().items()}
    out = {theirs: state[ours].contiguous() for ours, theirs in _NAMES.items()}
    gate, up = state["gate_up"][0].chunk(2, dim=0)
    out["midlayer.mlp.gate_proj.weight"] = gate.contiguous()
    out["midlayer.mlp.up_proj.weight"] = up.contiguous()
    out["midlayer.mlp.down_proj.weight"] = state["down"][0].contiguous()
    ids = state["d2t"] if "d2t" in state else torch.arange(c.vocab_size)
    out["d2t"] = (ids - torch.arange(len(ids))).to(torch.int64)
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    out["t2d"] = t2d
    return out


def export_eagle3(model, out: str, dtype: str = "float32") -> list[str]:
    """Write the Hugging Face EAGLE-3 folder; returns the files written."""
    from safetensors.torch import save_file
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    state = {k: (v.to(torch_dtype) if v.is_floating_point() else v) for k, v in eagle3_state(model).items()}
    os.makedirs(out, exist_ok=True)
    tmp = os.path.join(out, "model.safetensors.tmp")
    save_file(state, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(eagle3_config(model.config, dtype), f, indent=2)
    return [os.path.join(out, "config.json"), os.path.join(out, "model.safetensors")]


def is_eagle3_folder(folder: str) -> bool:
    """Whether ``folder`` holds an EAGLE-3 checkpoint in the public layout (not a jakiro config)."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError):
        return False
    return "jakiro" not in cfg and any(a in EAGLE3_ARCHITECTURES for a in cfg.get("architectures") or [])


def _flat_config(cfg: dict) -> dict:
    """Eagle3Speculator-style configs nest the layer's settings; flatten them."""
    inner = cfg.get("transformer_layer_config")
    return {**cfg, **inner} if isinstance(inner, dict) else cfg


def read_eagle3(folder: str, target_config=None, weights: bool = True
                ) -> tuple[DraftConfig, dict[str, torch.Tensor]]:
    """An EAGLE-3 folder (trained by any implementation writing the public layout) as our draft
    config and state dict. ``target_config`` (the target's ``TargetConfig``): the default
    streams when the folder does not name them, and its name for the config. ``weights=False``:
    the config alone (from the weights' headers)."""
    with open(os.path.join(folder, "config.json")) as f:
        cfg = _flat_config(json.load(f))
    state = {}
    for name, t in _read_tensors(folder, weights).items():
        for prefix in _LAYER_PREFIXES:
            if name.startswith(prefix):
                name = "midlayer." + name[len(prefix):]
                break
        state[name] = t
    config = _draft_config(folder, cfg, state, target_config)
    if not weights:
        return config, {}
    ours = {o: state[t].float() for o, t in _NAMES.items()}
    ours["gate_up"] = torch.cat((state["midlayer.mlp.gate_proj.weight"],
                                 state["midlayer.mlp.up_proj.weight"])).float().unsqueeze(0)
    ours["down"] = state["midlayer.mlp.down_proj.weight"].float().unsqueeze(0)
    if "embed_tokens.weight" in state:  # trainers save the target's embedding with the draft: checked on load
        ours[EMBEDDING] = state["embed_tokens.weight"]
    if config.draft_vocab_size is not None:
        n = config.draft_vocab_size
        ids = torch.arange(n) + (state["d2t"].to(torch.long) if "d2t" in state else 0)
        if int(ids.min()) < 0 or int(ids.max()) >= config.vocab_size or len(set(ids.tolist())) != n:
            raise JakiroError(f"{folder}: its d2t map does not give {n} distinct target tokens")
        ours["d2t"] = ids
    return config, ours


def _read_tensors(folder: str, weights: bool) -> dict:
    """The folder's tensors by name (``weights=False``: their safetensors slices, for shapes)."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        if os.path.exists(os.path.join(folder, "pytorch_model.bin")):
            return torch.load(os.path.join(folder, "pytorch_model.bin"), map_location="cpu", weights_only=True)
        raise JakiroError(f"{folder} has an EAGLE-3 config.json but no weights (*.safetensors)")
    raw = {}
    for name in files:
        path = os.path.join(folder, name)
        try:
            if weights:
                raw.update(load_file(path))
            else:
                with safe_open(path, "pt") as f:
                    raw.update({key: f.get_slice(key) for key in f.keys()})
        except (SafetensorError, OSError, ValueError) as exc:
            raise JakiroError(f"corrupted EAGLE-3 weights {path}: {exc}") from None
    return raw


def _stream_layers(folder: str, cfg: dict, target_config) -> list[int]:
    layers = (cfg.get("eagle_aux_hidden_state_layer_ids")
              or (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"))
    if layers:
        return [int(x) for x in layers]
    if target_config is None:
        raise JakiroError(f"{folder} does not name the target layers it reads; load it with its target")
    n = target_config.num_layers
    return [2, n // 2, n - 3]  # the loaders' default


def _check_runnable(folder: str, cfg: dict, state: dict, layers: list[int]) -> None:
    """Refuse what our runtime does not run, then what is missing."""
    d = cfg["hidden_size"]
    target_hidden = cfg.get("target_hidden_size") or d
    problems = []
    if target_hidden != d:
        problems.append(f"its width {d} differs from the target's {target_hidden}")
    if cfg.get("num_hidden_layers", 1) != 1:
        problems.append(f"{cfg['num_hidden_layers']} decoder layers")
    if len(layers) != EAGLE3_STREAMS:
        problems.append(f"{len(layers)} target streams")
    if any(k.endswith("_proj.bias") for k in state):
        problems.append("attention biases")
    if problems:
        raise JakiroError(f"{folder}: this EAGLE-3 draft has {', '.join(problems)}, which jakiro does not run "
                          f"(it uses the target's embedding and one bias-free layer as wide as the target)")
    need = set(_NAMES.values()) | {"midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
                                   "midlayer.mlp.down_proj.weight"}
    missing = sorted(need - set(state))
    if missing:
        raise JakiroError(f"{folder}: EAGLE-3 weights missing {', '.join(missing)}")


def _draft_config(folder: str, cfg: dict, state: dict, target_config) -> DraftConfig:
    layers = _stream_layers(folder, cfg, target_config)
    _check_runnable(folder, cfg, state, layers)
    d, H = cfg["hidden_size"], cfg["num_attention_heads"]
    vocab = cfg.get("vocab_size") or (target_config.vocab_size if target_config else None)
    draft_vocab = int(_shape(state["lm_head.weight"])[0])
    rope = {"rope_type": "default", "rope_theta": float(cfg.get("rope_theta", 10000.0))}
    if cfg.get("rope_scaling"):
        rope.update(cfg["rope_scaling"])
        rope.setdefault("rope_type", rope.pop("type", "default"))
    return DraftConfig(
        method="eagle3", hidden_size=d, intermediate_size=cfg["intermediate_size"], num_attention_heads=H,
        num_key_value_heads=cfg.get("num_key_value_heads", H), head_dim=cfg.get("head_dim") or d // H,
        vocab_size=vocab, rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048), rope_parameters=rope,
        draft_vocab_size=None if draft_vocab == vocab and "d2t" not in state else draft_vocab,
        target_name=cfg.get("jakiro_target_name") or (target_config.name if target_config else ""),
        aux_layers=layers)


def _shape(t) -> tuple[int, ...]:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else tuple(t.get_shape())


# ---------------------------------------------------------------------------------------- GGUF
def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q/k projection from rotate-half RoPE order to llama.cpp's interleaved pairs
    (what its converter does for Llama weights)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_TYPES = ("q8_0", "float16", "float32")


def _gguf_metadata(w, config: DraftConfig, target_gguf: str) -> None:
    """The eagle3 architecture's keys, and the target's tokenizer as it is."""
    from gguf import GGUFReader, GGUFValueType

    c = config
    w.add_name(f"{c.target_name or 'target'} EAGLE-3 draft (jakiro)")
    w.add_block_count(1)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(float(c.rope_parameters.get("rope_theta", 10000.0)))
    w.add_rope_dimension_count(c.head_dim)
    w.add_vocab_size(c.vocab_size)
    w.add_array(f"{w.arch}.target_layers", [int(x) for x in c.aux_layers])
    w.add_uint32(f"{w.arch}.target_hidden_size", c.hidden_size)
    for name, field in GGUFReader(target_gguf).fields.items():
        if name.startswith("tokenizer."):
            vtype = field.types[0]
            sub = field.types[1] if vtype == GGUFValueType.ARRAY and len(field.types) > 1 else None
            w.add_key_value(name, field.contents(), vtype, sub_type=sub)


def _gguf_tensors(model) -> dict[str, torch.Tensor]:
    """The draft's tensors under llama.cpp's names, q/k rows in its RoPE order."""
    c = model.config
    state = {k: v.detach().float() if v.is_floating_point() else v.detach() for k, v in model.state_dict().items()}
    state["q_proj.weight"] = _permute(state["q_proj.weight"], c.num_attention_heads)
    state["k_proj.weight"] = _permute(state["k_proj.weight"], c.num_key_value_heads)
    gate, up = state.pop("gate_up")[0].chunk(2, dim=0)
    tensors = {_GGUF_NAMES[k]: state[k] for k in _GGUF_NAMES}
    tensors.update({"blk.0.ffn_gate.weight": gate, "blk.0.ffn_up.weight": up,
                    "blk.0.ffn_down.weight": state["down"][0]})
    tensors["d2t"] = state["d2t"].to(torch.long) if "d2t" in state else torch.arange(c.vocab_size)
    return tensors


def export_gguf(model, target_gguf: str, path: str, dtype: str = "q8_0") -> str:
    """Write the GGUF llama.cpp runs with ``--spec-type draft-eagle3 -md PATH`` beside the target
    GGUF ``target_gguf`` (whose tokenizer the file carries, as llama.cpp requires). ``dtype``: the
    matrices' type; Q8_0 (the default) is what our runtime streams a draft as beside a quantized
    target, a quarter of float32's bytes (norms stay float32)."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    c = model.config
    refuse_unless_eagle3(c, "gguf")
    if c.rope_parameters.get("rope_type", "default") != "default":
        raise JakiroError(f"RoPE scaling {c.rope_parameters.get('rope_type')!r} is not written to the GGUF yet")
    if dtype not in GGUF_TYPES:
        raise JakiroError(f"a GGUF draft's matrices are {', '.join(GGUF_TYPES)}, not {dtype}")
    tmp = path + ".tmp"
    w = GGUFWriter(tmp, "eagle3")
    _gguf_metadata(w, c, target_gguf)
    for name, t in _gguf_tensors(model).items():
        if name == "d2t":
            w.add_tensor(name, t.numpy().astype(np.int64))
            continue
        a = t.contiguous().numpy().astype(np.float32)
        if a.ndim == 2 and dtype == "q8_0" and a.shape[1] % 32 == 0:
            q = quants.quantize(a, GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, a.astype(np.float16) if a.ndim == 2 and dtype == "float16" else a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    return path


def export(draft: str, fmt: str, out: str, target: str | None = None, cache_dir: str | None = None,
           dtype: str | None = None) -> list[str]:
    """``jakiro export``: the draft folder ``draft`` in format ``fmt`` (``FORMATS``) at ``out``;
    ``target`` (a named model, GGUF file or folder; for ``gguf`` its file gives the tokenizer):
    the draft is checked against it; ``dtype``: the weights' type (default float32 for a folder,
    Q8_0 for a GGUF). Returns the files written."""
    from .checkpoint import check_compatible, load_draft, read_draft_config

    if fmt not in FORMATS:
        raise JakiroError(f"unknown export format {fmt!r} (choose from {', '.join(FORMATS)})")
    config = read_draft_config(draft)
    refuse_unless_eagle3(config, "EAGLE-1/2" if fmt == "eagle" else fmt)
    if fmt == "eagle":  # an EAGLE-3 draft asked for the older layout
        raise JakiroError("an eagle3 draft exports as --format eagle3 or gguf; the EAGLE-1/2 layout reads one "
                          "feature, not three streams")
    model = load_draft(draft)
    if fmt == "eagle3":
        if dtype not in (None, "float32", "bfloat16", "float16"):
            raise JakiroError(f"an eagle3 folder holds float32, bfloat16 or float16 weights, not {dtype}")
        return export_eagle3(model, out, dtype or "float32")
    from ..models import gguf_file
    from ..models.hub import resolve_target
    from ..models.target import TargetModel
    folder = resolve_target(target, cache_dir)
    if not os.path.exists(os.path.join(folder, gguf_file.META_FILE)):
        raise JakiroError(f"--format gguf needs the target as a GGUF file (its tokenizer goes into the draft's "
                          f"file); {target} is a Hugging Face folder")
    check_compatible(config, TargetModel.from_folder(folder).config)
    if not out.endswith(".gguf"):
        raise JakiroError(f"--out for --format gguf is a file name ending in .gguf, got {out}")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    return [export_gguf(model, gguf_file.source_file(folder), out, dtype or "q8_0")]
