"""Would an EAGLE-3-style draft input (the target's mid-layer residual streams next to its last
feature) help our drafts? A side-by-side probe, run from the repository root:

    python docs/experiments/mid_layer_features.py features SOURCE.jsonl FIRST COUNT OUT.pt [--threads N]
    python docs/experiments/mid_layer_features.py train {plain,mid,self} STEPS OUT.json TRAIN.pt[,TRAIN2.pt] HELD.pt [--threads N]

``features`` runs the target (its torch path, float32) over conversations FIRST .. FIRST+COUNT−1 of
a regenerated JSONL and keeps, per conversation, the token ids, the loss mask, the draft's usual
input feature (the final norm's output) and the residual stream after layers 3 and 15 (float16).

``train`` continues the shipped EAGLE-2 draft on those records for STEPS steps of 8 conversations
with the trainer's recipe (single step, input noise 0.2, AdamW 5e-4 with 20 warm-up steps and a
cosine decay, gradient clip 0.5). Arm ``mid`` adds the two residual streams, each RMS-normalised
without a weight, through a zero-initialised linear map (1152 → 576) to the draft's step-1 input
feature; arm ``plain`` trains without it; arm ``self`` is the capacity control: the same map,
trained the same way, fed the final feature twice instead of the mid-layer streams. All arms see
the same batches and the same noise. It prints
held-out top-1 per draft step (four unrolled steps, as ``jakiro train`` measures it) before
training, every 150 steps and at the end, and writes the log to OUT.json.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from jakiro.settings import Runtime
import torch.nn.functional as F

MID_LAYERS = (3, 15)  # residual stream after these many decoder layers (of 30)
BATCH, SEQ_LEN, NOISE, WARMUP, LR = 8, 512, 0.2, 20, 5e-4
DRAFT = "jakiro/drafts/smollm2-135m-eagle2"


def extract(args) -> None:
    from transformers import AutoTokenizer
    from jakiro.models.hub import resolve_target
    from jakiro.models.target import TargetModel
    from jakiro.train.records import tokenize_conversation

    path = resolve_target()
    tokenizer = AutoTokenizer.from_pretrained(path)
    m = TargetModel.from_folder(path, Runtime(quantized=False))
    with open(args.source) as f:
        lines = f.read().splitlines()[args.first:args.first + args.count]
    out, tokens, t0 = [], 0, time.time()
    with torch.inference_mode():
        for line in lines:
            r = tokenize_conversation(tokenizer, json.loads(line)["messages"], SEQ_LEN)
            if r is None:
                continue
            ids, mask = r
            x = m.embed[torch.tensor(ids)]
            cache = m.new_cache(len(ids))
            pos = torch.arange(len(ids))
            cos, sin = m.cos[pos].unsqueeze(1), m.sin[pos].unsqueeze(1)
            mids = []
            for i, layer in enumerate(m.layers):
                q, k, v = m._attention_inputs(layer, x, cos, sin)
                k_all, v_all = cache.write(i, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0))
                x = m._attention_output_and_mlp(layer, x, m._attend(q, k_all, v_all, None, True))
                if i + 1 in MID_LAYERS:
                    mids.append(x.clone())
            f = F.rms_norm(x, (x.shape[-1],), m.norm, m.config.rms_norm_eps)
            out.append((torch.tensor(ids), torch.tensor(mask, dtype=torch.bool), f.clone(),
                        torch.stack(mids, 1).half()))
            tokens += len(ids)
    print(f"{len(out)} conversations, {tokens} tokens, {tokens / (time.time() - t0):.0f} tokens/s")
    torch.save(out, args.out)


def batch(recs, d: int, seed: int | None = None):
    """Padded ids, features, mask, mid-layer streams and (with ``seed``) the input noise."""
    T = min(SEQ_LEN, max(r[0].shape[0] for r in recs))
    ids = torch.zeros(len(recs), T, dtype=torch.long)
    feats, noise = torch.zeros(len(recs), T, d), torch.zeros(len(recs), T, d)
    mids = torch.zeros(len(recs), T, len(MID_LAYERS), d)
    mask = torch.zeros(len(recs), T, dtype=torch.bool)
    for b, (i, m, f, mm) in enumerate(recs):
        n = min(T, i.shape[0])
        ids[b, :n], mask[b, :n], feats[b, :n], mids[b, :n] = i[:n], m[:n], f[:n], mm[:n].float()
        if seed is not None:
            g = torch.Generator().manual_seed(seed * 1000 + b)
            noise[b, :n] = (torch.rand(n, d, generator=g) - 0.5) * NOISE
    return ids, feats, mask, mids, noise


def train(args) -> None:
    from jakiro.draft import load_draft
    from jakiro.models.hub import resolve_target
    from jakiro.models.target import TargetModel
    from jakiro.train.losses import carried_feature, draft_loss, unroll

    torch.manual_seed(0)
    target = TargetModel.from_folder(resolve_target())
    draft = load_draft(DRAFT, target)
    full_head = target.lm_head.weight
    d = target.config.hidden_size
    records = [r for f in args.train.split(",") for r in torch.load(f)]
    held = torch.load(args.held)
    proj = torch.nn.Linear(len(MID_LAYERS) * d, d, bias=False)
    torch.nn.init.zeros_(proj.weight)
    params = list(draft.parameters()) + ([proj.weight] if args.arm != "plain" else [])
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.0)

    def inject(feats, mids):
        if args.arm == "plain":
            return None
        source = mids if args.arm == "mid" else torch.stack((feats, feats), -2)
        return proj(F.rms_norm(source, (d,)).flatten(-2))

    @torch.no_grad()
    def evaluate(steps: int = 4) -> list[float]:
        draft.eval()
        hits = torch.zeros(2, steps)
        for s in range(0, len(held), 8):
            ids, feats, mask, mids, _ = batch(held[s:s + 8], d)
            want = torch.full(mask.shape, -1, dtype=torch.long)
            want[mask] = F.linear(feats[mask], full_head).argmax(-1)
            for rows in unroll(draft, ids, feats, mask, steps, inject(feats, mids)):
                ok, b, p = rows.targets(mask)
                best = draft.head_logits(carried_feature(draft, rows.out)[ok]).argmax(-1)
                hits[0, rows.step - 1] += float((draft.to_target_ids(best) == want[b, p]).sum())
                hits[1, rows.step - 1] += int(ok.sum())
        draft.train()
        return [round(x, 4) for x in (hits[0] / hits[1]).tolist()]

    log = {"arm": args.arm, "threads": args.threads, "before": evaluate(), "curve": []}
    print(f"{args.arm}: held-out top-1 per step before training {log['before']}", flush=True)
    order = torch.randperm(len(records), generator=torch.Generator().manual_seed(0)).tolist()
    t0, tokens = time.time(), 0
    for step in range(args.steps):
        recs = [records[order[(step * BATCH + j) % len(order)]] for j in range(BATCH)]
        ids, feats, mask, mids, noise = batch(recs, d, seed=step)
        progress = (step - WARMUP) / max(1, args.steps - WARMUP)
        lr = LR * (step + 1) / WARMUP if step < WARMUP else LR * 0.5 * (1 + math.cos(math.pi * progress))
        for g in opt.param_groups:
            g["lr"] = lr
        extra = inject(feats, mids)
        total, _ = draft_loss(draft, ids, feats, mask, 1, noise if extra is None else noise + extra, "separate")
        count = mask[:, 1:].sum().clamp(min=1)
        opt.zero_grad(set_to_none=True)
        (total / count).backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        tokens += int(count)
        if (step + 1) % 50 == 0 or step + 1 == args.steps:
            row = {"step": step + 1, "loss_tokens": tokens, "loss": float(total.detach()) / float(count),
                   "seconds": round(time.time() - t0, 1)}
            if (step + 1) % 150 == 0 or step + 1 == args.steps:
                row["heldout_top1"] = evaluate()
            log["curve"].append(row)
            print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(log, f, indent=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    fe = sub.add_parser("features")
    fe.add_argument("source")
    fe.add_argument("first", type=int)
    fe.add_argument("count", type=int)
    fe.add_argument("out")
    tr = sub.add_parser("train")
    tr.add_argument("arm", choices=("plain", "mid", "self"))
    tr.add_argument("steps", type=int)
    tr.add_argument("out")
    tr.add_argument("train")
    tr.add_argument("held")
    for s in (fe, tr):
        s.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    (extract if args.cmd == "features" else train)(args)


if __name__ == "__main__":
    main()
