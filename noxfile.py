"""Nox sessions: how users run the harness. `python -m nox -l` lists them with their docstrings.

CPU sessions build their own virtualenv with the CPU build of torch pinned by constraints-cpu.txt.
"""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "virtualenv"
nox.options.sessions = ["tests"]

CPU_CONSTRAINTS = "constraints-cpu.txt"


def install_cpu(session: nox.Session, extras: str = "dev,triton") -> None:
    """Editable install of the project with pinned CPU torch/triton."""
    session.install("-c", CPU_CONSTRAINTS, "-e", f".[{extras}]")


@nox.session
def tests(session: nox.Session) -> None:
    """Unit tests and the conformance suite on CPU (the CI command)."""
    install_cpu(session)
    session.run("pytest", "-q", *session.posargs)


@nox.session
def conformance(session: nox.Session) -> None:
    """Main job: run the conformance properties against --impl (CPU), print the verdict, write reports/conformance/."""
    install_cpu(session)
    session.run("pytest", "-q", "conformance", *session.posargs)


@nox.session(venv_backend="none")
def perf(session: nox.Session) -> None:
    """GPU benchmark (issue 8) with the interpreter running nox, nothing installed: NSA stages and layer vs SDPA
    at 8k-128k, CSV/JSON/plots in reports/perf/, gate on reports/baselines/perf-<gpu>.json (exit 1 on a
    regression). Posargs go to `python -m perf run`, e.g. `-- --update-baseline` or `-- --seq-lens 64k`."""
    import sys

    session.run(sys.executable, "-m", "perf", "run", "--device", "cuda", "--compare-baseline", *session.posargs,
                external=True)


@nox.session(name="perf-cpu")
def perf_cpu(session: nox.Session) -> None:
    """The benchmark runner on tiny CPU shapes end to end (run, CSV/plots/README, baseline write + compare) so it
    cannot rot; writes only under the session's tmp folder."""
    install_cpu(session, "dev,triton,plots")
    tmp = session.create_tmp()
    session.run("python", "-m", "perf", "run", "--device", "cpu", "--preset", "tiny", "--out", f"{tmp}/perf",
                "--readme", f"{tmp}/README.md", "--update-baseline", "--baseline-dir", f"{tmp}/baselines",
                *session.posargs)
    session.run("python", "-m", "perf", "compare", "--results", f"{tmp}/perf/results.csv", "--baseline",
                f"{tmp}/baselines")
