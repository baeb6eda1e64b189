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


@pytest.fixture
def saved_under_bf16_autocast():
    """A function run(fn) -> (list of the tensors autograd saved while fn ran under CPU bf16 autocast, one per
    storage; copies_of(x, dtype=bf16) -> those holding exactly x cast to dtype): what backward keeps of a layer."""
    def run(fn):
        saved = {}

        def keep(t):
            saved[t.untyped_storage().data_ptr()] = t
            return t

        with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            fn()
        tensors = list(saved.values())

        def copies_of(x, dtype=torch.bfloat16):
            x_cast = x.detach().to(dtype).reshape(-1)
            return [t for t in tensors if t.dtype == dtype and t.numel() == x_cast.numel()
                    and torch.equal(t.detach().reshape(-1), x_cast)]
        return tensors, copies_of
    return run
