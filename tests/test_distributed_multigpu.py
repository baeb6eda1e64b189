"""`python -m sentinels.multigpu` end to end on CPU: the tiny config, 2 gloo ranks under torchrun, the same code path
as on 2 GPUs (one process with doubled accumulation, 2 ranks, a .HALT stop and --resume, the summation-order run)
and the report it writes. The end-to-end run starts 11 processes (about 40 s on 2 busy cores), so it is marked
slow and left out of CI (`pytest -m slow tests/test_distributed_multigpu.py` runs it); the argument checks run
in CI."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sentinels import multigpu
from sentinels.multigpu import main

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny-cpu.yaml"


def run_on_cpu_ranks(tmp_path: Path, *extra: str) -> Path:
    """The command on two gloo ranks with the tiny config (14 steps, .HALT after step 2, checkpoint at step 7);
    returns its --out folder after checking it exited 0."""
    out = tmp_path / "report"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "sentinels.multigpu", "--out", str(out), "--config", str(TINY), "--device", "cpu",
         "--data", "synthetic", "--steps", "14", "--seq-len", "32", "--micro-batch", "2", "--warmup-steps", "2",
         "--save-every", "7", "--halt-at", "2", "--resume-until", "9", "--warmup", "2",
         "--work-dir", str(tmp_path / "work"), "--time-limit-s", "240", *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.mark.slow
def test_the_multi_gpu_check_runs_end_to_end_on_cpu_ranks(tmp_path):
    out = run_on_cpu_ranks(tmp_path)
    summary = json.loads((out / "summary.json").read_text())
    verdicts = {name: v["verdict"] for name, v in summary["verdicts"].items()}
    assert verdicts == {"loss curves": "PASS", "throughput": "NOT JUDGED", "halt/resume": "PASS"}, summary["verdicts"]
    # DDP on 2 ranks equals one process with grad_accum 2 exactly; the summation-order run does not
    assert summary["loss_comparison"]["n-gpu"]["max_abs"] == 0 and summary["tolerance"] > 0
    halt = summary["halt_resume"]
    first, second = halt["stops_after_steps"]
    assert 2 < first < 7 < second < 14 and halt["history_equal"] and halt["checkpoint"]["equal"]
    assert [p["status"] for p in summary["phases"]] == ["completed", "completed", "halted and resumed", "completed"]
    one, two = summary["throughput"]["one-gpu"], summary["throughput"]["n-gpu"]
    assert two["gpus"] == 2 and one["tokens_per_s_per_gpu"] > 0 and one["judged"] == "wall" and one["device"] is None
    with (out / "loss_curves.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 14 and all(row["loss_one-gpu"] == row["loss_n-gpu"] for row in rows)
    report = (out / "report.md").read_text()
    assert "| halt/resume | PASS |" in report and "![loss curves](loss_curves.png)" in report
    assert (out / "loss_curves.png").stat().st_size > 10_000 and (out / "throughput.csv").is_file()
    assert sorted(p.name for p in (out / "logs").iterdir()) == [
        "halted.leg1.log", "halted.leg2.log", "n-gpu.log", "one-gpu-2m.log", "one-gpu.log"]


@pytest.mark.slow
def test_runs_selects_the_halt_resume_check_alone(tmp_path):
    """--runs n-gpu,halted makes only the runs halt/resume needs; the other checks are NOT RUN, not FAIL."""
    out = run_on_cpu_ranks(tmp_path, "--runs", "n-gpu,halted")
    summary = json.loads((out / "summary.json").read_text())
    verdicts = {name: v["verdict"] for name, v in summary["verdicts"].items()}
    assert verdicts == {"loss curves": "NOT RUN", "throughput": "NOT RUN", "halt/resume": "PASS"}, summary["verdicts"]
    assert [p["status"] for p in summary["phases"]] == ["not run", "completed", "halted and resumed", "not run"]
    assert sorted(p.name for p in (out / "logs").iterdir()) == ["halted.leg1.log", "halted.leg2.log", "n-gpu.log"]


@pytest.mark.parametrize("args, message", [
    (["--halt-at", "120"], "need 1 <= --halt-at (120) < --save-every (100)"),
    (["--runs", "n-gpu,twice"], "--runs must name some of one-gpu, n-gpu, halted, one-gpu-2m"),
    (["--nproc", "1"], "--nproc must be >= 2"),
])
def test_inconsistent_arguments_are_one_line(tmp_path, capsys, args, message):
    assert main(["--out", str(tmp_path), "--config", str(TINY), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_trainer_status_is_read_when_another_rank_writes_on_its_line(tmp_path):
    """The ranks share one log: rank 1's log line can land right after rank 0's JSON summary, before its newline
    (as seen under torchrun on two GPUs), and a line of another rank can come before it."""
    log = tmp_path / "leg.log"
    log.write_text('step 41\n{"status": "halted", "steps_done": 42, "events": []}2026-01-01 00:00:00,000 WARNING '
                   'sentinels.train: run halted after 42 of 200 steps (rank 1)\n'
                   'W1125 torchrun: Sending process 894 closing signal SIGTERM\n')
    assert multigpu.trainer_status(log) == "halted"
    log.write_text('rank 1 says hi {"status": "completed", "steps_done": 3}\n')
    assert multigpu.trainer_status(log) == "completed"
    log.write_text("no summary at all\n")
    assert multigpu.trainer_status(log) is None
