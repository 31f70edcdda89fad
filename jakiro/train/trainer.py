"""Draft trainer: one CPU, one GPU, or several processes (torch.distributed DDP: gloo on CPU,
NCCL on GPU; launch with ``torchrun --nproc-per-node N -m jakiro train ...``). Periodic
checkpoints, exact resume, held-out top-1 accuracy per draft step, a JSON log and a PNG plot."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

from ..settings import Runtime
from ..draft import DraftConfig, DraftModel, load_draft, save_draft
from ..errors import JakiroError
from .batches import heldout_batches, heldout_split, heldout_tau, make_batch
from .feature_dataset import FeatureDataset
from .config import TrainConfig, parse_layers
from .report import describe_eval, plot_log
from .upcycle import keeping_own, upcycle
from .losses import draft_loss, heldout_metrics

CALIBRATION_STEPS = 10  # --minutes: timed steps (after the first) that set the step count


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


class DraftLoss(torch.nn.Module):
    """The unrolled training loss as a module, so that DDP's hooks see the whole unroll."""

    def __init__(self, model: DraftModel, cfg: TrainConfig):
        super().__init__()
        self.model, self.cfg = model, cfg

    def forward(self, ids, feats, mask, noises):
        cfg = self.cfg
        return draft_loss(self.model, ids, feats, mask, cfg.unroll, noises, cfg.jakiro_loss, cfg.step_decay,
                          cfg.p_weight)


# settings added after a run format was first written, with the behaviour runs had before them
_LEGACY_SETTINGS = {"unroll": 1, "step_decay": 0.8, "jakiro_loss": "full", "init_from": None, "aux_layers": ""}
_MOE_SETTINGS = ("num_experts", "experts_per_token", "candidate_mode", "parallel_decoding", "jakiro_loss")


def _upgrade_identity(previous: dict, current: dict) -> dict:
    """A run.json written by an earlier version, in today's terms: settings it predates get the
    behaviour it had, and an eagle2 run's Mixture-of-Experts settings (which never applied) go."""
    upgraded = {**{k: v for k, v in _LEGACY_SETTINGS.items() if k in current}, **previous}
    if previous.get("method") == "eagle2":
        for k in _MOE_SETTINGS:
            upgraded.pop(k, None)
    return upgraded


class Trainer:
    def __init__(self, cfg: TrainConfig, target_path: str | None = None, cache_dir: str | None = None,
                 runtime: Runtime | None = None,
                 resume: bool = False, device: str | None = None, progress: bool = True):
        self.cfg, self.progress = cfg, progress
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        _init_distributed(self.device)
        self.rank, self.world = _rank_world()
        cfg.check(self.world)
        target = self._load_data_and_target(target_path, cache_dir, runtime)
        self.ckpt_dir = os.path.join(cfg.out, "checkpoint")
        self._prepare_out(resume)
        self._build_model(target)
        self.target = target if cfg.tau_every else None  # kept only to measure decoding
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                                     weight_decay=cfg.weight_decay)
        self.step = self.tokens = 0
        self.log: list[dict] = []
        self._tau_engine = None
        if resume and os.path.exists(os.path.join(self.ckpt_dir, "trainer.pt")):
            self._resume()
        self.loss = DraftLoss(self.model, cfg)
        self.ddp = None
        if self.world > 1:
            from torch.nn.parallel import DistributedDataParallel
            self.ddp = DistributedDataParallel(self.loss)

    def _load_data_and_target(self, target_path: str | None, cache_dir: str | None, runtime: Runtime | None):
        """The dataset, its train/held-out split, and the target it was built for (returned; its
        embedding and LM head are kept)."""
        from ..models.hub import resolve_target
        from ..models.target import TargetModel
        cfg = self.cfg
        self.ds = FeatureDataset(cfg.data)
        if len(self.ds) < 2:
            raise JakiroError(f"dataset {cfg.data} has {len(self.ds)} record(s); need at least 2")
        self.target_dir = resolve_target(target_path, cache_dir)
        target = TargetModel.from_folder(self.target_dir, runtime)
        self.ds.check_target(target)
        self.target_name = target.config.name
        self.featurizer = self.ds.featurizer(self.target_dir, self.device)  # tokens-only data: per batch
        self.embed = target.dense_embedding().to(self.device)
        self.full_head = target.dense_head().to(self.device)
        self.train_idx, self.eval_idx = heldout_split(self.ds.parts, cfg.eval_records)
        return target

    def _build_model(self, target) -> None:
        """The draft: seeded initialisation (or --init-from), its vocabulary, the target's head."""
        cfg = self.cfg
        overrides = dict(num_experts=cfg.num_experts, experts_per_token=cfg.experts_per_token,
                         candidate_mode=cfg.candidate_mode, parallel_decoding=cfg.parallel_decoding,
                         draft_vocab_size=cfg.draft_vocab_size, aux_layers=list(parse_layers(cfg.aux_layers)))
        if cfg.intermediate_size:
            overrides["intermediate_size"] = cfg.intermediate_size
        if cfg.method == "eagle3" and not cfg.aux_layers:
            overrides.pop("aux_layers")  # the loaders' default streams (2, L/2, L-3)
        if cfg.method in ("eagle2", "eagle3"):
            overrides.update(num_experts=1, experts_per_token=1, parallel_decoding=False)
        self.draft_config = DraftConfig.for_target(target.config, target.hf_config, cfg.method, **overrides)
        self.ds.check_draft(self.draft_config)
        target.check_aux_layers(tuple(self.draft_config.aux_layers))
        with torch.random.fork_rng(devices=[]):  # a seeded init without touching the caller's generator
            torch.manual_seed(cfg.seed)
            self.model = DraftModel(self.draft_config)
        if cfg.draft_vocab_size:
            self.model.set_draft_vocab(self.ds.frequent_tokens(cfg.draft_vocab_size))
        if cfg.init_from:
            self._init_from(cfg.init_from, target)
        self.model.to(self.device)
        self.model.attach_target(self.embed, self.full_head)
        if cfg.method == "eagle3" and not cfg.init_from:  # its own head starts as the target's rows
            with torch.no_grad():
                self.model.lm_head.copy_(self.model.head_weight)

    def _resume(self) -> None:
        cfg = self.cfg
        self._load_checkpoint()
        if self.step > cfg.steps:
            raise JakiroError(f"{cfg.out} is already at step {self.step}, beyond --steps {cfg.steps}")
        if self.progress and self.rank == 0:
            print(f"[jakiro] resuming {cfg.out} at step {self.step} of {cfg.steps}"
                  + (" (already complete)" if self.step == cfg.steps else ""), file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ run folder
    def _run_identity(self) -> dict:
        ident = asdict(self.cfg)
        for k in ("out", "steps", "minutes", "eval_every", "checkpoint_every", "tau_every", "tau_prompts", "tau_tokens"):
            ident.pop(k)
        ident["target_name"] = self.ds.identity["target_name"]
        if self.cfg.method in ("eagle2", "eagle3"):  # one dense MLP: the Mixture-of-Experts settings do not apply
            for k in _MOE_SETTINGS:
                ident.pop(k)
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
                previous = _upgrade_identity(json.load(f), self._run_identity())
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

    def _init_from(self, path: str, target) -> None:
        """Start from another draft's weights (e.g. single-step training continued unrolled), or
        a Jakiro draft from an EAGLE-2 one (``upcycle``)."""
        init = load_draft(path, target)  # checks it fits the target (width, vocabulary)
        mine, theirs = self.draft_config.to_json_dict(), init.config.to_json_dict()
        if init.config.aux_layers and init.config.aux_layers != self.draft_config.aux_layers:
            raise JakiroError(f"--init-from {path} reads the target's residual streams after layers "
                              f"{init.config.aux_layers}; this run's --aux-layers is "
                              f"{self.cfg.aux_layers or 'none'}")
        if self.cfg.method == "jakiro" and init.config.method == "eagle2":
            upcycle(self.model, init)
            return
        # the target's name carries the conversion cache's folder hash, which differs between
        # machines for the same model: the shape check above is what matters; a draft without
        # mid-layer inputs may gain them (their map starts at zero)
        diff = sorted(k for k in set(mine["jakiro"]) | set(theirs["jakiro"])
                      if k not in ("target_name", "aux_layers") and mine["jakiro"].get(k) != theirs["jakiro"].get(k))
        if diff:
            raise JakiroError(f"--init-from {path} is a different draft (differs in: {', '.join(diff)})")
        self.model.load_state_dict(keeping_own(init.state_dict(), self.model))

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
        self.tokens = state.get("tokens", 0)

    def _save_checkpoint(self) -> None:
        if self.rank != 0:
            return
        tmp = self.ckpt_dir + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        save_draft(self.model, tmp, {"training": {"step": self.step, "target_name": self.target_name}})
        torch.save({"optimizer": self.opt.state_dict(), "step": self.step, "tokens": self.tokens,
                    "log": self.log},
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
        return self.step_on(make_batch(self.ds, local, cfg.seq_len, self.device, cfg.noise,
                                       cfg.seed + 7919 * self.step, self.featurizer))

    def step_on(self, batch: tuple) -> dict:
        """One optimiser step on this process's share of a batch, as ``make_batch`` builds it."""
        cfg = self.cfg
        ids, feats, mask, noises = batch
        count = mask[:, 1:].sum().to(torch.float64)
        if self.world > 1:
            dist.all_reduce(count)
        model = self.ddp or self.loss
        for group in self.opt.param_groups:
            group["lr"] = lr_at(self.step, cfg)
        total, parts = model(ids, feats, mask, noises)
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
        self.tokens += int(count)
        return {"step": self.step, "tokens": self.tokens, "loss": float(value) / max(1.0, float(count)),
                "lr": lr_at(self.step - 1, cfg), "grad_norm": float(grad_norm)}

    def evaluate(self) -> dict:
        """Held-out metrics as drafting sees them (``losses.heldout_metrics``)."""
        return heldout_metrics(self.model, heldout_batches(self.ds, self.eval_idx, self.cfg.seq_len, self.device,
                                                               featurizer=self.featurizer),
                               self.cfg.eval_steps, self.full_head)

    def decoding_tau(self) -> float:
        """τ of real greedy decoding with the draft as it stands (default tree, no cost-aware
        sizing) on the first user turns of held-out records: committed tokens per target forward."""
        from ..api import load_tokenizer
        from ..decoding.engine import Engine
        from ..decoding.proposers import TreeBudget
        from ..decoding.draft_proposer import DraftProposer
        if self._tau_engine is None:
            self._tau_engine = Engine(self.target, load_tokenizer(self.target_dir),
                                      DraftProposer(self.model, TreeBudget()))
        self.model.eval()
        tau = heldout_tau(self._tau_engine, self.ds, self.eval_idx[: self.cfg.tau_prompts], self.cfg.tau_tokens)
        self.model.train()
        return tau

    def run(self, stop_after: int | None = None) -> dict:
        """Train until cfg.steps (or ``stop_after`` more steps, for tests of resuming)."""
        from tqdm import tqdm
        cfg = self.cfg
        end = cfg.steps if stop_after is None else min(cfg.steps, self.step + stop_after)
        bar = tqdm(total=cfg.steps, initial=self.step, desc=f"train {cfg.method}",
                   disable=not self.progress or self.rank != 0)
        t0 = time.time()
        paced = (self.step + 1, None) if cfg.minutes else None  # (step that starts the pace's clock, its time)
        while self.step < end:
            if paced and self.step == paced[0]:  # the first step (allocations, kernel choice) is not timed
                paced = (paced[0], time.time())
            if paced and paced[1] and self.step == paced[0] + CALIBRATION_STEPS:
                end = self._fit_to_minutes(paced, t0, end, bar)
                paced = None
            row = self.train_step(self.batch_indices(self.step))
            if self.step % cfg.eval_every == 0 or self.step == cfg.steps:
                row["eval"] = self.evaluate()
                row["eval_acc"] = row["eval"]["top1"]
                bar.write(f"step {self.step}: held-out {describe_eval(row['eval'])}")
            if cfg.tau_every and self.rank == 0 and (self.step % cfg.tau_every == 0 or self.step == cfg.steps):
                row["tau"] = self.decoding_tau()
                bar.write(f"step {self.step}: greedy decoding tau {row['tau']:.3f} on "
                          f"{cfg.tau_prompts} held-out prompts")
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

    def _fit_to_minutes(self, paced: tuple[int, float], t0: float, end: int, bar) -> int:
        """Set the step count so that the rest of the run fits ``--minutes`` at the pace of the
        steps since ``paced``, held-out evaluations estimated; with several processes, rank 0's
        count holds for all (each must stop at the same step)."""
        cfg = self.cfg
        per_step = (time.time() - paced[1]) / (self.step - paced[0])
        left = cfg.minutes * 60 - (time.time() - t0)
        # a held-out evaluation runs forwards only, over batches of 8 records: about half a step's
        # time per training batch of records (an overestimate; the final one is counted too)
        eval_s = per_step * len(self.eval_idx) / cfg.batch_size / 2
        steps = int((left - eval_s) / (per_step + eval_s / cfg.eval_every))
        cfg.steps = max(min(cfg.steps, self.step + steps), cfg.warmup + 1, self.step + 1)
        if self.world > 1:
            box = [cfg.steps]
            dist.broadcast_object_list(box, src=0)
            cfg.steps = box[0]
        if self.progress and self.rank == 0:
            bar.total = cfg.steps
            bar.write(f"--minutes {cfg.minutes:g}: {per_step:.3f} s a step, training to step {cfg.steps}")
        return min(end, cfg.steps)

    def finish(self) -> None:
        cfg = self.cfg
        ev = next((r["eval"] for r in reversed(self.log) if "eval" in r), None) or self.evaluate()
        save_draft(self.model, cfg.out, {"training": {
            "steps": self.step, "tokens": self.tokens, "target_name": self.target_name, "data": cfg.data,
            "records": len(self.train_idx), "heldout_records": len(self.eval_idx),
            "unroll": cfg.unroll, "jakiro_loss": cfg.jakiro_loss if cfg.method == "jakiro" else None,
            "heldout_top1_per_step": ev["top1"], "heldout": ev}})
        with open(os.path.join(cfg.out, "train_log.json"), "w") as f:
            json.dump({"config": asdict(cfg), "heldout_top1_per_step": ev["top1"], "heldout": ev,
                       "log": self.log}, f)
        plot_log(self.log, os.path.join(cfg.out, "train_plot.png"), cfg.method)
