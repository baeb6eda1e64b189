"""GPU tests of our own kernels and of the optimized path's parity (tests/gpu): every test here is marked `gpu` and
skipped without a CUDA device.

Option: --gpu-report-dir DIR (default reports/parity; registered in the root conftest.py, so that every pytest
command line of the repository accepts it): where each module writes its report (<name>.json and .md, merged over
pytest-xdist workers by conformance.helpers.finish_gpu_report); the tables are printed either way, e.g.
`python -m pytest tests/gpu -n 6 --gpu-report-dir gpu-reports` or
`python -m pytest -m gpu --gpu-report-dir gpu-reports`.

Under pytest-xdist each worker gets its share of the CPU cores for torch's CPU threads (worker_threads): the float64
loop-reference oracles run on the CPU, and N workers each starting one thread per core oversubscribe it N times.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def worker_threads(cores: int, workers: int) -> int:
    """torch CPU threads for one of `workers` pytest-xdist workers sharing `cores` cores (at least 1)."""
    return max(1, cores // max(1, workers))


def pytest_configure(config: pytest.Config) -> None:
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(worker_threads(cores, int(workers)))


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
