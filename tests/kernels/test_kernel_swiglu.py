"""The MLP's fused path (sentinels.model.SwiGLU with fused=True: one matmul for gate and up, the activation on
sentinels/swiglu_kernels.py) against torch's ops (fused=False): the output and every gradient within
FlashAttention's error-ratio rule against an fp64 oracle, torch's ops in the same dtype as the low-precision
reference (in half precision its activation rounds twice, the kernel once).

Without CUDA the kernels run in Triton's interpreter on fp16 inputs (the interpreter truncates fp32 -> bf16 where the
GPU rounds to nearest even, so bf16 needs the GPU); with CUDA bf16 runs too, at a prod-125m layer's size.
"""

from __future__ import annotations

import pytest
import torch

from conformance.helpers import error_ratio
from sentinels.model import SwiGLU
from sentinels.swiglu_kernels import swiglu_backward, swiglu_forward

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
NAMES = ("out", "x", "gate", "up", "down")


def _twins(dim: int, hidden: int, seed: int, dtype: torch.dtype) -> tuple[SwiGLU, SwiGLU]:
    torch.manual_seed(seed)
    fused = SwiGLU(dim, hidden, fused=True)
    with torch.no_grad():
        for p in fused.parameters():
            p.mul_(8.0)  # pre-activations of order 1-3: every part of silu's curve
    plain = SwiGLU(dim, hidden, fused=False)
    plain.load_state_dict(fused.state_dict())
    return fused.to(DEVICE, dtype), plain.to(DEVICE, dtype)


def _run(mlp: SwiGLU, x: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    x = x.detach().requires_grad_(True)
    out = mlp(x)
    leaves = [x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
    return [out.detach(), *torch.autograd.grad(out, leaves, grad.to(out.dtype))]


NEEDS_GPU_ROUNDING = pytest.mark.skipif(not CUDA, reason="interpreter: fp32 -> bf16 truncates")
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=NEEDS_GPU_ROUNDING)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, dim, hidden", [
    (37, 24, 40),
    (2, 16, 1000),
    pytest.param(16384, 768, 2048, marks=pytest.mark.skipif(not CUDA, reason="a prod-125m layer's size: GPU")),
])
def test_fused_mlp_passes_the_error_ratio(rows, dim, hidden, dtype):
    """In every dtype against an fp64 oracle, torch's ops in the same dtype as the low-precision reference: in fp32
    the one matmul sums gate and up's input gradients in another order than the two matmuls and their sum."""
    fused, plain = _twins(dim, hidden, seed=rows, dtype=dtype)
    exact = SwiGLU(dim, hidden, fused=False).to(DEVICE, torch.float64)
    exact.load_state_dict(fused.state_dict())
    g = torch.Generator().manual_seed(2)
    x, grad = torch.randn(rows, dim, generator=g).to(DEVICE), torch.randn(rows, dim, generator=g).to(DEVICE)
    got, low = _run(fused, x.to(dtype), grad), _run(plain, x.to(dtype), grad)
    oracle = _run(exact, x.to(dtype).double(), grad.double())
    for name, a, b, c in zip(NAMES, got, low, oracle):
        assert a.dtype == dtype and torch.isfinite(a).all(), name
        assert error_ratio(a.double(), b.double(), c) <= 1.0, name


def test_activation_kernels_by_their_formulas():
    """The kernels alone on one gu of known values: silu(g) * u and its two halves' gradients, by the formulas."""
    g = torch.linspace(-6, 6, 30, dtype=torch.float64).view(3, 10)
    u = torch.linspace(2, -1, 30, dtype=torch.float64).view(3, 10)
    dout = torch.linspace(-1, 1.5, 30, dtype=torch.float64).view(3, 10)
    gu = torch.cat([g, u], 1).float().to(DEVICE)
    sig = torch.sigmoid(g)
    torch.testing.assert_close(swiglu_forward(gu).cpu().double(), g * sig * u, rtol=1e-6, atol=1e-6)
    want = torch.cat([dout * u * sig * (1 + g * (1 - sig)), dout * g * sig], 1)
    torch.testing.assert_close(swiglu_backward(gu, dout.float().to(DEVICE)).cpu().double(), want, rtol=1e-6, atol=1e-6)


def test_backward_keeps_the_matmuls_output_not_silu_of_the_gate():
    """What backward keeps: torch's ops keep x, g, silu(g), u and the product; the fused path x, [g, u] and the
    product, and the concatenated weight (a copy, not a parameter): silu(g) fewer, the weight's copy more."""
    from perf.train_memory import saved_storages

    rows, dim, hidden = 256, 32, 64
    fused, plain = _twins(dim, hidden, seed=3, dtype=torch.float32)
    x = torch.randn(rows, dim, device=DEVICE, requires_grad=True)

    def kept(mlp: SwiGLU) -> int:
        return sum(s["bytes"] for s in saved_storages(mlp, lambda: mlp(x).sum()))

    assert kept(fused) <= kept(plain) - rows * hidden * 4 + 2 * hidden * dim * 4, (kept(fused), kept(plain))


@pytest.mark.skipif(CUDA, reason="the error is for CPU tensors without the interpreter")
def test_fused_mlp_on_cpu_without_the_interpreter_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="SwiGLU: fused=True runs Triton kernels, which need CUDA tensors"):
        SwiGLU(8, 16, fused=True)(torch.randn(2, 8))
