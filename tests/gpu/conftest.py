"""GPU tests of our own kernels and of the optimized path's parity (tests/gpu): every test here is marked `gpu` and
skipped without a CUDA device.

Option: --gpu-report-dir DIR (default reports/parity): where each module writes its report (<name>.json and .md,
merged over pytest-xdist workers by conformance.helpers.finish_gpu_report); the tables are printed either way.
Pass it with these paths on the command line, e.g. `python -m pytest tests/gpu -n 6 --gpu-report-dir /tmp/gpu`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
DEFAULT_REPORT_DIR = "reports/parity"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("nsa-gpu").addoption(
        "--gpu-report-dir", action="store", default=DEFAULT_REPORT_DIR,
        help=f"where the tests/gpu modules write their JSON and markdown reports (default {DEFAULT_REPORT_DIR})")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)


@pytest.fixture(scope="session")
def gpu_report_dir(request: pytest.FixtureRequest) -> Path:
    return Path(request.config.getoption("--gpu-report-dir"))
