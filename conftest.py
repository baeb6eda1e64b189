"""Root pytest setup shared by tests/ and conformance/.

TRITON_INTERPRET must be set before any Triton kernel is defined, so it is decided here, before the
test modules import optimized.kernels: with no CUDA device the kernels run in Triton's interpreter.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, Phase, settings  # noqa: E402

settings.register_profile(
    "ci", max_examples=12, deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# ci without shrinking: a failing test reports the first failing draw instead of a minimal one. For report cards
# of libraries whose kernels are compiled and autotuned anew for every shape (each shrink step is a new shape:
# conformance/cards.py).
settings.register_profile(
    "ci-no-shrink", parent=settings.get_profile("ci"),
    phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.target),
)
settings.register_profile(
    "thorough", max_examples=300, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_addoption(parser: pytest.Parser) -> None:
    # Here rather than in tests/gpu/conftest.py: pytest registers only the options of the conftest files it loads
    # before collecting, so `pytest -m gpu` (no path) would refuse an option that lives under tests/gpu.
    parser.getgroup("nsa-gpu").addoption(
        "--gpu-report-dir", action="store", default="reports/parity",
        help="where the GPU tests (tests/gpu) write their JSON and markdown reports (default reports/parity)")


@pytest.fixture
def poisoned_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.empty returns NaN-filled float tensors, so an output element a kernel never writes stays NaN (the
    kernel tests ask for it)."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        if out.is_floating_point():
            out.fill_(float("nan"))
        return out

    monkeypatch.setattr(torch, "empty", empty)
