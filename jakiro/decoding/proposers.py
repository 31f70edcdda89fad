"""Proposers: what builds the draft tree each cycle. One decode loop serves them all.

The interface has four calls: ``start`` (a new request), ``observe`` (the target's features for
newly committed positions with the token that follows each), ``propose`` (a tree rooted at the
last committed token) and ``feedback`` (what verification accepted of it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree import DRAFT, LOOKUP, Tree, build_tree, chain_tree, select_nodes


class Proposer:
    name = "ar"
    needs_features = False
    max_tree_tokens = 1  # the most nodes (root included) a proposed tree can have

    def start(self, max_len: int) -> None:
        """Prepare for a request whose sequence will not exceed ``max_len`` tokens."""

    def observe(self, features: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """features [m, d] at newly committed positions t; next_tokens [m] = x_{t+1}."""

    def propose(self, context: list[int]) -> Tree:
        """A tree whose root is context[-1]. The base proposer drafts nothing (plain decoding)."""
        return chain_tree(context[-1], [])

    def feedback(self, tree: Tree, verdict) -> None:
        """What verification made of ``tree`` (a ``verify.Verdict``: accepted nodes, bonus token)."""

    def stats(self) -> dict:
        return {}


class PromptLookupProposer(Proposer):
    """Draft-free baseline: find the latest earlier occurrence of the context's last n-gram
    (n = max_ngram .. min_ngram) and propose the tokens that followed it, as a chain."""

    name = "pld"

    def __init__(self, num_tokens: int = 6, max_ngram: int = 3, min_ngram: int = 1):
        if num_tokens < 1 or not 1 <= min_ngram <= max_ngram:
            raise ValueError("prompt lookup needs num_tokens >= 1 and 1 <= min_ngram <= max_ngram")
        self.num_tokens, self.max_ngram, self.min_ngram = num_tokens, max_ngram, min_ngram
        self.max_tree_tokens = num_tokens + 1

    def propose(self, context: list[int]) -> Tree:
        tree = chain_tree(context[-1], self.lookup(context))
        tree.sources = torch.tensor([0] + [LOOKUP] * (tree.size - 1))
        return tree

    def lookup(self, context: list[int]) -> list[int]:
        """The tokens that followed the latest earlier occurrence of the longest matching n-gram."""
        seq = torch.tensor(context)
        length = seq.shape[0]
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            windows = seq.unfold(0, n, 1)[:-1]  # every earlier n-gram, [length - n, n]
            hits = torch.nonzero((windows == seq[-n:]).all(1)).flatten()
            if hits.numel():
                start = int(hits[-1]) + n
                drafted = seq[start: start + self.num_tokens]
                if drafted.numel():
                    return drafted.tolist()
        return []


@dataclass
class TreeBudget:
    depth: int = 4
    top_k: int = 4
    total_tokens: int = 8  # draft tokens verified per cycle, root excluded

    def __post_init__(self):
        if self.depth < 1 or self.top_k < 1 or self.total_tokens < 1:
            raise ValueError(f"tree budget must be positive: {self}")


class DraftProposer(Proposer):
    """EAGLE-2 dynamic tree from a draft model; with a Jakiro draft, candidates come from the
    activated experts (``decoupled``) or from their blend (``blended``), and with parallel
    decoding the last tree layer comes from the contrastive branch of the previous forward."""

    needs_features = True

    def __init__(self, draft, budget: TreeBudget, candidate_mode: str | None = None,
                 parallel_decoding: bool | None = None):
        cfg = draft.config
        self.draft, self.budget = draft, budget
        self.name = cfg.method
        self.mode = "single" if cfg.method == "eagle2" else (candidate_mode or cfg.candidate_mode)
        if self.mode not in ("single", "decoupled", "blended"):
            raise ValueError(f"unknown candidate mode {self.mode!r}")
        self.parallel = cfg.parallel_decoding if parallel_decoding is None else parallel_decoding
        if self.parallel and not cfg.parallel_decoding:
            raise ValueError("this draft has no contrastive branch: parallel decoding is unavailable")
        if self.parallel and budget.depth < 2:
            self.parallel = False  # the contrastive layer needs a layer above it
        self.max_tree_tokens = budget.total_tokens + 1
        self.head_vocab: int | None = None  # use only the most frequent entries of a reduced head
        self.cache = None
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.draft_forwards = 0

    def start(self, max_len: int) -> None:
        # scratch room for the tree's forwarded nodes after the committed pairs
        self.cache = self.draft.new_cache(max_len + self.budget.depth * self.budget.top_k + 1)
        self._pending = []
        self.draft_forwards = 0

    def observe(self, features: torch.Tensor, next_tokens: torch.Tensor) -> None:
        self._pending.append((features, next_tokens))

    def stats(self) -> dict:
        return {"draft_forwards": self.draft_forwards}

    # ------------------------------------------------------------------ candidates
    def _children(self, out, rows: torch.Tensor, k: int):
        """Top-k children of each forwarded node in ``rows``.
        Returns tokens [F, k] (target ids), log-probs [F, k], carried features [F, k, d]."""
        draft = self.draft
        if self.mode == "decoupled":
            feats = out.features[0, rows]  # [F, K, d]
            n_exp = feats.shape[1]
            quotas = [k // n_exp + (1 if j < k % n_exp else 0) for j in range(n_exp)]
            active = [j for j in range(n_exp) if quotas[j] > 0]
            logp = draft.head_logits(feats[:, active], self.head_vocab).log_softmax(-1)  # [F, A, Vd]
            toks, lps, carried = [], [], []
            for a, j in enumerate(active):
                lp = logp[:, a]
                if toks:  # an expert proposes only tokens its predecessors did not
                    lp = lp.scatter(1, torch.cat(toks, 1), float("-inf"))
                top = torch.topk(lp, quotas[j], dim=-1)
                toks.append(top.indices)
                lps.append(top.values)
                carried.append(feats[:, j:j + 1].expand(-1, quotas[j], -1))
            ids, lp, feat = torch.cat(toks, 1), torch.cat(lps, 1), torch.cat(carried, 1)
        else:
            f = out.blend[0, rows]  # [F, d]
            top = torch.topk(draft.head_logits(f, self.head_vocab).log_softmax(-1), k, dim=-1)
            ids, lp, feat = top.indices, top.values, f.unsqueeze(1).expand(-1, k, -1)
        return draft.to_target_ids(ids), lp, feat

    def _contrastive_children(self, out, rows: torch.Tensor, k: int):
        top = torch.topk(self.draft.head_logits(out.contrastive[0, rows], self.head_vocab).log_softmax(-1),
                         k, dim=-1)
        return self.draft.to_target_ids(top.indices), top.values

    # ------------------------------------------------------------------ tree
    @torch.inference_mode()
    def propose(self, context: list[int], depth: int | None = None) -> Tree:
        """The EAGLE-2 tree of the budget, or of ``depth`` draft layers when given (<= the
        budget's depth: the draft's scratch cache is sized for it). Node scores are attached."""
        draft, cache, budget = self.draft, self.cache, self.budget
        depth = budget.depth if depth is None else min(depth, budget.depth)
        k = budget.top_k
        feats = torch.cat([f for f, _ in self._pending])
        toks = torch.cat([t for _, t in self._pending])
        self._pending = []
        base = cache.length
        m = feats.shape[0]
        out = draft(feats.unsqueeze(0), toks.unsqueeze(0), torch.arange(base, base + m), cache)
        cache.commit(m)
        self.draft_forwards += 1
        base = cache.length  # = position of the root token

        # candidate arrays (creation order); parent -1 = root
        cand_tokens, cand_scores, cand_parents = [], [], []
        n_cand = 0
        rows = torch.tensor([m - 1])  # forwarded rows of the current frontier in `out`
        front_ids = torch.tensor([-1])  # their candidate ids
        front_scores = torch.zeros(1)
        slot_rows = torch.zeros(1, depth * k, dtype=torch.bool)  # draft scratch slots seen
        n_slots = 0
        normal_layers = depth - 1 if self.parallel and depth >= 2 else depth
        for layer in range(normal_layers):
            tokens, logp, carried = self._children(out, rows, k)  # [F, k]
            F_ = tokens.shape[0]
            scores = front_scores.unsqueeze(1) + logp
            ids = torch.arange(n_cand, n_cand + F_ * k).view(F_, k)
            cand_tokens.append(tokens.flatten())
            cand_scores.append(scores.flatten())
            cand_parents.append(front_ids.unsqueeze(1).expand(F_, k).flatten())
            n_cand += F_ * k
            if layer == normal_layers - 1:
                if self.parallel and depth >= 2:  # last layer from the contrastive branch of the same forward,
                    # hung under the best child of the node whose forward produced it
                    con_tokens, con_logp = self._contrastive_children(out, rows, k)
                    best = scores.argmax(1)
                    best_ids = ids.gather(1, best.unsqueeze(1)).squeeze(1)
                    best_scores = scores.gather(1, best.unsqueeze(1)).squeeze(1)
                    cand_tokens.append(con_tokens.flatten())
                    cand_scores.append((best_scores.unsqueeze(1) + con_logp).flatten())
                    cand_parents.append(best_ids.unsqueeze(1).expand(F_, k).flatten())
                    n_cand += F_ * k
                break
            # next frontier: the top_k children of this layer by cumulative score
            flat_scores = scores.flatten()
            pick = torch.topk(flat_scores, min(k, flat_scores.shape[0])).indices
            parent_local = pick // k
            new_rows = slot_rows[parent_local].clone()
            own = torch.arange(n_slots, n_slots + pick.shape[0])
            new_rows[torch.arange(pick.shape[0]), own] = True
            n_slots += pick.shape[0]
            attn = torch.cat((torch.ones(pick.shape[0], base, dtype=torch.bool), new_rows[:, :n_slots]), 1)
            in_feats = carried.reshape(-1, carried.shape[-1])[pick]
            in_tokens = tokens.flatten()[pick]
            # the pair (f_t, x_{t+1}) for a node at depth layer+1 sits at position base + layer
            out = draft(in_feats.unsqueeze(0), in_tokens.unsqueeze(0),
                        torch.full((pick.shape[0],), base + layer), cache, attn)
            cache.commit(pick.shape[0])
            self.draft_forwards += 1
            rows = torch.arange(pick.shape[0])
            front_ids = ids.flatten()[pick]
            front_scores = flat_scores[pick]
            slot_rows = new_rows
        cache.truncate(base)
        all_scores = torch.cat(cand_scores)
        kept, parents = select_nodes(all_scores, torch.cat(cand_parents), budget.total_tokens)
        tokens = torch.cat((torch.tensor([context[-1]]), torch.cat(cand_tokens)[kept]))
        tree = build_tree(tokens, torch.cat((torch.tensor([-1]), parents)))
        tree.scores = torch.cat((torch.zeros(1), all_scores[kept]))
        tree.sources = torch.tensor([0] + [DRAFT] * (tree.size - 1))
        return tree
