"""Conformance suite setup: command-line options, shared fixtures, and the verdict plugin (verdict.py).

Options: --impl (what to check), --device (where its inputs live), --dtype (the low precision its
error-ratio checks run in), --preset / --set key=value / --config FILE (the NSAConfig conventions checked),
--report-dir (write <impl>-<device>.json/.md there), --baseline / --update-baseline (deterministic metrics),
--expect-baseline-verdicts (a report card: pass when verdicts and test counts equal the baseline's),
--require PROPERTY[,...] / --require-all (NOT COVERED fails the run), --properties-only (leave out the self-test,
which checks the suite rather than --impl).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conformance.adapters import load_impl
from conformance.conventions import ConventionError, checked_conventions
from conformance.precision import Precision, detect_precision
from conformance.strategies import CPU_SIZES, CUDA_SIZES, Envelope, current_sizes, use_sizes
from conformance.verdict import VerdictPlugin, run_info
from reference.config import PRESETS

LOW_PRECISION = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("nsa-conformance")
    group.addoption("--impl", action="store", default="reference",
                    help="implementation under test: reference | optimized | package.module:attr")
    group.addoption("--device", action="store", default="cpu", help="torch device for the inputs: cpu | cuda")
    group.addoption("--dtype", action="store", default="float32", choices=sorted(LOW_PRECISION),
                    help="low precision of the error-ratio checks (float64 checks always run too)")
    group.addoption("--preset", action="store", default=None, choices=sorted(PRESETS),
                    help="NSAConfig preset whose conventions are checked (default paper; sizes are drawn small)")
    group.addoption("--set", action="append", default=[], metavar="SWITCH=VALUE", dest="set_conventions",
                    help="change one convention switch of the preset (repeatable): phi, window_keys, "
                         "cmp_visibility, selection_score, group_reduce, e.g. --set phi=avg")
    group.addoption("--config", action="store", default=None, metavar="FILE",
                    help="a YAML/JSON file of conventions: optional 'preset' and switch: value lines (--set wins)")
    group.addoption("--report-dir", action="store", default=None,
                    help="write the verdict as <impl>-<device>[-<dtype>][-<preset>].json and .md here")
    group.addoption("--report-name", action="store", default=None, metavar="STEM",
                    help="file name (without .json/.md) of the report in --report-dir (default from impl, device, "
                         "dtype and conventions)")
    group.addoption("--baseline", action="store", default="reports/baselines/conformance.json",
                    help="baseline of deterministic metrics to compare with")
    group.addoption("--update-baseline", action="store_true", default=False,
                    help="write this run's metrics into --baseline")
    group.addoption("--expect-baseline-verdicts", action="store_true", default=False,
                    help="pass exactly when every property's verdict and test counts equal the --baseline entry's "
                         "(a third-party report card, its known FAILs included); any difference fails")
    group.addoption("--require", action="append", default=[], metavar="PROPERTY[,...]",
                    help="fail the run (exit 1) if a listed property ends NOT COVERED (name or module, e.g. "
                         "no_peeking or 'No peeking')")
    group.addoption("--require-all", action="store_true", default=False,
                    help="fail the run if any property ends NOT COVERED")
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
        impl = load_impl(config.getoption("--impl"))
        conventions = checked_conventions(config.getoption("--preset"), config.getoption("--config"),
                                          config.getoption("set_conventions"))
    except (ValueError, ConventionError) as exc:
        raise pytest.UsageError(str(exc)) from exc
    use_sizes(CUDA_SIZES if torch.device(config.getoption("--device")).type == "cuda" else CPU_SIZES)
    envelope = Envelope(conventions.config, impl.caps, current_sizes())
    outside = envelope.conventions_outside()
    if outside:
        fixes = " ".join(f"--set {name}={sorted(getattr(impl.caps, name))[0]}"
                         for name in (o.split("=")[0] for o in outside))
        raise pytest.UsageError(f"--impl {impl.spec}: the checked conventions are outside what it declares: "
                                f"{'; '.join(outside)}. Check its own conventions, e.g. with {fixes}")
    config.nsa_envelope = envelope
    config.nsa_precision = detect_precision(impl, envelope, torch.device(config.getoption("--device")))
    plugin = VerdictPlugin(config, run_info(config, impl, envelope, conventions, config.nsa_precision))
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
def envelope(request: pytest.FixtureRequest) -> Envelope:
    """What the tests may draw: the checked conventions (kept by strategies.configs; their sizes serve the Table 4
    check) inside the implementation's declared capabilities (strategies.Envelope)."""
    return request.config.nsa_envelope


@pytest.fixture(scope="session")
def precision(request: pytest.FixtureRequest) -> Precision:
    """The implementation's working precision (declared, or detected once at start), which judges float64 checks
    (conformance/precision.py)."""
    return request.config.nsa_precision


@pytest.fixture(scope="session")
def record_metric(request: pytest.FixtureRequest):
    """record_metric(name, value, kind="ratio"|"tolerance"|"count") for the verdict table and the baseline."""
    return request.config.pluginmanager.get_plugin("nsa-verdict").recorder
