"""Conformance suite setup: the --impl option and shared fixtures."""

from __future__ import annotations

import pytest
import torch

from conformance.adapters import load_impl


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("nsa-conformance")
    group.addoption("--impl", action="store", default="reference",
                    help="implementation under test: reference | optimized | package.module:attr")
    group.addoption("--device", action="store", default="cpu", help="torch device for the inputs: cpu | cuda")


@pytest.fixture(scope="session")
def impl(request: pytest.FixtureRequest):
    return load_impl(request.config.getoption("--impl"))


@pytest.fixture(scope="session")
def device(request: pytest.FixtureRequest) -> torch.device:
    dev = torch.device(request.config.getoption("--device"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        pytest.exit("--device cuda was asked for but no CUDA device is visible", returncode=2)
    return dev
