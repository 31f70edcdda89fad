"""The draft network: EAGLE core (feature + next-token fusion, one decoder layer) with either a
dense MLP (EAGLE-2) or Jakiro's Mixture-of-Experts heads and contrastive branch.

The target's embedding and LM head are used frozen and are never part of the draft's state.
All experts are evaluated for every row (N is small and the rows are few), then the top-K are
gathered: simple, batched, and identical in training and inference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import JakiroError
from ..models.kv_cache import KVCache
from ..models.linear import FastLinear
from ..models.target import ROPE_SLACK, embedding_rows
from ..models.target_config import rope_tables
from .config import DraftConfig
from .fused import FusedSteps
from .head import INPUT_BYTES, HeadRows

@dataclass
class DraftOutput:
    features: torch.Tensor  # [B, T, K, d] output feature of each activated expert (K = 1 if dense)
    weights: torch.Tensor  # [B, T, K] renormalised router weights of those experts
    blend: torch.Tensor  # [B, T, d] weighted sum (the dense output for eagle2)
    contrastive: torch.Tensor | None  # [B, T, d] prediction of the feature two positions ahead


def _scatter_rows(t: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor], B: int, T: int) -> torch.Tensor:
    """Rows t [N, ...] at (b, j) of a zero [B, T, ...] tensor (differentiable)."""
    return t.new_zeros(B, T, *t.shape[1:]).index_put(rows, t)


def _unrolled_attention(q: torch.Tensor, steps: list, groups: int) -> torch.Tensor:
    """Attention of an unrolled draft step: row j sees the first step's keys of rows 0..j and one
    key per later step, its own row's. q [B, H, T, D]; steps: [(k, v)] of [B, Hkv, T, D].
    Written out (scores over the first step's keys plus one diagonal column per later step)
    rather than one masked attention over all steps' keys, which would compute T×T scores per
    step only to keep T of them."""
    k1, v1 = (x.repeat_interleave(groups, 1) for x in steps[0])
    T, D = q.shape[2], q.shape[3]
    scale = D ** -0.5
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril_()
    scores = (q @ k1.transpose(-1, -2)).mul_(scale).masked_fill_(~causal, float("-inf"))
    later = [(k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)) for k, v in steps[1:]]
    diag = torch.stack([(q * k).sum(-1) * scale for k, _ in later], -1)  # [B, H, T, S-1]
    p = torch.cat((scores, diag), -1).softmax(-1)
    o = p[..., :T] @ v1
    for i, (_, v) in enumerate(later):
        o = o + p[..., T + i:T + i + 1] * v
    return o


class DraftModel(HeadRows, FusedSteps, nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        self.config = c = config
        d, H, Hkv, D = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        eagle3 = c.method == "eagle3"
        # EAGLE-2: fc fuses (embedding, feature) into the residual; EAGLE-3: fc maps the target's
        # three streams to the first step's input g, and attention reads (norm(embedding), norm(g))
        self.fc = nn.Linear(len(c.aux_layers) * d, d, bias=False) if eagle3 else nn.Linear(2 * d, d, bias=True)
        self.input_norm = nn.Parameter(torch.ones(d))
        attn_in = 2 * d if eagle3 else d
        if eagle3:
            self.hidden_norm = nn.Parameter(torch.ones(d))
        self.q_proj = nn.Linear(attn_in, H * D, bias=False)
        self.k_proj = nn.Linear(attn_in, Hkv * D, bias=False)
        self.v_proj = nn.Linear(attn_in, Hkv * D, bias=False)
        self.o_proj = nn.Linear(H * D, d, bias=False)
        self.post_norm = nn.Parameter(torch.ones(d))
        n_exp = c.num_experts
        I = c.intermediate_size
        # experts: [N, 2I, d] gate+up and [N, d, I] down; eagle2 is the N = 1 dense case
        self.gate_up = nn.Parameter(torch.empty(n_exp, 2 * I, d))
        self.down = nn.Parameter(torch.empty(n_exp, d, I))
        if c.method == "jakiro":
            self.router = nn.Linear(d, n_exp, bias=False)
            if c.parallel_decoding:
                self.con_router = nn.Linear(d, n_exp, bias=False)
        if c.aux_layers and not eagle3:  # mid-layer streams -> the first step's input feature
            self.aux_proj = nn.Linear(len(c.aux_layers) * d, d, bias=False)
        if eagle3:  # its own final norm and head over the draft vocabulary
            self.norm = nn.Parameter(torch.ones(d))
            self.lm_head = nn.Parameter(torch.empty(c.draft_vocab_size or c.vocab_size, d))
        if c.draft_vocab_size is not None:
            self.register_buffer("d2t", torch.arange(c.draft_vocab_size, dtype=torch.long))
        self.reset_parameters()
        # a deep tree drafted near the end of the context needs angles past it
        cos, sin = rope_tables(c.to_llama_config(), D, c.max_position_embeddings + ROPE_SLACK)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.embed: torch.Tensor | None = None  # target's, frozen, attached by attach_target
        self.head_weight: torch.Tensor | None = None  # [head_vocab, d]
        self._lm_head: torch.Tensor | None = None  # the target's whole LM head [V, d]
        self._heads: dict[int | None, tuple] = {}  # limit -> (weights stamp, DraftHead)
        self._fast: dict[str, tuple] = {}  # inference copies of the layers: name -> (stamp, FastLinear)
        self._head_blocks: tuple[str, torch.Tensor] | None = None
        # inference streams the layers as Q8_0 blocks (set with a quantized target: the draft
        # then costs a quarter of the bytes; what it proposes changes slightly, never what is accepted)
        self.quantized = False

    def reset_parameters(self, std: float = 0.02) -> None:
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            nn.init.normal_(lin.weight, std=std)
        nn.init.normal_(self.fc.weight, std=std)
        if self.fc.bias is not None:
            nn.init.zeros_(self.fc.bias)
        if hasattr(self, "lm_head"):
            nn.init.normal_(self.lm_head, std=std)
        nn.init.normal_(self.gate_up, std=std)
        nn.init.normal_(self.down, std=std)
        for name in ("router", "con_router"):
            if hasattr(self, name):
                nn.init.normal_(getattr(self, name).weight, std=std)
        if hasattr(self, "aux_proj"):  # starts as the draft without mid-layer inputs
            nn.init.zeros_(self.aux_proj.weight)

    # ------------------------------------------------------------------ mid-layer inputs
    @property
    def feature_width(self) -> int:
        """Width of the target features this draft reads: the final feature, then the residual
        stream after each of ``config.aux_layers`` (``TargetModel.forward(aux_layers=...)``)."""
        return (1 + len(self.config.aux_layers)) * self.config.hidden_size

    def split_features(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Target features [..., width] -> (the final feature [..., d], what the mid-layer streams
        add to the first step's input [..., d], or None without them). Wider features than the
        draft reads (a dataset that also holds mid-layer streams) give the final feature alone."""
        d = self.config.hidden_size
        if not self.config.aux_layers:
            return features[..., :d], None
        self._check_width(features)
        if self.config.method == "eagle3":  # the first step reads fc(streams), not the final feature
            return features[..., :d], None
        streams = features[..., d:].unflatten(-1, (len(self.config.aux_layers), d))
        streams = F.rms_norm(streams, (d,), eps=self.config.rms_norm_eps).flatten(-2)
        return features[..., :d], self._linear("aux_proj", streams, (self.aux_proj.weight,))

    def _check_width(self, features: torch.Tensor) -> None:
        if features.shape[-1] != self.feature_width:
            raise JakiroError(f"this draft reads the target's features and its residual streams after layers "
                              f"{self.config.aux_layers} ({self.feature_width} values per token), got "
                              f"{features.shape[-1]}")

    def input_features(self, features: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
        """What the first draft step reads at committed positions: the final feature plus the
        mid-layer streams' part (and ``noise``, training's); EAGLE-3: fc over the three streams."""
        if self.config.method == "eagle3":
            self._check_width(features)
            g = self._linear("fc_in", features[..., self.config.hidden_size:], (self.fc.weight,))
            return g if noise is None else g + noise
        final, extra = self.split_features(features)
        if noise is not None:
            extra = noise if extra is None else noise + extra
        return final if extra is None else final + extra

    # ------------------------------------------------------------------ target coupling
    def attach_target(self, embed: torch.Tensor, lm_head: torch.Tensor,
                      head_blocks: tuple[str, torch.Tensor] | None = None) -> "DraftModel":
        """Use the target's embedding [V, d] and LM head [V, d] (frozen, not copied);
        ``head_blocks``: the head's quantized blocks (``models.quant``), which the draft head's
        rows then stream too (bitwise the same weights, a quarter of the bytes)."""
        self.embed = embed.detach()
        self._head_blocks = head_blocks
        self._lm_head = head = lm_head.detach()
        if self.config.draft_vocab_size is not None or head.dtype != torch.float32:
            head = embedding_rows(head, self._vocab_order()).contiguous()
        self.head_weight = head
        self._heads = {}
        return self

    def _linear(self, name: str, x: torch.Tensor, weights: tuple, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ cat(weights)^T (+ bias). In training, ``F.linear``; in inference, the runtime's
        ``FastLinear`` (see ``_fast_layer``)."""
        if self.training or torch.is_grad_enabled():
            return F.linear(x, weights[0] if len(weights) == 1 else torch.cat(weights), bias)
        return self._fast_layer(name, weights, bias)(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)

    def _fast_layer(self, name: str, weights: tuple, bias: torch.Tensor | None = None) -> FastLinear:
        """The inference copy of a layer (the small-batch kernel for a draft step's few rows,
        oneDNN for a prompt's catch-up), built on first use and again whenever the weights change
        (a training run measuring its draft between optimiser steps)."""
        stamp = tuple((w.data_ptr(), w._version) for w in weights + ((bias,) if bias is not None else ()))
        entry = self._fast.get(name)
        if entry is None or entry[0] != stamp:
            weight = torch.cat(weights) if len(weights) > 1 else weights[0].contiguous()
            blocks = None
            if self.quantized and weight.shape[1] % 32 == 0:
                from ..models.quant import quantize_q8_0
                blocks = ("q8_0", quantize_q8_0(weight))
            entry = self._fast[name] = (stamp, FastLinear(weight, None if bias is None else bias.detach(),
                                                          quantized=blocks, input_bytes=INPUT_BYTES))
        return entry[1]

    def new_cache(self, max_len: int) -> KVCache:
        c = self.config
        return KVCache(1, c.num_key_value_heads, c.head_dim, max_len, self.fc.weight.dtype)

    # ------------------------------------------------------------------ forward
    def forward(self, features: torch.Tensor, token_ids: torch.Tensor, position_ids: torch.Tensor,
                cache: KVCache | None = None, attn_mask: torch.Tensor | None = None) -> DraftOutput:
        """features [B, T, d] (f_t), token_ids [B, T] (x_{t+1}), position_ids [T] (t).

        Without a cache the T rows attend causally (training). With a cache (B = 1) the new keys
        are written after its committed prefix and ``attn_mask`` [T, past + T] (default causal)
        says what each row sees; the caller commits or discards the entries.
        """
        return self.heads(self.attend(features, token_ids, position_ids, cache, attn_mask))

    def attend(self, features: torch.Tensor, token_ids: torch.Tensor, position_ids: torch.Tensor,
               cache: KVCache | None = None, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The fusion and attention half of ``forward``: the residual stream r [B, T, d]."""
        c = self.config
        B, T, _ = features.shape
        H, Hkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        fused = self._fused_step(features, token_ids, position_ids, cache, attn_mask)
        if fused is not None:
            return fused
        x, h = self._fusion(features, token_ids)
        q, k, v = self._linear("qkv", h, (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight)).split(
            (H * D, Hkv * D, Hkv * D), -1)
        q, k, v = q.reshape(B, T, H, D), k.reshape(B, T, Hkv, D), v.reshape(B, T, Hkv, D)
        q, k = self._rope(q, position_ids), self._rope(k, position_ids)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, D]
        gqa = H != Hkv
        if cache is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            past = cache.length
            k_all, v_all = cache.write(0, k, v)
            if attn_mask is None and T > 1:
                attn_mask = torch.cat((torch.ones(T, past, dtype=torch.bool),
                                       torch.ones(T, T, dtype=torch.bool).tril_()), 1)
            o = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=attn_mask, enable_gqa=gqa)
        # residual after attention
        return x + self._linear("o", o.transpose(1, 2).reshape(B, T, H * D), (self.o_proj.weight,))

    def attend_unrolled(self, features: torch.Tensor, token_ids: torch.Tensor, position_ids: torch.Tensor,
                        unrolled: list, rows: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``attend`` for one step of training's unrolled drafting (no cache), which drafts as
        inference does, several steps deep: the residual stream of ``rows`` = (b, j) only, [N, d].

        ``unrolled`` holds the keys and values of the earlier steps over the batch [B, T] and gets
        this step's. Row j of step s is the s-th draft step of a cycle rooted at position j: it
        sees the first step's keys of rows 0..j (the target's own features) and, of every later
        step, only its own row's key (its own earlier draft steps). So the first step computes
        every row's keys and values and, like every step, queries and the output projection only
        for ``rows``; a later step computes ``rows`` alone (a row a step leaves out has no later
        step that reads it: callers pass each step a subset of the previous step's rows).
        """
        c = self.config
        B, T, _ = features.shape
        H, Hkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        b, j = rows
        pos = position_ids[j]
        first = not unrolled
        if first:
            x, h = self._fusion(features, token_ids)
            k, v = self._linear("kv", h, (self.k_proj.weight, self.v_proj.weight)).split((Hkv * D, Hkv * D), -1)
            k, v = self._rope(k.reshape(B, T, Hkv, D), position_ids), v.reshape(B, T, Hkv, D)
            x, q = x[b, j], self._linear("q", h[b, j], (self.q_proj.weight,))
        else:
            x, h = self._fusion(features[b, j], token_ids[b, j])
            q, k, v = self._linear("qkv", h, (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight)).split(
                (H * D, Hkv * D, Hkv * D), -1)
            k = _scatter_rows(self._rope(k.reshape(-1, Hkv, D), pos), rows, B, T)
            v = _scatter_rows(v.reshape(-1, Hkv, D), rows, B, T)
        q = _scatter_rows(self._rope(q.reshape(-1, H, D), pos), rows, B, T)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, D]
        unrolled.append((k, v))
        if first:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=H != Hkv)
        else:
            o = _unrolled_attention(q, unrolled, H // Hkv)
        return x + self._linear("o", o.transpose(1, 2)[b, j].reshape(-1, H * D), (self.o_proj.weight,))

    def _fusion(self, features: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """EAGLE's fusion of (x_{t+1}, f_t) into the residual x, and x normalised for attention;
        EAGLE-3: the residual is g = f_t itself, attention reads (norm(embedding), norm(g))."""
        c = self.config
        if c.method == "eagle3":
            emb = F.rms_norm(self._embedding(token_ids), (c.hidden_size,), self.input_norm, c.rms_norm_eps)
            g = F.rms_norm(features, (c.hidden_size,), self.hidden_norm, c.rms_norm_eps)
            return features, torch.cat((emb, g), -1)
        x = self._linear("fc", torch.cat((self._embedding(token_ids), features), -1), (self.fc.weight,),
                         self.fc.bias)
        return x, F.rms_norm(x, (self.config.hidden_size,), self.input_norm, self.config.rms_norm_eps)

    def _embedding(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The target's embeddings of token ids of any shape (a float table or a GGUF file's rows)."""
        if self.embed.dtype == torch.float32:
            return F.embedding(token_ids, self.embed)
        return embedding_rows(self.embed, token_ids.reshape(-1)).reshape(*token_ids.shape, -1)

    def _rope(self, t: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of t [..., T, heads, D] at positions [T]."""
        cos = self.rope_cos[position_ids].unsqueeze(-2)  # [T, 1, D]
        sin = self.rope_sin[position_ids].unsqueeze(-2)
        half = t.shape[-1] // 2
        return t * cos + torch.cat((-t[..., half:], t[..., :half]), -1) * sin

    def fill_cache(self, features: torch.Tensor, token_ids: torch.Tensor, position_ids: torch.Tensor,
                   cache: KVCache) -> None:
        """Write (and commit) the keys and values of T committed rows (features [T, d], token_ids
        [T], position_ids [T]) without their attention: rows that only later rows attend to (a
        catch-up's all but last) need nothing else, and skip the queries, the attention over the
        context and the output projection. The same keys and values as ``attend`` writes."""
        c = self.config
        Hkv, D = c.num_key_value_heads, c.head_dim
        _, h = self._fusion(features, token_ids)
        k, v = self._linear("kv", h, (self.k_proj.weight, self.v_proj.weight)).split((Hkv * D, Hkv * D), -1)
        k, v = self._rope(k.reshape(-1, Hkv, D), position_ids), v.reshape(-1, Hkv, D)
        cache.write(0, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0))
        cache.commit(k.shape[0])

    def heads(self, r: torch.Tensor) -> DraftOutput:
        """The per-row half of ``forward``: experts (or the dense MLP), router, blend and
        contrastive branch for residual rows r [..., d] (training passes only the rows it needs)."""
        c = self.config
        lead, d = r.shape[:-1], r.shape[-1]
        m = F.rms_norm(r, (d,), self.post_norm, c.rms_norm_eps)
        if c.method != "jakiro":
            out = r + self._expert(0, m)
            return DraftOutput(out.unsqueeze(-2), r.new_ones(*lead, 1), out, None)
        if self.training or torch.is_grad_enabled():
            gate, up = torch.einsum("...d,nfd->...nf", m, self.gate_up).chunk(2, dim=-1)
            experts = torch.einsum("...ni,ndi->...nd", F.silu(gate) * up, self.down)  # [..., N, d]
        else:
            experts = torch.stack([self._expert(n, m) for n in range(c.num_experts)], -2)
        router_probs = self.router(m).softmax(-1)  # [..., N]
        top_w, top_i = torch.topk(router_probs, c.experts_per_token, dim=-1)  # [..., K]
        top_w = top_w / top_w.sum(-1, keepdim=True)
        chosen = experts.gather(-2, top_i.unsqueeze(-1).expand(*lead, -1, d))  # [..., K, d]
        blend = r + (top_w.unsqueeze(-1) * chosen).sum(-2)
        contrastive = None
        if c.parallel_decoding:
            coef = self.con_router(m).softmax(-1).gather(-1, top_i[..., :2])  # [..., 2]: A, B
            contrastive = r + coef[..., :1] * chosen[..., 0, :] - coef[..., 1:] * chosen[..., 1, :]
        return DraftOutput(r.unsqueeze(-2) + chosen, top_w, blend, contrastive)

    def first_feature(self, r: torch.Tensor) -> torch.Tensor:
        """For one residual row r [1, d]: r plus EAGLE-2's MLP, or plus the expert the router
        ranks first (a decoupled Jakiro node's first child carries it): that part of ``heads``
        without the other experts, the router's weights or the contrastive branch."""
        c = self.config
        m = F.rms_norm(r, (r.shape[-1],), self.post_norm, c.rms_norm_eps)
        n = 0 if c.method != "jakiro" else int(self.router(m).argmax(-1)[0])
        return r + self._expert(n, m)

    def _expert(self, n: int, m: torch.Tensor) -> torch.Tensor:
        """Expert ``n``'s MLP (the dense MLP for eagle2) on normalised rows m [..., d]."""
        gate, up = self._linear(f"gate_up{n}", m, (self.gate_up[n],)).chunk(2, dim=-1)
        return self._linear(f"down{n}", F.silu(gate) * up, (self.down[n],))
