"""noxfile.py: every session users and the launch procedure rely on exists with a docstring whose first line (what
`nox -l` shows) is a whole sentence; GPU sessions run in the current interpreter (venv_backend="none"), CPU sessions
build their own virtualenv, reused across runs; the CPU install takes PyTorch's CPU index only when it answers."""

from __future__ import annotations

import importlib.util
import urllib.error
import urllib.request
from pathlib import Path

import pytest

nox_registry = pytest.importorskip("nox.registry")

REPO = Path(__file__).resolve().parent.parent
GPU_SESSIONS = ("conformance-gpu", "sentinels-gpu", "perf", "preflight", "launch")
CPU_SESSIONS = ("tests", "conformance", "sentinels", "perf-cpu", "lint")


# The sessions whose docstrings this file's owners keep; `nox -l` shows each one's first line.
SUMMARY_LINE_SESSIONS = ("perf", "perf-cpu", "preflight", "launch", "lint", "sentinels", "sentinels-gpu")


@pytest.fixture(scope="module")
def noxfile():
    spec = importlib.util.spec_from_file_location("noxfile_under_test", REPO / "noxfile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # @nox.session registers each session in nox.registry
    return module


@pytest.fixture(scope="module")
def sessions(noxfile):
    return dict(nox_registry.get())


@pytest.mark.parametrize("name", GPU_SESSIONS + CPU_SESSIONS)
def test_session_exists_with_a_docstring(sessions, name):
    assert name in sessions, f"nox session {name!r} is missing from noxfile.py"
    assert (sessions[name].__doc__ or "").strip(), f"nox session {name!r} has no docstring (nox -l shows it)"


@pytest.mark.parametrize("name", GPU_SESSIONS)
def test_cuda_sessions_use_the_current_interpreter(sessions, name):
    assert sessions[name].venv_backend == "none"


@pytest.mark.parametrize("name", CPU_SESSIONS)
def test_cpu_sessions_build_a_virtualenv(sessions, name):
    assert sessions[name].venv_backend != "none"


@pytest.mark.parametrize("name", SUMMARY_LINE_SESSIONS)
def test_nox_list_shows_a_whole_sentence(sessions, name):
    first_line = sessions[name].__doc__.strip().splitlines()[0]
    assert first_line.endswith("."), f"`nox -l` cuts {name}'s docstring mid-sentence: {first_line!r}"


def test_virtualenvs_are_reused(noxfile):
    import nox

    assert nox.options.reuse_venv == "yes"


class FakeSession:
    def __init__(self):
        self.logged: list[str] = []
        self.installs: list[tuple] = []

    def log(self, message: str) -> None:
        self.logged.append(message)

    def install(self, *args, **kwargs) -> None:
        self.installs.append((args, kwargs))


def answer_with(monkeypatch, outcome):
    """urlopen that records each probe and raises `outcome` (an exception) or returns a closable response."""
    probes = []

    def urlopen(request, timeout):
        probes.append((request.full_url, request.get_method(), timeout))
        if isinstance(outcome, BaseException):
            raise outcome

        class Response:
            def close(self):
                pass
        return Response()

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    monkeypatch.setattr("sys.platform", "linux")
    return probes


def test_cpu_index_is_added_when_it_answers(noxfile, monkeypatch):
    probes = answer_with(monkeypatch, None)
    session = FakeSession()
    assert noxfile.torch_cpu_index(session) == ["--extra-index-url", "https://download.pytorch.org/whl/cpu"]
    assert probes == [("https://download.pytorch.org/whl/cpu/torch/", "HEAD", noxfile.INDEX_PROBE_TIMEOUT_S)]
    assert noxfile.INDEX_PROBE_TIMEOUT_S <= 5


def test_cpu_index_that_answers_with_an_error_status_still_counts(noxfile, monkeypatch):
    answer_with(monkeypatch, urllib.error.HTTPError("https://download.pytorch.org/whl/cpu/torch/", 405,
                                                    "Method Not Allowed", {}, None))
    assert noxfile.torch_cpu_index(FakeSession()) == ["--extra-index-url", "https://download.pytorch.org/whl/cpu"]


@pytest.mark.parametrize("failure", [urllib.error.URLError("Name or service not known"), TimeoutError("timed out"),
                                     ConnectionRefusedError("refused")])
def test_cpu_index_that_does_not_answer_is_left_out_and_said(noxfile, monkeypatch, failure):
    answer_with(monkeypatch, failure)
    session = FakeSession()
    assert noxfile.torch_cpu_index(session) == []
    assert len(session.logged) == 1 and "does not answer" in session.logged[0] and "CUDA build" in session.logged[0]


def test_cpu_index_is_not_probed_off_linux(noxfile, monkeypatch):
    probes = answer_with(monkeypatch, None)
    monkeypatch.setattr("sys.platform", "darwin")
    assert noxfile.torch_cpu_index(FakeSession()) == [] and probes == []


def test_cpu_install_pins_shows_progress_and_takes_the_index(noxfile, monkeypatch):
    answer_with(monkeypatch, None)
    session = FakeSession()
    noxfile.install_cpu(session, "dev,triton,plots")
    (args, kwargs), = session.installs
    assert args == ("--extra-index-url", "https://download.pytorch.org/whl/cpu", "-c", "constraints-cpu.txt", "-e",
                    ".[dev,triton,plots]")
    assert kwargs == {"silent": False}
    assert (REPO / "constraints-cpu.txt").read_text().count("torch==2.13.0") == 1
