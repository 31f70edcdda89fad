"""A plain-torch EAGLE-3 draft written from the public loaders' layout (vLLM ``llama_eagle3.py``,
SGLang ``llama_eagle3.py``, SpecForge ``LlamaForCausalLMEagle3``, llama.cpp ``eagle3.cpp``), not
from jakiro's draft code: it reads a Hugging Face EAGLE-3 folder and writes one the way those
trainers save theirs. Tests hold jakiro's export and import against it."""

from __future__ import annotations

import json
import math
import os

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file


def _rms(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class ReferenceEagle3:
    """One EAGLE-3 draft: ``step`` runs rows (token embeddings, hidden inputs) at positions,
    attending to every earlier row it has run (a KV cache)."""

    def __init__(self, folder: str):
        with open(os.path.join(folder, "config.json")) as f:
            self.cfg = json.load(f)
        w = {}
        for name in sorted(os.listdir(folder)):
            if name.endswith(".safetensors"):
                w.update(load_file(os.path.join(folder, name)))
        # vLLM renames midlayer. to model.layers.0.; accept both
        self.w = {k.replace("model.layers.0.", "midlayer."): v.float() if v.is_floating_point() else v
                  for k, v in w.items()}
        c = self.cfg
        self.d, self.H = c["hidden_size"], c["num_attention_heads"]
        self.Hkv = c.get("num_key_value_heads", self.H)
        self.D = c.get("head_dim") or self.d // self.H
        self.eps = c["rms_norm_eps"]
        self.theta = c.get("rope_theta", 10000.0)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.positions: list[int] = []

    def _rope(self, x, pos):  # x [T, heads, D], rotate-half (Hugging Face) convention
        inv = 1.0 / (self.theta ** (torch.arange(0, self.D, 2, dtype=torch.float64) / self.D))
        ang = torch.tensor(pos, dtype=torch.float64)[:, None] * inv[None]
        emb = torch.cat((ang, ang), -1)
        cos, sin = emb.cos().float()[:, None], emb.sin().float()[:, None]
        return x * cos + _rotate_half(x) * sin

    def step(self, embeds: torch.Tensor, hidden: torch.Tensor, pos: list[int]):
        """embeds [T, d] (the target's embedding of token t+1), hidden [T, 3·d] (the target's
        three streams at t: fc maps them) or [T, d] (the draft's own pre-norm output) ->
        (logits over the draft vocabulary [T, V'], pre-norm hidden [T, d])."""
        w, L = self.w, "midlayer."
        if hidden.shape[-1] != self.d:
            hidden = hidden @ w["fc.weight"].T
        residual = hidden
        x = torch.cat((_rms(embeds, w[L + "input_layernorm.weight"], self.eps),
                       _rms(hidden, w[L + "hidden_norm.weight"], self.eps)), -1)
        T = x.shape[0]
        q = (x @ w[L + "self_attn.q_proj.weight"].T).view(T, self.H, self.D)
        k = (x @ w[L + "self_attn.k_proj.weight"].T).view(T, self.Hkv, self.D)
        v = (x @ w[L + "self_attn.v_proj.weight"].T).view(T, self.Hkv, self.D)
        q, k = self._rope(q, pos), self._rope(k, pos)
        self.keys.append(k)
        self.values.append(v)
        self.positions += pos
        K, V = torch.cat(self.keys), torch.cat(self.values)
        rep = self.H // self.Hkv
        K, V = K.repeat_interleave(rep, 1), V.repeat_interleave(rep, 1)
        scores = torch.einsum("thd,shd->hts", q, K) / math.sqrt(self.D)
        n = K.shape[0]
        allowed = torch.ones(T, n, dtype=torch.bool)
        allowed[:, n - T:] = torch.ones(T, T, dtype=torch.bool).tril()  # causal among the new rows
        o = torch.einsum("hts,shd->thd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), V)
        h = o.reshape(T, -1) @ w[L + "self_attn.o_proj.weight"].T + residual
        m = _rms(h, w[L + "post_attention_layernorm.weight"], self.eps)
        m = (F.silu(m @ w[L + "mlp.gate_proj.weight"].T) * (m @ w[L + "mlp.up_proj.weight"].T)) \
            @ w[L + "mlp.down_proj.weight"].T
        prenorm = m + h
        logits = _rms(prenorm, w["norm.weight"], self.eps) @ w["lm_head.weight"].T
        return logits, prenorm

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft vocabulary rows -> target token ids (d2t holds offsets)."""
        if "d2t" not in self.w:
            return draft_ids
        return draft_ids + self.w["d2t"][draft_ids]


def write_reference_checkpoint(folder: str, target_hidden: int, vocab: int, draft_vocab: int, heads: int,
                               kv_heads: int, intermediate: int, layers: list[int] | None, seed: int = 0,
                               theta: float = 10000.0, prefix: str = "midlayer.") -> str:
    """A random EAGLE-3 checkpoint saved as the EAGLE-3 trainers save theirs: SpecForge /
    SafeAILab names (``midlayer.``; vLLM-style ``model.layers.0.`` with ``prefix``), d2t offsets
    for a random draft vocabulary, t2d a mask, bfloat16 weights, a config with or without the
    layer ids (``layers=None``: the loaders' default 2, L/2, L-3)."""
    g = torch.Generator().manual_seed(seed)
    d = target_hidden
    D = d // heads

    def mat(r, c):
        return (torch.randn(r, c, generator=g) * 0.2).to(torch.bfloat16)

    def norm():
        return (1 + 0.1 * torch.randn(d, generator=g)).to(torch.bfloat16)

    ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    L = prefix
    state = {
        "fc.weight": mat(d, 3 * d),
        L + "input_layernorm.weight": norm(), L + "hidden_norm.weight": norm(),
        L + "self_attn.q_proj.weight": mat(heads * D, 2 * d),
        L + "self_attn.k_proj.weight": mat(kv_heads * D, 2 * d),
        L + "self_attn.v_proj.weight": mat(kv_heads * D, 2 * d),
        L + "self_attn.o_proj.weight": mat(d, heads * D),
        L + "post_attention_layernorm.weight": norm(),
        L + "mlp.gate_proj.weight": mat(intermediate, d), L + "mlp.up_proj.weight": mat(intermediate, d),
        L + "mlp.down_proj.weight": mat(d, intermediate),
        "norm.weight": norm(), "lm_head.weight": mat(draft_vocab, d),
        "d2t": ids - torch.arange(draft_vocab), "t2d": t2d,
    }
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": d,
           "intermediate_size": intermediate, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
           "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
           "rope_theta": theta, "vocab_size": vocab, "draft_vocab_size": draft_vocab, "hidden_act": "silu",
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", "target_hidden_size": d}
    if layers is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layers}
    os.makedirs(folder, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return folder
