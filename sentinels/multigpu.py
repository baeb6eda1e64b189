"""Multi-GPU check: one command trains a config on one GPU with N-fold gradient accumulation and on N GPUs (torchrun,
NCCL), stops an N-GPU run with .HALT and resumes it, and writes a report to --out.

    python -m sentinels.multigpu --out DIR [--config configs/prod-125m.yaml] [--nproc 2] [--steps 200]
                                 [--seq-len 2048] [--micro-batch 2] [--data auto|wiki|synthetic] ...

Runs, in this order, each in processes of its own (the N-GPU ones under torchrun, through `python -m sentinels
train`, the command a user launches):
  one-gpu     one process, grad_accum N, reading the micro-batches the N ranks read (RanksAsOneSource); with
              --parallel fsdp a group of one rank, so that it computes with FSDP's mixed precision too
  n-gpu       N ranks, micro-batch m and grad_accum 1 each: the same tokens per optimizer step, uninterrupted
  halted      N ranks again: .HALT is created once step --halt-at is logged; then --resume, and .HALT again once
              step --resume-until is logged (past the checkpoint of step --save-every)
  one-gpu-2m  one process, one micro-batch of N x m sequences: the same data, another order of the fp32 sums

Verdicts:
  loss curves   max over steps |loss(n-gpu) - loss(one-gpu)| <= TOLERANCE_FACTOR x max over steps
                |loss(one-gpu-2m) - loss(one-gpu)|: the N-GPU run may differ from one GPU by no more than a mere
                change in the order of the floating-point sums does (DDP with N = 2 is expected to match exactly)
  throughput    tokens/s per GPU of n-gpu >= THROUGHPUT_GOAL x one-gpu's (medians over the steps after --warmup,
                each step's tokens over its CUDA event span; the trainer's wall-clock tokens/s beside it; judged on
                CUDA only)
  halt/resume   every step the halted-and-resumed run logged equals the uninterrupted run's (loss, gradient norm,
                learning rate, bit for bit), and its checkpoint of step --save-every equals the uninterrupted
                run's tensor for tensor

--out receives report.md, summary.json, loss_curves.csv, throughput.csv, loss_curves.png and logs/; the run
directories and checkpoints go to --work-dir (a temporary directory, removed at the end unless --keep-runs).
--time-limit-s bounds the whole command: a run still going at the limit is stopped, the later ones are skipped,
and the report says so. Exit 0 when every judged verdict passes, 1 otherwise, 2 on bad input.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .config import RunConfig, load_config
from .errors import InputError, add_debug_flag, run_reporting_errors

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "configs" / "prod-125m.yaml"
TOLERANCE_FACTOR = 4.0
THROUGHPUT_GOAL = 0.90
ANALYSIS_RESERVE_S = 30.0  # of --time-limit-s, kept for comparing checkpoints and writing the report
RUNS = ("one-gpu", "n-gpu", "halted", "one-gpu-2m")
NOT_RUN = "NOT RUN"  # the verdict of a check whose runs --runs left out


class MultiGpuError(InputError, ValueError):
    """Bad arguments or a data choice that cannot work (the message says which)."""


# ------------------------------------------------------------------------------------------------ configs
def data_overrides(cfg: RunConfig, choice: str, work: Path) -> tuple[list[str], str]:
    """(overrides, description) for --data: wiki = the sentinels' local English corpus (gensim's Wikipedia excerpt)
    tokenized by the config's tokenizer; synthetic = uniform tokens over the config's vocabulary; auto = wiki when
    it is available offline, else synthetic."""
    from .data.prepare import DEFAULT_WIKI_OUT, prepare_wiki
    from .data.tokenizers import get_tokenizer, tokenizer_vocab_size

    def synthetic(why: str = "") -> tuple[list[str], str]:
        vocab = cfg.vocab_size() if cfg.data.source == "synthetic" else tokenizer_vocab_size(cfg.data.tokenizer)
        return (["data.source=synthetic", "data.synthetic.task=uniform", f"data.synthetic.vocab_size={vocab}",
                 "data.packing=contiguous"],
                f"synthetic: uniform random tokens over {vocab} ids{why}")

    if choice == "synthetic":
        return synthetic()
    try:
        if cfg.data.tokenizer == "byte" and cfg.data.source == "synthetic" and choice == "auto":
            return synthetic(" (the config trains on synthetic tokens)")
        get_tokenizer(cfg.data.tokenizer)
        corpus = REPO_ROOT / DEFAULT_WIKI_OUT
        if not corpus.is_file():
            corpus = work / "data" / "wiki.jsonl"
            if not corpus.is_file():
                prepare_wiki(corpus)
    except (ImportError, OSError, InputError) as exc:
        if choice == "wiki":
            raise MultiGpuError(f"--data wiki: the local corpus is not available: {exc} (use --data synthetic)") \
                from None
        return synthetic(f" (the local corpus is not available: {' '.join(str(exc).split())[:200]})")
    return (["data.source=jsonl", f"data.paths=[{corpus}]", "data.packing=contiguous"],
            f"wiki: the English Wikipedia excerpt shipped with gensim ({corpus.name}), {cfg.data.tokenizer} tokens")


def run_overrides(args: argparse.Namespace, data: list[str], out_dir: Path) -> list[str]:
    """The overrides of the N-rank runs (the one-GPU runs derive theirs from these)."""
    device = ["train.device=cpu", "train.precision=fp32"] if args.device == "cpu" else ["train.device=cuda"]
    return [*args.override, *data, *device, f"train.steps={args.steps}", f"train.seq_len={args.seq_len}",
            f"train.micro_batch_size={args.micro_batch}", "train.grad_accum=1",
            f"train.warmup_steps={args.warmup_steps}", f"train.save_every={args.save_every}",
            "train.keep_checkpoints=3", f"train.parallel={args.parallel}", f"train.out_dir={out_dir}"]


# ------------------------------------------------------------------------------------------------ running
@dataclass
class Phase:
    name: str
    status: str = "not run"  # completed | halted | failed | timeout | skipped (time limit) | not run
    seconds: float = 0.0
    returncode: int | None = None
    log: str | None = None
    detail: str = ""
    legs: list[dict[str, Any]] = field(default_factory=list)


def _child_env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def last_logged_step(run_dir: Path) -> int:
    """The step of the last line of heartbeat.jsonl (-1 before the first)."""
    path = run_dir / "heartbeat.jsonl"
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return -1
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue
    return -1


def run_process(argv: list[str], log_path: Path, deadline: float, *, run_dir: Path | None = None,
                halt_at: int | None = None) -> tuple[int | None, float, bool]:
    """(exit code or None on the deadline, seconds, whether .HALT was created). With halt_at, .HALT is created in
    run_dir as soon as heartbeat.jsonl logs a step >= halt_at."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    touched = False
    with log_path.open("w") as log:
        log.write("$ " + " ".join(argv) + "\n")
        log.flush()
        proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=_child_env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    _stop_group(proc)
                    return None, time.monotonic() - started, touched
                if halt_at is not None and not touched and last_logged_step(run_dir) >= halt_at:
                    (run_dir / ".HALT").touch()
                    touched = True
                time.sleep(0.02)
        except BaseException:
            _stop_group(proc)
            raise
    return proc.returncode, time.monotonic() - started, touched


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group this command started (torchrun and its ranks), SIGKILL after 30 s."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def trainer_status(log_path: Path) -> str | None:
    """The status rank 0 of `python -m sentinels train` printed last (its one-line JSON summary), if any. The ranks
    share the log, so another rank's output may stand before or after the summary on its line."""
    status = None
    decoder = json.JSONDecoder()
    for line in log_path.read_text(errors="replace").splitlines():
        start = line.find('{"status":')
        if start < 0:
            continue
        try:
            status = decoder.raw_decode(line, start)[0]["status"]
        except (ValueError, KeyError, TypeError):
            pass
    return status


def torchrun_argv(nproc: int, config: Path, overrides: list[str], *, resume: bool) -> list[str]:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            "-m", "sentinels", "train", "--config", str(config)]
    for item in overrides:
        argv += ["-o", item]
    return argv + (["--resume"] if resume else [])


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one_process_main(spec_path: Path) -> int:
    """A one-GPU run (a child of this command): the N ranks' micro-batches in one process."""
    from .distributed import RanksAsOneSource
    from .trainer import Trainer

    spec = json.loads(spec_path.read_text())
    ranks_cfg = load_config(spec["config"], spec["overrides"])
    nproc, mode = int(spec["nproc"]), spec["mode"]
    if ranks_cfg.train.parallel == "fsdp":
        # FSDP's numerics (on CUDA: parameters gathered in bf16, gradients reduced in fp32) come from fully_shard,
        # which needs a process group: this process forms a group of one, as torchrun --nproc_per_node 1 would.
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    t = ranks_cfg.train
    # the ranks run the eager step (CUDA graphs need one process), so the one-process run does too
    single = ranks_cfg.replace(**({"train.grad_accum": nproc * t.grad_accum} if mode == "interleave" else
                                  {"train.micro_batch_size": nproc * t.micro_batch_size}),
                               **{"train.cuda_graphs": False})
    trainer = Trainer(single, batch_source=RanksAsOneSource(ranks_cfg, nproc, mode=mode), save_checkpoints=False,
                      extra_metadata={"multigpu_run": spec["name"], "reads_ranks": nproc, "mode": mode})
    try:
        result = trainer.train()
    finally:
        trainer.close()
    print(json.dumps({"status": result.status, "steps_done": result.steps_done}))
    return 0 if result.status == "completed" else 3


# ------------------------------------------------------------------------------------------------ analysis
def history(run_dir: Path) -> dict[int, dict[str, Any]]:
    """step -> the record rank 0 logged (heartbeat.jsonl: floats written exactly)."""
    path = run_dir / "heartbeat.jsonl"
    if not path.is_file():
        return {}
    rows = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            rows[int(record["step"])] = record
    return rows


def _per_gpu(values: list[float], gpus: int) -> dict[str, float]:
    q = statistics.quantiles(values, n=10)
    return {"median": statistics.median(values) / gpus, "p10": q[0] / gpus, "p90": q[-1] / gpus}


def throughput(rows: dict[int, dict], gpus: int, warmup: int) -> dict[str, Any] | None:
    """Tokens/s per GPU over the steps from `warmup` on, two ways: `device`, the tokens of a step over its CUDA
    event span (first forward to last kernel: what the GPUs sustain; judged) and `wall`, the trainer's tokens/s
    (also the data fetch of the step, which one process with grad_accum > 1 partly hides behind its GPU work and a
    rank with one micro-batch cannot). `device` is None off CUDA; then `wall` is judged."""
    timed = [r for s, r in sorted(rows.items()) if s >= warmup]
    if len(timed) < 3:
        return None
    device = [r["tokens"] / r["dt_device_s"] for r in timed if r.get("dt_device_s")]
    out = {"gpus": gpus, "steps_timed": len(timed), "tokens_per_step": timed[-1]["tokens"],
           "wall": _per_gpu([r["tokens_per_s"] for r in timed], gpus),
           "device": _per_gpu(device, gpus) if len(device) == len(timed) else None,
           "fetch_share": statistics.median(r["dt_fetch_s"] / max(r["dt_fetch_s"] + r["dt_step_s"], 1e-12)
                                            for r in timed)}
    out["judged"] = "device" if out["device"] else "wall"
    out["tokens_per_s_per_gpu"] = out[out["judged"]]["median"]
    return out


def compare_losses(a: dict[int, dict], b: dict[int, dict]) -> dict[str, Any]:
    steps = sorted(set(a) & set(b))
    diffs = [abs(a[s]["loss"] - b[s]["loss"]) for s in steps]
    return {"steps": len(steps), "max_abs": max(diffs, default=None),
            "mean_abs": statistics.fmean(diffs) if diffs else None,
            "equal_steps": sum(a[s]["loss"] == b[s]["loss"] for s in steps),
            "worst_step": steps[diffs.index(max(diffs))] if diffs else None}


def _equal(a: Any, b: Any, where: str = "") -> str | None:
    """None when a and b are equal (tensors bit for bit), else the first path where they differ."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and torch.equal(a, b)
        return None if same else where or "tensor"
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{where} (keys differ)"
        for key in a:
            found = _equal(a[key], b[key], f"{where}.{key}" if where else str(key))
            if found:
                return found
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{where} (lengths differ)"
        for i, (x, y) in enumerate(zip(a, b)):
            found = _equal(x, y, f"{where}[{i}]")
            if found:
                return found
        return None
    return None if a == b else where or "value"


def checkpoint_state(ckpt_dir: Path, step: int, scratch: Path) -> dict[str, Any] | None:
    """Every tensor and number of the checkpoint of `step` (a file, or a sharded directory gathered into one
    state through torch.distributed.checkpoint.format_utils), or None when there is none."""
    import torch

    from . import checkpoints

    single = ckpt_dir / checkpoints.checkpoint_name(step)
    if single.is_file():
        return torch.load(single, map_location="cpu", weights_only=True)
    sharded = ckpt_dir / checkpoints.checkpoint_name(step, sharded=True)
    if not sharded.is_dir():
        return None
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    checkpoints.check_tensor_index(sharded / checkpoints.TENSORS / ".metadata")
    scratch.mkdir(parents=True, exist_ok=True)
    gathered = scratch / f"{ckpt_dir.parent.name}-{step}.pt"
    dcp_to_torch_save(str(sharded / checkpoints.TENSORS), str(gathered))
    state = torch.load(sharded / checkpoints.STATE, map_location="cpu", weights_only=True)
    state["tensors"] = torch.load(gathered, map_location="cpu", weights_only=True)
    gathered.unlink()
    return state


def halt_resume_check(full_dir: Path, halted_dir: Path, save_every: int, scratch: Path,
                      legs: list[dict[str, Any]]) -> dict[str, Any]:
    full, resumed = history(full_dir), history(halted_dir)
    mismatches = [s for s in sorted(resumed) if s not in full or any(
        resumed[s][k] != full[s][k] for k in ("loss", "grad_norm", "lr"))]
    stops = [leg.get("stopped_after") for leg in legs]
    result: dict[str, Any] = {"steps_compared": len(resumed), "stops_after_steps": stops,
                              "resumed_from_step": stops[0] if stops else None,
                              "mismatched_steps": mismatches[:20], "history_equal": not mismatches and bool(resumed)}
    ckpt_step = save_every
    mine = checkpoint_state(halted_dir / "checkpoints", ckpt_step, scratch)
    theirs = checkpoint_state(full_dir / "checkpoints", ckpt_step, scratch)
    if mine is None or theirs is None:
        result["checkpoint"] = {"step": ckpt_step, "compared": False,
                                "detail": "missing in the " + ("halted" if mine is None else "uninterrupted") + " run"}
    else:
        skip = {"config", "config_hash"}  # train.out_dir differs between the two runs, by design
        differs = _equal({k: v for k, v in mine.items() if k not in skip},
                         {k: v for k, v in theirs.items() if k not in skip})
        result["checkpoint"] = {"step": ckpt_step, "compared": True, "equal": differs is None,
                                "first_difference": differs}
    resumed_after_stop = bool(stops and stops[0] is not None and stops[0] < ckpt_step
                              and max(resumed, default=-1) >= ckpt_step)
    result["pass"] = bool(result["history_equal"] and result["checkpoint"].get("equal") and resumed_after_stop)
    if not resumed_after_stop:
        result["detail"] = (f"the first stop (after step {stops[0] if stops else None}) must come before step "
                            f"{ckpt_step} and the resumed run must pass it")
    return result


# ------------------------------------------------------------------------------------------------ report
def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]) if rows else ["step"])
        writer.writeheader()
        writer.writerows(rows)


def plot(path: Path, curves: dict[str, dict[int, dict]], tolerance: float | None, nproc: int) -> str | None:
    """loss_curves.png: the loss of every run per step, and |loss - loss(one-gpu)| per step with the tolerance."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (the `plots` extra): no plot"
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 8), sharex=True)
    labels = {"one-gpu": f"1 GPU, grad_accum {nproc}", "n-gpu": f"{nproc} GPUs (uninterrupted)",
              "halted": f"{nproc} GPUs, halted and resumed", "one-gpu-2m": f"1 GPU, one micro-batch of {nproc}x"}
    styles = {"one-gpu": dict(color="black", linewidth=2.5), "n-gpu": dict(color="tab:orange", linewidth=1.2),
              "halted": dict(color="tab:blue", linestyle=":", linewidth=1.5),
              "one-gpu-2m": dict(color="tab:green", linewidth=0.8, alpha=0.8)}
    for name, rows in curves.items():
        if rows:
            steps = sorted(rows)
            top.plot(steps, [rows[s]["loss"] for s in steps], label=labels[name], **styles[name])
    top.set_ylabel("training loss (nats)")
    top.set_title("loss per optimizer step")
    top.grid(True, alpha=0.3)
    top.legend()
    base = curves.get("one-gpu") or {}
    floor = 1e-9
    for name in ("n-gpu", "one-gpu-2m", "halted"):
        rows = curves.get(name) or {}
        steps = sorted(set(rows) & set(base))
        if steps:
            bottom.plot(steps, [max(abs(rows[s]["loss"] - base[s]["loss"]), floor) for s in steps],
                        label=f"{labels[name]} vs 1 GPU", **styles[name])
    if tolerance is not None and tolerance > 0:
        bottom.axhline(tolerance, color="red", linestyle="--", linewidth=1, label=f"tolerance {tolerance:.2g}")
    bottom.set_yscale("log")
    bottom.set_xlabel("optimizer step")
    bottom.set_ylabel(f"|loss - loss(1 GPU)| (nats; {floor:g} = equal)")
    bottom.grid(True, alpha=0.3, which="both")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _fmt(value: Any, spec: str = ".4g") -> str:
    return "n/a" if value is None else format(value, spec) if isinstance(value, (int, float)) else str(value)


def report_markdown(summary: dict[str, Any]) -> str:
    s = summary
    n = s["nproc"]
    lines = [f"# Multi-GPU check: {s['config_name']} on 1 GPU and on {n} GPUs", ""]
    lines += [f"Command: `{s['command']}`", ""]
    lines += ["| check | verdict | detail |", "|---|---|---|"]
    for name, verdict in s["verdicts"].items():
        lines.append(f"| {name} | {verdict['verdict']} | {verdict['detail'].replace('|', '/')} |")
    lines += ["", "## Setup", ""]
    setup = s["setup"]
    lines += [f"- Model: {setup['model']}", f"- Data: {s['data']}",
              f"- Per optimizer step: {setup['tokens_per_step']} tokens ({n} x micro-batch {s['micro_batch']} x "
              f"seq_len {s['seq_len']}); {s['steps']} steps, warm-up {s['warmup_steps']} steps of learning rate, "
              f"checkpoints every {s['save_every']} steps",
              f"- 1 GPU: grad_accum {n} x micro-batch {s['micro_batch']}, reading the micro-batches of the {n} "
              f"ranks (rank 0's, then rank 1's, ...); {n} GPUs: `train.parallel: {s['parallel']}`, grad_accum 1",
              f"- Device: {setup['device']}; {setup['versions']}", ""]
    lines += ["## Throughput", "",
              f"Tokens/s per GPU, medians over the steps from step {s['throughput_warmup']} on (the first steps "
              f"compile and tune the kernels), [p10-p90]. Device: a step's tokens over its CUDA event span, from the "
              f"launch of its first forward to its last kernel (judged). Wall: the trainer's tokens/s, which also "
              f"counts fetching the step's data; one process with grad_accum {n} hides its later fetches behind "
              f"its GPU work, a rank with one micro-batch cannot, so wall time favours the one-GPU run by about the "
              f"fetch share.", "",
              "| run | GPUs | tokens/step | steps timed | per GPU, device | per GPU, wall | data fetch share |",
              "|---|---|---|---|---|---|---|"]

    def cell(stats: dict | None) -> str:
        return "n/a" if not stats else f"{stats['median']:.0f} [{stats['p10']:.0f}-{stats['p90']:.0f}]"

    for name in ("one-gpu", "n-gpu"):
        t = s["throughput"].get(name)
        if t:
            lines.append(f"| {name} | {t['gpus']} | {t['tokens_per_step']} | {t['steps_timed']} | "
                         f"{cell(t['device'])} | {cell(t['wall'])} | {t['fetch_share']:.1%} |")
    lines += ["", "## Loss curves", "",
              f"Tolerance: {TOLERANCE_FACTOR:g} x the largest per-step loss difference between the two one-GPU runs, "
              f"which differ only in the order of their floating-point sums (grad_accum {n} of micro-batch m against "
              f"one micro-batch of {n}m on the same data): the {n}-GPU run may differ from one GPU by no more than a "
              f"change of summation order does.", "",
              "| compared with 1 GPU | steps | max abs diff (nats) | mean abs diff | equal steps | worst step |",
              "|---|---|---|---|---|---|"]
    for name, c in s["loss_comparison"].items():
        lines.append(f"| {name} | {c['steps']} | {_fmt(c['max_abs'])} | {_fmt(c['mean_abs'])} | "
                     f"{c['equal_steps']} | {_fmt(c['worst_step'])} |")
    lines += ["", "![loss curves](loss_curves.png)", ""] if s.get("plot") == "loss_curves.png" else \
        ["", f"(no plot: {s.get('plot')})", ""]
    h = s.get("halt_resume") or {}
    lines += ["## Halt and resume", ""]
    if h:
        ck = h.get("checkpoint", {})
        lines += [f"- `.HALT` stops after steps {h.get('stops_after_steps')}; `--resume` on {n} GPUs after the "
                  f"first stop",
                  f"- steps logged by the halted-and-resumed run: {h['steps_compared']}, every one equal to the "
                  f"uninterrupted run's (loss, gradient norm, learning rate): {h['history_equal']}"
                  + (f" (first mismatches: {h['mismatched_steps']})" if h["mismatched_steps"] else ""),
                  f"- checkpoint of step {ck.get('step')}: "
                  + ("equal to the uninterrupted run's, tensor for tensor (model, optimizer, data and RNG state)"
                     if ck.get("equal") else f"NOT equal ({ck.get('first_difference') or ck.get('detail')})"), ""]
    else:
        lines += ["not run", ""]
    lines += ["## Runs", "", "| run | status | seconds | detail |", "|---|---|---|---|"]
    for phase in s["phases"]:
        lines.append(f"| {phase['name']} | {phase['status']} | {phase['seconds']:.0f} | {phase['detail']} |")
    lines += ["", f"Total: {s['total_seconds']:.0f} s (limit {s['time_limit_s']:.0f} s), including process starts "
              f"and kernel compilation. Logs: `logs/`; numbers: `summary.json`, `loss_curves.csv`, `throughput.csv`.",
              ""]
    return "\n".join(lines)


def _shown_path(path: Path) -> str:
    """A path as the report shows it: relative to the repository when inside it (no machine paths in reports)."""
    try:
        return Path(path).resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return str(path)


def _setup_facts(cfg: RunConfig, run_dir: Path, nproc: int) -> dict[str, Any]:
    from .model import count_parameters_for

    meta_path = run_dir / "metadata.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    versions = meta.get("versions", {})
    m, nsa = cfg.model, cfg.model.nsa
    gpu = versions.get("gpu")
    return {"model": f"{count_parameters_for(cfg):,} parameters, d_model {m.d_model}, {m.n_layers} layers, "
                     f"{nsa.get('n_heads')} query heads / {nsa.get('n_kv_heads')} KV heads, NSA "
                     f"l={nsa.get('cmp_block')} d={nsa.get('cmp_stride')} l'={nsa.get('sel_block')} "
                     f"n={nsa.get('n_sel')} "
                     f"w={nsa.get('window')}, attention `{m.attention}`, precision "
                     f"{meta.get('precision', {}).get('effective', 'unknown')}",
            "tokens_per_step": nproc * cfg.train.micro_batch_size * cfg.train.seq_len,
            "device": f"{nproc} x {gpu}" if gpu else f"{meta.get('device', 'unknown')} ({nproc} ranks)",
            "versions": ", ".join(f"{k} {versions.get(k)}" for k in ("torch", "cuda", "triton", "python")
                                  if versions.get(k))}


# ------------------------------------------------------------------------------------------------ main
def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    deadline = started + args.time_limit_s - ANALYSIS_RESERVE_S  # the runs stop here; comparing them takes the rest
    out = Path(args.out)
    if args.halt_at < 1 or args.halt_at >= args.save_every or args.resume_until <= args.save_every \
            or args.resume_until >= args.steps - 1:
        raise MultiGpuError(f"need 1 <= --halt-at ({args.halt_at}) < --save-every ({args.save_every}) < "
                            f"--resume-until ({args.resume_until}) < --steps - 1 ({args.steps - 1}): the halted run "
                            f"stops before the checkpoint that is compared and its resumed part passes it")
    if args.nproc < 2:
        raise MultiGpuError(f"--nproc must be >= 2, got {args.nproc}")
    args.selected = tuple(name for name in args.runs.split(",") if name)
    unknown = sorted(set(args.selected) - set(RUNS))
    if unknown or not args.selected:
        raise MultiGpuError(f"--runs must name some of {', '.join(RUNS)}, got {args.runs!r}")
    base = load_config(args.config, args.override)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="multigpu-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        return _run_all(args, base, out, work, started, deadline)
    finally:
        if not args.keep_runs and not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)


def _run_all(args, base: RunConfig, out: Path, work: Path, started: float, deadline: float) -> int:
    data, data_text = data_overrides(base, args.data, work)
    n = args.nproc
    runs = {name: work / "runs" / name for name in RUNS}
    overrides = {name: run_overrides(args, data, runs[name]) for name in RUNS}
    cfgs = {name: load_config(args.config, overrides[name]) for name in RUNS}  # every override checked up front
    phases = {name: Phase(name) for name in RUNS}
    log = lambda msg: print(f"[multigpu] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    log(f"work dir {work}; data: {data_text}")

    def out_of_time(phase: Phase) -> bool:
        if time.monotonic() < deadline - 5:
            return False
        phase.status, phase.detail = "skipped", "the time limit was reached before it started"
        return True

    def one_process(name: str, mode: str) -> None:
        phase = phases[name]
        if out_of_time(phase):
            return
        spec = work / f"{name}.json"
        spec.write_text(json.dumps({"name": name, "config": str(args.config), "overrides": overrides[name],
                                    "nproc": n, "mode": mode}))
        log(f"{name}: one process ({mode} of {n} ranks' micro-batches)")
        code, seconds, _ = run_process([sys.executable, "-m", "sentinels.multigpu", "--one-process", str(spec)],
                                       out / "logs" / f"{name}.log", deadline)
        phase.returncode, phase.seconds, phase.log = code, seconds, f"logs/{name}.log"
        phase.status = "timeout" if code is None else "completed" if code == 0 else "failed"

    def ranks(name: str, *, halts: list[int] | None = None) -> None:
        phase = phases[name]
        if out_of_time(phase):
            return
        legs = [None] if halts is None else halts
        for i, halt_at in enumerate(legs):
            leg_log = out / "logs" / (f"{name}.log" if len(legs) == 1 else f"{name}.leg{i + 1}.log")
            log(f"{name}: {n} ranks" + ("" if halt_at is None else f", .HALT once step {halt_at} is logged")
                + (" (--resume)" if i else ""))
            code, seconds, touched = run_process(torchrun_argv(n, args.config, overrides[name], resume=i > 0),
                                                 leg_log, deadline, run_dir=runs[name], halt_at=halt_at)
            phase.seconds += seconds
            phase.returncode = code
            status = trainer_status(leg_log)
            leg = {"log": leg_log.relative_to(out).as_posix(), "seconds": round(seconds, 1), "returncode": code,
                   "trainer_status": status, "halt_requested_at": halt_at if touched else None,
                   "stopped_after": None}
            latest = runs[name] / "checkpoints" / "latest.json"
            if halt_at is not None and latest.is_file():
                leg["stopped_after"] = json.loads(latest.read_text())["step"]
            phase.legs.append(leg)
            if code is None:
                phase.status, phase.detail = "timeout", f"stopped at the time limit (leg {i + 1})"
                return
            expected = "completed" if halt_at is None else "halted"
            if status != expected or (halt_at is not None and not touched):
                phase.status = "failed"
                phase.detail = (f"leg {i + 1}: the trainer reported {status!r} (exit code {code}), expected "
                                f"{expected!r}" + (f" after a .HALT at step {halt_at}" if halt_at is not None else ""))
                return
        phase.status = "completed" if halts is None else "halted and resumed"
        if halts is not None:
            phase.detail = f"stopped after steps {[leg['stopped_after'] for leg in phase.legs]}"

    if "one-gpu" in args.selected:
        one_process("one-gpu", "interleave")
    if "n-gpu" in args.selected:
        ranks("n-gpu")
    if "halted" in args.selected:
        ranks("halted", halts=[args.halt_at, args.resume_until])
    if "one-gpu-2m" in args.selected:
        one_process("one-gpu-2m", "concat")

    curves = {name: history(runs[name]) for name in RUNS}
    summary = analyse(args, base, cfgs, runs, curves, phases, work, out, data_text, started)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    (out / "report.md").write_text(report_markdown(summary))
    print(f"report: {out / 'report.md'}")
    for name, verdict in summary["verdicts"].items():
        print(f"{name:14s} {verdict['verdict']:8s} {verdict['detail']}")
    return 0 if all(v["verdict"] in ("PASS", "NOT JUDGED", NOT_RUN) for v in summary["verdicts"].values()) else 1


def analyse(args, base: RunConfig, cfgs: dict[str, RunConfig], runs: dict[str, Path],
            curves: dict[str, dict[int, dict]], phases: dict[str, Phase], work: Path, out: Path, data_text: str,
            started: float) -> dict[str, Any]:
    n = args.nproc
    comparison = {name: compare_losses(curves["one-gpu"], curves[name]) for name in ("n-gpu", "one-gpu-2m", "halted")}
    order = comparison["one-gpu-2m"]["max_abs"] if phases["one-gpu-2m"].status == "completed" else None
    tolerance = None if order is None else TOLERANCE_FACTOR * order
    verdicts: dict[str, dict[str, str]] = {}

    ab = comparison["n-gpu"]
    complete = (phases["one-gpu"].status == phases["n-gpu"].status == "completed"
                and ab["steps"] == args.steps)
    def not_run(*names: str) -> dict[str, str] | None:
        """The NOT RUN verdict of a check that needs runs --runs left out, else None."""
        missing = [name for name in names if name not in args.selected]
        return {"verdict": NOT_RUN, "detail": f"--runs left out {', '.join(missing)}"} if missing else None

    if not_run("one-gpu", "n-gpu"):
        verdicts["loss curves"] = not_run("one-gpu", "n-gpu")
    elif not complete:
        verdicts["loss curves"] = {"verdict": "FAIL", "detail": "the one-GPU or the N-GPU run did not complete"}
    elif tolerance is None:
        same = ab["max_abs"] == 0
        verdicts["loss curves"] = {"verdict": "PASS" if same else "NOT JUDGED",
                                   "detail": f"max abs diff {ab['max_abs']:.3g} over {ab['steps']} steps; no tolerance "
                                             f"(the summation-order run did not complete)"}
    else:
        ok = ab["max_abs"] <= tolerance
        verdicts["loss curves"] = {
            "verdict": "PASS" if ok else "FAIL",
            "detail": f"max over {ab['steps']} steps of abs(loss({n} GPUs) - loss(1 GPU)) = {ab['max_abs']:.3g} nats "
                      f"({ab['equal_steps']} steps equal) {'<=' if ok else '>'} tolerance {tolerance:.3g} = "
                      f"{TOLERANCE_FACTOR:g} x {order:.3g} (summation order)"}

    warm = min(args.warmup, max(0, args.steps // 2))
    tp = {name: throughput(curves[name], gpus, warm) for name, gpus in (("one-gpu", 1), ("n-gpu", n))}
    if not_run("one-gpu", "n-gpu"):
        ratio = None
        verdicts["throughput"] = not_run("one-gpu", "n-gpu")
    elif tp["one-gpu"] and tp["n-gpu"]:
        ratio = tp["n-gpu"]["tokens_per_s_per_gpu"] / tp["one-gpu"]["tokens_per_s_per_gpu"]
        detail = (f"per GPU {tp['n-gpu']['tokens_per_s_per_gpu']:.0f} tokens/s on {n} GPUs, "
                  f"{tp['one-gpu']['tokens_per_s_per_gpu']:.0f} on 1 ({tp['n-gpu']['judged']} time): {ratio:.3f} "
                  f"(goal >= {THROUGHPUT_GOAL:.2f})")
        judged = args.device == "cuda"
        verdicts["throughput"] = {"verdict": ("PASS" if ratio >= THROUGHPUT_GOAL else "FAIL") if judged else
                                  "NOT JUDGED", "detail": detail + ("" if judged else " (CPU ranks: not judged)")}
    else:
        ratio = None
        verdicts["throughput"] = {"verdict": "FAIL", "detail": "a run did not log enough steps"}

    halt = None
    if not_run("n-gpu", "halted"):
        verdicts["halt/resume"] = not_run("n-gpu", "halted")
    elif phases["halted"].status == "halted and resumed" and phases["n-gpu"].status == "completed":
        halt = halt_resume_check(runs["n-gpu"], runs["halted"], args.save_every, work / "scratch",
                                 phases["halted"].legs)
        ck = halt["checkpoint"]
        verdicts["halt/resume"] = {
            "verdict": "PASS" if halt["pass"] else "FAIL",
            "detail": f"stops after steps {halt['stops_after_steps']}; {halt['steps_compared']} logged steps "
                      f"{'equal' if halt['history_equal'] else 'NOT equal'} to the uninterrupted run; checkpoint of "
                      f"step {ck['step']} {'equal' if ck.get('equal') else 'NOT equal'}"
                      + (f" ({halt['detail']})" if halt.get("detail") else "")}
    else:
        verdicts["halt/resume"] = {"verdict": "FAIL", "detail": f"halted run: {phases['halted'].status} "
                                                                f"{phases['halted'].detail}".strip()}

    plot_note = plot(out / "loss_curves.png", {k: curves[k] for k in ("one-gpu", "n-gpu", "one-gpu-2m", "halted")},
                     tolerance, n)
    rows = []
    for step in range(args.steps):
        row: dict[str, Any] = {"step": step}
        for name in RUNS:
            row[f"loss_{name}"] = curves[name].get(step, {}).get("loss", "")
        a, b = curves["one-gpu"].get(step), curves["n-gpu"].get(step)
        row["abs_diff_n_gpu"] = abs(a["loss"] - b["loss"]) if a and b else ""
        rows.append(row)
    write_csv(out / "loss_curves.csv", rows)
    write_csv(out / "throughput.csv", [{"run": k, **v} for k, v in tp.items() if v])
    command = "python -m sentinels.multigpu " + " ".join(args.argv)
    return {
        "command": command, "config": _shown_path(args.config), "config_name": base.name, "nproc": n,
        "parallel": args.parallel, "device": args.device, "steps": args.steps, "seq_len": args.seq_len,
        "micro_batch": args.micro_batch, "warmup_steps": args.warmup_steps, "save_every": args.save_every,
        "data": data_text, "setup": _setup_facts(cfgs["n-gpu"], runs["n-gpu"], n),
        "verdicts": verdicts, "throughput": tp, "throughput_ratio": ratio, "throughput_warmup": warm,
        "throughput_goal": THROUGHPUT_GOAL, "loss_comparison": comparison, "tolerance": tolerance,
        "tolerance_factor": TOLERANCE_FACTOR, "summation_order_max_abs": order, "halt_resume": halt,
        "phases": [asdict(p) for p in phases.values()], "plot": plot_note or "loss_curves.png",
        "total_seconds": time.monotonic() - started, "time_limit_s": args.time_limit_s,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sentinels.multigpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="report directory (required)")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="run config (default: prod-125m)")
    parser.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                        help="dotted override of the config, applied before this command's own")
    parser.add_argument("--nproc", type=int, default=2, help="GPUs (ranks) of the multi-GPU runs (default 2)")
    parser.add_argument("--parallel", choices=("ddp", "fsdp"), default="ddp", help="train.parallel of the runs")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default; NCCL) or cpu (gloo ranks, fp32: a check of this command itself)")
    parser.add_argument("--data", choices=("auto", "wiki", "synthetic"), default="auto",
                        help="wiki: the sentinels' local corpus (gensim's Wikipedia excerpt, offline); synthetic: "
                             "uniform tokens over the config's vocabulary; auto (default): wiki if available")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per rank per step (default 2)")
    parser.add_argument("--warmup-steps", type=int, default=20, help="learning-rate warm-up (default 20)")
    parser.add_argument("--save-every", type=int, default=100, help="checkpoint interval; the checkpoint compared")
    parser.add_argument("--halt-at", type=int, default=40, help="first .HALT once this step is logged")
    parser.add_argument("--resume-until", type=int, default=110, help="second .HALT once this step is logged")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the throughput medians")
    parser.add_argument("--runs", default=",".join(RUNS),
                        help=f"the runs to make, comma-separated (default all: {','.join(RUNS)}); a check whose "
                             f"runs are left out is NOT RUN, e.g. --runs n-gpu,halted checks only halt/resume")
    parser.add_argument("--time-limit-s", type=float, default=540.0, help="wall-clock limit of the whole command")
    parser.add_argument("--work-dir", help="where the runs and checkpoints go (default: a temporary directory)")
    parser.add_argument("--keep-runs", action="store_true", help="keep the temporary work directory")
    parser.add_argument("--one-process", type=Path, help=argparse.SUPPRESS)
    add_debug_flag(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = argv
    if args.one_process is not None:
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return run_reporting_errors(lambda a: one_process_main(a.one_process), args)
    if not args.out:
        print("error: --out DIR is required", file=sys.stderr)
        return 2
    return run_reporting_errors(run, args)


if __name__ == "__main__":
    sys.exit(main())
