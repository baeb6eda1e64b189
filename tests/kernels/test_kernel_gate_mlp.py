"""The gate MLP's kernel path (optimized/kernels/gate_mlp.py) against the torch expression it replaces,
sigmoid(Linear(SiLU(Linear(x)))) under autocast: the gates bitwise (the forward runs the expression's ops), every
gradient (x, both weights, both biases) within the error-ratio rule against an fp64 oracle of the same expression,
with the torch expression in the kernels' dtype as the low-precision reference.

Without CUDA the kernels run in Triton's interpreter on fp16 inputs (the interpreter truncates fp32 -> bf16 where the
GPU rounds to nearest even, so bf16 needs the GPU); with CUDA bf16 runs too, at a prod-125m layer's size.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conformance.helpers import error_ratio
from optimized.dispatch import gate_mlp_on_kernels
from optimized.kernels.gate_mlp import gate_mlp_kernel

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_gpu_rounding = pytest.mark.skipif(not CUDA, reason="the interpreter truncates fp32 -> bf16 (module docstring)")


def gate_mlp(n_in: int, n_hidden: int, n_out: int, seed: int) -> nn.Sequential:
    """The reference module's gate MLP with random weights (its last layer starts at zero, which would hide W2)."""
    torch.manual_seed(seed)
    mlp = nn.Sequential(nn.Linear(n_in, n_hidden), nn.SiLU(), nn.Linear(n_hidden, n_out))
    with torch.no_grad():
        for p in mlp.parameters():
            p.mul_(3.0)
    return mlp.to(DEVICE)


def expression(mlp: nn.Sequential, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The torch expression in dtype: what autocast runs (weights cast to dtype, each op rounded to it)."""
    first, _, last = mlp
    h = torch.nn.functional.silu(torch.nn.functional.linear(x.to(dtype), first.weight.to(dtype), first.bias.to(dtype)))
    return torch.sigmoid(torch.nn.functional.linear(h, last.weight.to(dtype), last.bias.to(dtype)))


def grads_of(fn, mlp: nn.Sequential, x: torch.Tensor, dg: torch.Tensor) -> list[torch.Tensor]:
    leaves = [x, *mlp.parameters()]
    for t in leaves:
        t.grad = None
    out = fn()
    out.backward(dg.to(out.dtype))
    return [out.detach().double()] + [t.grad.detach().double() for t in leaves]


DTYPES = [torch.float16, pytest.param(torch.bfloat16, marks=needs_gpu_rounding)]
NAMES = ("gates", "x", "W1", "b1", "W2", "b2")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, n_in, n_hidden, n_out", [
    (70, 40, 72, 9),  # no dimension a multiple of the tiles: every mask
    (64, 64, 128, 36),  # whole tiles; prod-125m's 12 heads x 3 gates
    (1, 24, 16, 3),  # one token
    pytest.param(8192, 768, 768, 36, marks=pytest.mark.skipif(not CUDA, reason="a prod-125m layer's size: GPU")),
])
def test_gates_and_gradients_pass_the_error_ratio(tokens, n_in, n_hidden, n_out, dtype) -> None:
    mlp = gate_mlp(n_in, n_hidden, n_out, seed=tokens + n_in)
    g = torch.Generator().manual_seed(n_hidden)
    x = (torch.randn(2, tokens, n_in, generator=g)).to(DEVICE, dtype).requires_grad_(True)
    dg = torch.randn(2, tokens, n_out, generator=g).to(DEVICE)
    first, _, last = mlp
    kernel = grads_of(lambda: gate_mlp_kernel(x, first.weight, first.bias, last.weight, last.bias), mlp, x, dg)
    low = grads_of(lambda: expression(mlp, x, dtype), mlp, x, dg)
    mlp64 = gate_mlp(n_in, n_hidden, n_out, seed=tokens + n_in).double()
    x64 = x.detach().double().requires_grad_(True)
    exact = grads_of(lambda: expression(mlp64, x64, torch.float64), mlp64, x64, dg)
    assert kernel[0].shape == (2, tokens, n_out)
    assert torch.equal(kernel[0], low[0])  # the forward is the expression's own ops
    for name, got, ref, oracle in zip(NAMES, kernel, low, exact):
        assert torch.isfinite(got).all(), name
        assert error_ratio(got, ref, oracle) <= 1.0, name


def test_gradients_reach_every_input() -> None:
    """A planted zero in one weight's gradient would pass a loose check of the others: each gradient is compared
    on its own, and each must be non-zero where the oracle's is."""
    mlp = gate_mlp(32, 48, 6, seed=5)
    x = torch.randn(1, 20, 32).to(DEVICE, torch.float16).requires_grad_(True)
    first, _, last = mlp
    out = gate_mlp_kernel(x, first.weight, first.bias, last.weight, last.bias)
    out.float().square().sum().backward()
    for name, t in zip(NAMES[1:], (x, first.weight, first.bias, last.weight, last.bias)):
        assert t.grad is not None and t.grad.abs().sum() > 0, name


def test_bad_input_raises_value_error() -> None:
    mlp = gate_mlp(16, 16, 3, seed=0)
    first, _, last = mlp
    with pytest.raises(ValueError, match="bf16 or fp16"):
        gate_mlp_kernel(torch.randn(1, 4, 16, device=DEVICE), first.weight, first.bias, last.weight, last.bias)
    with pytest.raises(ValueError, match=r"W1 \[hidden, 8\]"):
        gate_mlp_kernel(torch.randn(1, 4, 8, device=DEVICE).half(), first.weight, first.bias, last.weight, last.bias)


def test_dispatch_runs_the_kernels_for_half_precision_only() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not gate_mlp_on_kernels(cpu, torch.bfloat16, "auto")  # CPU tensors: the torch expression
    assert not gate_mlp_on_kernels(cuda, torch.float32, "triton")  # fp32: cuBLAS's fp32 matmuls on every backend
    assert not gate_mlp_on_kernels(cuda, torch.bfloat16, "torch")
    if not CUDA:  # forced: the interpreter runs it here (the root conftest sets TRITON_INTERPRET=1)
        assert gate_mlp_on_kernels(cpu, torch.float16, "triton")
    with pytest.raises(ValueError, match="range_backend"):
        gate_mlp_on_kernels(cpu, torch.bfloat16, "cuda")
