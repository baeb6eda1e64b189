"""Fixtures shared by the unit tests."""

import pytest
import torch


@pytest.fixture
def single_torch_thread():
    """Run the test with one intra-op torch thread and restore the count afterwards: these tests run hundreds of
    tiny ops, where threads on a shared 2-core machine only add waits (10-70x slower, measured)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
