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
