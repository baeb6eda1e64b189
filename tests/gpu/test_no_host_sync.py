"""nsa_forward on the kernel path, forward and backward, launches its kernels without waiting for the device: under
torch.cuda.set_sync_debug_mode("error") any operation that synchronizes the host with the GPU (.item(), a copy to
the host, nonzero, torch.bincount...) raises. A sync per layer stops the host from queueing the next layer's
kernels while the GPU works, so a training step costs host time plus device time instead of the larger of them.

The first call of each shape autotunes and compiles (which syncs), so it runs before the checked one. Packed
batches (cu_seqlens) still read their document count back (perf/NOTES.md) and are not checked.
"""

from __future__ import annotations

import pytest
import torch

import optimized
from conformance.helpers import make_inputs
from reference.config import NSAConfig

PROD_125M = NSAConfig(cmp_block=32, cmp_stride=16, sel_block=64, n_sel=16, n_init=1, n_local=2, window=512, n_heads=12,
                      n_kv_heads=2, head_dim_qk=64, head_dim_v=64, phi="avg")


@pytest.mark.parametrize("T", [2048, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernel_path_does_not_sync(T, dtype):
    x = make_inputs(PROD_125M, T=T, B=1, seed=0, dtype=dtype, device="cuda")
    inputs = [x.q, x.gates, *(t for branch in (x.kv.cmp, x.kv.slc, x.kv.win) for t in (branch.k, branch.v))]
    for t in inputs:
        t.requires_grad_(True)
    grad_o = torch.randn(x.q.shape[:3] + (PROD_125M.head_dim_v,), dtype=dtype, device="cuda")

    def step():
        out = optimized.nsa_forward(x.q, x.kv, x.gates, PROD_125M, x.phi)
        return out, torch.autograd.grad(out.o, inputs, grad_o)

    step()  # autotune and compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, grads = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert bool(torch.isfinite(out.o).all()) and all(bool(torch.isfinite(g).all()) for g in grads)
