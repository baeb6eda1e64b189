"""Training throughput: full trainer steps (forward, backward, gradient clipping, AdamW) of the NSA model and of the
same model with dense attention (perf/train_model.py), in one process, per geometry and sequence length.

Every case builds the trainer afresh (the same seed, hence the same initial weights for both models), runs `warmup`
untimed steps (the first compiles and autotunes kernels) and then `steps` timed steps through `Trainer.train()`; its
step hook records a CUDA event at the start of every step (perf_counter on CPU), so a step's time is the trainer's
whole loop iteration (data, forward, backward, clipping, optimizer, statistics, the per-step syncs). Reported: the
median step (and mean, min, quartiles) and tokens/s = tokens per step / median step. Peak memory is
torch.cuda.max_memory_allocated over the timed steps (reset after the warm-up: parameters, gradients, optimizer
state and activations); with --cuda-graphs torch.cuda.max_memory_reserved instead, because the graphs hold their
activations and workspaces in private memory pools that the allocated count leaves out once recorded. Before the
last warm-up step the allocator's cache is emptied (StepClock), so what the case before left cached, and the
blocks of the eager runs that precede a graph's recording, are not counted: the reserved peak is the graphs'
pools plus what the steps themselves allocate, whatever ran before in the process. Every sequence length runs the
same number of tokens per optimizer step (batch_plan).

On CUDA the first warm-up step runs under torch.profiler to record which attention kernels ran (optimized's Triton
kernels or the torch path for NSA, the SDPA kernel for dense), next to the module's backend switches.

Budget: a case is skipped (with its estimate) when its predicted time (the same model's previous sequence length,
scaled by the length ratio) would end past --budget-s; a case whose warm-up shows that its timed steps will not fit
stops there and is recorded as skipped.
"""

from __future__ import annotations

import gc
import json
import math
import statistics
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .env import describe, nvidia_smi
from .results import merge_rows, read_csv, write_csv
from .timing import Samples
from .train_model import GEOMETRIES, MODELS, BatchPlan, Execution, attention_path, batch_plan, count_parameters, \
    geometry, trainer_for

OK, OOM, ERROR, SKIPPED = "ok", "oom", "error", "skipped"
TRAIN_CSV, TRAIN_JSON, TRAIN_MD, TRAIN_PNG = "train.csv", "train.json", "train.md", "train.png"
DEFAULT_SEQ_LENS = (2048, 8192, 16384, 32768, 65536)
# What NSA must reach against the dense model, per geometry: (seq_len, minimum NSA / dense tokens/s).
TARGETS = {"prod-125m": ((2048, 0.8), (16384, 1.0), (65536, 2.0)), "paper": ((16384, 1.5), (65536, 3.0))}
MEMORY_TARGET_FROM = 8192  # NSA peak memory <= dense at every seq_len from here on


@dataclass
class TrainRow:
    geometry: str
    model: str
    seq_len: int
    micro_batch: int
    grad_accum: int
    tokens_per_step: int
    status: str
    activation_checkpointing: bool | str = False
    cuda_graphs: bool = False
    median_step_ms: float | None = None
    mean_step_ms: float | None = None
    min_step_ms: float | None = None
    p20_step_ms: float | None = None
    p80_step_ms: float | None = None
    n_steps: int = 0
    tokens_per_s: float | None = None  # tokens_per_step / median step
    peak_mem_bytes: int | None = None
    parameters: int | None = None
    loss_last: float | None = None
    attention: str = ""  # attention class and backend switches; kernels that ran (CUDA)
    note: str = ""

    @property
    def execution(self) -> Execution:
        return Execution(self.activation_checkpointing, self.cuda_graphs)

    @property
    def key(self) -> tuple[str, str, int]:
        return self.geometry, self.model, self.seq_len


class OverBudget(Exception):
    """Raised from the step hook when the timed steps would end past the budget."""


class StepClock:
    """The trainer's step hook: a mark at the start of every step (CUDA event, or perf_counter on CPU); after the
    warm-up it checks the budget and resets the peak-memory statistics; on CUDA the first (warm-up) step runs under
    torch.profiler, which records the kernels it launched, and the allocator's cache is emptied before the last
    warm-up step (release_step), which allocates again what a step needs, so the timed steps' reserved peak does not
    count blocks cached before them."""

    def __init__(self, device: torch.device, warmup: int, steps: int, deadline: float, profile_kernels: bool):
        self.device, self.warmup, self.steps, self.deadline = device, warmup, steps, deadline
        self.is_cuda = device.type == "cuda"
        self.marks: list[Any] = []
        self.profile_kernels = profile_kernels and self.is_cuda and warmup >= 1  # never a timed step
        self.profiler = None
        self.kernels: dict[str, int] = {}

    def _mark(self) -> None:
        if self.is_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    @property
    def release_step(self) -> int | None:
        """The step before which the cache is emptied: the last warm-up step, but never step 0, which records the
        CUDA graphs (and whose eager runs before the recording fill the cache); None without a warm-up."""
        if not self.is_cuda or self.warmup < 1:
            return None
        return max(1, self.warmup - 1)

    def __call__(self, trainer, step: int) -> None:
        if self.profiler is not None:  # the profiled first step ended: its processing stays out of the timed steps
            self._finish_profile()
        if step == self.release_step:  # before the mark, so the release itself is never timed
            release_device_memory(self.device)
        self._mark()
        if step == self.warmup:
            self._check_budget()
            if self.is_cuda:
                torch.cuda.reset_peak_memory_stats(self.device)
        if self.profile_kernels and step == 0:
            from torch.profiler import ProfilerActivity, profile

            self.profiler = profile(activities=[ProfilerActivity.CUDA])
            self.profiler.__enter__()

    def finish(self) -> None:
        if self.profiler is not None:
            self._finish_profile()
        self._mark()
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        """Stop a profiler a failed step left running."""
        if self.profiler is not None:
            self.profiler.__exit__(None, None, None)
            self.profiler = None

    def _finish_profile(self) -> None:
        self.profiler.__exit__(None, None, None)
        for event in self.profiler.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                self.kernels[event.name] = self.kernels.get(event.name, 0) + 1
        self.profiler = None

    def step_ms(self) -> list[float]:
        if self.is_cuda:
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]

    def _check_budget(self) -> None:
        if not self.warmup:
            return
        if self.is_cuda:
            self.marks[-1].synchronize()
        last = self.step_ms()[-1] / 1e3  # the last warm-up step
        need = last * self.steps
        if time.perf_counter() + need > self.deadline:
            left = max(0.0, self.deadline - time.perf_counter())
            raise OverBudget(f"skipped after the warm-up: {self.steps} steps of ~{last * 1e3:.0f} ms need "
                             f"~{need:.0f} s, {left:.0f} s of the budget left")


def attention_kernels(kernels: dict[str, int]) -> list[str]:
    """The kernels of a step that compute attention: optimized's Triton kernels and SDPA's kernels."""
    from .train_profile import is_attention_kernel

    return sorted(name for name in kernels if is_attention_kernel(name))


def describe_attention(model: torch.nn.Module, kernels: list[str] | None) -> str:
    path = attention_path(model)
    text = path["class"]
    switches = [f"{k}={v}" for k, v in path.items() if k not in ("class", "nsa_forward_defaults")]
    defaults = path.get("nsa_forward_defaults") or {}
    switches += [f"nsa_forward default {k}={v}" for k, v in defaults.items()]
    text += (" (" + ", ".join(switches) + ")") if switches else ""
    if kernels is not None:
        shown = ", ".join(kernels[:8]) + (f" and {len(kernels) - 8} more" if len(kernels) > 8 else "")
        text += f"; attention kernels that ran: {shown or 'none (torch path)'}"
    return text


def release_device_memory(device: torch.device, *, cublas_workspaces: bool = False) -> None:
    """Return to the device what is no longer used: unreachable objects (collected) and the allocator's unused
    blocks; with cublas_workspaces, cuBLAS's workspaces too (one per stream cuBLAS ran on, kept for the process:
    every graph recording's streams add theirs). Workspaces only between cases, so that a case's peak does not depend
    on the cases before it: a recorded graph holds its streams' workspace addresses, so they are never dropped while
    one lives."""
    gc.collect()
    torch.cuda.synchronize(device)
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # not public; a torch without it skips
    if cublas_workspaces and clear_workspaces is not None:
        clear_workspaces()
    torch.cuda.empty_cache()


def run_case(geom_name: str, model: str, plan: BatchPlan, *, warmup: int, steps: int, device: torch.device,
             deadline: float, execution: Execution = Execution(), log=print) -> TrainRow:
    row = TrainRow(geom_name, model, plan.seq_len, plan.micro_batch, plan.grad_accum, plan.tokens, SKIPPED,
                   execution.activation_checkpointing, execution.cuda_graphs)
    clock = StepClock(device, warmup, steps, deadline, profile_kernels=True)
    if device.type == "cuda":
        release_device_memory(device, cublas_workspaces=True)  # what earlier cases of the process left
    try:
        with trainer_for(geometry(geom_name), model, plan, steps=warmup + steps, device=device, step_hook=clock,
                         execution=execution) as trainer:
            row.parameters = count_parameters(trainer.model)
            result = trainer.train()
            clock.finish()
            kernels = attention_kernels(clock.kernels) if clock.profile_kernels else None
            row.attention = describe_attention(trainer.model, kernels)
            if result.status != "completed":
                raise RuntimeError(f"the trainer stopped early: {result.halt_reason}")
            row.loss_last = result.records[-1]["loss"]
            if not math.isfinite(row.loss_last):
                raise RuntimeError(f"non-finite loss {row.loss_last}")
        timed = clock.step_ms()[warmup:]
        if len(timed) != steps:
            raise RuntimeError(f"expected {steps} timed steps, measured {len(timed)}")
        _fill_timing(row, timed)
        row.status = OK
        if device.type == "cuda":  # graphs keep their activations in private pools the allocated count leaves out
            row.peak_mem_bytes = (torch.cuda.max_memory_reserved(device) if execution.cuda_graphs else
                                  torch.cuda.max_memory_allocated(device))
    except OverBudget as exc:
        row.status, row.note = SKIPPED, str(exc)
    except Exception as exc:  # noqa: BLE001 - every failure is recorded and the sweep goes on
        message = str(exc).splitlines()[0][:300] if str(exc) else ""
        if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in message.lower():
            row.status, row.note = OOM, f"out of memory: {message[:200]}"
        else:
            row.status, row.note = ERROR, f"{type(exc).__name__}: {message}"
            log(traceback.format_exc(limit=6))
    finally:
        clock.close()
    return row


def _fill_timing(row: TrainRow, times_ms: list[float]) -> None:
    samples = Samples(times_ms)
    row.median_step_ms, row.min_step_ms = samples.median, samples.minimum
    row.mean_step_ms = statistics.fmean(times_ms)
    row.p20_step_ms, row.p80_step_ms = samples.quantile(0.2), samples.quantile(0.8)
    row.n_steps = len(times_ms)
    row.tokens_per_s = row.tokens_per_step / (row.median_step_ms / 1e3)


def describe_row(row: TrainRow) -> str:
    head = (f"{row.geometry:>9s} {row.model:>5s} T={row.seq_len:>6d} ({row.micro_batch} x {row.grad_accum} "
            f"micro-steps)")
    if row.status != OK:
        return f"{head}  {row.status.upper()}: {row.note}"
    mem = f", peak {row.peak_mem_bytes / 2**30:.1f} GiB" if row.peak_mem_bytes else ""
    return (f"{head}  {row.tokens_per_s:10.0f} tokens/s (median step {row.median_step_ms:.1f} ms, mean "
            f"{row.mean_step_ms:.1f}){mem}")


class Sweep:
    """Cases in order geometry -> seq_len -> model, inside a wall-clock budget."""

    def __init__(self, geometries: tuple[str, ...], models: tuple[str, ...], seq_lens: tuple[int, ...],
                 tokens_per_step: int, micro_tokens: int, warmup: int, steps: int, budget_s: float,
                 device: torch.device, executions: dict[str, Execution], log=print):
        """executions: how each model runs (a model it does not name runs plain eager steps)."""
        for name in geometries:
            geometry(name)
        bad = [m for m in models if m not in MODELS]
        if bad or not models:
            raise ValueError(f"--models must be a comma list of {MODELS}, got {models}")
        if steps < 1 or warmup < 0:
            raise ValueError(f"--steps must be >= 1 and --warmup >= 0, got {steps} and {warmup}")
        self.plans = [batch_plan(T, tokens_per_step, micro_tokens) for T in seq_lens]
        self.geometries, self.models = geometries, models
        self.warmup, self.steps, self.budget_s, self.device = warmup, steps, budget_s, device
        self.executions = {m: executions.get(m, Execution()) for m in models}
        self.log = log
        self.started = time.perf_counter()
        self._last: dict[tuple[str, str], tuple[int, float]] = {}  # (geometry, model) -> (T, seconds per step)

    def deadline(self) -> float:
        return self.started + self.budget_s

    def _predicted_s(self, geom: str, model: str, T: int) -> float | None:
        last = self._last.get((geom, model))
        if last is None:
            return None
        T0, step_s = last
        return step_s * max(1.0, T / T0) * (self.warmup + self.steps)

    def run(self, on_row=None) -> list[TrainRow]:
        rows: list[TrainRow] = []
        for geom in self.geometries:
            for plan in self.plans:
                for model in self.models:
                    predicted = self._predicted_s(geom, model, plan.seq_len)
                    left = self.deadline() - time.perf_counter()
                    if left <= 0 or (predicted is not None and predicted > left):
                        note = (f"skipped by the {self.budget_s:.0f} s budget: predicted ~{predicted or 0:.0f} s, "
                                f"{max(0.0, left):.0f} s left")
                        row = TrainRow(geom, model, plan.seq_len, plan.micro_batch, plan.grad_accum, plan.tokens,
                                       SKIPPED, self.executions[model].activation_checkpointing,
                                       self.executions[model].cuda_graphs, note=note)
                    else:
                        row = run_case(geom, model, plan, warmup=self.warmup, steps=self.steps, device=self.device,
                                       deadline=self.deadline(), execution=self.executions[model], log=self.log)
                        if row.status == OK:
                            self._last[(geom, model)] = (plan.seq_len, row.median_step_ms / 1e3)
                    rows.append(row)
                    self.log(describe_row(row))
                    if on_row is not None:
                        on_row(rows)
        return rows


# Files ------------------------------------------------------------------------------------------------------------

def _carry_earlier_meta(meta: dict[str, Any], earlier: dict[str, Any]) -> None:
    """A --merge sweep's meta keeps what the file's earlier sweeps said of the rows it does not measure again: their
    geometries' descriptions, and the environments they ran in (meta["earlier"]: each earlier sweep's env once)."""
    meta["geometries"] = {**(earlier.get("geometries") or {}), **meta["geometries"]}
    envs = [*(e["env"] for e in earlier.get("earlier", [])), earlier.get("env", {})]
    meta["earlier"] = [{"env": env} for i, env in enumerate(envs) if env and env not in envs[:i]]


def write_rows(rows: list[TrainRow], out_dir: Path, meta: dict[str, Any],
               measured: list[TrainRow] | None = None) -> None:
    """train.csv and train.json; measured: the rows this sweep ran (the others, merged from the file, are named in
    meta["kept_rows"] for the report)."""
    if measured is not None:
        ran = {r.key for r in measured}
        meta["kept_rows"] = [f"{r.geometry} {r.model} {r.seq_len}" for r in rows if r.key not in ran]
    out_dir.mkdir(parents=True, exist_ok=True)
    write_csv(out_dir / TRAIN_CSV, rows, TrainRow)
    (out_dir / TRAIN_JSON).write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1,
                                                 default=str) + "\n")


def read_rows(path: Path) -> list[TrainRow]:
    return read_csv(path, TrainRow)


def read_meta(out_dir: Path) -> dict[str, Any]:
    path = Path(out_dir) / TRAIN_JSON
    return json.loads(path.read_text()).get("meta", {}) if path.exists() else {}


def run_sweep(args, device: torch.device) -> tuple[list[TrainRow], Path]:
    """`python -m perf train`: run the sweep, write train.csv / train.json after every case, then the report."""
    from .train_report import make_report

    out_dir = Path(args.out)
    sweep = Sweep(args.geometries, args.models, args.seq_lens, args.tokens_per_step, args.micro_tokens, args.warmup,
                  args.steps, args.budget_s, device,
                  {m: Execution(args.activation_checkpointing.get(m, False), args.cuda_graphs) for m in MODELS})
    env = describe(device)
    meta = {"env": env, "geometries": {g: GEOMETRIES[g].description for g in args.geometries},
            "tokens_per_step": args.tokens_per_step, "micro_batch_tokens": args.micro_tokens,
            "warmup_steps": args.warmup, "timed_steps": args.steps, "budget_s": args.budget_s,
            "activation_checkpointing": args.activation_checkpointing, "cuda_graphs": args.cuda_graphs,
            "timing": ("CUDA events at the start of every trainer step (Trainer.train step hook), median of the timed "
                       "steps after the warm-up" if device.type == "cuda" else
                       "perf_counter at the start of every trainer step, median of the timed steps after the warm-up")}
    old = read_rows(out_dir / TRAIN_CSV) if args.merge and (out_dir / TRAIN_CSV).exists() else []
    if old:
        _carry_earlier_meta(meta, read_meta(out_dir))

    def save(rows: list[TrainRow]) -> None:
        write_rows(merge_rows(old, rows), out_dir, meta, measured=rows)

    if args.steps < 10:
        print(f"perf train: note: {args.steps} timed steps per case, fewer than the 10 that reported medians need")
    print(f"perf train: {env['device']} | torch {env['torch']} | triton {env['triton']} | geometries "
          f"{list(args.geometries)} | T={list(args.seq_lens)} | {args.tokens_per_step} tokens per step | budget "
          f"{args.budget_s:.0f} s", flush=True)
    rows = sweep.run(on_row=save)
    if device.type == "cuda":
        env["nvidia_smi_end"] = nvidia_smi(device.index or 0)
    meta["elapsed_s"] = round(time.perf_counter() - sweep.started, 1)
    measured, rows = rows, merge_rows(old, rows)
    write_rows(rows, out_dir, meta, measured=measured)
    make_report(out_dir)
    skipped = sum(r.status == SKIPPED for r in rows)
    print(f"perf train: wrote {out_dir}/ ({len(rows)} rows, {skipped} skipped) in {meta['elapsed_s']:.0f} s")
    return rows, out_dir
