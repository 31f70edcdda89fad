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

from ..models.kv_cache import KVCache
from ..models.linear import FastLinear
from ..models.target import ROPE_SLACK, rope_tables
from .config import DraftConfig


@dataclass
class DraftOutput:
    features: torch.Tensor  # [B, T, K, d] output feature of each activated expert (K = 1 if dense)
    weights: torch.Tensor  # [B, T, K] renormalised router weights of those experts
    blend: torch.Tensor  # [B, T, d] weighted sum (the dense output for eagle2)
    contrastive: torch.Tensor | None  # [B, T, d] prediction of the feature two positions ahead
    router_probs: torch.Tensor | None  # [B, T, N]


class DraftModel(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        self.config = c = config
        d, H, Hkv, D = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.fc = nn.Linear(2 * d, d, bias=True)
        self.input_norm = nn.Parameter(torch.ones(d))
        self.q_proj = nn.Linear(d, H * D, bias=False)
        self.k_proj = nn.Linear(d, Hkv * D, bias=False)
        self.v_proj = nn.Linear(d, Hkv * D, bias=False)
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
        if c.draft_vocab_size is not None:
            self.register_buffer("d2t", torch.arange(c.draft_vocab_size, dtype=torch.long))
        self.reset_parameters()
        # a deep tree drafted near the end of the context needs angles past it
        cos, sin = rope_tables(c.to_llama_config(), D, c.max_position_embeddings + ROPE_SLACK)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.embed: torch.Tensor | None = None  # target's, frozen, attached by attach_target
        self.head_weight: torch.Tensor | None = None  # [head_vocab, d]
        self._head_fast: dict[int | None, FastLinear] = {}

    def reset_parameters(self, std: float = 0.02) -> None:
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            nn.init.normal_(lin.weight, std=std)
        nn.init.normal_(self.fc.weight, std=std)
        nn.init.zeros_(self.fc.bias)
        nn.init.normal_(self.gate_up, std=std)
        nn.init.normal_(self.down, std=std)
        for name in ("router", "con_router"):
            if hasattr(self, name):
                nn.init.normal_(getattr(self, name).weight, std=std)

    # ------------------------------------------------------------------ target coupling
    def attach_target(self, embed: torch.Tensor, lm_head: torch.Tensor) -> "DraftModel":
        """Use the target's embedding [V, d] and LM head [V, d] (frozen, not copied)."""
        self.embed = embed.detach()
        head = lm_head.detach()
        if self.config.draft_vocab_size is not None:
            head = head[self.d2t].contiguous()
        self.head_weight = head
        self._head_fast = {}
        return self

    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Restrict the draft head to these target token ids (most frequent first)."""
        if token_ids.numel() != self.config.draft_vocab_size:
            raise ValueError(f"expected {self.config.draft_vocab_size} ids, got {token_ids.numel()}")
        self.d2t.copy_(token_ids.to(torch.long))

    def head_logits(self, features: torch.Tensor, limit: int | None = None) -> torch.Tensor:
        """[..., d] -> [..., head_vocab] logits over the draft vocabulary, or over its first
        ``limit`` (most frequent) entries when a reduced vocabulary is in use."""
        if self.training or torch.is_grad_enabled():
            return F.linear(features, self.head_weight[:limit])
        fast = self._head_fast.get(limit)
        if fast is None:
            fast = self._head_fast[limit] = FastLinear(self.head_weight[:limit].contiguous())
        flat = features.reshape(-1, features.shape[-1])
        return fast(flat).view(*features.shape[:-1], -1)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.config.draft_vocab_size is None else self.d2t[draft_ids]

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
        c = self.config
        B, T, d = features.shape
        H, Hkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        x = self.fc(torch.cat((F.embedding(token_ids, self.embed), features), -1))
        h = F.rms_norm(x, (d,), self.input_norm, c.rms_norm_eps)
        q = self.q_proj(h).view(B, T, H, D)
        k = self.k_proj(h).view(B, T, Hkv, D)
        v = self.v_proj(h).view(B, T, Hkv, D)
        cos = self.rope_cos[position_ids].unsqueeze(-2)  # [T, 1, D]
        sin = self.rope_sin[position_ids].unsqueeze(-2)
        half = D // 2
        q = q * cos + torch.cat((-q[..., half:], q[..., :half]), -1) * sin
        k = k * cos + torch.cat((-k[..., half:], k[..., :half]), -1) * sin
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, D]
        if cache is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=H != Hkv)
        else:
            past = cache.length
            k_all, v_all = cache.write(0, k, v)
            if attn_mask is None and T > 1:
                attn_mask = torch.cat((torch.ones(T, past, dtype=torch.bool),
                                       torch.ones(T, T, dtype=torch.bool).tril_()), 1)
            o = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=attn_mask, enable_gqa=H != Hkv)
        r = x + self.o_proj(o.transpose(1, 2).reshape(B, T, H * D))  # residual after attention
        m = F.rms_norm(r, (d,), self.post_norm, c.rms_norm_eps)
        gate, up = torch.einsum("btd,nfd->btnf", m, self.gate_up).chunk(2, dim=-1)
        experts = torch.einsum("btni,ndi->btnd", F.silu(gate) * up, self.down)  # [B, T, N, d]
        if c.method == "eagle2":
            out = r + experts[:, :, 0]
            return DraftOutput(out.unsqueeze(2), torch.ones(B, T, 1), out, None, None)
        router_probs = self.router(m).softmax(-1)  # [B, T, N]
        top_w, top_i = torch.topk(router_probs, c.experts_per_token, dim=-1)  # [B, T, K]
        top_w = top_w / top_w.sum(-1, keepdim=True)
        chosen = experts.gather(2, top_i.unsqueeze(-1).expand(B, T, -1, d))  # [B, T, K, d]
        blend = r + (top_w.unsqueeze(-1) * chosen).sum(2)
        contrastive = None
        if c.parallel_decoding:
            coef = self.con_router(m).softmax(-1).gather(2, top_i[..., :2])  # [B, T, 2]: A, B
            contrastive = r + coef[..., :1] * chosen[:, :, 0] - coef[..., 1:] * chosen[:, :, 1]
        return DraftOutput(r.unsqueeze(2) + chosen, top_w, blend, contrastive, router_probs)
