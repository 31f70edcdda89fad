"""Target cost curve (forward time vs number of new tree tokens at a fixed context), judged
against the machine's memory floor (the time to stream the target's weights once, measured in
the same run; also the weights plus the KV cache at that context, which a forward reads too),
the draft's cost per step and per cycle for each shipped draft, what verifying a tree costs
(greedy and sampled), and plain greedy decoding
tokens/s of our runtime vs Hugging Face ``generate``, measured alternately."""

from __future__ import annotations

import statistics
import time

import torch

from ..decoding.costs import forward_costs, median_ms, prefilled_cache
from ..models import smallgemm
from ..settings import Runtime

PROMPT = "Write a detailed, step by step explanation of how a refrigerator keeps food cold."


def weight_bytes(target) -> int:
    """Bytes of weights one forward of a few rows streams (every matrix and norm once; the LM
    head once; GGUF blocks where the quantized kernel streams those)."""
    size = target.norm.element_size()
    total = target.norm.numel() * size  # the embedding is only gathered from: one row per token
    for layer in target.layers:
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
            total += lin.streamed_bytes
        total += (layer.input_norm.numel() + layer.post_norm.numel()) * size
    return total + target.lm_head.streamed_bytes


def kv_bytes(target, context: int) -> int:
    """Bytes of cached keys and values a forward reads at ``context`` cached tokens (every layer's
    keys and values once; trees re-read them per row)."""
    cfg = target.config
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * context * target.kv_dtype.itemsize  # as new_cache


def floor_buffer(nbytes: int) -> torch.Tensor:
    """``nbytes`` of float32 ones on the memory pages the kernels' weights get (2 MiB pages where
    the OS allows: read once, 4 KiB pages take about a tenth longer), so that the floor is read
    the way the weights are."""
    if smallgemm.available():
        return smallgemm.weight_buffer(nbytes // 4).fill_(1.0)
    return torch.ones(nbytes // 4, dtype=torch.float32)


def memory_floor_ms(nbytes: int, repeats: int) -> float:
    """Median ms to read ``nbytes`` once (a sum over a buffer of that size): the least time any
    forward that streams that many bytes of weights can take on this machine."""
    buf = floor_buffer(nbytes)
    return median_ms(lambda: buf.sum(), repeats)


@torch.inference_mode()
def floor_and_forward_ms(target, nbytes: int, context: int, repeats: int) -> tuple[float, float]:
    """The memory floor and a one-token forward (after ``context`` tokens) timed in the same
    rounds, one after the other: on a shared machine whose memory bandwidth moves by a third from
    one minute to the next, their ratio is only meaningful measured together."""
    from ..decoding.costs import PRIMING_CALLS, interleaved_ms
    buf = floor_buffer(nbytes)
    cache = prefilled_cache(target, context, 1)
    token = torch.tensor([7])
    times = interleaved_ms({"floor": lambda: buf.sum(), "forward": lambda: target(token, cache)}, repeats,
                           primed=PRIMING_CALLS)
    return times["floor"], times["forward"]


def draft_costs(jk, method: str, context: int, repeats: int, nodes: int = 8) -> dict:
    """For the shipped ``method`` draft: one draft step over ``nodes`` frontier nodes (the draft
    forward, its head and the top-k of the default tree), repeated on its own and each time right
    after a target forward (as in decoding), one whole proposal with the draft's default tree, and
    a two-token chain proposal (the kind ``jakiro tune`` picks here) right after a target forward."""
    from ..api import shipped_draft
    from ..decoding.proposers import TreeBudget
    from ..decoding.draft_proposer import DraftProposer
    from ..draft import load_draft

    draft = load_draft(shipped_draft(method), jk.target)
    gen = torch.Generator().manual_seed(0)
    d, w = draft.config.hidden_size, draft.feature_width  # w: the target features proposers observe
    cache = draft.new_cache(context + 64)
    with torch.inference_mode():
        draft(torch.randn(1, context, d, generator=gen), torch.randint(0, 1000, (1, context), generator=gen),
              torch.arange(context), cache)
        cache.commit(context)
        feats = torch.randn(1, nodes, d, generator=gen)
        toks = torch.randint(0, 1000, (1, nodes), generator=gen)
        positions = torch.full((nodes,), context)
        mask = torch.cat((torch.ones(nodes, context, dtype=torch.bool), torch.eye(nodes, dtype=torch.bool)), 1)

        proposer = DraftProposer(draft, TreeBudget())

        def step():  # as a dynamic tree's layer runs: attention, then experts, head and top-k
            return proposer._expand(draft.attend(feats, toks, positions, cache, mask), proposer.budget.top_k)
        step_ms = median_ms(step, repeats)
        # in decoding a target forward runs between draft steps and pushes the draft's weights
        # out of the caches: the same step, each time right after a one-token target forward
        target_cache = prefilled_cache(jk.target, context, 1)
        one = torch.tensor([7])
        step_cold_ms = median_ms(step, repeats, warmup=1, before=lambda: jk.target(one, target_cache))

    ids = torch.randint(0, 1000, (context,), generator=gen).tolist()
    _started(proposer, ids, w, gen, context + 4 * repeats + 64)

    def cycle():
        proposer.observe(torch.randn(1, w, generator=gen), torch.tensor([7]))
        proposer.propose(ids)

    # the chain the tuner picks on this machine: catch up on two committed positions, draft two
    # tokens one at a time (top-1, no contrastive branch), right after a target forward
    chain = _started(DraftProposer(draft, TreeBudget(2, 1, 2), parallel_decoding=False), ids, w, gen,
                     context + 4 * repeats + 64)

    def chain_cycle():
        chain.observe(torch.randn(2, w, generator=gen), torch.tensor([7, 8]))
        chain.propose(ids)
    with torch.inference_mode():
        chain_ms = median_ms(chain_cycle, repeats, warmup=1, before=lambda: jk.target(one, target_cache))
    return {"draft": shipped_draft(method), "head_vocab": draft.config.draft_vocab_size,
            "step_ms": round(step_ms, 2), "step_after_target_ms": round(step_cold_ms, 2), "step_nodes": nodes,
            "chain2_propose_after_target_ms": round(chain_ms, 2),
            "propose_ms": round(median_ms(cycle, repeats), 2),
            "tree": {"depth": proposer.budget.depth, "top_k": proposer.budget.top_k,
                     "total_tokens": proposer.budget.total_tokens}}


def verification_costs(vocab: int, repeats: int, sizes=(1, 8, 16)) -> dict:
    """Median ms to verify a tree of n nodes (a binary tree whose every token is its parent's
    most likely one, over random logits of the target's vocabulary) greedily and by sampling at
    T = 1; and one token drawn from a distribution over ``vocab`` by ``sample_rows`` and by
    ``torch.multinomial``, which draws the same distribution."""
    from ..decoding.sampling import SamplingParams, sample
    from ..decoding.tree import build_tree
    from ..decoding.verify import verify

    gen = torch.Generator().manual_seed(0)
    out: dict = {"vocab": vocab, "greedy_ms": {}, "sampled_t1_ms": {}}
    for n in sizes:
        logits = torch.randn(n, vocab, generator=gen) * 3
        parents = [-1] + [(i - 1) // 2 for i in range(1, n)]
        best = logits.argmax(-1)
        tree = build_tree(torch.tensor([0] + [int(best[p]) for p in parents[1:]]), torch.tensor(parents))
        for key, params in (("greedy_ms", SamplingParams()), ("sampled_t1_ms", SamplingParams(1.0))):
            out[key][str(n)] = round(median_ms(lambda: verify(tree, logits, params, gen), repeats), 3)
    probs = (torch.randn(vocab, generator=gen) * 3).softmax(-1)
    out["one_sample_ms"] = {
        "sample_rows": round(median_ms(lambda: sample(probs, gen), repeats), 3),
        "torch_multinomial": round(median_ms(lambda: torch.multinomial(probs, 1, generator=gen), repeats), 3)}
    return out


def kernel_comparison(with_kernel, target_path: str, context: int, repeats: int, rounds: int = 3) -> dict:
    """Forward costs with the small-batch kernel (``with_kernel``, a loaded target) and with
    torch's kernels (a second copy), and where ``with_kernel`` streams quantized weights also
    with the kernel on float32 weights (a third) and, where it streams them through the AMX or
    the int8 kernel, with the portable quantized kernel (a fourth), measured alternately (machine
    drift hits all alike); medians over ``rounds``."""
    from ..models.target import TargetModel
    models = {}
    blocks = with_kernel.runtime.but(int8_activations=False)
    floats = blocks.but(quantized=False, kv_cache="float32")  # (float32 weights keep float32 entries)
    if with_kernel.quantized_matrices:
        models["quantized"] = with_kernel
        if with_kernel.tile_matrices:
            with smallgemm.int8_disabled(), smallgemm.tiles_disabled():  # int8 first: it asks whether tiles run
                models["quantized_portable"] = TargetModel.from_folder(target_path, blocks)
        models["small_batch"] = TargetModel.from_folder(target_path, floats)
    else:
        models["small_batch"] = with_kernel
    with smallgemm.disabled():
        models["torch"] = TargetModel.from_folder(target_path, floats)
    runs: dict[str, list[dict]] = {name: [] for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            runs[name].append(forward_costs(model, context, repeats))
    medians = {name: {n: statistics.median(r[n] for r in rs) for n in rs[0]} for name, rs in runs.items()}

    def ratio(a: str, b: str) -> dict:
        return {str(n): round(medians[a][n] / medians[b][n], 2) for n in medians[a]}
    out = {name: {str(n): round(ms, 2) for n, ms in m.items()} for name, m in medians.items()}
    out["torch_over_small_batch"] = ratio("torch", "small_batch")
    if "quantized" in medians:
        out["small_batch_over_quantized"] = ratio("small_batch", "quantized")
    if "quantized_portable" in medians:
        out["portable_over_tiles"] = ratio("quantized_portable", "quantized")
    return out


def _started(proposer, ids: list[int], width: int, gen: torch.Generator, room: int):
    """``proposer`` started on the prompt ``ids`` (random target features of ``width``) and
    through its first proposal."""
    proposer.start(room, prompt_vocab=False)
    proposer.observe(torch.randn(len(ids), width, generator=gen), torch.tensor(ids[1:] + [7]))
    proposer.propose(ids)
    return proposer


def shipped_draft_costs(jk, context: int, repeats: int, t1_ms: float) -> dict:
    """``draft_costs`` of each shipped draft of the default target (with the int8 kernel, also
    its step with the float32 kernel), each also as a multiple of the one-token forward."""
    from ..api import shipped_draft
    drafts = {m: draft_costs(jk, m, context, repeats) for m in ("eagle2", "jakiro") if shipped_draft(m)}
    if smallgemm.int8_enabled():  # the same draft steps with the float32 kernel, side by side
        with smallgemm.int8_disabled():
            for m, d in drafts.items():
                d["step_ms_float32_kernel"] = draft_costs(jk, m, context, repeats)["step_ms"]
    for d in drafts.values():
        for key in ("step", "step_after_target", "propose", "chain2_propose_after_target"):
            d[f"{key}_x_t1"] = round(d[f"{key}_ms"] / t1_ms, 3)
    return drafts


def plain_decoding(jk, new_tokens: int, rounds: int, llamacpp: bool, cache_dir: str | None) -> dict:
    """Greedy plain decoding of ``PROMPT``, ours against Hugging Face ``generate`` on the
    dequantized weights (and with ``llamacpp`` llama.cpp's server on the same file and threads),
    one after another in each of ``rounds``: {"ours": tokens/s, "hf": ..., "same": whether
    Hugging Face's tokens were ours in every round, "ours_decode": tokens/s without the
    prompt's prefill, "llamacpp": the same for llama.cpp (empty without it)}."""
    from ..models.gguf_file import hugging_face_model
    engine = jk.engine("ar")
    ids = engine.encode(PROMPT)
    hf = hugging_face_model(jk.target_path)
    out = {"ours": [], "hf": [], "same": True, "ours_decode": [], "llamacpp": []}
    llama = None
    if llamacpp:  # llama.cpp's server on the same file and threads, timed by itself (prompt excluded)
        from ..models.gguf_file import source_file
        from .llamacpp import LlamaServer
        llama = LlamaServer(source_file(jk.target_path), torch.get_num_threads(), cache=cache_dir)
        llama.complete(ids, 8, 0.0, 0)
    engine.generate(ids, 8)  # warm-up
    try:
        with torch.inference_mode():
            hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
            for _ in range(rounds):
                res = engine.generate(ids, new_tokens)
                out["ours"].append(res.metrics.tokens_per_s)
                out["ours_decode"].append(res.metrics.new_tokens / (res.metrics.total_s - res.metrics.prefill_s))
                t0 = time.perf_counter()
                hf_ids = hf.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)[0, len(ids):].tolist()
                out["hf"].append(len(hf_ids) / (time.perf_counter() - t0))
                out["same"] &= hf_ids == res.token_ids
                if llama is not None:
                    answer = llama.complete(ids, new_tokens, 0.0, 0)
                    out["llamacpp"].append(len(answer["token_ids"]) / answer["decode_s"])
    finally:
        if llama is not None:
            llama.close()
    return out


def run_cost_curve(target_path: str | None, cache_dir: str | None, context: int, repeats: int,
                   new_tokens: int, rounds: int, compare_kernels: bool = False, llamacpp: bool = False,
                   runtime: Runtime | None = None) -> dict:
    from ..api import load

    jk = load(target_path, cache_dir=cache_dir, runtime=runtime, prompt_cache=False)
    nbytes = weight_bytes(jk.target)
    floor = memory_floor_ms(nbytes, repeats)
    cached = kv_bytes(jk.target, context)
    floor_kv = memory_floor_ms(nbytes + cached, repeats)
    costs = forward_costs(jk.target, context, repeats)
    paired_floor, paired_t1 = floor_and_forward_ms(jk.target, nbytes, context, repeats)
    drafts = shipped_draft_costs(jk, context, repeats, costs[1]) if target_path is None else {}
    verification = verification_costs(jk.target.config.vocab_size, repeats)
    plain = plain_decoding(jk, new_tokens, rounds, llamacpp, cache_dir)
    ours, theirs = statistics.median(plain["ours"]), statistics.median(plain["hf"])
    extra = {}
    if plain["llamacpp"]:  # both without the prompt's prefill (llama.cpp's own decoding time)
        ours_decode, llama_decode = statistics.median(plain["ours_decode"]), statistics.median(plain["llamacpp"])
        extra["llamacpp_plain_decoding"] = {"ours_tokens_per_s": round(ours_decode, 2),
                                            "llamacpp_tokens_per_s": round(llama_decode, 2),
                                            "ours_over_llamacpp": round(ours_decode / llama_decode, 3)}
    if compare_kernels and smallgemm.available():
        extra["kernels_side_by_side_ms"] = kernel_comparison(jk.target, jk.target_path, context, repeats, rounds)
    return {
        "target": jk.target_path,
        "threads": torch.get_num_threads(),
        "small_batch_kernel": smallgemm.status(),
        "quantized_matrices": jk.target.quantized_matrices,
        "tile_matrices": jk.target.tile_matrices,
        "int8_activations": jk.target.int8_activations,
        "kv_cache": jk.target.runtime.kv_cache,
        "context": context,
        "weights_mb": round(nbytes / 1e6, 1),
        "memory_floor_ms": round(floor, 2),
        "forward_ms": {str(n): round(ms, 2) for n, ms in costs.items()},
        "forward_x_floor": {str(n): round(ms / floor, 2) for n, ms in costs.items()},
        # the one-token forward and the floor in the same rounds (the ratio to trust on a shared machine)
        "paired": {"memory_floor_ms": round(paired_floor, 2), "forward_1_ms": round(paired_t1, 2),
                   "forward_1_x_floor": round(paired_t1 / paired_floor, 3)},
        "kv_cache_mb": round(cached / 1e6, 1),
        "memory_floor_with_kv_ms": round(floor_kv, 2),
        "t1_x_floor_with_kv": round(costs[1] / floor_kv, 2),
        "forward_x_t1": {str(n): round(ms / costs[1], 2) for n, ms in costs.items()},
        "draft_cost": drafts,
        "verification": verification,
        "plain_decoding": {
            "new_tokens": new_tokens, "rounds": rounds,
            "ours_tokens_per_s": round(ours, 2), "hf_generate_tokens_per_s": round(theirs, 2),
            "ratio": round(ours / theirs, 3), "same_tokens": plain["same"],
            "floor_tokens_per_s": round(1000 / floor, 1),
            "ours_x_floor_rate": round(ours / (1000 / floor), 3),
        },
        **extra,
    }
