"""Eq. 7's MLP on its kernels (optimized/kernels/compression_mlp.py) against phi_mlp over the strided blocks
(optimized.compression, the torch path's): phi and the gradients of x and of every weight, for every m = l / d and
rows whose last chunk is partial or in no complete block.

Without CUDA the kernels run in Triton's interpreter on fp32 inputs (exact fp32 dots): they must match an fp64
oracle to fp32 rounding. With CUDA, bf16 under autocast too (the training setup): every output must pass the
error-ratio rule against the fp64 oracle, with phi_mlp over the blocks under the same autocast as the low-precision
reference.
"""

from __future__ import annotations

import pytest
import torch

from conformance.helpers import error_ratio, rel_error
from optimized import compression
from optimized.kernels.compression_mlp import phi_mlp_kernel
from reference.config import NSAConfig
from reference.contract import PhiWeights

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
NAMES = ("phi", "x", "pos", "w1", "b1", "w2", "b2")


def _cfg(l: int, d: int, dim: int) -> NSAConfig:
    return NSAConfig(cmp_block=l, cmp_stride=d, sel_block=max(l, 8), n_sel=2, n_init=0, n_local=1, window=8,
                     n_heads=4, n_kv_heads=2, head_dim_qk=dim, head_dim_v=dim, phi="mlp")


def _grads(fn, x, w, d_out) -> list[torch.Tensor]:
    leaves = [x, w.pos, w.w1, w.b1, w.w2, w.b2]
    out = fn(x, w)
    grads = torch.autograd.grad(out, leaves, d_out.to(out.dtype))
    return [out.detach().double()] + [g.double() for g in grads]


def _weights(cfg: NSAConfig, dim: int, hidden: int, seed: int, dtype: torch.dtype) -> PhiWeights:
    w = PhiWeights.init(cfg, hidden, generator=torch.Generator().manual_seed(seed)).k
    return type(w)(*(t.to(DEVICE, dtype).requires_grad_(True) for t in (w.pos, w.w1, w.b1, w.w2, w.b2)))


def _blocks_phi(x, w, cfg):
    return compression.phi_mlp(compression.block_windows(x, cfg), w)


@pytest.mark.parametrize("l, d", [(8, 4), (6, 2), (4, 4), (12, 4)], ids=["m2", "m3", "m1", "m3-d4"])
@pytest.mark.parametrize("T", [12, 31, 70], ids=["T12", "T31", "T70"])
def test_fp32_kernels_give_the_blocks_phi_and_its_gradients(l: int, d: int, T: int) -> None:
    dim, hidden = 6, 5  # neither a power of two: the kernels' padded tiles are masked
    cfg = _cfg(l, d, dim)
    g = torch.Generator().manual_seed(l * 100 + d * 10 + T)
    x = torch.randn(2, T, 3, dim, generator=g).to(DEVICE).requires_grad_(True)
    w = _weights(cfg, dim, hidden, seed=T, dtype=torch.float32)
    d_out = torch.randn(2, (T - l) // d + 1, 3, dim, generator=g).to(DEVICE)
    got = _grads(lambda x, w: phi_mlp_kernel(x, w, l, d), x, w, d_out)
    x64 = x.detach().double().requires_grad_(True)
    w64 = type(w)(*(t.detach().double().requires_grad_(True) for t in (w.pos, w.w1, w.b1, w.w2, w.b2)))
    want = _grads(lambda x, w: _blocks_phi(x, w, cfg), x64, w64, d_out.double())
    assert got[0].shape == want[0].shape
    for name, a, b in zip(NAMES, got, want):
        assert rel_error(a, b) < 1e-5, name


def test_rows_in_no_complete_block_get_no_gradient() -> None:
    """T = 30, l = 8, d = 4: blocks end at row 27, rows 28-29 are in none; a kernel that wrote them from a
    neighbouring block would fail here even where the oracle's comparison is loose."""
    cfg = _cfg(8, 4, 6)
    x = torch.randn(1, 30, 2, 6).to(DEVICE).requires_grad_(True)
    w = _weights(cfg, 6, 5, seed=1, dtype=torch.float32)
    phi_mlp_kernel(x, w, 8, 4).square().sum().backward()
    assert torch.equal(x.grad[:, 28:], torch.zeros_like(x.grad[:, 28:]))
    assert (x.grad[:, :28].abs().sum(dim=(-1, -2)) > 0).all()


def test_no_complete_block_gives_an_empty_phi() -> None:
    cfg = _cfg(8, 4, 6)
    x = torch.randn(1, 6, 2, 6).to(DEVICE)
    assert phi_mlp_kernel(x, _weights(cfg, 6, 5, seed=0, dtype=torch.float32), 8, 4).shape == (1, 0, 2, 6)


@pytest.mark.skipif(not CUDA, reason="bf16 under autocast: GPU (the interpreter truncates fp32 -> bf16)")
@pytest.mark.parametrize("T, dim, hidden", [(2048, 64, 64), (4096, 128, 128), (999, 64, 32)])
def test_bf16_under_autocast_passes_the_error_ratio(T: int, dim: int, hidden: int) -> None:
    cfg = _cfg(32, 16, dim)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(2, T, 2, dim, generator=g).to(DEVICE, torch.bfloat16).requires_grad_(True)
    w = _weights(cfg, dim, hidden, seed=T, dtype=torch.float32)
    d_out = torch.randn(2, (T - 32) // 16 + 1, 2, dim, generator=g).to(DEVICE)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = _grads(lambda x, w: phi_mlp_kernel(x, w, 32, 16), x, w, d_out)
        low = _grads(lambda x, w: _blocks_phi(x, w, cfg), x, w, d_out)
    x64 = x.detach().double().requires_grad_(True)
    w64 = type(w)(*(t.detach().double().requires_grad_(True) for t in (w.pos, w.w1, w.b1, w.w2, w.b2)))
    exact = _grads(lambda x, w: _blocks_phi(x, w, cfg), x64, w64, d_out.double())
    for name, a, ref, oracle in zip(NAMES, got, low, exact):
        assert torch.isfinite(a).all(), name
        assert error_ratio(a, ref, oracle) <= 1.0, name
