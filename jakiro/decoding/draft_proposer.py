"""The draft proposer: an EAGLE-2 dynamic tree (or chain, or static tree) from a draft model,
with Jakiro's decoupled expert candidates and contrastive last layer; the request's draft head
takes in its prompt's and answer's own tokens."""

from __future__ import annotations

import math

import torch

from ..models.linear import SMALL_ROWS
from .proposers import Proposer, TreeBudget
from .request_head import ANSWER_VOCAB_MAX, RequestHead
from .sampling import SamplingParams, processed_probs, sample
from .tree import DRAFT, Tree, build_tree, chain_tree, select_nodes


PROMPT_WINDOW = 512  # a draft reads at most this many of a prompt's last positions: drafts are
# trained on records of up to 512 tokens (attention over more keys is beyond what they learned),
# and reading an 854-token RAG prompt took 25-28 ms, three target forwards, before the first
# proposal. Positions come from the draft cache's length, so the window only moves every
# position back by the same amount: the rotary attention between the rows read is unchanged.


class _Candidates:
    """Draft tree candidates in creation order: token, cumulative score, parent candidate id."""

    def __init__(self):
        self.tokens, self.scores, self.parents = [], [], []
        self.n = 0

    def add(self, tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        """[F, k] children of F parents (ids [F]); returns their candidate ids [F, k]."""
        f, k = tokens.shape
        self.tokens.append(tokens.flatten())
        self.scores.append(scores.flatten())
        self.parents.append(parents.unsqueeze(1).expand(f, k).flatten())
        ids = torch.arange(self.n, self.n + f * k).view(f, k)
        self.n += f * k
        return ids

    def tree(self, root_token: int, total_tokens: int) -> Tree:
        """The ``total_tokens`` best-scored candidates (with their ancestors) under the root."""
        all_scores = torch.cat(self.scores)
        kept, parents = select_nodes(all_scores, torch.cat(self.parents), total_tokens)
        tokens = torch.cat((torch.tensor([root_token]), torch.cat(self.tokens)[kept]))
        tree = build_tree(tokens, torch.cat((torch.tensor([-1]), parents)))
        tree.scores = torch.cat((torch.zeros(1), all_scores[kept]))
        tree.sources = torch.tensor([0] + [DRAFT] * (tree.size - 1))
        return tree


class DraftProposer(RequestHead, Proposer):
    """EAGLE-2 dynamic tree from a draft model; with a Jakiro draft, candidates come from the
    activated experts (``decoupled``) or from their blend (``blended``), and with parallel
    decoding the last tree layer comes from the contrastive branch of the previous forward."""

    needs_features = True

    def __init__(self, draft, budget: TreeBudget, candidate_mode: str | None = None,
                 parallel_decoding: bool | None = None, static=None, head_vocab: int | None = None,
                 prompt_vocab: bool = True):
        """``static``: a ``StaticTree`` to draft instead of the dynamic tree (the budget is then
        derived from it). ``head_vocab``: use only the first (most frequent) entries of the draft
        vocabulary (a reduced head chosen by ``jakiro tune``). ``prompt_vocab``: each request's
        head also scores the prompt's tokens that the draft vocabulary lacks (``prompt_head``)."""
        cfg = draft.config
        self.static = static
        if static is not None:  # scratch for every forwarded node, one slot per tree node
            budget = TreeBudget(static.depth, len(static.paths), len(static.paths))
        self.draft, self.budget = draft, budget
        self.name = cfg.method
        self.mode = "single" if cfg.method != "jakiro" else (candidate_mode or cfg.candidate_mode)
        if self.mode not in ("single", "decoupled", "blended"):
            raise ValueError(f"unknown candidate mode {self.mode!r}")
        self.parallel = cfg.parallel_decoding if parallel_decoding is None else parallel_decoding
        if self.parallel and not cfg.parallel_decoding:
            raise ValueError("this draft has no contrastive branch: parallel decoding is unavailable")
        if self.parallel and budget.depth < 2:
            self.parallel = False  # the contrastive layer needs a layer above it
        if static is not None and self.parallel:
            # the contrastive branch of a node's forward predicts the children of its best child only
            self.parallel = all(p[-2] == 0 for p in static.at_depth(static.depth))
        self.max_tree_tokens, self.max_tree_depth = budget.total_tokens + 1, budget.depth
        self.aux_layers = tuple(cfg.aux_layers)
        self.head_vocab, self.prompt_vocab = head_vocab, prompt_vocab
        self.answer_vocab = ANSWER_VOCAB_MAX
        self._head = None  # this request's head rows (``head``)
        self._own_tokens = False
        self._grown_to: int | None = None  # context length whose tokens the head has taken in
        self._extra: list[int] = []  # the tokens the request's head adds to the vocabulary, in order
        self._head_tokens: set[int] = set()  # the vocabulary's and those (the head's rows but its padding)
        self._answer_rows = 0  # tokens of the answer among them
        self.cache = None
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._pending_count = 0  # their rows (asked for every cycle by cost-aware drafting)
        self.draft_forwards = 0
        self._sampling: tuple[SamplingParams, torch.Generator] | None = None

    def start(self, max_len: int, prompt_vocab: bool | None = None) -> None:
        """``prompt_vocab``: whether this request's head takes in its prompt's tokens (default:
        as the proposer was built; cost measurements on random prompts turn it off)."""
        # scratch room for the tree's forwarded nodes after the committed pairs
        self.cache = self.draft.new_cache(max_len + self.budget.depth * self.budget.top_k + 1)
        self._pending, self._pending_count = [], 0
        self.draft_forwards = 0
        self._head = None
        self._own_tokens = self.prompt_vocab if prompt_vocab is None else prompt_vocab
        self._grown_to, self._extra, self._head_tokens, self._answer_rows = None, [], set(), 0

    def set_sampling(self, params: SamplingParams | None, generator: torch.Generator | None = None) -> None:
        """With sampling, a chain (top_k = 1, no static tree) is drawn token by token from the
        draft's distribution over its head, processed as the target's (temperature, top-k,
        top-p), and each node carries that distribution (``Tree.proposals``): verification then
        accepts a token with min(1, p / q) instead of p, which for a draft whose distribution is
        close to the target's is far more often (development prompts, T = 1: 0.49 against 0.31
        for its most likely token at depth 1). Trees (top_k > 1) stay deterministic."""
        drawn = params is not None and not params.greedy
        self._sampling = (params, generator or params.generator()) if drawn else None

    def observe(self, features: torch.Tensor, next_tokens: torch.Tensor) -> None:
        # kept as the target gave them: the mid-layer map (``input_features``) runs once over all
        # pending rows when the draft next catches up, not on each plain step before that
        self._pending.append((features, next_tokens))
        self._pending_count += features.shape[0]

    @property
    def pending_rows(self) -> int:
        """Committed positions the next proposal catches up on first (of a prompt, its last
        ``PROMPT_WINDOW``)."""
        rows = self._pending_count
        return min(rows, PROMPT_WINDOW) if self.cache is not None and self.cache.length == 0 else rows

    # ------------------------------------------------------------------ candidates
    def _children(self, out, rows: torch.Tensor, k: int):
        """Top-k children of each forwarded node in ``rows``.
        Returns tokens [F, k] (target ids), log-probs [F, k], carried features [F, k, d]."""
        draft = self.draft
        if self.mode == "decoupled":
            feats = out.features[0, rows]  # [F, K, d]
            n_exp = feats.shape[1]
            quotas = _quotas(k, n_exp)
            active = [j for j in range(n_exp) if quotas[j] > 0]
            logp = draft.head_logits(feats[:, active], self.head).log_softmax(-1)  # [F, A, Vd]
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
            top = torch.topk(draft.head_logits(f, self.head).log_softmax(-1), k, dim=-1)
            ids, lp, feat = top.indices, top.values, f.unsqueeze(1).expand(-1, k, -1)
        return draft.to_target_ids(ids, self.head), lp, feat

    def _contrastive_children(self, out, rows: torch.Tensor, k: int):
        top = torch.topk(self.draft.head_logits(out.contrastive[0, rows], self.head).log_softmax(-1),
                         k, dim=-1)
        return self.draft.to_target_ids(top.indices, self.head), top.values

    # ------------------------------------------------------------------ tree
    @torch.inference_mode()
    def propose(self, context: list[int], depth: int | None = None) -> Tree:
        """The EAGLE-2 tree of the budget, or of ``depth`` draft layers when given (<= the
        budget's depth: the draft's scratch cache is sized for it). Node scores are attached."""
        depth = self.budget.depth if depth is None else min(depth, self.budget.depth)
        if self._own_tokens:  # the head takes in the request's own tokens: first the prompt's,
            self._take_in(context)  # then its answer's as they come
        feats, toks = self._catch_up_rows()
        if self.static is None and self.budget.top_k == 1:
            contrastive = self.parallel and depth >= 2
            steps = depth - 1 if contrastive else depth
            params, draws = None, None
            if self._sampling is not None:
                params, generator = self._sampling
                # the kernel draws from softmax(logits / T); top-k and top-p filters are applied here
                if params.top_k == 0 and params.top_p >= 1.0:
                    draws = torch.rand(steps, dtype=torch.float64, generator=generator)
            fused = (self.draft.chain(feats, toks, steps, contrastive, self.cache, self.head, draws,
                                      params.temperature if params else 1.0)
                     if self.mode in ("single", "decoupled") and (params is None or draws is not None) else None)
            if fused is not None:  # the catch-up and the whole chain in one kernel call
                self.cache.commit(feats.shape[0])
                self.draft_forwards += steps
                scores = [0.0]
                for lp in fused[1].tolist():
                    scores.append(scores[-1] + lp)
                tree = self._chain(context, fused[0].tolist(), scores)
                if draws is not None:  # each drawn node carries its distribution
                    tree.proposals = {j + 1: (self.head.ids, fused[2][j]) for j in range(min(steps, tree.size - 1))}
                return tree
        r = self._attend_rows(feats, toks)
        base = self.cache.length  # = position of the root token
        if self.static is not None:
            return self._propose_static(context, self.draft.heads(r), base)
        if self.budget.top_k == 1:
            return self._propose_chain(context, r, base, depth)
        return self._propose_dynamic(context, r, base, depth)

    def _catch_up(self) -> torch.Tensor:
        """One draft forward over the (feature, next token) pairs committed since the last cycle,
        kept in the draft's cache; returns the residual stream at the newest pair [1, 1, d] (the
        caller runs the heads on that row only)."""
        return self._attend_rows(*self._catch_up_rows())

    def _catch_up_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft's input features [m, d] and next tokens [m] of the pairs committed since the
        last cycle that the catch-up attends; more than ``SMALL_ROWS`` of them (a prompt, a long
        run of plain steps) go to the cache here without attention, but for the newest."""
        rows = self.pending_rows  # of a prompt, its last PROMPT_WINDOW positions
        feats = torch.cat([f for f, _ in self._pending])[-rows:]
        toks = torch.cat([t for _, t in self._pending])[-rows:]
        self._pending, self._pending_count = [], 0
        feats = self.draft.input_features(feats)
        m = feats.shape[0]
        if m > SMALL_ROWS:  # a prompt, or a long run of plain steps: only the newest row attends
            base = self.cache.length
            self.draft.fill_cache(feats[:-1], toks[:-1], torch.arange(base, base + m - 1), self.cache)
            feats, toks = feats[-1:], toks[-1:]
        return feats, toks

    def _attend_rows(self, feats: torch.Tensor, toks: torch.Tensor) -> torch.Tensor:
        """The catch-up's draft forward over ``_catch_up_rows``: the residual at the newest."""
        base, m = self.cache.length, feats.shape[0]
        r = self.draft.attend(feats.unsqueeze(0), toks.unsqueeze(0), torch.arange(base, base + m), self.cache)
        self.cache.commit(m)
        self.draft_forwards += 1
        # only the newest position drafts; the others just fill the cache (after a run of plain
        # steps there are dozens of them, and the MLP or experts over every one would be wasted)
        return r[:, -1:]

    def _propose_chain(self, context: list[int], r: torch.Tensor, base: int, depth: int) -> Tree:
        """``_propose_dynamic`` for top_k = 1, where the tree is a chain: each layer's one frontier
        node is the previous layer's only child and sees every scratch slot before it, so a draft
        step needs no mask and the tree no reranking (scores only fall along a chain: the best
        ``total_tokens`` candidates are its first ones). ``r``: the residual row of the root.
        Same tree, a fraction of the bookkeeping (and of the expert work: ``_expand``). A sampled
        request's chain is drawn (``_drawn_step``); a contrastive last token stays the branch's best.
        (``propose`` runs it in one kernel call where it can: ``DraftModel.chain``.)"""
        contrastive = self.parallel and depth >= 2
        normal_layers = depth - 1 if contrastive else depth
        tokens: list[int] = []
        scores = [0.0]
        proposals: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in range(normal_layers):
            last = layer == normal_layers - 1
            if self._sampling is not None:
                tok, logp, carried, out, proposals[len(tokens) + 1] = self._drawn_step(r, last and contrastive)
            else:
                tok, logp, carried, out = self._expand(r, 1, need_out=last and contrastive)
            tokens.append(int(tok))
            scores.append(scores[-1] + float(logp))
            if last:
                if contrastive:
                    con_tok, con_logp = self._contrastive_children(out, torch.zeros(1, dtype=torch.long), 1)
                    tokens.append(int(con_tok))
                    scores.append(scores[-1] + float(con_logp))
                break
            r = self.draft.attend(carried.view(1, 1, -1), torch.tensor([[tokens[-1]]]), torch.tensor([base + layer]),
                                  self.cache)
            self.cache.commit(1)
            self.draft_forwards += 1
        self.cache.truncate(base)
        tree = self._chain(context, tokens, scores)
        if proposals:
            tree.proposals = {node: proposal for node, proposal in proposals.items() if node < tree.size}
        return tree

    def _drawn_step(self, r: torch.Tensor, need_out: bool):
        """A chain step of a sampled request from the residual row r [1, 1, d]: the token drawn
        from the draft's processed distribution over its head (``set_sampling``), its score, the
        feature it carries (``_children``'s: the first activated expert's with decoupled
        candidates, the blend otherwise), the draft output (``need_out``, else None) and
        (head ids, q), the distribution it was drawn from."""
        params, generator = self._sampling
        out = None
        if self.mode == "blended" or need_out:
            out = self.draft.heads(r)
            feat = out.features[0, :, 0] if self.mode == "decoupled" else out.blend[0]  # [1, d]
        else:
            feat = self.draft.first_feature(r[0])
        head = self.head
        q = processed_probs(self.draft.head_logits(feat, head)[0], params)
        i = sample(q, generator)
        # the score is the draft's confidence, as for a chain of its most likely tokens: a drawn
        # token's own probability says little of its chance (min(1, p / q) is often 1 for an
        # unlikely one), and scored by it the cost-aware cut left sampled chains unverified
        return int(head.ids[i]), math.log(float(q.max())), feat, out, (head.ids, q)

    def _chain(self, context: list[int], tokens: list[int], scores: list[float]) -> Tree:
        """The chain tree of a proposal's first ``total_tokens`` tokens, with their scores."""
        n = min(len(tokens), self.budget.total_tokens)
        tree = chain_tree(context[-1], tokens[:n])
        tree.scores = torch.tensor(scores[:n + 1])
        tree.sources = torch.tensor([0] + [DRAFT] * n)
        return tree

    def _expand(self, r: torch.Tensor, k: int, need_out: bool = False):
        """The top-k children of each forwarded row of residual rows r [1, F, d]: (tokens [F, k],
        log-probs [F, k], the features they carry [F, k, d], the draft output, or None where a
        fused kernel ran). EAGLE-2's one MLP takes one kernel call for the MLP, the head and its
        top-k; decoupled Jakiro children take one for the router, the activated experts, the head
        and each expert's share (``DraftModel.experts_topk``: a node's only child runs the expert
        the router ranks first, the other experts are not evaluated). The contrastive branch
        (``need_out``) and blended candidates need the whole draft output (``heads``)."""
        if self.mode == "single":
            fused = self.draft.mlp_head_topk(r[0], k, self.head)
            if fused is not None:
                feats, tokens, logp = fused
                return tokens, logp, feats.unsqueeze(1).expand(-1, tokens.shape[1], -1), None
        elif self.mode == "decoupled" and not need_out:
            quotas = [q for q in _quotas(k, self.draft.config.experts_per_token) if q > 0]
            fused = self.draft.experts_topk(r[0], quotas, self.head)
            if fused is not None:
                feats, tokens, logp = fused  # [F, A, d], [F, k], [F, k]
                carried = torch.cat([feats[:, a:a + 1].expand(-1, q, -1) for a, q in enumerate(quotas)], 1)
                return tokens, logp, carried, None
        out = self.draft.heads(r)
        return (*self._children(out, torch.arange(r.shape[1]), k), out)

    def _propose_dynamic(self, context: list[int], r: torch.Tensor, base: int, depth: int) -> Tree:
        """Expand the top_k frontier layer by layer (one draft forward per layer, the last layer
        from the contrastive branch with parallel decoding), then keep the best-scored nodes.
        ``r``: the residual row of the root [1, 1, d]."""
        k, cache = self.budget.top_k, self.cache
        cands = _Candidates()
        front_ids = torch.tensor([-1])  # their candidate ids (-1 = the root)
        front_scores = torch.zeros(1)
        slot_rows = torch.zeros(1, depth * k, dtype=torch.bool)  # draft scratch slots each frontier node sees
        n_slots = 0
        normal_layers = depth - 1 if self.parallel and depth >= 2 else depth
        for layer in range(normal_layers):
            last = layer == normal_layers - 1
            tokens, logp, carried, out = self._expand(r, k, need_out=last and self.parallel and depth >= 2)  # [F, k]
            scores = front_scores.unsqueeze(1) + logp
            ids = cands.add(tokens, scores, front_ids)
            if last:
                if self.parallel and depth >= 2:  # last layer from the contrastive branch of the same forward,
                    # hung under the best child of the node whose forward produced it
                    con_tokens, con_logp = self._contrastive_children(out, torch.arange(r.shape[1]), k)
                    best = scores.argmax(1, keepdim=True)
                    cands.add(con_tokens, scores.gather(1, best) + con_logp, ids.gather(1, best).squeeze(1))
                break
            # next frontier: the top_k children of this layer by cumulative score
            flat_scores = scores.flatten()
            pick = torch.topk(flat_scores, min(k, flat_scores.shape[0])).indices
            new_rows = slot_rows[pick // k].clone()
            new_rows[torch.arange(pick.shape[0]), torch.arange(n_slots, n_slots + pick.shape[0])] = True
            n_slots += pick.shape[0]
            attn = torch.cat((torch.ones(pick.shape[0], base, dtype=torch.bool), new_rows[:, :n_slots]), 1)
            in_feats = carried.reshape(-1, carried.shape[-1])[pick]
            # the pair (f_t, x_{t+1}) for a node at depth layer+1 sits at position base + layer
            r = self.draft.attend(in_feats.unsqueeze(0), tokens.flatten()[pick].unsqueeze(0),
                                  torch.full((pick.shape[0],), base + layer), cache, attn)
            cache.commit(pick.shape[0])
            self.draft_forwards += 1
            front_ids, front_scores, slot_rows = ids.flatten()[pick], flat_scores[pick], new_rows
        cache.truncate(base)
        return cands.tree(context[-1], self.budget.total_tokens)

    def _propose_static(self, context: list[int], out, base: int) -> Tree:
        from .static_tree import fill_static_tree
        return fill_static_tree(self, context, out, base)


def _quotas(k: int, experts: int) -> list[int]:
    """Children per activated expert, in router order, for a decoupled node's k children."""
    return [k // experts + (1 if j < k % experts else 0) for j in range(experts)]
