"""A draft's inference steps in one call of the small-batch kernels (``models.smallgemm``): the
attention step, the MLP or experts with the head's top-k, and whole chains. Each returns None
where its path does not apply (training, no kernel, more rows than the kernels take, the
EAGLE-3 layout), and the caller then takes the torch path, which computes the same."""

from __future__ import annotations

import torch

from ..models import smallgemm
from ..models.kv_cache import KVCache
from ..models.linear import SMALL_ROWS, FastLinear
from .head import INPUT_BYTES, DraftHead


class FusedSteps:
    """Mixed into ``DraftModel``: its fused inference paths."""

    def mlp_head_topk(self, r: torch.Tensor, k: int, head: "DraftHead | int | None" = None):
        """EAGLE-2's MLP then the head's top-k, for residual rows r [n, d], in one call of the
        small-batch kernels: (features r + MLP [n, d], target token ids [n, k], log-probs [n, k]
        over ``head``'s rows), or None where that path does not apply (training, no kernel, more
        than one expert: the MLP is the only expert's)."""
        c = self.config
        if (self.training or torch.is_grad_enabled() or not smallgemm.available() or len(self.gate_up) != 1
                or self.post_norm.dtype != torch.float32 or c.method == "eagle3"):
            return None
        gate_up = self._fast_layer("gate_up0", (self.gate_up[0],)).kernel_weight
        down = self._fast_layer("down0", (self.down[0],)).kernel_weight
        rows = self._head_of(head)
        if gate_up is None or down is None or rows.kernel_weight is None:
            return None
        vocab = rows.size
        feats, ids, logp = smallgemm.draft_mlp_head(r, self.post_norm.detach(), gate_up, down, c.intermediate_size,
                                                    rows.kernel_weight, vocab, min(k, vocab), c.rms_norm_eps,
                                                    INPUT_BYTES)
        return feats, rows.ids[ids], logp

    def experts_topk(self, r: torch.Tensor, quotas: list[int], head: "DraftHead | int | None" = None):
        """Decoupled children of residual rows r [n, d] in one call of the small-batch kernels:
        each row's activated experts in router order, the one of rank a proposing ``quotas[a]``
        children from its own output (tokens the ranks before it proposed skipped), as
        ``DraftProposer._children`` does from ``heads``; with one rank (a chain), only the expert
        the router ranks first runs. The router runs in the same call. Returns (features r +
        expert output [n, A, d], target token ids [n, k], log-probs [n, k]), or None where that
        path does not apply (training, no kernel, EAGLE-2)."""
        c = self.config
        if (c.method != "jakiro" or self.training or torch.is_grad_enabled() or not smallgemm.available()
                or self.post_norm.dtype != torch.float32 or len(quotas) > c.experts_per_token):
            return None
        experts = self._expert_kernels()
        rows = self._head_of(head)
        if experts is None or rows.kernel_weight is None:
            return None
        feats, ids, logp = smallgemm.draft_experts_topk(
            r, self.post_norm.detach(), [g for g, _ in experts], [d for _, d in experts], c.intermediate_size,
            rows.kernel_weight, rows.size, self.router.weight.detach(), quotas, c.rms_norm_eps,
            INPUT_BYTES)
        return feats, rows.ids[ids], logp

    def _fused_step(self, features, token_ids, position_ids, cache, attn_mask) -> torch.Tensor | None:
        """``attend`` in one call of the small-batch kernels for a draft step's few rows (None
        where that path does not apply: training, batches, prompts, no kernel)."""
        B, T, d = features.shape
        if (cache is None or B != 1 or T > SMALL_ROWS or self.training or torch.is_grad_enabled()
                or not smallgemm.available() or self.config.method == "eagle3"):
            return None
        c = self.config
        layers = self._attend_layers()
        if layers is None:
            return None
        cache.check_room(T)
        r = smallgemm.draft_attend(features[0], token_ids[0], self.embed, layers[0].kernel_weight, layers[0].bias,
                                   self.input_norm.detach(), layers[1].kernel_weight, layers[2].kernel_weight,
                                   cache.data, cache.length, self.rope_cos, self.rope_sin, position_ids, attn_mask,
                                   c.num_attention_heads, c.num_key_value_heads, c.rms_norm_eps, c.head_dim ** -0.5,
                                   INPUT_BYTES)
        return r.unsqueeze(0)

    def _expert_kernels(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Each expert's (gate/up, down) as the small-batch kernels read them (EAGLE-2: its one MLP),
        None where one cannot be."""
        kernels = [(self._fast_layer(f"gate_up{e}", (self.gate_up[e],)).kernel_weight,
                    self._fast_layer(f"down{e}", (self.down[e],)).kernel_weight)
                   for e in range(self.config.num_experts)]
        return None if any(w is None for pair in kernels for w in pair) else kernels

    def _attend_layers(self) -> tuple[FastLinear, FastLinear, FastLinear] | None:
        """The fusion layer, qkv and o as the fused attention step takes them (None where it cannot)."""
        layers = (self._fast_layer("fc", (self.fc.weight,), self.fc.bias),
                  self._fast_layer("qkv", (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight)),
                  self._fast_layer("o", (self.o_proj.weight,)))
        if (any(layer.kernel_weight is None for layer in layers) or self.input_norm.dtype != torch.float32
                or not self.embed.is_contiguous()):
            return None
        return layers

    def chain(self, features: torch.Tensor, token_ids: torch.Tensor, steps: int, contrastive: bool, cache: KVCache,
              head: "DraftHead | int | None" = None, draws: torch.Tensor | None = None, temperature: float = 1.0
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """A chain proposal (top-k 1) in one call of the kernels: ``attend`` over the rows
        committed since the last proposal (input features [m, d] as ``input_features`` gives
        them, the tokens after them [m]) at the cache's next positions, then from the newest row
        ``steps`` draft steps, each keeping the head's best row for EAGLE-2's MLP or for the
        expert the router ranks first (as ``mlp_head_topk`` and ``experts_topk`` with k = 1, then
        ``attend``), the last adding the contrastive branch's best row when ``contrastive``. The
        m rows' keys and values are written into ``cache`` for the caller to commit; the chain's
        after them, left uncommitted. With ``draws`` (float64 uniforms [steps]) each step's token
        is drawn from softmax(logits / ``temperature``) over ``head``'s rows instead of being the best.
        Returns (target token ids [steps (+ 1)], the best rows' log-probs, the distributions drawn
        from [steps, V] or None), or None where the kernels do not apply (training, no kernel,
        more rows than they take)."""
        c = self.config
        if (self.training or torch.is_grad_enabled() or not smallgemm.available() or features.shape[0] > SMALL_ROWS
                or self.post_norm.dtype != torch.float32 or (contrastive and not c.parallel_decoding)
                or c.method == "eagle3"):
            return None
        layers, mlps = self._attend_layers(), self._expert_kernels()
        rows = self._head_of(head)
        if layers is None or mlps is None or rows.kernel_weight is None:
            return None
        cache.check_room(features.shape[0] + steps - 1)
        jakiro = c.method == "jakiro"
        ids, logp, probs = smallgemm.draft_chain(
            features, token_ids, steps, self.embed, layers[0].kernel_weight, layers[0].bias, self.input_norm.detach(),
            layers[1].kernel_weight, layers[2].kernel_weight, cache.data, cache.length, self.rope_cos, self.rope_sin,
            c.num_attention_heads, c.num_key_value_heads, c.head_dim ** -0.5, self.post_norm.detach(),
            [g for g, _ in mlps], [d for _, d in mlps], c.intermediate_size,
            self.router.weight.detach() if jakiro else None, self.con_router.weight.detach() if contrastive else None,
            rows.kernel_weight, rows.ids, c.rms_norm_eps, INPUT_BYTES, draws, temperature)
        return rows.ids[ids], logp, (probs if draws is not None else None)
