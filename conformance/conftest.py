"""Conformance suite setup: command-line options, shared fixtures, and the verdict plugin (verdict.py).

Options: --impl (what to check), --device (where its inputs live), --dtype (the low precision its
error-ratio checks run in), --preset (the NSAConfig conventions checked), --report-dir (write
<impl>-<device>.json/.md there), --baseline / --update-baseline (deterministic metrics), --properties-only
(leave out the self-test, which checks the suite rather than --impl).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conformance.adapters import load_impl
from conformance.strategies import CPU_SIZES, CUDA_SIZES, use_sizes
from conformance.verdict import VerdictPlugin, run_info
from reference.config import PRESETS, NSAConfig

LOW_PRECISION = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("nsa-conformance")
    group.addoption("--impl", action="store", default="reference",
                    help="implementation under test: reference | optimized | package.module:attr")
    group.addoption("--device", action="store", default="cpu", help="torch device for the inputs: cpu | cuda")
    group.addoption("--dtype", action="store", default="float32", choices=sorted(LOW_PRECISION),
                    help="low precision of the error-ratio checks (float64 checks always run too)")
    group.addoption("--preset", action="store", default="paper", choices=sorted(PRESETS),
                    help="NSAConfig preset whose conventions are checked (sizes are drawn small)")
    group.addoption("--report-dir", action="store", default=None,
                    help="write the verdict as <impl>-<device>[-<dtype>][-<preset>].json and .md here")
    group.addoption("--baseline", action="store", default="reports/baselines/conformance.json",
                    help="baseline of deterministic metrics to compare with")
    group.addoption("--update-baseline", action="store_true", default=False,
                    help="write this run's metrics into --baseline")
    group.addoption("--properties-only", action="store_true", default=False,
                    help="run only the property modules (those declaring PROPERTY), not the self-test")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """--properties-only: do not even import test modules that are not properties (the self-test), so their import
    errors cannot break a verdict run."""
    if not config.getoption("--properties-only"):
        return None
    if collection_path.name == "selftest" and collection_path.is_dir():
        return True
    if collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        declares = any(line.startswith("PROPERTY = ") for line in collection_path.read_text().splitlines())
        return None if declares else True
    return None


def pytest_configure(config: pytest.Config) -> None:
    try:
        name = load_impl(config.getoption("--impl")).name
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from exc
    use_sizes(CUDA_SIZES if torch.device(config.getoption("--device")).type == "cuda" else CPU_SIZES)
    plugin = VerdictPlugin(config, run_info(config, name))
    config.pluginmanager.register(plugin, "nsa-verdict")


@pytest.fixture(scope="session")
def impl(request: pytest.FixtureRequest):
    return load_impl(request.config.getoption("--impl"))


@pytest.fixture(scope="session")
def device(request: pytest.FixtureRequest) -> torch.device:
    dev = torch.device(request.config.getoption("--device"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        pytest.exit("--device cuda was asked for but no CUDA device is visible", returncode=2)
    return dev


@pytest.fixture(scope="session")
def low_dtype(request: pytest.FixtureRequest) -> torch.dtype:
    """The low precision in which error ratios are measured (FlashAttention's rule, helpers.error_ratio)."""
    return LOW_PRECISION[request.config.getoption("--dtype")]


@pytest.fixture(scope="session")
def preset(request: pytest.FixtureRequest) -> NSAConfig:
    """The checked preset: its conventions are kept by strategies.configs; its sizes by the Table 4 check."""
    return NSAConfig.preset(request.config.getoption("--preset"))


@pytest.fixture(scope="session")
def record_metric(request: pytest.FixtureRequest):
    """record_metric(name, value, kind="ratio"|"count") for the verdict table and the baseline."""
    return request.config.pluginmanager.get_plugin("nsa-verdict").recorder
