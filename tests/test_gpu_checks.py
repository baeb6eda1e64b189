"""scripts/gpu_checks.sh without a GPU: the commands it builds, where their output goes, and how a step's exit
becomes its verdict, with a stand-in interpreter that answers the CUDA probe and plays each step."""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_checks.sh"
STEPS = ("conformance-gpu", "gpu-tests", "kernels", "sentinels-gpu", "perf", "decode-bench")

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils timeout")


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


@pytest.fixture
def fake_python(tmp_path: Path) -> Path:
    """An interpreter that sees a GPU, fails the gpu-marked tests, outlives any short time limit in the sentinel
    step, and passes everything else."""
    path = tmp_path / "python"
    path.write_text(textwrap.dedent("""\
        #!/usr/bin/env bash
        case "$*" in
          *torch.cuda.is_available*) echo "0.0+fake"; exit 0 ;;
          -c*) echo "fake versions"; exit 0 ;;
          *"-m gpu"*) echo "1 failed"; exit 1 ;;
          *sentinels-gpu*) sleep 20 ;;
          *) echo "ran: $*"; exit 0 ;;
        esac
        """))
    path.chmod(0o755)
    return path


def dry_run(*args: str, env: dict | None = None) -> dict[str, str]:
    done = run("--dry-run", *args, env=env)
    assert done.returncode == 0, done.stderr
    return dict(line.split(": ", 1) for line in done.stdout.splitlines())


def test_every_step_writes_under_out(tmp_path):
    out = tmp_path / "results"
    commands = dry_run("--out", str(out))
    assert tuple(commands) == STEPS
    for step in ("conformance-gpu", "gpu-tests", "sentinels-gpu", "perf", "decode-bench"):
        assert str(out) in commands[step], (step, commands[step])
    assert "-m gpu" in commands["gpu-tests"]
    assert "nox -s conformance-gpu" in commands["conformance-gpu"]
    assert f"--baseline-dir {out}/baselines" in commands["perf"]


def test_the_environment_does_not_move_the_output(tmp_path):
    elsewhere = str(tmp_path / "elsewhere")
    crowded = {name: elsewhere for name in ("OUTPUT", "OUTDIR", "REPORT_DIR", "NSA_REPORT_DIR", "RESULTS")}
    commands = dry_run(env=crowded)
    assert commands == dry_run()
    assert all(elsewhere not in command for command in commands.values())
    assert all("reports/gpu-checks" in commands[s] for s in ("conformance-gpu", "gpu-tests", "perf"))


def test_time_limit_becomes_the_benchmarks_budget():
    limited = dry_run("--time-limit", "600", "perf", "decode-bench")
    assert limited["perf"].endswith("--time-budget 540")
    assert limited["decode-bench"].endswith("--budget-s 540")
    unlimited = dry_run("--time-limit", "0", "perf", "decode-bench")
    assert "--time-budget" not in unlimited["perf"] and "--budget-s" not in unlimited["decode-bench"]


def test_workers_reach_pytest_only():
    commands = dry_run("--workers", "4")
    assert commands["gpu-tests"].endswith("-n 4") and "-n 4" in commands["kernels"]
    assert "-n 4" not in commands["perf"] and "-n 4" not in commands["sentinels-gpu"]
    assert "-n " not in dry_run()["gpu-tests"]


@pytest.mark.parametrize("args, message", [
    (("no-such-step",), "unknown step no-such-step"),
    (("--workers", "0"), "--workers needs a count >= 1"),
    (("--time-limit", "soon"), "--time-limit needs a whole number of seconds"),
    (("--out",), "--out needs a folder"),
    (("--verbose",), "unknown option --verbose"),
])
def test_bad_usage_is_one_line_and_exit_2(args, message):
    done = run(*args)
    assert done.returncode == 2
    assert done.stderr.strip().startswith(f"gpu_checks.sh: {message}")
    assert len(done.stderr.strip().splitlines()) == 1


def test_no_gpu_stops_before_any_step(tmp_path):
    no_gpu = tmp_path / "python"
    no_gpu.write_text("#!/usr/bin/env bash\necho 0.0+cpu; exit 3\n")
    no_gpu.chmod(0o755)
    done = run("--python", str(no_gpu), "--out", str(tmp_path / "out"))
    assert done.returncode == 2
    assert "sees no CUDA GPU (torch 0.0+cpu)" in done.stderr
    assert not (tmp_path / "out").exists()


def test_verdicts_logs_and_exit_status(tmp_path, fake_python):
    out = tmp_path / "out"
    done = run("--python", str(fake_python), "--out", str(out), "--time-limit", "1",
               "conformance-gpu", "gpu-tests", "sentinels-gpu")
    assert done.returncode == 1, done.stdout + done.stderr
    summary = (out / "logs" / "summary.txt").read_text().splitlines()
    verdicts = {line.split()[0]: line.split("exit")[0].split(None, 1)[1].strip() for line in summary}
    assert verdicts == {"conformance-gpu": "PASS", "gpu-tests": "FAIL", "sentinels-gpu": "TIME LIMIT"}
    assert "ran: -m nox -s conformance-gpu -- --report-dir" in (out / "logs" / "conformance-gpu.log").read_text()
    assert "1 failed" in (out / "logs" / "gpu-tests.log").read_text()
    assert "fake versions" in (out / "logs" / "environment.txt").read_text()


def test_all_steps_passing_exit_0(tmp_path, fake_python):
    done = run("--python", str(fake_python), "--out", str(tmp_path / "out"), "conformance-gpu", "perf")
    assert done.returncode == 0, done.stdout + done.stderr
    assert [line.split()[:2] for line in (tmp_path / "out" / "logs" / "summary.txt").read_text().splitlines()] == \
        [["conformance-gpu", "PASS"], ["perf", "PASS"]]


def test_pytest_accepts_the_gpu_tests_command_line(tmp_path):
    """The gpu-tests step's pytest arguments, as the script builds them, collected here (no GPU: the tests are
    skipped, but an option pytest does not know stops the whole step before it starts)."""
    import shlex
    import sys

    command = shlex.split(dry_run("--out", str(tmp_path / "results"), "--workers", "2", "gpu-tests")["gpu-tests"])
    assert command[:3] == ["python3", "-m", "pytest"]
    args = [a for a in command[3:] if a not in ("-n", "2")]
    done = subprocess.run([sys.executable, "-m", "pytest", *args, "--collect-only", "-q"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "tests/gpu/test_parity_gpu.py" in done.stdout
