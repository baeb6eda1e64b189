"""Rotary position embedding (RoPE) in one pass, forward and backward: bitwise what reference.module.apply_rope's
torch expression gives, for x [B, T, H, D] of fp32, bf16 or fp16 (D even):

    x1, x2 = the two halves of each head,  c, s = rope_angles(positions) rounded to x's dtype   [T, D/2]
    y1 = x1 * c - x2 * s,   y2 = x1 * s + x2 * c

each product and each sum widened to fp32 and rounded to x's dtype one by one, as torch's CUDA kernels round every
op of that expression (no FMA: the launch disables fp fusion). The torch expression runs as several kernels with
broadcast operands (cos and sin over the heads) and a concatenation, and its backward as many: at prod-125m's 16k
tokens and 18 heads of 64 (q and the three branch keys) they take 451 us of device time forward + backward, against
123 us here, the angles included (perf/NOTES.md).

The backward is the same rotation by -angle: autograd of that expression gives dx1 = dy1 * c + dy2 * s and
dx2 = dy2 * c - dy1 * s, each product rounded and the two gradients of x1 (and of x2) added in x's dtype, which is
the forward pass with s negated (negation is exact). Backward keeps only c and s, as the expression's does.

The output is a new contiguous [B, T, H, D] tensor; x may be any view whose last dimension is contiguous (the
q/k part of a projection's output).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from reference.module import rope_angles

from ..dispatch import KERNEL_DTYPES
from .common import row_pass_shape


@triton.jit
def _rope_kernel(X, COS, SIN, Y,
                 stride_xb, stride_xt, stride_xh, n_rows, T, H,
                 HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, ROWS: tl.constexpr, INVERSE: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # (batch, token, head) in that order
    cols = tl.arange(0, BLOCK_HALF)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols[None, :] < HALF)
    h = rows % H
    t = (rows // H) % T
    b = rows // (H * T)
    x_row = X + (b * stride_xb + t * stride_xt + h * stride_xh)[:, None] + cols[None, :]
    x1 = tl.load(x_row, mask=mask, other=0.0)
    x2 = tl.load(x_row + HALF, mask=mask, other=0.0)
    c = tl.load(COS + t[:, None] * HALF + cols[None, :], mask=mask, other=0.0)
    s = tl.load(SIN + t[:, None] * HALF + cols[None, :], mask=mask, other=0.0)
    if INVERSE:
        s = -s
    dtype = x1.dtype
    x1, x2, c, s = x1.to(tl.float32), x2.to(tl.float32), c.to(tl.float32), s.to(tl.float32)
    y1 = ((x1 * c).to(dtype).to(tl.float32) - (x2 * s).to(dtype).to(tl.float32)).to(dtype)
    y2 = ((x1 * s).to(dtype).to(tl.float32) + (x2 * c).to(dtype).to(tl.float32)).to(dtype)
    y_row = Y + rows[:, None] * (2 * HALF) + cols[None, :]
    tl.store(y_row, y1, mask=mask)
    tl.store(y_row + HALF, y2, mask=mask)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool) -> Tensor:
    B, T, H, D = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((B, T, H, D), dtype=x.dtype, device=x.device)
    n_rows = B * T * H
    if n_rows:
        block, rows = row_pass_shape(D)  # a row pass over the (token, head) rows; each loads two halves of block / 2
        _rope_kernel[(triton.cdiv(n_rows, rows),)](
            x, cos, sin, y, x.stride(0), x.stride(1), x.stride(2), n_rows, T, H,
            HALF=D // 2, BLOCK_HALF=block // 2, ROWS=rows, INVERSE=inverse,
            num_warps=4, enable_fp_fusion=False,  # every product and sum rounded on its own, as in torch
        )
    return y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, inverse=False)

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return _rotate(dy, cos, sin, inverse=True), None, None


def apply_rope_kernel(x: Tensor, positions: Tensor, base: float = 10000.0) -> Tensor:
    """reference.module.apply_rope(x, positions, base) in one kernel launch each way (module docstring): x
    [B, T, H, D] of fp32, bf16 or fp16 with an even D, positions [T]."""
    if x.dim() != 4 or x.dtype not in KERNEL_DTYPES or x.shape[-1] % 2:
        raise ValueError(f"apply_rope_kernel: x must be a [B, T, H, D] tensor of {KERNEL_DTYPES} with an even D, got "
                         f"{x.dtype} {tuple(x.shape)}")
    if positions.shape != x.shape[1:2]:
        raise ValueError(f"apply_rope_kernel: positions must be [T] = [{x.shape[1]}], got {tuple(positions.shape)}")
    cos, sin = rope_angles(positions, x.shape[-1], base)
    return _Rope.apply(x, cos.to(x.dtype).contiguous(), sin.to(x.dtype).contiguous())
