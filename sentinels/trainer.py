"""The trainer: AdamW, warmup + cosine LR, grad clipping, gradient accumulation, bf16 autocast on CUDA,
DDP or FSDP2 through torchrun (train.parallel, sentinels/distributed.py), atomic checkpoints with exact resume,
monitors, and clean stops (.HALT, SIGTERM).

Run directory (train.out_dir):
    config.yaml, metadata.json         resolved config; hash, git commit, versions, tokenizer fingerprint
    heartbeat.jsonl, metrics.csv       one record per step (rank 0)
    events.jsonl                       monitor events (loss floor, gate collapse, watchdog, data fallback)
    checkpoints/step_XXXXXXXX.pt       plain data loaded with weights_only=True; checkpoints/latest.json lists the kept
                                       ones with their sha256 (sentinels/checkpoints.py: atomic, fsynced, fallback);
                                       train.parallel fsdp: a step_XXXXXXXX.dcp/ directory of shards instead
    loss_floor_dump.pt / .jsonl        the last batches when the loss-floor monitor trips
    .HALT                              create it to stop after the next step (a checkpoint is written first)
SIGTERM and SIGINT (Ctrl-C) stop like .HALT; a second Ctrl-C aborts at once, without a checkpoint. SIGUSR1 dumps
every thread's stack to stderr (faulthandler). A new run refuses a non-empty train.out_dir unless it resumes
(--resume) or starts over (--fresh: the old contents are moved to <out_dir>.old-N, nothing is deleted).

Several ranks (torchrun): every rank runs the launch gate's check, judges out_dir and opens its data shard, and
the ranks agree on the outcome, so a refusal on any rank stops them all with one message from rank 0. A stop
(.HALT on rank 0, a signal to any rank, a halting monitor) is agreed after each step, so every rank stops after
the same step and one checkpoint is written. Before each checkpoint the DDP replicas are compared bit for bit
(a rank that missed an all-reduce stops the run instead of being saved). --resume continues bit for bit on the
same number of ranks; on another number it keeps the model, optimizer and schedule when the global batch (ranks x
micro_batch_size x grad_accum) is unchanged, and says that the data readers start over.
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import gc
import io
import json
import logging
import math
import os
import platform
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import yaml

from . import checkpoints
from .checkpoints import (CHECKPOINT_DIR, CheckpointEntry, CheckpointError, atomic_torch_save,  # noqa: F401
                          atomic_write_bytes)
from .config import RunConfig
from .data.batch import Batch
from .data.pipeline import BatchSource
from .data.sources import ShardSpec
from .data.tokenizers import get_tokenizer
from .graphs import GraphedLoss
from .distributed import (DistInfo, clear_dtensor_caches, clip_grad_norm, diverged_parameters,  # noqa: F401
                          gather_objects, gradient_sync, init_distributed, load_sharded_state, on_every_rank,
                          require_fsdp, save_sharded_tensors, sharded_state, wrap_model)
from .errors import InputError, ReportedElsewhere
from .model import NSALanguageModel, build_model, count_parameters
from .monitors import Event, GateCollapseMonitor, HeartbeatWatchdog, LossFloorMonitor, Watchdog
from .launch.gonogo import authorize_training
from .telemetry import ProgressBar, Telemetry

log = logging.getLogger("sentinels.train")

HALT_FILE = ".HALT"
# The only config keys a resume may change, together, when the global batch (ranks x micro_batch_size x grad_accum)
# stays the same: a run moved to another number of GPUs, or a micro-batch halved to fit memory.
LAYOUT_KEYS = ("train.grad_accum", "train.micro_batch_size")


class TrainerError(InputError, RuntimeError):
    """The run cannot start or resume (message says why)."""


class AbortedError(KeyboardInterrupt):
    """A second Ctrl-C: the run stops at once, without a checkpoint."""


class RankStopped(TrainerError, ReportedElsewhere):
    """This rank stops because a check failed on some rank; rank 0 says why (the command line prints nothing)."""


class RanksDivergedError(RuntimeError):
    """The DDP replicas no longer hold the same parameters: the gradient averaging is broken."""


# ----------------------------------------------------------------------------------------------------
# Device


def resolve_device(cfg: RunConfig, local_rank: int) -> torch.device:
    want = cfg.train.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda":
        if not torch.cuda.is_available():
            raise TrainerError("train.device is 'cuda' but no CUDA device is visible")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


# ----------------------------------------------------------------------------------------------------
# Schedule, RNG, metadata


def lr_at(step: int, cfg: RunConfig) -> float:
    """Linear warmup over warmup_steps to lr, then cosine decay to min_lr at the last step."""
    t = cfg.train
    if t.warmup_steps > 0 and step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    decay_steps = max(1, t.steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / decay_steps)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + math.cos(math.pi * progress))


def rng_state() -> dict[str, Any]:
    """Every RNG's state as plain data (tuples, lists, numbers, tensors): checkpoints load with weights_only."""
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": {"bit_generator": str(name), "keys": [int(k) for k in keys], "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["bit_generator"], np.array(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def git_commit() -> dict[str, Any]:
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    return {"commit": commit, "dirty": dirty}


def versions() -> dict[str, Any]:
    out = {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
           "cuda": torch.version.cuda, "platform": platform.platform()}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
        out["gpu_capability"] = list(torch.cuda.get_device_capability())
    return out


def tokenizer_info(cfg: RunConfig) -> dict[str, Any]:
    if cfg.data.source == "synthetic":
        return {"name": f"synthetic-{cfg.data.synthetic.task}", "vocab_size": cfg.vocab_size(),
                "fingerprint": None, "configured": cfg.data.tokenizer}
    tok = get_tokenizer(cfg.data.tokenizer)
    return {"name": tok.name, "vocab_size": tok.vocab_size, "fingerprint": tok.fingerprint,
            "backend": getattr(tok, "backend", "python")}


def move_aside(run_dir: Path) -> Path:
    """--fresh: rename a non-empty run directory to <name>.old-N (the first free N) and return the new path."""
    n = 1
    while (target := run_dir.with_name(f"{run_dir.name}.old-{n}")).exists():
        n += 1
    os.replace(run_dir, target)
    checkpoints.fsync_dir(run_dir.parent)
    return target


def check_out_dir(cfg: RunConfig, *, resume: bool, fresh: bool) -> Path:
    """The run directory, refused when it cannot be written or when a new run would mix with an old one."""
    run_dir = Path(cfg.train.out_dir)
    if resume and fresh:
        raise TrainerError("--resume and --fresh exclude each other: continue the run in train.out_dir, or start "
                           "over there")
    if run_dir.exists() and not run_dir.is_dir():
        raise TrainerError(f"train.out_dir {run_dir}: a file exists and is not a directory; choose another out_dir")
    if resume or fresh or not run_dir.is_dir():
        return run_dir
    entries = sorted(p.name for p in run_dir.iterdir())
    if entries:
        shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
        fresh_hint = f"start over with --fresh (the contents move to {run_dir.name}.old-N)"
        if checkpoints.has_checkpoint(run_dir):
            advice = f"it holds checkpoints of an earlier run ({shown}): continue it with --resume, or {fresh_hint}"
        else:
            advice = f"it holds no checkpoint to --resume from ({shown}): {fresh_hint}"
        raise TrainerError(f"train.out_dir {run_dir} is not empty: {advice}, or choose another out_dir")
    return run_dir


# ----------------------------------------------------------------------------------------------------


@dataclass
class TrainResult:
    status: str  # completed | halted
    steps_done: int  # optimizer steps completed in total (including before a resume)
    halt_reason: str | None
    records: list[dict] = field(default_factory=list)  # this process's step records (rank 0)
    events: list[Event] = field(default_factory=list)
    run_dir: Path | None = None


class Trainer:
    """Builds model, optimizer, data and monitors for a RunConfig; `train()` runs to the end or a halt.

    batch_source / step_hook exist for the sentinel self-test (planted data stalls, planted NaN);
    save_checkpoints=False is for throw-away sentinel runs."""

    def __init__(self, cfg: RunConfig, *, resume: bool = False, synthetic_on_fail: bool = False,
                 batch_source: Any = None, step_hook: Callable[["Trainer", int], None] | None = None,
                 console: bool = True, extra_metadata: dict[str, Any] | None = None,
                 save_checkpoints: bool = True, i_know_what_im_doing: bool = False, fresh: bool = False,
                 stop_after: int | None = None):
        if stop_after is not None and stop_after < 1:
            raise TrainerError(f"stop_after must be a positive number of steps, got {stop_after}")
        self.cfg = cfg
        self.stop_after = stop_after
        self.save_checkpoints = save_checkpoints
        self.step_hook = step_hook
        self.synthetic_on_fail = synthetic_on_fail
        self.events: list[Event] = []
        self.telemetry: Telemetry | None = None
        self.device = resolve_device(cfg, int(os.environ.get("LOCAL_RANK", 0)))
        self.dist = init_distributed(self.device.type)
        try:
            self._build(resume=resume, fresh=fresh, batch_source=batch_source, console=console,
                        extra_metadata=extra_metadata, i_know_what_im_doing=i_know_what_im_doing)
        except BaseException:
            self.close()
            raise

    def _build(self, *, resume: bool, fresh: bool, batch_source: Any, console: bool,
               extra_metadata: dict[str, Any] | None, i_know_what_im_doing: bool) -> None:
        cfg = self.cfg

        def start() -> tuple:
            # The launch gate (docs/runbook.md): >= 5000 steps need a valid GO record, or the logged override.
            # The trainer checks the record and the long-run rules itself, whatever launched it, on every rank.
            authorization = authorize_training(cfg, i_know_what_im_doing=i_know_what_im_doing,
                                               save_checkpoints=self.save_checkpoints, steps=self.last_step)
            if not authorization.allowed:
                raise TrainerError(authorization.reason)
            if cfg.train.parallel == "fsdp":
                require_fsdp()
            run_dir = check_out_dir(cfg, resume=resume, fresh=fresh)
            candidates: list[CheckpointEntry] = []
            if resume:
                candidates, problems = checkpoints.resume_candidates(run_dir)
                if not candidates:
                    raise TrainerError(f"--resume: no checkpoint in {run_dir / CHECKPOINT_DIR}"
                                       + (f" ({'; '.join(problems)})" if problems else ""))
                for problem in problems:
                    log.warning("resume: %s", problem)
            # The data source is built (and a local source checked) before the model: a bad file stops the run here.
            shard = ShardSpec.for_rank(self.dist.rank, self.dist.world_size)
            data = batch_source if batch_source is not None else BatchSource(
                cfg, shard, synthetic_on_fail=self.synthetic_on_fail, on_fallback=self._on_data_fallback)
            return authorization, run_dir, candidates, data

        # every rank has judged the gate, out_dir and its data before rank 0 changes out_dir
        self.launch_authorization, self.run_dir, candidates, self.data = self._on_every_rank("starting", start)

        def prepare_out_dir() -> None:
            if not self.dist.is_main:
                return
            if fresh and self.run_dir.is_dir() and any(self.run_dir.iterdir()):
                moved = move_aside(self.run_dir)
                log.warning("--fresh: moved the previous contents of %s to %s", self.run_dir, moved)
            self.run_dir.mkdir(parents=True, exist_ok=True)
            stale_halt = self.run_dir / HALT_FILE
            if stale_halt.exists():  # left by the stop this run resumes from
                log.warning("removing %s from a previous stop before starting", stale_halt)
                stale_halt.unlink()

        self._on_every_rank("preparing train.out_dir", prepare_out_dir)
        self.console = console and self.dist.is_main
        self.effective_precision = "bf16" if (cfg.train.precision == "bf16" and self.device.type == "cuda") else "fp32"
        if cfg.train.precision == "bf16" and self.device.type != "cuda":
            log.warning("train.precision is bf16 but the device is %s: running fp32", self.device.type)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True

        torch.manual_seed(cfg.train.seed)
        random.seed(cfg.train.seed)
        np.random.seed(cfg.train.seed)
        self.model: NSALanguageModel = build_model(cfg).to(self.device)
        self.model.activation_checkpointing = cfg.train.activation_checkpointing
        # DDP wraps the model; FSDP2 shards it in place (its parameters become DTensors): the optimizer comes after.
        self.net = wrap_model(self.model, parallel=cfg.train.parallel, device=self.device, info=self.dist,
                              bf16=self.effective_precision == "bf16")
        self.sharded = cfg.train.parallel == "fsdp"  # the checkpoint format: sharded directories (also in one process)
        self.graphed_loss: GraphedLoss | None = None
        if self._uses_cuda_graphs():
            self.graphed_loss = GraphedLoss(self.model, self._autocast, quiet=cfg.train.cuda_graphs == "auto")
        decay = [p for n, p in self.model.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in self.model.named_parameters() if p.ndim < 2]
        t = cfg.train
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=t.lr, betas=(t.beta1, t.beta2), fused=self.device.type == "cuda")
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_at(s, cfg) / t.lr)

        self.start_step = 0
        self._kept: list[CheckpointEntry] = []  # the checkpoints latest.json lists (oldest first)
        ckpt_path = self._resume(candidates) if resume else None

        self.loss_floor = LossFloorMonitor(cfg.monitors.loss_floor)
        self.gate_collapse = GateCollapseMonitor(cfg.monitors.gate_collapse)
        self.watchdog = Watchdog(cfg.monitors.watchdog)
        # The loss floor is a statement about real text; synthetic tasks (needle recall) may legitimately reach 0.
        self.monitors = ([self.loss_floor] if cfg.data.source != "synthetic" else []) + [self.gate_collapse,
                                                                                         self.watchdog]
        self.recent_batches: collections.deque = collections.deque(maxlen=cfg.monitors.loss_floor.dump_batches)
        self.telemetry = Telemetry(self.run_dir, resume_step=self.start_step if resume else None) \
            if self.dist.is_main else None
        for event in self.events:  # a fallback that happened while the source was built
            self._record_event(event)
        if self.dist.is_main:
            self._write_metadata(resumed_from=str(ckpt_path) if ckpt_path else None, extra=extra_metadata or {})
        self._stop_signal: str | None = None
        self._sigints = 0

    # -- helpers ---------------------------------------------------------------------------------
    def _barrier(self) -> None:
        if self.dist.active:
            dist.barrier()

    def _on_data_fallback(self, reason: str) -> None:
        event = Event("data_fallback", getattr(self, "_current_step", 0),
                      f"data source failed, training continues on SYNTHETIC tokens: {reason}",
                      data={"reason": reason})
        if getattr(self, "telemetry", None) is not None:
            self._record_event(event)
        else:
            self.events.append(event)

    def _record_event(self, event: Event) -> None:
        if event not in self.events:
            self.events.append(event)
        if self.telemetry is not None:
            self.telemetry.write_event(event)

    def _write_metadata(self, resumed_from: str | None, extra: dict[str, Any]) -> None:
        (self.run_dir / "config.yaml").write_text(yaml.safe_dump(self.cfg.to_dict(), sort_keys=False))
        meta = {
            "config": self.cfg.to_dict(),
            "config_hash": self.cfg.config_hash(),
            "git": git_commit(),
            "versions": versions(),
            "tokenizer": tokenizer_info(self.cfg),
            "parameters": count_parameters(self.model),
            "device": str(self.device),
            "precision": {"configured": self.cfg.train.precision, "effective": self.effective_precision},
            "world_size": self.dist.world_size,
            "packing": self.cfg.data.packing,
            "data": self.data.describe() if hasattr(self.data, "describe") else None,
            "synthetic_on_fail": self.synthetic_on_fail,
            "attention_class": f"{type(self.model.blocks[0].attn.inner).__module__}."
                               f"{type(self.model.blocks[0].attn.inner).__name__}",
            "resumed_from": resumed_from,
            "launch_authorization": self.launch_authorization.metadata,
            "start_step": self.start_step,
            "argv": sys.argv,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **extra,
        }
        name = "metadata.json" if resumed_from is None else f"metadata.resume-{self.start_step:08d}.json"
        atomic_write_bytes(self.run_dir / name, json.dumps(meta, indent=2, default=str).encode())

    def _gather(self, obj: Any) -> list[Any]:
        return gather_objects(self.dist, obj)

    def _on_every_rank(self, what: str, fn: Callable[[], Any]) -> Any:
        """fn() on every rank; a failure on any rank stops every rank, with one message from rank 0."""
        try:
            return on_every_rank(self.dist, what, fn, TrainerError, RankStopped)
        except Exception:  # raised after the ranks agreed, on every rank (close() waits for all); an interrupt
            self._stopped_together = True  # (KeyboardInterrupt) may reach one rank only and is not marked
            raise

    def _broadcast(self, obj: Any) -> Any:
        """Rank 0's obj on every rank."""
        if not self.dist.active:
            return obj
        box = [obj if self.dist.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _sum_over_ranks(self, count: int) -> int:
        if not self.dist.active:
            return count
        t = torch.tensor([count], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return int(t.item())

    def _stop_reason(self, mine: str | None) -> str:
        """The reasons the ranks stop for, one per distinct reason, naming the ranks (collective)."""
        reasons = self._gather(mine)
        by_reason: dict[str, list[int]] = {}
        for rank, reason in enumerate(reasons):
            if reason is not None:
                by_reason.setdefault(reason, []).append(rank)
        if len(by_reason) == 1 and len(next(iter(by_reason.values()))) == self.dist.world_size:
            return next(iter(by_reason))
        return "; ".join(f"{reason} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"
                         for reason, ranks in by_reason.items())

    def _any_rank(self, flag: bool) -> bool:
        if not self.dist.active:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item() > 0)

    # -- checkpoints -----------------------------------------------------------------------------
    def _check_replicas(self, step: int) -> None:
        """DDP keeps every rank's parameters bit-identical; a rank that missed a gradient all-reduce does not. Such a
        state is not saved: every rank stops (rank 0 raises RanksDivergedError naming the parameters)."""
        if self.cfg.train.parallel != "ddp" or not self.dist.active:
            return
        diverged = diverged_parameters(self.dist, self.model)
        if not diverged:
            return
        latest = self._kept[-1].file if self._kept else "none"
        message = (f"the ranks hold different parameters after step {step} ({len(diverged)} tensors differ, first "
                   f"{', '.join(diverged[:3])}): the gradients were not averaged over the ranks, so no checkpoint "
                   f"of this state is written (the last one kept: {latest})")
        if self.dist.is_main:
            raise RanksDivergedError(message)
        raise RankStopped(message)

    def save_checkpoint(self, next_step: int) -> Path | None:
        self._check_replicas(next_step)
        data_states = self._gather(self.data.state_dict())
        rng_states = self._gather(rng_state())
        ckpt_dir = self.run_dir / CHECKPOINT_DIR
        state = {
            "step": next_step,
            "config": self.cfg.to_dict(),
            "config_hash": self.cfg.config_hash(),
            "scheduler": self.scheduler.state_dict(),
            "data": data_states,
            "rng": rng_states,
            "monitor_counts": {"loss_floor_tripped": self.loss_floor.tripped},
        }
        if self.sharded:
            return self._save_sharded(ckpt_dir, state)
        path = None
        if self.dist.is_main:
            self._kept = checkpoints.write_checkpoint(ckpt_dir, {
                **state, "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()},
                self._kept, self.cfg.train.keep_checkpoints)
            path = ckpt_dir / self._kept[-1].file
        self._barrier()
        return path

    def _save_sharded(self, ckpt_dir: Path, state: dict[str, Any]) -> Path:
        """Every rank writes its shards into step_XXXXXXXX.dcp.tmp/tensors; rank 0 then writes the plain state and
        the manifest and renames the directory into place (sentinels/checkpoints.py)."""
        step = int(state["step"])
        tensors, optimizer_plain = sharded_state(self.model, self.optimizer)
        self._on_every_rank("preparing a sharded checkpoint", lambda: checkpoints.begin_sharded_checkpoint(
            ckpt_dir, step) if self.dist.is_main else None)
        save_sharded_tensors(tensors, str(checkpoints.sharded_tmp_dir(ckpt_dir, step) / checkpoints.TENSORS))
        self._barrier()

        def finish() -> None:
            if self.dist.is_main:
                self._kept = checkpoints.finish_sharded_checkpoint(
                    ckpt_dir, {**state, "optimizer_plain": optimizer_plain}, self._kept,
                    self.cfg.train.keep_checkpoints)

        self._on_every_rank("writing a sharded checkpoint", finish)
        return ckpt_dir / checkpoints.checkpoint_name(step, sharded=True)

    def _load_candidate(self, ckpt_dir: Path, entry: CheckpointEntry) -> dict[str, Any]:
        """The plain state of one kept checkpoint, or CheckpointError. A file is loaded by every rank; a sharded
        directory is checked once, by rank 0 (every file's sha256), and its small state sent to the others."""
        if not (entry.sharded and self.dist.active):
            return checkpoints.load_checkpoint(ckpt_dir, entry)
        state, problem = None, None
        if self.dist.is_main:
            try:
                state = checkpoints.load_checkpoint(ckpt_dir, entry)
            except CheckpointError as exc:
                problem = str(exc)
        state, problem = self._broadcast((state, problem))
        if problem is not None:
            raise CheckpointError(problem)
        return state

    def _resume(self, candidates: list[CheckpointEntry]) -> Path:
        """Load the newest usable checkpoint of `candidates` (newest first); each unusable one is reported and
        the previous one tried. Every rank must settle on the same checkpoint."""
        ckpt_dir = self.run_dir / CHECKPOINT_DIR
        failures: list[str] = []
        chosen, state = None, None
        for i, entry in enumerate(candidates):
            try:
                state = self._load_candidate(ckpt_dir, entry)
            except CheckpointError as exc:
                failures.append(str(exc))
                if i + 1 < len(candidates):
                    message = (f"checkpoint {entry.file} is unusable, resuming from the previous kept one, "
                               f"{candidates[i + 1].file}: {exc}")
                    log.warning("resume: %s", message)
                    self.events.append(Event("checkpoint_fallback", entry.step, message,
                                             data={"unusable": entry.file, "using": candidates[i + 1].file}))
                continue
            chosen = i
            break
        on_ranks = self._gather(None if chosen is None else candidates[chosen].file)  # once on every rank
        if len(set(on_ranks)) != 1:
            raise TrainerError(f"--resume: the ranks chose different checkpoints {on_ranks}: the checkpoint "
                               f"directory differs between ranks")
        if chosen is None:
            raise TrainerError(f"--resume: no usable checkpoint in {ckpt_dir}: " + "; ".join(failures))
        entry = candidates[chosen]
        self._load_state(ckpt_dir, entry, state)
        self._kept = list(reversed(candidates[chosen:]))  # oldest first, the loaded one last
        return ckpt_dir / entry.file

    def _resume_layout(self, path: Path, ckpt: dict[str, Any]) -> str | None:
        """None when the checkpoint continues bit for bit here (same config, same number of ranks); a description
        of the change when only the layout of the global batch changed (ranks, micro_batch_size, grad_accum, with
        ranks x micro_batch_size x grad_accum unchanged); TrainerError otherwise."""
        saved_world, world = len(ckpt["data"]), self.dist.world_size
        if ckpt["config_hash"] == self.cfg.config_hash() and saved_world == world:
            return None
        diff = _dict_diff(ckpt["config"], self.cfg.to_dict())
        if not set(diff) <= set(LAYOUT_KEYS):
            raise TrainerError(f"--resume: {path} was written with a different config; differing keys: {diff}")
        old, new = ckpt["config"]["train"], self.cfg.train
        old_global = saved_world * old["micro_batch_size"] * old["grad_accum"]
        new_global = world * new.micro_batch_size * new.grad_accum
        if old_global != new_global:
            per_step = world * new.micro_batch_size
            hint = (f"set train.grad_accum={old_global // per_step}" if old_global % per_step == 0 else
                    f"choose train.micro_batch_size and train.grad_accum so that {world} x micro_batch_size x "
                    f"grad_accum = {old_global}")
            raise TrainerError(f"--resume: {path} was written by {saved_world} rank(s) x micro_batch_size "
                               f"{old['micro_batch_size']} x grad_accum {old['grad_accum']} = {old_global} sequences "
                               f"per optimizer step; this run has {world} x {new.micro_batch_size} x {new.grad_accum} "
                               f"= {new_global}: {hint}, so that every optimizer step sees the same number of tokens")
        return (f"{saved_world} rank(s) x micro_batch_size {old['micro_batch_size']} x grad_accum "
                f"{old['grad_accum']} -> {world} x {new.micro_batch_size} x {new.grad_accum} (the same "
                f"{old_global} sequences per optimizer step)")

    def _load_state(self, ckpt_dir: Path, entry: CheckpointEntry, ckpt: dict[str, Any]) -> None:
        path = ckpt_dir / entry.file
        layout_change = self._on_every_rank("--resume", lambda: self._resume_layout(path, ckpt))
        saved_world = len(ckpt["data"])
        keep_data = layout_change is None or (
            saved_world == self.dist.world_size
            and ckpt["config"]["train"]["micro_batch_size"] == self.cfg.train.micro_batch_size)
        if entry.sharded:
            load_sharded_state(self.model, self.optimizer, str(checkpoints.sharded_tensors_dir(ckpt_dir, entry)),
                               ckpt["optimizer_plain"])

        def load() -> None:
            try:
                if not entry.sharded:
                    self.model.load_state_dict(ckpt["model"])
                    self.optimizer.load_state_dict(ckpt["optimizer"])
                self.scheduler.load_state_dict(ckpt["scheduler"])
                if keep_data:
                    self.data.load_state_dict(ckpt["data"][self.dist.rank])
            except (KeyError, RuntimeError, ValueError, TypeError) as exc:
                raise TrainerError(f"--resume: {path} does not fit this run: {type(exc).__name__}: "
                                   f"{str(exc).strip().splitlines()[0][:300]}") from None

        self._on_every_rank("--resume", load)
        self._resume_rng = ckpt["rng"][self.dist.rank % saved_world]
        self.start_step = int(ckpt["step"])
        if layout_change is not None:
            data_note = ("each rank's data continues where it stopped" if keep_data else
                         "the data readers start over (this run's shards are not the checkpoint's, so documents "
                         "seen before are read again)")
            message = (f"resumed with another layout of the global batch, {layout_change}: the model, optimizer and "
                       f"schedule continue; {data_note}")
            log.warning("resume: %s", message)
            self.events.append(Event("resume_layout_change", self.start_step, message,
                                     data={"from_world_size": saved_world, "to_world_size": self.dist.world_size,
                                           "data_continues": keep_data}))
        log.info("resumed from %s at step %d", path, self.start_step)

    # -- signals ---------------------------------------------------------------------------------
    def _install_signals(self) -> Callable[[], None]:
        """SIGTERM and SIGINT (Ctrl-C) stop after the current step with a checkpoint; a second SIGINT aborts at
        once (AbortedError, no checkpoint). SIGUSR1 dumps every thread's stack."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

        def on_stop(signum, frame):
            name = signal.Signals(signum).name
            if signum == signal.SIGINT:
                self._sigints += 1
                if self._sigints > 1:
                    signal.signal(signal.SIGINT, signal.default_int_handler)
                    raise AbortedError("a second Ctrl-C: aborted at once, without a checkpoint")
            self._stop_signal = self._stop_signal or name
            extra = "; press Ctrl-C again to abort at once without one" if signum == signal.SIGINT else ""
            log.warning("%s received: stopping after this step (a checkpoint will be written)%s", name, extra)

        for sig in previous:
            signal.signal(sig, on_stop)
        has_usr1 = hasattr(signal, "SIGUSR1")
        if has_usr1:
            try:
                faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
            except (io.UnsupportedOperation, ValueError, AttributeError):  # sys.stderr has no file descriptor
                faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True, chain=False)

        def restore():
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if has_usr1:
                faulthandler.unregister(signal.SIGUSR1)

        return restore

    # -- the loop ---------------------------------------------------------------------------------
    def _uses_cuda_graphs(self) -> bool:
        """train.cuda_graphs resolved for this run: true is refused in one line where it cannot run (no CUDA device,
        several ranks; the config refuses the rest); auto is on exactly where true would run, and says which."""
        setting, cfg = self.cfg.train.cuda_graphs, self.cfg
        if setting is True:
            if self.device.type != "cuda":
                raise TrainerError(f"train.cuda_graphs needs a CUDA device; this run uses {self.device.type}")
            if self.dist.active:
                raise TrainerError(f"train.cuda_graphs runs in one process; this run has {self.dist.world_size} "
                                   "ranks")
            return True
        if setting is False:
            return False
        reasons = [why for off, why in ((self.device.type != "cuda", f"device {self.device.type}"),
                                        (self.dist.active, f"{self.dist.world_size} ranks"),
                                        (cfg.data.packing != "contiguous", f"data.packing {cfg.data.packing}"),
                                        (cfg.train.activation_checkpointing is True,
                                         "activation checkpointing of whole blocks")) if off]
        if self.device.type == "cuda":  # on CPU there is nothing to say
            log.info("train.cuda_graphs auto: %s", f"off ({', '.join(reasons)})" if reasons else
                     "on (each micro-step replayed from CUDA graphs; train.cuda_graphs: false keeps the eager step)")
        return not reasons

    def _autocast(self):
        if self.effective_precision == "bf16":  # a CUDA graph must not keep autocast's cached casts
            return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=self.graphed_loss is None)
        return contextlib.nullcontext()

    def _zero_grads(self) -> None:
        if self.graphed_loss is not None:  # graphs: gradients stay allocated (GraphedLoss.zero_grads says why)
            self.graphed_loss.zero_grads()
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def _train_step(self, step: int) -> dict[str, Any]:
        cfg = self.cfg.train
        net = self.net
        self.model.train()
        for group in self.optimizer.param_groups:
            assert math.isclose(group["lr"], lr_at(step, self.cfg), rel_tol=1e-9), (group["lr"], step)
        lr = self.optimizer.param_groups[0]["lr"]
        self._zero_grads()
        dt_fetch = 0.0
        loss_sum = torch.zeros((), device=self.device)
        n_layers = len(self.model.blocks)
        gate_mean = torch.zeros(n_layers, 3, device=self.device)
        gate_max = torch.zeros(n_layers, 3, device=self.device)
        distinct = torch.zeros(n_layers, device=self.device)
        reads = torch.zeros(n_layers, 3, dtype=torch.int64, device=self.device)
        tokens = 0
        documents = 0  # packed documents (data.packing varlen)
        t_start = time.perf_counter()
        # The device's timeline of the step, from the first forward's launch to its last kernel (CUDA events): the
        # step time without the first micro-batch's fetch, and without later fetches the device computed through.
        device_span = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if self.device.type == "cuda" else None
        for micro in range(cfg.grad_accum):
            t0 = time.perf_counter()
            batch: Batch = self.data.next_batch()
            self.recent_batches.append((step, micro, batch.inputs.clone(),
                                        None if batch.cu_seqlens is None else batch.cu_seqlens.clone()))
            batch = batch.to(self.device)
            dt_fetch += time.perf_counter() - t0
            tokens += batch.n_tokens
            documents += batch.n_documents or 0
            if device_span is not None and micro == 0:
                device_span[0].record()
            with gradient_sync(net, sync=micro == cfg.grad_accum - 1):
                if self.graphed_loss is not None:  # recorded at the first micro-step, replayed after
                    loss = self.graphed_loss(batch.inputs, batch.labels, cu_seqlens=batch.cu_seqlens,
                                             loss_mask=batch.loss_mask)
                else:
                    with self._autocast():  # the loss without the full logits (NSALanguageModel.forward)
                        loss = net(batch.inputs, batch.cu_seqlens, labels=batch.labels, loss_mask=batch.loss_mask)
                (loss / cfg.grad_accum).backward()
            loss_sum += loss.detach()
            for i, s in enumerate(self.model.layer_stats()):
                gate_mean[i] += s.gate_mean
                gate_max[i] = torch.maximum(gate_max[i], s.gate_max)
                distinct[i] += s.distinct_blocks
                reads[i] += s.reads
        grad_norm = clip_grad_norm(list(self.model.parameters()), cfg.grad_clip)
        finite = bool(torch.isfinite(grad_norm).item())
        if finite:
            self.optimizer.step()
        else:
            self._zero_grads()
        self.scheduler.step()
        loss_mean = loss_sum / cfg.grad_accum
        if self.dist.active:
            dist.all_reduce(loss_mean, op=dist.ReduceOp.AVG if self.device.type == "cuda" else dist.ReduceOp.SUM)
            if self.device.type != "cuda":
                loss_mean /= self.dist.world_size
        gate_mean /= cfg.grad_accum
        distinct /= cfg.grad_accum
        if device_span is not None:
            device_span[1].record()
        loss_value = float(loss_mean.item())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt_total = time.perf_counter() - t_start
        gm, gx, rd = gate_mean.tolist(), gate_max.tolist(), reads.sum(0).tolist()
        mib = 2.0 ** 20
        record = {
            "step": step,
            "loss": loss_value,
            "lr": lr,
            "grad_norm": float(grad_norm.item()),
            "update_skipped": not finite,
            "tokens": tokens * self.dist.world_size,
            "documents": self._sum_over_ranks(documents) if self.cfg.data.packing == "varlen" else None,
            "tokens_per_s": tokens * self.dist.world_size / max(dt_total, 1e-9),
            "dt_fetch_s": dt_fetch,
            "dt_step_s": dt_total - dt_fetch,
            "dt_device_s": device_span[0].elapsed_time(device_span[1]) / 1000 if device_span is not None else None,
            "mem_allocated_mib": torch.cuda.memory_allocated(self.device) / mib if self.device.type == "cuda" else None,
            "mem_reserved_mib": torch.cuda.memory_reserved(self.device) / mib if self.device.type == "cuda" else None,
            "sel_distinct_blocks": float(distinct.mean().item()),
            "reads_cmp": rd[0], "reads_slc": rd[1], "reads_win": rd[2], "reads_total": sum(rd),
            "gate_mean_per_layer": gm,
            "gate_max_per_layer": gx,
            "wall_time": time.time(),
        }
        for b, name in enumerate(("cmp", "slc", "win")):
            record[f"gate_mean_{name}"] = sum(layer[b] for layer in gm) / n_layers
            record[f"gate_max_{name}"] = max(layer[b] for layer in gx)
        return record

    def _dump_recent_batches(self) -> None:
        if not self.dist.is_main:
            return
        dump = [{"step": s, "micro": m, "inputs": x, "cu_seqlens": cu} for s, m, x, cu in self.recent_batches]
        atomic_torch_save(dump, self.run_dir / "loss_floor_dump.pt")
        lines = []
        if self.cfg.data.source != "synthetic":
            tok = get_tokenizer(self.cfg.data.tokenizer)
            for item in dump:
                rows = item["inputs"].tolist()
                if item["cu_seqlens"] is not None:  # packed: one line per document
                    bounds = item["cu_seqlens"].tolist()
                    rows = [rows[0][a:b] for a, b in zip(bounds, bounds[1:])]
                for row in rows:
                    lines.append(json.dumps({"step": item["step"], "micro": item["micro"], "text": tok.decode(row)}))
        atomic_write_bytes(self.run_dir / "loss_floor_dump.jsonl", "".join(l + "\n" for l in lines).encode())

    def train(self) -> TrainResult:
        cfg = self.cfg.train
        if hasattr(self, "_resume_rng"):
            set_rng_state(self._resume_rng)
        restore_signals = self._install_signals()
        heartbeat = HeartbeatWatchdog(self.cfg.monitors.watchdog.heartbeat_stall_s, self._on_heartbeat_stall).start()
        progress = ProgressBar(cfg.steps, cfg.log_every) if self.console else None
        records: list[dict] = []
        status, halt_reason, step = "completed", None, self.start_step
        halt_path = self.run_dir / HALT_FILE
        try:
            for step in range(self.start_step, self.last_step):
                self._current_step = step
                if self.step_hook is not None:
                    self.step_hook(self, step)
                record = self._train_step(step)
                heartbeat.beat(step)
                records.append(record)
                halt_now = None
                if self.dist.is_main:
                    self.telemetry.write_step(record)
                    if progress:
                        progress.update(record)
                    for monitor in self.monitors:
                        for event in monitor.observe(record):
                            self._record_event(event)
                            if event.kind == "loss_floor":
                                self._dump_recent_batches()
                            if event.halt:
                                halt_now = halt_now or f"{event.kind}: {event.message}"
                            elif self.cfg.monitors.halt_on_event:
                                halt_path.touch()
                    if halt_now is None and halt_path.exists():
                        halt_now = f"{HALT_FILE} file found in {self.run_dir}"
                if self._stop_signal:
                    halt_now = halt_now or f"{self._stop_signal} received"
                stop = self._any_rank(halt_now is not None)
                if stop and self.dist.active:  # every rank learns why (a signal may have reached one rank only)
                    halt_now = self._stop_reason(halt_now)
                done = step + 1
                periodic = cfg.save_every > 0 and done % cfg.save_every == 0
                if self.save_checkpoints and (stop or periodic or done == self.last_step):
                    self.save_checkpoint(done)
                if stop:
                    status, halt_reason = "halted", halt_now
                    written = (f"checkpoint {checkpoints.checkpoint_name(done, self.sharded)} written"
                               if self.save_checkpoints else "no checkpoint: this run saves none")
                    log.warning("run halted after %d of %d steps (%s): %s", done, cfg.steps, written, halt_reason)
                    step = done
                    break
                step = done
        finally:
            heartbeat.stop()
            restore_signals()
            if progress:
                progress.close()
            if self.telemetry is not None:
                self.telemetry.close()
        self._ended_normally = True
        return TrainResult(status=status, steps_done=step, halt_reason=halt_reason, records=records,
                           events=list(self.events), run_dir=self.run_dir)

    @property
    def last_step(self) -> int:
        """The step this process stops at: train.steps, or stop_after when it is smaller (the first steps of the
        configured schedule, learning rate and warmup unchanged: the sentinels' real-text runs). The launch gate
        judges these steps, the ones this process runs."""
        steps = self.cfg.train.steps
        return steps if self.stop_after is None else min(steps, self.stop_after)

    def request_stop(self, reason: str) -> None:
        """Stop after the current step, as SIGTERM does (used by time budgets)."""
        self._stop_signal = reason

    def _on_heartbeat_stall(self, event: Event) -> None:
        if self.dist.is_main:
            self._record_event(event)
            if self.cfg.monitors.halt_on_event:
                (self.run_dir / HALT_FILE).touch()

    def close(self) -> None:
        """Leave the process group. After a run that ended normally (completed or halted), or that every rank
        stopped together (a refusal the ranks agreed on), the ranks first wait for each other, so that no rank exits
        while another still reports or still talks to the process group's store on rank 0 (a rank whose peer left
        first can abort): torchrun stops the other ranks of a group as soon as one exits with a non-zero code, and a
        halted run exits with 3.

        Destroying the group frees it (and stops its threads, which interpreter teardown could otherwise meet
        while a peer exits, and abort) only once nothing else holds it: DDP's wrapper is dropped, and a sharded
        model's parameters and AdamW state (DTensors on a mesh that holds the group) are released, so after close()
        an FSDP run under torchrun has no model, optimizer or scheduler left (none could run without its group)."""
        if self.dist.initialized_here and dist.is_initialized():
            if getattr(self, "_ended_normally", False) or getattr(self, "_stopped_together", False):
                dist.barrier()
            if hasattr(self, "net"):  # the DDP wrapper holds the group: drop it, so that destroying the group frees it
                self.net = self.model
            if getattr(self, "sharded", False):
                for name in ("scheduler", "optimizer", "net", "model"):
                    setattr(self, name, None)
                clear_dtensor_caches()  # torch's DTensor caches hold the mesh too
                gc.collect()  # modules, their FSDP states and hooks refer to each other
            dist.destroy_process_group()


def _dict_diff(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b)):
            out += _dict_diff(a.get(key), b.get(key), f"{prefix}.{key}" if prefix else key)
        return out
    return [] if a == b else [prefix]
