"""The model's RMSNorm on CUDA: torch's fused rms_norm, which matches the expression it replaces to fp32 rounding
and keeps only x and one fp32 value per row for backward (the expression also kept an fp32 copy of the normalized
x and the per-row scale)."""

from __future__ import annotations

import torch

from perf.train_memory import saved_storages
from sentinels.model import RMSNorm


def _by_definition(x, weight, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def test_rms_norm_matches_its_definition_and_keeps_x_and_one_value_per_row():
    rows, dim = 4096, 768
    norm = RMSNorm(dim, 1e-6).cuda()
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(rows, dim, device="cuda", requires_grad=True)
    grad = torch.randn(rows, dim, device="cuda")
    got = norm(x)
    want = _by_definition(x, norm.weight, 1e-6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(torch.autograd.grad(got, [x, norm.weight], grad),
                    torch.autograd.grad(want, [x, norm.weight], grad)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-3)

    def saved_bytes(forward) -> int:  # the weight, a parameter, is left out
        return sum(s["bytes"] for s in saved_storages(norm, lambda: forward().sum()))

    kept = saved_bytes(lambda: norm(x))
    assert kept <= x.numel() * 4 + rows * 4, kept
    assert saved_bytes(lambda: _by_definition(x, norm.weight, 1e-6)) > 2 * x.numel() * 4  # what it replaced kept
