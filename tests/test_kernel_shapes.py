"""Group sizes 1-64 and head dims 64/128/192 run on the kernels (Triton's interpreter, tiny T): every prefill kernel,
forward and backward, against the torch path on the same fp32 inputs, and the lean decode step against the
torch decode. A group of fewer than 16 heads fills a 16-row head tile with masked rows (tl.dot needs 16), a head
dim that is not a power of two (192) is padded to the next one (256) with masked columns; optimized.dispatch picks
the kernels for all of them (tests/test_dispatch.py), so none falls back to the torch path.
"""

from __future__ import annotations

import pytest
import torch

import optimized
from conformance.helpers import make_inputs, max_abs_error
from optimized.decode import NSADecodeCache
from reference.config import NSAConfig
from reference.contract import KV, BranchKV

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on CPU the kernels run in Triton's interpreter
SHAPES = [(1, 128), (3, 192), (6, 64), (16, 192), (32, 128), (64, 192)]  # (query heads per KV group, head dim)


def config(group: int, head_dim: int) -> NSAConfig:
    return NSAConfig(cmp_block=4, cmp_stride=2, sel_block=8, n_sel=3, window=5, n_heads=group, n_kv_heads=1,
                     head_dim_qk=head_dim, head_dim_v=head_dim, phi="avg")


@pytest.mark.parametrize("group, head_dim", SHAPES, ids=[f"h{g}-d{d}" for g, d in SHAPES])
def test_prefill_kernels_take_the_shape(group: int, head_dim: int) -> None:
    cfg = config(group, head_dim)
    x = make_inputs(cfg, 20, seed=group, dtype=torch.float32, device=DEVICE).to(requires_grad=True)
    want = optimized.nsa_forward(x.q, x.kv, x.gates, cfg, backend="torch", range_backend="torch")
    got = optimized.nsa_forward(x.q, x.kv, x.gates, cfg, backend="triton", range_backend="triton")
    assert torch.equal(got.indices, want.indices)
    for name in ("o", "o_cmp", "o_slc", "o_win"):
        assert max_abs_error(getattr(got, name), getattr(want, name)) < 1e-5, name
    for name in ("cmp", "slc", "win"):
        assert torch.equal(getattr(got.reads, name), getattr(want.reads, name)), name
    weight = torch.randn(want.o.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    leaves = [x.q, x.kv.cmp.k, x.kv.cmp.v, x.kv.slc.k, x.kv.slc.v, x.kv.win.k, x.kv.win.v, x.gates]
    grads_want = torch.autograd.grad((want.o * weight).sum(), leaves)
    grads_got = torch.autograd.grad((got.o * weight).sum(), leaves)
    for i, (g_got, g_want) in enumerate(zip(grads_got, grads_want)):
        assert max_abs_error(g_got, g_want) < 5e-5, f"gradient of input {i}"


@pytest.mark.parametrize("group, head_dim", [(3, 192), (64, 64)], ids=["h3-d192", "h64-d64"])
def test_lean_decode_step_takes_the_shape(group: int, head_dim: int) -> None:
    cfg = config(group, head_dim)
    x = make_inputs(cfg, 24, seed=group, dtype=torch.float32, device=DEVICE)

    def tokens(start: int, stop: int) -> BranchKV:
        return BranchKV(*(KV(b.k[:, start:stop], b.v[:, start:stop]) for b in (x.kv.cmp, x.kv.slc, x.kv.win)))

    outs = {}
    for backend in ("triton", "torch"):
        cache = NSADecodeCache(cfg, 1, 24, device=DEVICE, backend=backend)
        assert cache.uses_lean_step() == (backend == "triton")
        cache.fill(tokens(0, 21))
        outs[backend] = [cache.step(x.q[:, t:t + 1], tokens(t, t + 1), x.gates[:, t:t + 1]) for t in (21, 22, 23)]
    for got, want in zip(outs["triton"], outs["torch"]):
        assert torch.equal(got.indices, want.indices)
        assert max_abs_error(got.o, want.o) < 1e-5
