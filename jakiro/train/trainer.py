"""Draft trainer: one CPU, one GPU, or several processes (torch.distributed DDP: gloo on CPU,
NCCL on GPU; launch with ``torchrun --nproc-per-node N -m jakiro train ...``). Periodic
checkpoints, exact resume, held-out top-1 accuracy per draft step, a JSON log and a PNG plot."""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..draft import DraftConfig, DraftModel, load_draft, save_draft
from ..errors import JakiroError
from .dataset import FeatureDataset
from .losses import draft_loss


@dataclass
class TrainConfig:
    data: str
    out: str
    method: str = "jakiro"
    num_experts: int = 2
    experts_per_token: int = 2
    candidate_mode: str = "decoupled"
    parallel_decoding: bool = True
    draft_vocab_size: int | None = 8192
    steps: int = 1000
    batch_size: int = 8  # records per optimizer step (global, over all processes)
    seq_len: int = 512
    lr: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    noise: float = 0.2  # uniform input-feature noise in [-noise/2, noise/2]
    eval_every: int = 200
    eval_records: int = 32
    eval_steps: int = 4
    checkpoint_every: int = 100
    seed: int = 0


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _init_distributed(device: torch.device) -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def make_batch(ds: FeatureDataset, indices: list[int], seq_len: int, device,
               noise: float = 0.0, noise_seed: int = 0) -> tuple:
    """Pad records to a common length: ids [B, T], feats [B, T, d] float32, mask [B, T] bool,
    and the input noise [B, T, d]. A record's noise depends only on (noise_seed, its index), so a
    batch is the same however it is split over processes and however often training resumes."""
    recs = [ds.record(i) for i in indices]
    T = min(seq_len, max(r[0].shape[0] for r in recs))
    B, d = len(recs), ds.features.shape[1]
    ids = torch.zeros(B, T, dtype=torch.long)
    feats = torch.zeros(B, T, d)
    mask = torch.zeros(B, T, dtype=torch.bool)
    noises = torch.zeros(B, T, d)
    for b, (i, m, f) in enumerate(recs):
        n = min(T, i.shape[0])
        ids[b, :n], mask[b, :n], feats[b, :n] = i[:n], m[:n], f[:n].float()
        if noise > 0:
            g = torch.Generator().manual_seed(noise_seed * 1_000_003 + indices[b])
            noises[b, :n] = (torch.rand(n, d, generator=g) - 0.5) * noise
    return ids.to(device), feats.to(device), mask.to(device), noises.to(device)


def _forward(model, ids, feats, noises):
    """Pairs (f_t + noise, x_{t+1}) at positions t = 0..T-2."""
    inp = feats[:, :-1] + noises[:, :-1]
    T = inp.shape[1]
    return model(inp, ids[:, 1:], torch.arange(T, device=ids.device))


@torch.no_grad()
def step_accuracy(model: DraftModel, ds: FeatureDataset, indices: list[int], seq_len: int,
                  steps: int, full_head: torch.Tensor, device) -> list[float]:
    """Held-out top-1 accuracy per draft step. Step 1 uses the target's features; step k feeds
    the draft's own predictions from step k-1 as the features of every position (the
    training-time-test approximation of drafting k tokens ahead). A prediction counts when the
    draft's top token (in target ids) equals the target's own next token."""
    model.eval()
    hits = torch.zeros(steps)
    total = torch.zeros(steps)
    for start in range(0, len(indices), 8):
        ids, feats, mask, _ = make_batch(ds, indices[start:start + 8], seq_len, device)
        T = ids.shape[1] - 1
        target_next = F.linear(feats[:, 1:], full_head).argmax(-1)  # token after x_{t+1}: [B, T]
        inp = feats[:, :-1]
        for k in range(steps):
            out = model(inp, ids[:, 1:], torch.arange(T, device=device))
            pred_feat = out.features[:, :, 0] if model.config.candidate_mode == "decoupled" else out.blend
            pred = model.to_target_ids(model.head_logits(pred_feat).argmax(-1))
            valid = mask[:, 1:].clone()
            valid[:, :k] = False  # positions whose rolled inputs do not exist
            hits[k] += ((pred == target_next) & valid).sum().item()
            total[k] += valid.sum().item()
            inp = torch.cat((feats[:, :1], pred_feat[:, :-1]), 1)
    model.train()
    return (hits / total.clamp(min=1)).tolist()


class Trainer:
    def __init__(self, cfg: TrainConfig, target_path: str | None = None, cache_dir: str | None = None,
                 resume: bool = False, device: str | None = None, progress: bool = True):
        self.cfg, self.progress = cfg, progress
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        _init_distributed(self.device)
        self.rank, self.world = _rank_world()
        if cfg.batch_size % self.world:
            raise JakiroError(f"batch size {cfg.batch_size} must be divisible by the {self.world} processes")
        self.ds = FeatureDataset(cfg.data)
        if len(self.ds) < 2:
            raise JakiroError(f"dataset {cfg.data} has {len(self.ds)} record(s); need at least 2")
        from ..models.hub import resolve_target
        from ..models.target import TargetModel
        target = TargetModel.from_folder(resolve_target(target_path, cache_dir))
        ident = self.ds.identity
        if (ident["hidden_size"], ident["vocab_size"]) != (target.config.hidden_size, target.config.vocab_size):
            raise JakiroError(f"dataset {cfg.data} was built for {ident['target_name']} "
                              f"(hidden {ident['hidden_size']}, vocab {ident['vocab_size']}), "
                              f"not for this target ({target.config.name})")
        self.target_name = target.config.name
        self.embed = target.embed.to(self.device)
        self.full_head = target.lm_head.weight.to(self.device)
        n_eval = min(cfg.eval_records, max(1, len(self.ds) // 20))
        self.eval_idx = list(range(len(self.ds) - n_eval, len(self.ds)))
        self.train_idx = list(range(len(self.ds) - n_eval))
        self.ckpt_dir = os.path.join(cfg.out, "checkpoint")
        self._prepare_out(resume)
        overrides = dict(num_experts=cfg.num_experts, experts_per_token=cfg.experts_per_token,
                         candidate_mode=cfg.candidate_mode, parallel_decoding=cfg.parallel_decoding,
                         draft_vocab_size=cfg.draft_vocab_size)
        if cfg.method == "eagle2":
            overrides.update(num_experts=1, experts_per_token=1, parallel_decoding=False)
        self.draft_config = DraftConfig.for_target(target.config, target.hf_config, cfg.method, **overrides)
        torch.manual_seed(cfg.seed)
        self.model = DraftModel(self.draft_config)
        if cfg.draft_vocab_size:
            self.model.set_draft_vocab(self.ds.frequent_tokens(cfg.draft_vocab_size))
        self.model.to(self.device)
        self.model.attach_target(self.embed, self.full_head)
        del target
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                                     weight_decay=cfg.weight_decay)
        self.step = 0
        self.log: list[dict] = []
        if resume and os.path.exists(os.path.join(self.ckpt_dir, "trainer.pt")):
            self._load_checkpoint()
        self.ddp = None
        if self.world > 1:
            from torch.nn.parallel import DistributedDataParallel
            self.ddp = DistributedDataParallel(self.model)

    # ------------------------------------------------------------------ run folder
    def _run_identity(self) -> dict:
        ident = asdict(self.cfg)
        for k in ("out", "steps", "eval_every", "checkpoint_every"):
            ident.pop(k)
        ident["target_name"] = self.ds.identity["target_name"]
        return ident

    def _prepare_out(self, resume: bool) -> None:
        """Rank 0 checks and claims the output folder; every process gets its verdict."""
        error = None
        if self.rank == 0:
            try:
                self._claim_out(resume)
            except JakiroError as exc:
                error = str(exc)
        if self.world > 1:
            box = [error]
            dist.broadcast_object_list(box, src=0)
            error = box[0]
        if error:
            raise JakiroError(error)

    def _claim_out(self, resume: bool) -> None:
        run_file = os.path.join(self.cfg.out, "run.json")
        if os.path.exists(run_file):
            with open(run_file) as f:
                previous = json.load(f)
            if previous != self._run_identity():
                diff = sorted(k for k in set(previous) | set(self._run_identity())
                              if previous.get(k) != self._run_identity().get(k))
                raise JakiroError(f"{self.cfg.out} already holds a different run (differs in: "
                                  f"{', '.join(diff)}); choose another --out")
            if not resume:
                raise JakiroError(f"{self.cfg.out} already holds this run; pass --resume to continue it")
        elif resume:
            raise JakiroError(f"nothing to resume in {self.cfg.out} (no run.json)")
        elif os.path.isdir(self.cfg.out) and os.listdir(self.cfg.out):
            raise JakiroError(f"{self.cfg.out} is not empty and holds no jakiro run; choose another --out")
        os.makedirs(self.cfg.out, exist_ok=True)
        with open(run_file, "w") as f:
            json.dump(self._run_identity(), f, indent=2)

    def _load_checkpoint(self) -> None:
        model = load_draft(self.ckpt_dir)
        if model.config.hidden_size != self.draft_config.hidden_size or \
                model.config.vocab_size != self.draft_config.vocab_size:
            raise JakiroError("the checkpoint was trained for a different target")
        self.model.load_state_dict(model.state_dict())
        self.model.attach_target(self.embed, self.full_head)
        state = torch.load(os.path.join(self.ckpt_dir, "trainer.pt"), weights_only=False)
        self.opt.load_state_dict(state["optimizer"])
        self.step, self.log = state["step"], state["log"]

    def _save_checkpoint(self) -> None:
        if self.rank != 0:
            return
        tmp = self.ckpt_dir + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        save_draft(self.model, tmp, {"training": {"step": self.step, "target_name": self.target_name}})
        torch.save({"optimizer": self.opt.state_dict(), "step": self.step, "log": self.log},
                   os.path.join(tmp, "trainer.pt"))
        shutil.rmtree(self.ckpt_dir, ignore_errors=True)
        os.replace(tmp, self.ckpt_dir)

    # ------------------------------------------------------------------ training
    def batch_indices(self, step: int) -> list[int]:
        """The global batch for a step: a per-epoch permutation, the same on every process."""
        per_epoch = len(self.train_idx)
        out = []
        for j in range(step * self.cfg.batch_size, (step + 1) * self.cfg.batch_size):
            epoch, pos = divmod(j, per_epoch)
            perm = torch.randperm(per_epoch, generator=torch.Generator().manual_seed(self.cfg.seed + epoch))
            out.append(self.train_idx[int(perm[pos])])
        return out

    def train_step(self, indices: list[int]) -> dict:
        cfg = self.cfg
        local = indices[self.rank::self.world]
        ids, feats, mask, noises = make_batch(self.ds, local, cfg.seq_len, self.device, cfg.noise,
                                              cfg.seed + 7919 * self.step)
        count = mask[:, 1:].sum().to(torch.float64)
        if self.world > 1:
            dist.all_reduce(count)
        model = self.ddp or self.model
        for group in self.opt.param_groups:
            group["lr"] = lr_at(self.step, cfg)
        out = _forward(model, ids, feats, noises)
        total, parts = draft_loss(out, feats, self.model.head_weight, mask, cfg.method)
        # DDP averages gradients over processes: scale so the result is the global token mean
        loss = total * self.world / count.clamp(min=1).float()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.opt.step()
        self.step += 1
        value = torch.tensor([float(total.detach())], dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(value)
        return {"step": self.step, "loss": float(value) / max(1.0, float(count)),
                "lr": lr_at(self.step - 1, cfg), "grad_norm": float(grad_norm)}

    def evaluate(self) -> list[float]:
        return step_accuracy(self.model, self.ds, self.eval_idx, self.cfg.seq_len, self.cfg.eval_steps,
                             self.full_head, self.device)

    def run(self, stop_after: int | None = None) -> dict:
        """Train until cfg.steps (or ``stop_after`` more steps, for tests of resuming)."""
        from tqdm import tqdm
        cfg = self.cfg
        end = cfg.steps if stop_after is None else min(cfg.steps, self.step + stop_after)
        bar = tqdm(total=cfg.steps, initial=self.step, desc=f"train {cfg.method}",
                   disable=not self.progress or self.rank != 0)
        t0 = time.time()
        while self.step < end:
            row = self.train_step(self.batch_indices(self.step))
            if self.step % cfg.eval_every == 0 or self.step == cfg.steps:
                row["eval_acc"] = self.evaluate()
            self.log.append(row)
            bar.update(1)
            bar.set_postfix(loss=f"{row['loss']:.3f}")
            if self.step % cfg.checkpoint_every == 0 or self.step == end:
                self._save_checkpoint()
        bar.close()
        result = {"steps": self.step, "seconds": time.time() - t0}
        if self.step == cfg.steps and self.rank == 0:
            self.finish()
        return result

    def finish(self) -> None:
        cfg = self.cfg
        acc = next((r["eval_acc"] for r in reversed(self.log) if "eval_acc" in r), None) or self.evaluate()
        save_draft(self.model, cfg.out, {"training": {
            "steps": self.step, "target_name": self.target_name, "data": cfg.data,
            "records": len(self.train_idx), "heldout_records": len(self.eval_idx),
            "heldout_top1_per_step": acc}})
        with open(os.path.join(cfg.out, "train_log.json"), "w") as f:
            json.dump({"config": asdict(cfg), "heldout_top1_per_step": acc, "log": self.log}, f)
        plot_log(self.log, os.path.join(cfg.out, "train_plot.png"), cfg.method)


def plot_log(log: list[dict], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot([r["step"] for r in log], [r["loss"] for r in log], lw=0.8)
    a.set_xlabel("step")
    a.set_ylabel("training loss")
    a.set_yscale("log")
    evals = [r for r in log if "eval_acc" in r]
    for k in range(len(evals[0]["eval_acc"]) if evals else 0):
        b.plot([r["step"] for r in evals], [r["eval_acc"][k] for r in evals], marker="o", label=f"step {k + 1}")
    b.set_xlabel("step")
    b.set_ylabel("held-out top-1 accuracy")
    b.legend()
    fig.suptitle(f"{title} draft training")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
