"""SwiGLU's activation, silu(g) * u, in one Triton kernel each way (CUDA; the interpreter in tests).

The model's MLP (sentinels.model.SwiGLU) projects x to its gate and up halves with one matmul, gu = x [W_gate;
W_up]^T, so g and u sit side by side in each row of gu ([rows, 2 x hidden]). In torch the activation is two
elementwise kernels forward (silu, then the product, each rounding to bf16) and three backward, and it keeps
silu(g) for backward beside g and u. Here:

1. `_swiglu_fwd_kernel`: reads g and u, writes silu(g) * u (fp32 math, one rounding to the output dtype).
2. `_swiglu_bwd_kernel`: reads dO and gu again, writes d gu in gu's layout, so the one matmul's backward takes it
   as it is: du = dO silu(g), dg = dO u sigma(g) (1 + g (1 - sigma(g))).

Backward keeps gu alone (the matmul's output), not silu(g).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 1024  # outputs per program


@triton.jit
def _swiglu_fwd_kernel(GU, ACT, n, hidden, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    row = offs // hidden
    g_at = offs + row * hidden  # row * 2 hidden + column
    g = tl.load(GU + g_at, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GU + g_at + hidden, mask=ok, other=0.0).to(tl.float32)
    tl.store(ACT + offs, (g * tl.sigmoid(g) * u).to(ACT.dtype.element_ty), mask=ok)


@triton.jit
def _swiglu_bwd_kernel(GU, DOUT, DGU, n, hidden, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    row = offs // hidden
    g_at = offs + row * hidden
    g = tl.load(GU + g_at, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GU + g_at + hidden, mask=ok, other=0.0).to(tl.float32)
    dout = tl.load(DOUT + offs, mask=ok, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    tl.store(DGU + g_at, (dout * u * sig * (1.0 + g * (1.0 - sig))).to(DGU.dtype.element_ty), mask=ok)
    tl.store(DGU + g_at + hidden, (dout * g * sig).to(DGU.dtype.element_ty), mask=ok)


def swiglu_forward(gu: Tensor) -> Tensor:
    """silu(g) * u for a contiguous gu [..., 2 x hidden] holding g then u in each row: [..., hidden], gu's dtype."""
    hidden = gu.shape[-1] // 2
    out = torch.empty((*gu.shape[:-1], hidden), dtype=gu.dtype, device=gu.device)
    n = out.numel()
    if n:
        _swiglu_fwd_kernel[(triton.cdiv(n, BLOCK),)](gu, out, n, hidden, BLOCK=BLOCK, num_warps=4)
    return out


def swiglu_backward(gu: Tensor, dout: Tensor) -> Tensor:
    """The gradient of swiglu_forward with respect to gu, from the output's gradient dout (contiguous)."""
    hidden = gu.shape[-1] // 2
    dgu = torch.empty_like(gu)
    n = dout.numel()
    if n:
        _swiglu_bwd_kernel[(triton.cdiv(n, BLOCK),)](gu, dout, dgu, n, hidden, BLOCK=BLOCK, num_warps=4)
    return dgu
