"""Target-model runtime for Llama-family causal LMs (Llama, Mistral, Qwen2/2.5, Qwen3, SmolLM2).

One forward over new tokens with explicit positions and a tree attention mask (causal over the
cached prefix, arbitrary ancestor mask among the new tokens); returns logits and the final-norm
features. Weights are loaded straight from safetensors into fused, pre-transposed matrices.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

from ..errors import JakiroError
from ..settings import Runtime
from .kv_cache import BatchKVCache, KVCache
from . import smallgemm
from .linear import SMALL_ROWS
from .target_config import TargetConfig, rope_tables
from .target_weights import gguf_layers, load_state_dict, state_layers
from .torch_stack import TorchStack

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


class TargetModel(TorchStack):
    """A Llama-family model with a tree-attention forward: float32 weights (a Hugging Face folder)
    or a GGUF file's own blocks (``from_folder`` on a GGUF file's folder)."""

    def __init__(self, hf_config, embed: torch.Tensor, layers: list, norm: torch.Tensor, lm_head, name: str = "",
                 dtype: torch.dtype = torch.float32, input_bytes: int = 3, gguf=None,
                 rope_factors: torch.Tensor | None = None):
        """``embed``: [vocab, d] float, or a GGUF file's rows of it; ``layers``: ``Layer``s whose
        matrices are ``FastLinear`` (float weights) or ``BlockLinear`` (GGUF blocks);
        ``input_bytes``: how the blocks take their inputs (3: float32 accuracy; 1: int8
        activations); ``gguf``: the file's ``GGUFWeights`` (float32 copies on request)."""
        self.hf_config = hf_config
        self.input_bytes = input_bytes
        self.config = cfg = TargetConfig.from_hf(hf_config, name)
        self.dtype = dtype
        self.kv_dtype = dtype  # the KV cache's (``use_kv_cache``)
        self.embed, self.layers, self.norm, self.lm_head = embed, layers, norm, lm_head
        self.gguf = gguf
        self.blocks_only = gguf is not None  # no float32 weights: every forward runs the kernels
        # q, k, v, o, gate, up and down of each layer and the head
        self.quantized_matrices = 7 * len(layers) + 1 if self.blocks_only else 0
        # tree tokens drafted past the last committable position still need a rotary angle
        self.cos, self.sin = rope_tables(hf_config, cfg.head_dim, cfg.max_context + ROPE_SLACK, rope_factors)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self._fused = self._fused_weights()
        # the longest prompt that runs in pieces (see CHUNKED_PREFILL_MAX); 0: none does
        self._longest_chunked_prompt = (
            cfg.max_context if self.blocks_only and self._fused is not None else
            0 if self._fused is None or not self.tile_matrices else
            cfg.max_context if input_bytes == 1 and not smallgemm.tiles_enabled() else CHUNKED_PREFILL_MAX)

    @property
    def int8_activations(self) -> bool:
        """Whether the quantized matrices take their inputs as int8 (``from_folder``)."""
        return self.input_bytes == 1

    @property
    def runtime(self) -> Runtime:
        """What ``from_folder`` chose: whether the GGUF file's blocks are streamed, taking int8 inputs."""
        return Runtime(quantized=self.blocks_only, int8_activations=self.int8_activations,
                       kv_cache="float16" if self.kv_dtype == torch.float16 else "float32")

    def use_kv_cache(self, kind: str) -> None:
        """Hold the keys and values of the caches made from now on as ``kind`` ("float32" or
        "float16"); float16 needs every forward to run the kernels (a GGUF target from its blocks)."""
        if kind == "float16" and not (self.blocks_only and self._fused is not None):
            raise JakiroError("a float16 KV cache needs a GGUF target run from its own blocks by the kernels "
                              "(this one runs float32 weights)")
        self.kv_dtype = torch.float16 if kind == "float16" else self.dtype

    @property
    def tile_matrices(self) -> int:
        """Weight matrices (as the runtime stacks them: q/k/v and gate/up in one) streamed through
        the AMX kernel or the int8 (AVX-512 VNNI) one."""
        linears = [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return sum(lin.tiles for lin in linears + [self.lm_head])

    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Float32 embeddings [n, d] of token ids [n]."""
        return embedding_rows(self.embed, ids)

    def dense_embedding(self) -> torch.Tensor:
        """The embedding [vocab, d] in float32 (a copy of a GGUF file's)."""
        return self.embed if self.gguf is None else self.gguf.dense("token_embd.weight")

    def dense_head(self) -> torch.Tensor:
        """The LM head [vocab, d] in float32 (a copy of a GGUF file's)."""
        if self.gguf is None:
            return self.lm_head.weight
        return self.gguf.dense("output.weight" if "output.weight" in self.gguf else "token_embd.weight")

    @property
    def head_rows(self) -> torch.Tensor:
        """The LM head's rows as drafts index them: [vocab, d] float32, or a GGUF file's rows
        (``embedding_rows`` turns either into float32)."""
        return self.lm_head.weight if self.lm_head.weight is not None else self.lm_head.quantized[1]

    def _fused_weights(self) -> tuple[list, list[int]] | None:
        """The layers' weights as ``smallgemm.decoder_layers`` takes them (twelve per layer: see
        ``csrc/decoder.cpp``), where every matrix has a small-batch kernel layout; else None
        (forwards stay in torch)."""
        weights, sizes = [], []
        for layer in self.layers:
            linears = (layer.qkv, layer.o, layer.gate_up, layer.down)
            if any(lin.kernel_weight is None for lin in linears) or any(
                    lin.bias is not None for lin in linears[1:]) or any(
                    len(getattr(lin, "parts", (0,))) > 1 for lin in linears[1::2]):
                return None
            qkv, gate_up = getattr(layer.qkv, "parts", [layer.qkv.kernel_weight]), getattr(
                layer.gate_up, "parts", [layer.gate_up.kernel_weight])
            # apart from q, k and v as three parts: v alone (after q and k in one), or k and v
            k_v = qkv[1:] if len(qkv) == 3 else [None, qkv[1]] if len(qkv) == 2 else [None, None]
            weights += [layer.input_norm, layer.post_norm, qkv[0], layer.qkv.bias, layer.o.kernel_weight, gate_up[0],
                        layer.down.kernel_weight, layer.q_norm, layer.k_norm, *k_v,
                        gate_up[1] if len(gate_up) == 2 else None]
            sizes += [lin.out_features for lin in linears]
        return weights, sizes

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_folder(cls, folder: str, runtime: Runtime | None = None,
                    dtype: torch.dtype = torch.float32) -> "TargetModel":
        """A Hugging Face folder (float weights), or a GGUF file's folder (``hub.resolve_target``)
        as ``runtime`` (default: ``Runtime.from_env()``) asks: its blocks streamed as the file
        holds them unless ``runtime.quantized`` is False (then a float32 copy runs), taking int8
        inputs (True; needs a CPU with AVX-512 VNNI or AMX) or float32-accurate ones (False);
        unset: int8 where the CPU can; its KV cache float16 with int8 inputs and float32 with
        float32-accurate ones unless ``runtime.kv_cache`` says. ``runtime`` of the model says what
        was chosen."""
        from . import gguf_file, quant
        from .hub import _log
        runtime = runtime or Runtime.from_env()
        if not os.path.isdir(folder):
            raise JakiroError(f"model folder not found: {folder}")
        if not os.path.exists(os.path.join(folder, "config.json")):
            raise JakiroError(f"{folder} is not a Hugging Face model folder (no config.json)")
        from transformers import AutoConfig
        try:
            hf_config = AutoConfig.from_pretrained(folder)
        except Exception as exc:
            raise JakiroError(f"cannot read {os.path.join(folder, 'config.json')}: {exc}") from None
        cfg = TargetConfig.from_hf(hf_config)  # fail on the architecture before reading weights
        name = os.path.basename(os.path.normpath(folder))
        is_gguf = gguf_file.is_gguf_folder(folder)
        stream_blocks = is_gguf and runtime.quantized and dtype == torch.float32
        if is_gguf and stream_blocks and not smallgemm.available():
            _log("without the small-batch kernel a GGUF file's blocks cannot be streamed: running a float32 copy")
            stream_blocks = False
        setting = runtime.int8_activations
        int8 = setting if setting is not None else stream_blocks and quant.int8_activations_default()
        if int8 and not stream_blocks:
            raise JakiroError("int8 activations need a target from a GGUF file, streamed as its blocks "
                              f"({folder} has none here{'' if not is_gguf else ', or a float32 copy is run'})")
        if int8 and not smallgemm.int8_activations_usable():
            raise JakiroError("int8 activations need a CPU with AVX-512 VNNI or AMX tiles (and JAKIRO_INT8 / "
                              "JAKIRO_AMX not set to 0); this one runs float32 inputs only")
        input_bytes = 1 if int8 else 3
        if not stream_blocks:
            if runtime.kv_cache == "float16":
                raise JakiroError(f"a {runtime.kv_cache} KV cache needs a GGUF target run from its own blocks "
                                  f"({folder} {'is run as a float32 copy' if is_gguf else 'holds float weights'})")
            state = load_state_dict(folder)
            return cls(hf_config, *state_layers(cfg, state, dtype), name=name, dtype=dtype)
        weights = gguf_file.GGUFWeights(folder)
        factors = weights.raw("rope_freqs.weight", copy=True) if "rope_freqs.weight" in weights else None
        model = cls(hf_config, *gguf_layers(cfg, weights, input_bytes), name=name, input_bytes=input_bytes,
                    gguf=weights, rope_factors=factors)
        model.use_kv_cache(runtime.kv_cache or ("float16" if int8 else "float32"))
        return model

    def new_cache(self, max_len: int, scratch: int = 0) -> KVCache:
        """A cache for sequences of up to ``max_len`` tokens plus ``scratch`` slots for the
        uncommitted tree tokens of the last verification forward."""
        cfg = self.config
        return KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self._cache_room(max_len, scratch),
                       self.kv_dtype)

    def new_batch_cache(self, batch: int, max_len: int, scratch: int = 0) -> BatchKVCache:
        """A cache for ``batch`` independent sequences of up to ``max_len`` tokens each (plus
        ``scratch`` slots each for the uncommitted tokens of a verification forward)."""
        cfg = self.config
        return BatchKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, batch, self._cache_room(max_len, scratch),
                            self.kv_dtype)

    def _cache_room(self, max_len: int, scratch: int) -> int:
        """Entries a sequence's cache holds: ``max_len`` within the context, ``scratch`` within the
        rotary tables' slack past it."""
        self.config.check_length(max_len)
        if scratch > ROPE_SLACK:
            raise JakiroError(f"draft trees are limited to {ROPE_SLACK} tokens, got {scratch}")
        return max_len + scratch

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
        x = self.embed_rows(input_ids)  # [n, d]
        if self._fused is not None and (n <= SMALL_ROWS or self.blocks_only or (
                chunked and tree_mask is None and n <= self._longest_chunked_prompt)):
            cache.check_room(n)
            # a longer causal run (a prompt) in pieces of SMALL_ROWS, each after those before it; a
            # larger tree (blocks only) in one piece
            step = SMALL_ROWS if tree_mask is None else n
            pieces = []
            for s in range(0, n, step):
                pos = position_ids[s:s + step]
                pieces.append(smallgemm.decoder_layers(x[s:s + step], *self._fused, cache.data, past + s,
                                                       self.cos[pos], self.sin[pos], tree_mask, cfg.num_heads,
                                                       cfg.num_kv_heads, cfg.rms_norm_eps, self.scale, aux_layers,
                                                       self.input_bytes))
            x = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        else:
            x = self._layers(x, cache, position_ids, tree_mask, aux_layers)
        final, features = self._features(x)
        return self.lm_head(final if logits_rows is None else final[logits_rows]), features

    def fused_rows(self, n: int, tree: bool = True) -> bool:
        """Whether a forward over ``n`` new tokens (a tree, or with ``tree=False`` a prompt run
        with ``chunked``) goes through the one-call stack: rows it computes are computed the same
        in ``forward_rows``, and a prompt it takes in pieces the same piece by piece."""
        return self._fused is not None and (n <= SMALL_ROWS or self.blocks_only or (
            not tree and n <= self._longest_chunked_prompt))

    @torch.inference_mode()
    def forward_rows(self, input_ids: torch.Tensor, kv: torch.Tensor, seq: torch.Tensor, at: torch.Tensor,
                     prefix: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                     aux_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of several sequences in one pass (a batch of draft trees verified together):
        row r of sequence ``seq[r]`` (slot of ``kv``, a ``BatchKVCache``'s data) is written at
        ``at[r]``, rotated for ``positions[r]`` and attends the sequence's first ``prefix[r]``
        entries, then the rows c with ``mask[r, c]`` (within its sequence, in increasing ``at``).
        Each row's logits are bitwise those of its tree's ``forward`` alone where ``fused_rows``
        holds for that tree. Returns (logits [N, vocab], features [N, d], wider with
        ``aux_layers``)."""
        cfg = self.config
        if self._fused is None:
            raise JakiroError("batched verification needs the one-call kernels (smallgemm)")
        self.check_aux_layers(aux_layers)
        x = smallgemm.decoder_layers_ragged(self.embed_rows(input_ids), *self._fused, kv, seq, at, prefix, mask,
                                            self.cos[positions], self.sin[positions], cfg.num_heads,
                                            cfg.num_kv_heads, cfg.rms_norm_eps, self.scale, aux_layers,
                                            self.input_bytes)
        final, features = self._features(x)
        # the head in pieces of at most SMALL_ROWS rows: the kernel a tree's own forward used
        logits = torch.cat([self.lm_head(final[s:s + SMALL_ROWS]) for s in range(0, final.shape[0], SMALL_ROWS)])
        return logits, features

    def check_aux_layers(self, aux_layers: tuple[int, ...]) -> None:
        if aux_layers:  # every forward checks: the usual case returns at once
            self.config.check_aux_layers(aux_layers)

    def _features(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the final norm of the last stream [n, d], the features: it, then the mid-layer
        streams of ``x`` [n, 1 + A, d] as they are)."""
        cfg = self.config
        if x.dim() == 2:
            final = F.rms_norm(x, (x.shape[-1],), self.norm, cfg.rms_norm_eps)
            return final, final
        final = F.rms_norm(x[:, 0], (x.shape[-1],), self.norm, cfg.rms_norm_eps)
        return final, torch.cat((final, x[:, 1:].flatten(1)), 1)

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
        x = self.embed_rows(input_ids)  # [B, d]
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

    __call__ = forward


def embedding_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Float32 rows [n, d] of an embedding for token ids: a float table [V, d], or a GGUF file's
    rows of it (raw blocks, float16 or bfloat16)."""
    if table.dtype == torch.float32 and table.dim() == 2:
        return F.embedding(ids, table)
    return smallgemm.gguf_rows(table, ids.to(torch.long))
