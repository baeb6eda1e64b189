"""The model's RMSNorm on CUDA, on its add + RMSNorm Triton kernels by default (sentinels/residual_norm_kernels.py):
it matches the expression it replaces to fp32 rounding and keeps only its input and one fp32 value per row for
backward (the expression also kept an fp32 copy of the normalized x and the per-row scale); with a residual delta
under autocast, the sum equals torch's add exactly and the normalized sum comes out in bf16 as torch's norm and the
matmul's cast would round it."""

from __future__ import annotations

import torch

from perf.train_memory import saved_storages
from sentinels.model import RMSNorm


def _by_definition(x, weight, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def _norm(dim: int, fused: bool | None = None) -> RMSNorm:
    norm = RMSNorm(dim, 1e-6, fused=fused).cuda()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=torch.Generator().manual_seed(0)))
    return norm


def test_rms_norm_matches_its_definition_and_keeps_x_and_one_value_per_row():
    rows, dim = 4096, 768
    norm = _norm(dim)
    assert norm._on_kernels(torch.empty(1, device="cuda"), None)  # the kernels are the default on CUDA
    x = torch.randn(rows, dim, device="cuda", requires_grad=True)
    grad = torch.randn(rows, dim, device="cuda")
    got = norm(x)
    want = _by_definition(x, norm.weight, 1e-6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(torch.autograd.grad(got, [x, norm.weight], grad),
                    torch.autograd.grad(want, [x, norm.weight], grad)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-3)

    def saved_bytes(forward) -> int:  # the weight, a parameter, is left out
        return sum(s["bytes"] for s in saved_storages(norm, lambda: forward().float().sum()))

    kept = saved_bytes(lambda: norm(x))
    assert kept <= x.numel() * 4 + rows * 4, kept
    assert saved_bytes(lambda: _by_definition(x, norm.weight, 1e-6)) > 2 * x.numel() * 4  # what it replaced kept


def test_residual_add_and_norm_under_autocast_match_torchs_add_norm_and_cast():
    rows, dim = 16384, 768
    fused, plain = _norm(dim), _norm(dim, fused=False)
    x = torch.randn(rows, dim, device="cuda", requires_grad=True)
    delta = torch.randn(rows, dim, device="cuda").bfloat16().requires_grad_(True)
    grad_h = torch.randn(rows, dim, device="cuda")
    grad_y = torch.randn(rows, dim, device="cuda").bfloat16()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        h, y = fused(x, delta)
        h_torch, y_torch = plain(x, delta)
        y_torch = y_torch.to(torch.bfloat16)  # what the next matmul under autocast casts it to
    assert h.dtype == torch.float32 and y.dtype == torch.bfloat16
    assert torch.equal(h, h_torch)
    # the same fp32 value rounded to nearest even: equal but where the mean's summation order moved it across a
    # rounding boundary, and then by one ulp
    off = y != y_torch
    assert off.float().mean().item() < 1e-3
    ulp = torch.exp2(torch.floor(torch.log2(y_torch[off].float().abs())) - 7)
    assert ((y[off].float() - y_torch[off].float()).abs() <= ulp).all()
    grads = [torch.autograd.grad((h_, y_), [x, delta, norm.weight], (grad_h, grad_y))
             for h_, y_, norm in ((h, y, fused), (h_torch, y_torch, plain))]
    assert grads[0][0].dtype == torch.float32 and grads[0][1].dtype == torch.bfloat16
    for name, a, b in zip(("dx", "ddelta", "dweight"), *grads):
        torch.testing.assert_close(a.float(), b.float(), rtol=2**-7 if name == "ddelta" else 1e-4, atol=1e-3,
                                   msg=name)
