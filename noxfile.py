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
