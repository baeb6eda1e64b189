"""The residual add + RMSNorm kernels (sentinels/residual_norm_kernels.py, through sentinels.model.RMSNorm with
fused=True) against torch's add and rms_norm (fused=False): h, the normalized h and every gradient (x, delta, the
weight) in fp32 to fp32 rounding; a bf16 delta and the autocast output within one bf16 ulp of torch's rounding
(the interpreter truncates fp32 -> bf16 where the GPU rounds to nearest even). Row counts that are not a multiple of
the kernels' row tile and widths that are not a power of two, so the masks are exercised."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from sentinels.model import RMSNorm
from sentinels.residual_norm_kernels import add_rms_norm_forward

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def _norms(dim: int, seed: int) -> tuple[RMSNorm, RMSNorm]:
    """Two norms with the same random weight: the kernels' and torch's."""
    weight = torch.randn(dim, generator=torch.Generator().manual_seed(seed))
    pair = []
    for fused in (True, False):
        norm = RMSNorm(dim, 1e-6, fused=fused).to(DEVICE)
        with torch.no_grad():
            norm.weight.copy_(weight)
        pair.append(norm)
    return pair[0], pair[1]


def _leaf(shape, dtype, seed: int, scale: float = 1.0) -> Tensor:
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale
    return t.to(DEVICE, dtype).requires_grad_(True)


def _bf16_ulp(t: Tensor) -> Tensor:
    """The spacing of bf16 values at each element's magnitude (8 bits of significand)."""
    magnitude = t.detach().double().abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    return torch.exp2(torch.floor(torch.log2(magnitude)) - 7)


def _within(got: Tensor, want: Tensor, name: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, name
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6, msg=name)
    else:  # one bf16 ulp: a truncation against a rounding of the same fp32 value (or the GPU's rounding)
        excess = (got.double() - want.double()).abs() - _bf16_ulp(want)
        assert excess.max().item() <= 1e-12, f"{name}: {excess.max().item()}"


@pytest.mark.parametrize("delta_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [96, 40])
def test_add_rms_norm_kernels_equal_torch(delta_dtype, dim):
    fused, plain = _norms(dim, seed=1)
    shape = (2, 19, dim)  # 38 rows: not a multiple of the 4-row tile
    x = _leaf(shape, torch.float32, seed=2, scale=3.0)
    delta = None if delta_dtype is None else _leaf(shape, delta_dtype, seed=3)
    grad_y = torch.randn(shape, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    grad_h = torch.randn(shape, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    leaves = [x] + ([] if delta is None else [delta])
    results = []
    for norm in (fused, plain):
        out = norm(*leaves)
        outs = (out,) if delta is None else out
        grads = (grad_y,) if delta is None else (grad_h, grad_y)
        results.append((*outs, *torch.autograd.grad(outs, leaves + [norm.weight], grads)))
    names = (["y"] if delta is None else ["h", "y"]) + ["dx"] + ([] if delta is None else ["ddelta"]) + ["dweight"]
    for name, got, want in zip(names, *results):
        _within(got, want, name)


def test_only_h_read_later_sends_h_gradient_to_both_inputs():
    """When only h carries a gradient (nothing read the normalized h), x and delta get it unchanged, and the weight
    gets zero."""
    fused, _ = _norms(40, seed=6)
    x, delta = _leaf((5, 40), torch.float32, seed=7), _leaf((5, 40), torch.float32, seed=8)
    h, _ = fused(x, delta)
    grad_h = torch.randn(5, 40, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    dx, ddelta, dweight = torch.autograd.grad(h, [x, delta, fused.weight], grad_h)
    assert torch.equal(dx, grad_h) and torch.equal(ddelta, grad_h)
    assert torch.equal(dweight, torch.zeros_like(dweight))


def test_under_autocast_the_normalized_h_comes_out_in_the_autocast_dtype():
    """Under autocast the kernels write the normalized h in the autocast dtype (the cast the next matmul would
    make), h itself in the stream's dtype; torch's path returns fp32 for the matmul to cast."""
    fused, plain = _norms(96, seed=10)
    x, delta = _leaf((3, 7, 96), torch.float32, seed=11), _leaf((3, 7, 96), torch.bfloat16, seed=12)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        h, y = fused(x, delta)
        h_torch, y_torch = plain(x, delta)
        alone = fused(x)
    assert h.dtype == torch.float32 and y.dtype == torch.bfloat16 and alone.dtype == torch.bfloat16
    assert y_torch.dtype == torch.float32
    _within(h, h_torch, "h")
    _within(y, y_torch.to(torch.bfloat16), "y")
    _within(alone, plain(x).to(torch.bfloat16), "y without delta")


def test_bf16_stream_is_rounded_before_the_norm_reads_it():
    """A bf16 stream (FSDP gathers bf16 parameters, so blocks add in bf16): h is x + delta rounded to bf16, and the
    norm normalizes that rounded h, as torch's add and norm do (seen to fp32 rounding with the output in fp32)."""
    fused, plain = _norms(40, seed=13)
    x, delta = _leaf((6, 40), torch.bfloat16, seed=14), _leaf((6, 40), torch.bfloat16, seed=15)
    (h, y), (h_torch, _) = fused(x, delta), plain(x, delta)
    _within(h, h_torch, "h")
    _within(y, plain(h.detach()), "y")
    h, y32, _ = add_rms_norm_forward(x.detach(), delta.detach(), fused.weight.detach(), 1e-6, torch.float32)
    want = torch.nn.functional.rms_norm(h.float(), (40,), fused.weight.detach(), 1e-6)
    _within(y32, want, "y in fp32")


@pytest.mark.skipif(CUDA, reason="the error is for CPU tensors without the interpreter")
def test_fused_norm_on_cpu_without_the_interpreter_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="RMSNorm: fused=True runs Triton kernels, which need CUDA tensors"):
        RMSNorm(8, 1e-6, fused=True)(torch.randn(2, 8))
