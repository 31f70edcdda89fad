"""Target-model runtime for Llama-family causal LMs (Llama, Mistral, Qwen2/2.5, Qwen3, SmolLM2).

One forward over new tokens with explicit positions and a tree attention mask (causal over the
cached prefix, arbitrary ancestor mask among the new tokens); returns logits and the final-norm
features. Weights are loaded straight from safetensors into fused, pre-transposed matrices.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import JakiroError
from .kv_cache import BatchKVCache, KVCache
from . import smallgemm
from .linear import SMALL_ROWS, FastLinear

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_SLACK = 256  # positions beyond the context reserved for uncommitted draft-tree tokens
# With the AMX kernel, a prompt of up to this many tokens (``forward(chunked=True)``) goes through
# the one-call stack in pieces of SMALL_ROWS rather than oneDNN over the float32 weights: SmolLM2 on two Xeon
# cores, 37 / 100 / 300 / 900 tokens took 31.6 / 84.6 / 269 / 1028 ms that way against 69.1 / 125 /
# 307 / 1014 ms (the float32 stack and the portable kernel lose to oneDNN from a few dozen tokens).
# With the int8 kernel (int8 activations on AVX-512 VNNI CPUs without tiles) prompts of any length go
# in pieces: on two Zen 4 EPYC cores 128 / 512 / 800 / 1200 / 2000 / 3000 tokens took 82 / 430 / 718 /
# 1338 / 3144 / 6003 ms that way against 172 / 737 / 1205 / 2081 / 4161 / 7015 ms on oneDNN. With
# float32 inputs there (three bytes each) the limit is this one again: 256 / 512 / 1024 / 1536 tokens
# took 365 / 751 / 1703 / 3285 ms in pieces against 386 / 854 / 1865 / 3040 ms on oneDNN
CHUNKED_PREFILL_MAX = 512


def half_features(features: torch.Tensor) -> torch.Tensor:
    """Features as datasets store them: float16, clamped to its range (a mid-layer residual
    stream can hold outliers beyond it, which the draft normalises away anyway)."""
    return features.clamp(-65504.0, 65504.0).to(torch.float16)


@dataclass
class TargetConfig:
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_context: int
    qkv_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    name: str = ""

    def check_length(self, max_len: int) -> None:
        """Refuse a cache for more tokens than this model's context."""
        if max_len > self.max_context:
            raise JakiroError(f"requested {max_len} tokens but the model's context length is {self.max_context}")

    def check_aux_layers(self, aux_layers: tuple[int, ...]) -> None:
        """Refuse mid-layer streams that are not after increasing counts of this model's layers."""
        layers = self.num_layers
        if list(aux_layers) != sorted(set(aux_layers)) or any(not 0 < a < layers for a in aux_layers):
            raise JakiroError(f"mid-layer features must come after increasing layer counts in 1..{layers - 1} "
                              f"(this target has {layers} decoder layers), got {list(aux_layers)}")

    @classmethod
    def from_hf(cls, hf_config, name: str = "") -> "TargetConfig":
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise JakiroError(
                f"unsupported architecture {model_type!r}: supported model types are "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        max_context = hf_config.max_position_embeddings
        window = getattr(hf_config, "sliding_window", None)
        if model_type == "mistral" and window:
            max_context = min(max_context, window)  # beyond the window Mistral attends differently
        return cls(
            model_type=model_type,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab_size=hf_config.vocab_size,
            rms_norm_eps=hf_config.rms_norm_eps,
            max_context=max_context,
            qkv_bias=model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            name=name,
        )


def rope_tables(hf_config, head_dim: int, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_positions, head_dim] in the Hugging Face (rotate-half) layout."""
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        scaling = 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise JakiroError(f"unsupported RoPE type {rope_type!r}")
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None)
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq.float())
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).contiguous(), (emb.sin() * scaling).contiguous()


class _Layer:
    __slots__ = ("input_norm", "post_norm", "qkv", "o", "gate_up", "down", "q_norm", "k_norm")


def _load_state_dict(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(p for p in os.listdir(folder) if p.endswith(".safetensors"))
    if not files:
        raise JakiroError(f"no .safetensors weights found in {folder}")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            state.update(load_file(os.path.join(folder, name)))
        except Exception as exc:  # corrupted / truncated file
            raise JakiroError(f"cannot read weights {os.path.join(folder, name)}: {exc}") from None
    return state


class TargetModel:
    """A Llama-family model with a tree-attention forward. Float32 on CPU by default."""

    def __init__(self, hf_config, state: dict[str, torch.Tensor], name: str = "",
                 dtype: torch.dtype = torch.float32, quantized: dict | None = None, input_bytes: int = 3):
        """``quantized``: {state key: (kind, blocks)} of matrices also held in GGUF blocks
        (``models.quant``), which the small-batch kernel streams instead of float32; ``input_bytes``:
        how those take their inputs (3: float32 accuracy; 1: int8 activations)."""
        self.hf_config = hf_config
        self.quantized_matrices = 0
        self.input_bytes = input_bytes
        self.config = cfg = TargetConfig.from_hf(hf_config, name)
        self.dtype = dtype
        prefix = "model." if any(k.startswith("model.") for k in state) else ""
        used: set[str] = set()

        def full_key(key: str) -> str:
            return prefix + key if not key.startswith("lm_head") else key

        def take(key: str) -> torch.Tensor:
            full = full_key(key)
            if full not in state:
                raise JakiroError(f"missing weight {full!r} in target checkpoint")
            used.add(full)
            return state[full].to(dtype)

        def blocks(*keys: str):
            from .quant import concatenated
            if not quantized or dtype != torch.float32:
                return None
            found = concatenated([quantized.get(full_key(k)) for k in keys])
            self.quantized_matrices += len(keys) if found is not None else 0
            return found

        self.embed = take("embed_tokens.weight").contiguous()  # [vocab, d]
        if self.embed.shape != (cfg.vocab_size, cfg.hidden_size):
            raise JakiroError(f"embedding shape {tuple(self.embed.shape)} does not match config "
                              f"({cfg.vocab_size}, {cfg.hidden_size})")
        self.layers: list[_Layer] = []
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            layer = _Layer()
            layer.input_norm = take(p + "input_layernorm.weight")
            layer.post_norm = take(p + "post_attention_layernorm.weight")
            qkv_w = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"], 0)
            qkv_b = (torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"], 0)
                     if cfg.qkv_bias else None)
            layer.qkv = FastLinear(qkv_w, qkv_b, quantized=blocks(*(p + f"self_attn.{n}_proj.weight" for n in "qkv")),
                                   input_bytes=input_bytes)
            layer.o = FastLinear(take(p + "self_attn.o_proj.weight"), quantized=blocks(p + "self_attn.o_proj.weight"),
                                 input_bytes=input_bytes)
            layer.gate_up = FastLinear(torch.cat([take(p + "mlp.gate_proj.weight"),
                                                  take(p + "mlp.up_proj.weight")], 0),
                                       quantized=blocks(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                                       input_bytes=input_bytes)
            layer.down = FastLinear(take(p + "mlp.down_proj.weight"), quantized=blocks(p + "mlp.down_proj.weight"),
                                    input_bytes=input_bytes)
            layer.q_norm = take(p + "self_attn.q_norm.weight") if cfg.qk_norm else None
            layer.k_norm = take(p + "self_attn.k_norm.weight") if cfg.qk_norm else None
            self.layers.append(layer)
        self.norm = take("norm.weight")
        if "lm_head.weight" in state and not cfg.tie_word_embeddings:
            head, head_blocks = take("lm_head.weight"), blocks("lm_head.weight")
        else:
            used.add("lm_head.weight")
            head, head_blocks = self.embed, blocks("embed_tokens.weight")
        self.lm_head = FastLinear(head, keep_weight=True, quantized=head_blocks, input_bytes=input_bytes)
        unexpected = [k for k in state if k not in used and "rotary_emb" not in k]
        if unexpected:
            raise JakiroError(f"unexpected weights in target checkpoint: {', '.join(unexpected[:5])}"
                              + (" ..." if len(unexpected) > 5 else ""))
        # tree tokens drafted past the last committable position still need a rotary angle
        self.cos, self.sin = rope_tables(hf_config, cfg.head_dim, cfg.max_context + ROPE_SLACK)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self._fused = self._fused_weights()
        # the longest prompt that runs in pieces (see CHUNKED_PREFILL_MAX); 0: none does
        self._longest_chunked_prompt = (0 if self._fused is None or not self.tile_matrices else
                                        cfg.max_context if input_bytes == 1 and not smallgemm.tiles_enabled()
                                        else CHUNKED_PREFILL_MAX)

    @property
    def int8_activations(self) -> bool:
        """Whether the quantized matrices take their inputs as int8 (``from_folder``)."""
        return self.input_bytes == 1

    @property
    def tile_matrices(self) -> int:
        """Weight matrices (as the runtime stacks them: q/k/v and gate/up in one) streamed through
        the AMX kernel or the int8 (AVX-512 VNNI) one."""
        linears = [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return sum(lin.tiles for lin in linears + [self.lm_head])

    def _fused_weights(self) -> tuple[list, list[int]] | None:
        """The layers' weights as ``smallgemm.decoder_layers`` takes them (nine per layer), where
        every matrix has a small-batch kernel layout; else None (forwards stay in torch)."""
        weights, sizes = [], []
        for layer in self.layers:
            linears = (layer.qkv, layer.o, layer.gate_up, layer.down)
            if any(lin.kernel_weight is None for lin in linears) or any(
                    lin.bias is not None for lin in linears[1:]):
                return None
            weights += [layer.input_norm, layer.post_norm, layer.qkv.kernel_weight, layer.qkv.bias,
                        layer.o.kernel_weight, layer.gate_up.kernel_weight, layer.down.kernel_weight,
                        layer.q_norm, layer.k_norm]
            sizes += [lin.out_features for lin in linears]
        return weights, sizes

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_folder(cls, folder: str, dtype: torch.dtype = torch.float32,
                    quantized: bool | None = None, int8_activations: bool | None = None) -> "TargetModel":
        """``quantized`` (default: on unless ``JAKIRO_QUANTIZED=0``): stream the GGUF blocks of a model
        converted from a GGUF file, where the small-batch kernel is available. ``int8_activations``
        (default: off unless ``JAKIRO_INT8_ACTIVATIONS=1``): those blocks take their inputs as int8
        (``models.quant``); needs the blocks and a CPU with AVX-512 VNNI or AMX."""
        if not os.path.isdir(folder):
            raise JakiroError(f"model folder not found: {folder}")
        if not os.path.exists(os.path.join(folder, "config.json")):
            raise JakiroError(f"{folder} is not a Hugging Face model folder (no config.json)")
        from transformers import AutoConfig
        try:
            hf_config = AutoConfig.from_pretrained(folder)
        except Exception as exc:
            raise JakiroError(f"cannot read {os.path.join(folder, 'config.json')}: {exc}") from None
        TargetConfig.from_hf(hf_config)  # fail on the architecture before reading weights
        from . import quant, smallgemm
        from .hub import _log
        state = _load_state_dict(folder)
        blocks = None
        stream_blocks = quant.enabled() if quantized is None else quantized
        if stream_blocks and dtype == torch.float32 and smallgemm.available():
            blocks = quant.load_blocks(folder, state, hf_config, log=_log)
        int8 = quant.int8_activations() if int8_activations is None else int8_activations
        if int8 and not blocks:
            raise JakiroError("int8 activations need a target converted from a GGUF file, streamed as its blocks "
                              f"({folder} has none here{'' if stream_blocks else ', or the float32 weights are streamed'})")
        if int8 and not (smallgemm.tiles_enabled() or smallgemm.int8_enabled()):
            raise JakiroError("int8 activations need a CPU with AVX-512 VNNI or AMX tiles (and JAKIRO_INT8 / "
                              "JAKIRO_AMX not set to 0); this one runs float32 inputs only")
        return cls(hf_config, state, name=os.path.basename(os.path.normpath(folder)), dtype=dtype, quantized=blocks,
                   input_bytes=1 if int8 else 3)

    def new_cache(self, max_len: int, scratch: int = 0) -> KVCache:
        """A cache for sequences of up to ``max_len`` tokens plus ``scratch`` slots for the
        uncommitted tree tokens of the last verification forward."""
        cfg = self.config
        cfg.check_length(max_len)
        if scratch > ROPE_SLACK:
            raise JakiroError(f"draft trees are limited to {ROPE_SLACK} tokens, got {scratch}")
        return KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, max_len + scratch, self.dtype)

    def new_batch_cache(self, batch: int, max_len: int) -> BatchKVCache:
        """A cache for ``batch`` independent sequences of up to ``max_len`` tokens each."""
        cfg = self.config
        cfg.check_length(max_len)
        return BatchKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, batch, max_len, self.dtype)

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache: KVCache,
                position_ids: torch.Tensor | None = None,
                tree_mask: torch.Tensor | None = None,
                logits_rows: torch.Tensor | slice | None = None, chunked: bool = False,
                aux_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the model over ``n`` new tokens placed after the cache's committed prefix.

        input_ids: [n] long. position_ids: [n] (default: consecutive after the prefix).
        tree_mask: [n, n] bool, True where new token i may attend new token j (default causal).
        logits_rows: which rows get logits (default all). Returns (logits [r, vocab],
        features [n, d]). The new KV entries are written but not committed: call
        ``cache.commit`` or ``cache.keep`` afterwards. ``aux_layers`` (increasing layer counts,
        e.g. (3, 15)): the features also carry the residual stream after that many decoder layers,
        [n, (1 + len(aux_layers)) * d], the final feature first (drafts with mid-layer inputs).

        ``chunked`` (prompts): with the AMX or the int8 kernel a causal run of up to ``CHUNKED_PREFILL_MAX``
        tokens (with int8 activations on the int8 kernel, of any length) goes through the one-call stack in pieces of
        ``SMALL_ROWS`` instead of oneDNN over the float32 weights: faster, and each token gets bitwise the features that feeding the
        tokens one at a time gives (within float32 accuracy of the float32 weights, as every
        quantized forward).
        """
        cfg = self.config
        n = input_ids.shape[0]
        past = cache.length
        if position_ids is None:
            position_ids = torch.arange(past, past + n)
        if n == 1 and tree_mask is not None and not bool(tree_mask[0, 0]):
            raise ValueError("a token must attend to itself")
        self.check_aux_layers(aux_layers)
        x = self.embed[input_ids]  # [n, d]
        if self._fused is not None and (n <= SMALL_ROWS or (
                chunked and tree_mask is None and n <= self._longest_chunked_prompt)):
            cache.check_room(n)
            pieces = []  # a longer causal run (a prompt) in pieces of SMALL_ROWS, each after those before it
            for s in range(0, n, SMALL_ROWS):
                pos = position_ids[s:s + SMALL_ROWS]
                pieces.append(smallgemm.decoder_layers(x[s:s + SMALL_ROWS], *self._fused, cache.data, past + s,
                                                       self.cos[pos], self.sin[pos], tree_mask, cfg.num_heads,
                                                       cfg.num_kv_heads, cfg.rms_norm_eps, self.scale, aux_layers,
                                                       self.input_bytes))
            x = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        else:
            x = self._layers(x, cache, position_ids, tree_mask, aux_layers)
        final, features = self._features(x)
        return self.lm_head(final if logits_rows is None else final[logits_rows]), features

    def check_aux_layers(self, aux_layers: tuple[int, ...]) -> None:
        if aux_layers:  # every forward checks: the usual case returns at once
            self.config.check_aux_layers(aux_layers)

    def _stack(self, run, x: torch.Tensor, aux_layers: tuple[int, ...]) -> torch.Tensor:
        """``run(x, a, b)`` (layers a..b-1 in torch) over the decoder layers, cut after each of
        ``aux_layers``: the last residual stream, then (with ``aux_layers``) the streams at the
        cuts, [n, 1 + A, d], as the fused stack returns them (``keep_after``)."""
        if not aux_layers:
            return run(x, 0, self.config.num_layers)
        streams, start = [], 0
        for end in (*aux_layers, self.config.num_layers):
            x = run(x, start, end)
            streams.append(x)
            start = end
        return torch.stack([streams[-1], *streams[:-1]], 1)

    def _features(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the final norm of the last stream [n, d], the features: it, then the mid-layer
        streams of ``x`` [n, 1 + A, d] as they are)."""
        cfg = self.config
        if x.dim() == 2:
            final = F.rms_norm(x, (x.shape[-1],), self.norm, cfg.rms_norm_eps)
            return final, final
        final = F.rms_norm(x[:, 0], (x.shape[-1],), self.norm, cfg.rms_norm_eps)
        return final, torch.cat((final, x[:, 1:].flatten(1)), 1)

    def _layers(self, x: torch.Tensor, cache: KVCache, position_ids: torch.Tensor,
                tree_mask: torch.Tensor | None, aux_layers: tuple[int, ...] = ()) -> torch.Tensor:
        """The decoder stack in torch operations (prefills, and where the fused one is unavailable);
        see ``_stack`` for ``aux_layers``."""
        n, past = x.shape[0], cache.length
        cos = self.cos[position_ids].unsqueeze(1)  # [n, 1, D]
        sin = self.sin[position_ids].unsqueeze(1)
        attn_mask, is_causal = None, False
        if n > 1:
            if tree_mask is None and past == 0:
                is_causal = True
            else:
                new_mask = tree_mask if tree_mask is not None else torch.ones(n, n, dtype=torch.bool).tril_()
                attn_mask = torch.cat((torch.ones(n, past, dtype=torch.bool), new_mask), 1)

        def run(h, a, b):
            for i in range(a, b):
                layer = self.layers[i]
                q, k, v = self._attention_inputs(layer, h, cos, sin)
                k_all, v_all = cache.write(i, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0))
                h = self._attention_output_and_mlp(layer, h, self._attend(q, k_all, v_all, attn_mask, is_causal))
            return h
        return self._stack(run, x, aux_layers)

    @torch.inference_mode()
    def decode_batch(self, input_ids: torch.Tensor, cache: BatchKVCache,
                     aux_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """One new token for each of the cache's sequences, at position ``cache.lengths[b]``:
        input_ids [batch] -> (logits [batch, vocab], features [batch, d], wider with
        ``aux_layers`` as in ``forward``). The new entries are written; ``cache.advance()``
        commits them."""
        cfg = self.config
        B, H, D = input_ids.shape[0], cfg.num_heads, cfg.head_dim
        if B != cache.batch:
            raise ValueError(f"{B} tokens for a cache of {cache.batch} sequences")
        self.check_aux_layers(aux_layers)
        positions = cache.lengths
        x = self.embed[input_ids]  # [B, d]
        if self._fused is not None:
            cache.check_room()
            x = smallgemm.decoder_layers_batch(x, *self._fused, cache.data, positions, self.cos[positions],
                                               self.sin[positions], cfg.num_heads, cfg.num_kv_heads,
                                               cfg.rms_norm_eps, self.scale, aux_layers, self.input_bytes)
        else:
            cos = self.cos[positions].unsqueeze(1)  # [B, 1, D]
            sin = self.sin[positions].unsqueeze(1)
            mask = cache.attention_mask()

            def run(h, a, b):
                for i in range(a, b):
                    layer = self.layers[i]
                    q, k, v = self._attention_inputs(layer, h, cos, sin)
                    k_all, v_all = cache.write(i, k, v)
                    # the query heads sharing a KV head as g rows of one head (see ``_attend``)
                    o = F.scaled_dot_product_attention(q.reshape(B, cfg.num_kv_heads, -1, D), k_all, v_all,
                                                       attn_mask=mask, scale=self.scale)
                    h = self._attention_output_and_mlp(layer, h, o.reshape(B, H * D))
                return h
            x = self._stack(run, x, aux_layers)
        final, features = self._features(x)
        return self.lm_head(final), features

    def _attend(self, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor,
                attn_mask: torch.Tensor | None, is_causal: bool) -> torch.Tensor:
        """q [n, H, D] over the cache's k, v [1, Hkv, L, D] -> [n, H D]. Outside the causal prefill
        the query heads sharing a KV head run as one head with g n rows (the mask repeated per
        group): the same products as grouped-query attention, each K/V row read once instead of
        g times, which is most of the cost of one token's attention over a long context."""
        cfg = self.config
        n, H, D = q.shape
        Hkv = cfg.num_kv_heads
        g = H // Hkv
        if is_causal or g == 1:
            o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k_all, v_all, is_causal=is_causal,
                                               attn_mask=attn_mask, scale=self.scale, enable_gqa=g > 1)
            return o[0].transpose(0, 1).reshape(n, H * D)
        grouped = q.transpose(0, 1).reshape(1, Hkv, g * n, D)  # heads h = j g + i share KV head j
        mask = attn_mask.repeat(g, 1) if attn_mask is not None else None
        o = F.scaled_dot_product_attention(grouped, k_all, v_all, attn_mask=mask, scale=self.scale)
        return o.view(H, n, D).transpose(0, 1).reshape(n, H * D)

    def _attention_inputs(self, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [n, d] -> rotated q [n, H, D], rotated k [n, Hkv, D], v [n, Hkv, D]."""
        cfg = self.config
        n, H, Hkv, D = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        h = F.rms_norm(x, (x.shape[-1],), layer.input_norm, eps)
        qkv = layer.qkv(h)  # [n, (H + 2 Hkv) D]
        qk = qkv[:, : (H + Hkv) * D].view(n, H + Hkv, D)
        v = qkv[:, (H + Hkv) * D:].view(n, Hkv, D)
        if layer.q_norm is not None:
            qk = torch.cat((F.rms_norm(qk[:, :H], (D,), layer.q_norm, eps),
                            F.rms_norm(qk[:, H:], (D,), layer.k_norm, eps)), 1)
        half = D // 2
        rotated = torch.cat((-qk[..., half:], qk[..., :half]), -1)
        qk = qk * cos + rotated * sin
        return qk[:, :H], qk[:, H:], v

    def _attention_output_and_mlp(self, layer: _Layer, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Residual stream after the attention output o [n, H D] and the MLP block."""
        x = x + layer.o(o)
        h = F.rms_norm(x, (x.shape[-1],), layer.post_norm, self.config.rms_norm_eps)
        gate, up = layer.gate_up(h).chunk(2, dim=-1)
        return x + layer.down(F.silu(gate) * up)

    __call__ = forward
