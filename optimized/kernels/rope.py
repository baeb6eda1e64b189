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

project_heads takes the whole output of a q/k/v projection ([B, T, N]: heads to rotate, then heads kept as they
are) and returns each part's heads as its own tensor; its backward writes every part's gradient (the rotated ones
through the inverse rotation) straight into the columns of one [B, T, N] gradient, the matmul's, where autograd of
split views concatenates the parts' gradients two or three times over (a pass over the whole gradient each).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from reference.module import rope_angles

from ..device_tables import DeviceTables
from ..dispatch import KERNEL_DTYPES
from .common import row_pass_shape


@triton.jit
def _rope_kernel(X, COS, SIN, Y,
                 stride_xb, stride_xt, stride_xh, stride_yb, stride_yt, stride_yh, n_rows, T, H,
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
    y_row = Y + (b * stride_yb + t * stride_yt + h * stride_yh)[:, None] + cols[None, :]
    tl.store(y_row, y1, mask=mask)
    tl.store(y_row + HALF, y2, mask=mask)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool, out: Tensor | None = None) -> Tensor:
    """x [B, T, H, D] rotated (by -angle with inverse) into out (any [B, T, H, D] view of x's dtype whose last
    dimension is contiguous; default a new contiguous tensor)."""
    B, T, H, D = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((B, T, H, D), dtype=x.dtype, device=x.device) if out is None else out
    n_rows = B * T * H
    if n_rows:
        block, rows = row_pass_shape(D)  # a row pass over the (token, head) rows; each loads two halves of block / 2
        _rope_kernel[(triton.cdiv(n_rows, rows),)](
            x, cos, sin, y, x.stride(0), x.stride(1), x.stride(2), y.stride(0), y.stride(1), y.stride(2), n_rows, T, H,
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
    return _Rope.apply(x, *rope_tables(positions, x.shape[-1], base, x.dtype))


class _ProjectHeads(torch.autograd.Function):
    """(rotated parts..., plain parts...) of a projection's output y [B, T, N] (project_heads)."""

    @staticmethod
    def forward(ctx, y: Tensor, cos: Tensor, sin: Tensor, rotated: tuple[int, ...], dk: int,
                plain: tuple[int, ...], dv: int) -> tuple[Tensor, ...]:
        B, T, _ = y.shape
        n_rotated = sum(rotated) * dk
        qk = _rotate(y[..., :n_rotated].view(B, T, sum(rotated), dk), cos, sin, inverse=False)
        # the plain heads are copied out of y, so that backward keeps them alone rather than all of y
        v = y[..., n_rotated:n_rotated + sum(plain) * dv].contiguous().view(B, T, sum(plain), dv)
        ctx.save_for_backward(cos, sin)
        ctx.layout = (y.shape, rotated, dk, plain, dv)
        ctx.set_materialize_grads(False)  # a part without a gradient comes as None: its columns are zero-filled
        return (*qk.split(list(rotated), dim=2), *v.split(list(plain), dim=2))

    @staticmethod
    def backward(ctx, *grads: Tensor | None):
        cos, sin = ctx.saved_tensors
        shape, rotated, dk, plain, dv = ctx.layout
        B, T, _ = shape
        dy = torch.empty(shape, dtype=cos.dtype, device=cos.device)
        column = 0
        for i, (heads, width) in enumerate([(h, dk) for h in rotated] + [(h, dv) for h in plain]):
            part = dy[..., column:column + heads * width].view(B, T, heads, width)
            grad = grads[i]
            if grad is None:  # a part that reached no loss
                part.zero_()
            elif i < len(rotated):
                _rotate(grad, cos, sin, inverse=True, out=part)
            else:
                part.copy_(grad)
            column += heads * width
        if column < shape[-1]:
            dy[..., column:].zero_()
        return dy, None, None, None, None, None, None


def project_heads(y: Tensor, tables: tuple[Tensor, Tensor], rotated: tuple[int, ...], dk: int,
                  plain: tuple[int, ...], dv: int) -> tuple[Tensor, ...]:
    """The heads of a fused projection's output y [B, T, N] of fp32, bf16 or fp16: the first sum(rotated) * dk
    columns as heads of dk rotated by RoPE with tables = (cos, sin) [T, dk / 2] (rope_tables), split into parts
    of `rotated` heads each; the next sum(plain) * dv columns as heads of dv, copied, split into parts of `plain`
    heads. Returns the rotated parts, then the plain parts (views of one tensor each). Values and gradients are
    bitwise those of apply_rope_kernel on y's view and of split views; backward writes each part's gradient into
    its columns of y's gradient (module docstring)."""
    if y.dim() != 3 or y.dtype not in KERNEL_DTYPES or dk % 2:
        raise ValueError(f"project_heads: y must be a [B, T, N] tensor of {KERNEL_DTYPES} and dk even, got "
                         f"{y.dtype} {tuple(y.shape)}, dk={dk}")
    if sum(rotated) * dk + sum(plain) * dv > y.shape[-1]:
        raise ValueError(f"project_heads: {sum(rotated)} heads of {dk} and {sum(plain)} of {dv} need "
                         f"{sum(rotated) * dk + sum(plain) * dv} columns, y has {y.shape[-1]}")
    cos, sin = tables
    if any(t.shape != (y.shape[1], dk // 2) or t.dtype != y.dtype or not t.is_contiguous() for t in tables):
        raise ValueError(f"project_heads: tables must be contiguous [T, dk / 2] = [{y.shape[1]}, {dk // 2}] "
                         f"tensors of y's dtype {y.dtype}, got {[(t.dtype, tuple(t.shape)) for t in tables]}")
    if y.stride(-1) != 1:
        y = y.contiguous()
    return _ProjectHeads.apply(y, cos, sin, tuple(rotated), dk, tuple(plain), dv)


def rope_tables(positions: Tensor, dim: int, base: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(cos, sin) [T, dim / 2] of reference.module.rope_angles at positions [T], rounded to dtype, contiguous: the
    tables the kernels take."""
    cos, sin = rope_angles(positions, dim, base)
    return cos.to(dtype).contiguous(), sin.to(dtype).contiguous()


_TABLES = DeviceTables()


def contiguous_rope_tables(n: int, first: int, dim: int, base: float, dtype: torch.dtype,
                           device: torch.device) -> tuple[Tensor, Tensor]:
    """rope_tables at positions first .. first + n - 1, built once per (n, first, dim, base, dtype, device) and
    kept (optimized.device_tables): every layer of a model asks for the same ones, about ten small launches each
    time."""
    return _TABLES.kept((n, first, dim, base, dtype, device), device,
                        lambda: rope_tables(torch.arange(first, first + n, device=device), dim, base, dtype))
