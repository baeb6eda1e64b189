"""noxfile.py: every session the launch procedure relies on exists with a docstring; GPU sessions
run in the current interpreter (venv_backend="none"), CPU sessions build their own virtualenv."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

nox_registry = pytest.importorskip("nox.registry")

REPO = Path(__file__).resolve().parent.parent
GPU_SESSIONS = ("conformance-gpu", "sentinels-gpu", "perf", "preflight", "launch")
CPU_SESSIONS = ("tests", "conformance", "sentinels", "perf-cpu", "lint")


@pytest.fixture(scope="module")
def sessions():
    spec = importlib.util.spec_from_file_location("noxfile_under_test", REPO / "noxfile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # @nox.session registers each session in nox.registry
    return dict(nox_registry.get())


@pytest.mark.parametrize("name", GPU_SESSIONS + CPU_SESSIONS)
def test_session_exists_with_a_docstring(sessions, name):
    assert name in sessions, f"nox session {name!r} is missing from noxfile.py"
    assert (sessions[name].__doc__ or "").strip(), f"nox session {name!r} has no docstring (nox -l shows it)"


@pytest.mark.parametrize("name", GPU_SESSIONS)
def test_gpu_sessions_use_the_current_interpreter(sessions, name):
    assert sessions[name].venv_backend == "none"


@pytest.mark.parametrize("name", CPU_SESSIONS)
def test_cpu_sessions_build_a_virtualenv(sessions, name):
    assert sessions[name].venv_backend != "none"
