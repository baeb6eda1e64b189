"""GPU tests of our own kernels and of the optimized path's parity (tests/gpu): every test here is marked `gpu` and
skipped without a CUDA device.

Option: --gpu-report-dir DIR (default reports/parity; registered in the root conftest.py, so that every pytest
command line of the repository accepts it): where each module writes its report (<name>.json and .md, merged over
pytest-xdist workers by conformance.helpers.finish_gpu_report); the tables are printed either way, e.g.
`python -m pytest tests/gpu -n 6 --gpu-report-dir gpu-reports` or `python -m pytest -m gpu --gpu-report-dir gpu-reports`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent

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
