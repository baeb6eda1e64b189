"""`nox -s conformance` (the README's main job) leaves a checkout as it was: by default its reports go to a
git-ignored folder; only `--update-baseline` or an explicit `--report-dir` writes elsewhere (noxfile.py)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

nox_registry = pytest.importorskip("nox.registry")

REPO = Path(__file__).resolve().parent.parent


class RecordingSession:
    """The part of nox.Session the CPU sessions use; records every command instead of running it."""

    def __init__(self, posargs: list[str]) -> None:
        self.posargs = posargs
        self.runs: list[tuple[str, ...]] = []

    def install(self, *args: str, **kwargs) -> None:
        pass

    def log(self, *args: str, **kwargs) -> None:
        pass

    def run(self, *args: str, **kwargs) -> None:
        self.runs.append(args)

    def create_tmp(self) -> str:
        return "/tmp/nox-tmp"


@pytest.fixture(scope="module")
def cpu_sessions():
    spec = importlib.util.spec_from_file_location("noxfile_conformance_under_test", REPO / "noxfile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.torch_cpu_index = lambda session: []  # no probe of PyTorch's index from a test
    return dict(nox_registry.get())


@pytest.fixture(scope="module")
def conformance_session(cpu_sessions):
    return cpu_sessions["conformance"]


def report_dirs(session_func, posargs: list[str]) -> list[str]:
    """Every --report-dir of the session's pytest command, in order (pytest keeps the last)."""
    session = RecordingSession(posargs)
    session_func(session)
    (cmd,) = [run for run in session.runs if run[0] == "pytest"]
    dirs = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--report-dir"]
    return dirs + [a.split("=", 1)[1] for a in cmd if a.startswith("--report-dir=")]


def git_ignores(path: str) -> bool:
    done = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=REPO, capture_output=True)
    assert done.returncode in (0, 1), done.stderr
    return done.returncode == 0


@pytest.fixture(scope="module")
def git_checkout():
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not applicable: needs a git checkout")


def test_default_reports_are_git_ignored(conformance_session, git_checkout):
    dirs = report_dirs(conformance_session, [])
    assert dirs, "the main job writes no report"
    for name in ("optimized-cpu.json", "optimized-cpu.md"):
        assert git_ignores(f"{dirs[-1]}/{name}"), f"a default run writes {dirs[-1]}/{name}, a path git tracks"


def test_update_baseline_writes_the_committed_reports(conformance_session, git_checkout):
    dirs = report_dirs(conformance_session, ["--update-baseline"])
    assert dirs[-1] == "reports/conformance" and not git_ignores("reports/conformance/optimized-cpu.json")


@pytest.mark.parametrize("posargs", [["--report-dir", "/tmp/elsewhere"], ["--report-dir=/tmp/elsewhere"]])
def test_an_explicit_report_dir_wins(conformance_session, posargs):
    assert report_dirs(conformance_session, posargs + ["--update-baseline"])[-1] == "/tmp/elsewhere"


def test_the_unit_tests_run_on_xdist_workers_when_nox_itself_lacks_xdist(cpu_sessions, monkeypatch):
    """The CI command runs nox from an interpreter with nox only; the tests session's venv has pytest-xdist (the dev
    extra), so its first pytest command spreads over the cores unless posargs choose."""
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "xdist" else
                        real_find_spec(name, *a))
    session = RecordingSession([])
    cpu_sessions["tests"](session)
    first = session.runs[0]
    assert first[0] == "pytest" and "-n" in first, first
    session = RecordingSession(["-n", "1"])
    cpu_sessions["tests"](session)
    assert session.runs[0].count("-n") == 1, session.runs[0]


def _gqa_run(tmp_path, baseline, *extra):
    import os
    import sys

    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "conformance/test_gqa_consistency.py", "--impl", "optimized", "--baseline", str(baseline),
                           "--report-dir", str(tmp_path / "r"), *extra], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_update_baseline_accepts_the_differences_it_writes(tmp_path):
    """A difference from the baseline fails a plain run; with --update-baseline it is reported as accepted (the run
    passes) and the new entry is written, so the next plain run passes."""
    import json

    baseline = tmp_path / "baseline.json"
    assert _gqa_run(tmp_path, baseline, "--update-baseline").returncode == 0
    data = json.loads(baseline.read_text())
    (key, entry), = data.items()
    entry["GQA consistency"]["tests"]["passed"] = 999  # the baseline ran more tests than this run will
    baseline.write_text(json.dumps(data))

    plain = _gqa_run(tmp_path, baseline)
    assert plain.returncode == 1 and "coverage lost" in plain.stdout, plain.stdout[-2000:]
    updated = _gqa_run(tmp_path, baseline, "--update-baseline")
    assert updated.returncode == 0, updated.stdout[-2000:]
    assert "accepted by --update-baseline): coverage lost" in updated.stdout, updated.stdout[-1500:]
    report = json.loads(next((tmp_path / "r").glob("*.json")).read_text())
    gqa, = [p for p in report["properties"] if p["property"] == "GQA consistency"]
    assert gqa["verdict"] == "PASS" and gqa["baseline_changes_accepted"] and not gqa["baseline_regressions"]
    assert json.loads(baseline.read_text())[key]["GQA consistency"]["tests"]["passed"] < 999
    assert _gqa_run(tmp_path, baseline).returncode == 0
