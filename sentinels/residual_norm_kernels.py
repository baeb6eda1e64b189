"""A residual add and the RMSNorm after it in one Triton kernel each way (CUDA; the interpreter in tests).

A pre-norm block adds each sublayer's output to the residual stream and normalizes the sum for the next sublayer:
h = x + delta, y = h * rsqrt(mean(h^2) + eps) * w. In torch that is three passes forward (the add, the norm, and
under autocast the cast of the norm's fp32 output for the next matmul) and three backward (the norm's backward,
autograd's sum of the two gradients reaching h, and the cast of that sum for the bf16 delta). At prod-125m's width
they are memory-bound passes over 16k x 768 values, 25 norms and 24 adds per 16k-token micro-step. Here:

1. `_add_rms_norm_fwd_kernel`, one program per tile of rows: reads x and delta, writes h (x's and delta's promoted
   dtype, rounded as torch's add rounds) and y (in `out_dtype`: the autocast dtype, so the next matmul casts
   nothing), and keeps 1 / rms per row for backward.
2. `_add_rms_norm_bwd_kernel`, one program per run of rows: dh = (gradient reaching h from later) + the norm's
   backward of dy, written in fp32 for x and in delta's dtype for delta, and the program's partial sum of
   dy * h / rms for the weight's gradient (the partials summed by torch in program order: deterministic).

Both are compiled without fused multiply-adds, so every product is rounded as written: in backward the norm's part
is rounded before the sum, so dh is bitwise what autograd sums when the add runs apart from the norm (a checkpointed
sublayer's norm without a delta), and the checkpointing modes' gradients stay bitwise those of keeping everything.

Without delta it is the RMSNorm alone (y only; x's gradient from the norm alone). The math is torch's rms_norm's in
fp32; only the order of the mean's sum differs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

ROWS = 4  # rows per tile
BWD_PROGRAMS_PER_SM = 4  # backward programs per streaming multiprocessor (each sums its rows' weight gradient)


@triton.jit
def _add_rms_norm_fwd_kernel(X, DELTA, W, H, Y, RSTD, n_rows, dim, eps,
                             HAS_DELTA: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    row_ok = rows < n_rows
    col_ok = cols < dim
    mask = row_ok[:, None] & col_ok[None, :]
    offs = rows[:, None] * dim + cols[None, :]
    h = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        h += tl.load(DELTA + offs, mask=mask, other=0.0).to(tl.float32)
        h = h.to(H.dtype.element_ty)  # rounded as torch's add rounds; the norm reads the stored h
        tl.store(H + offs, h, mask=mask)
        h = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(h * h, 1) / dim + eps)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = h * rstd[:, None] * w[None, :]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def _add_rms_norm_bwd_kernel(H, W, RSTD, DY, DH, DX, DDELTA, DW_PARTS, n_rows, dim, rows_per_program,
                             HAS_DH: tl.constexpr, HAS_DDELTA: tl.constexpr, ROWS: tl.constexpr,
                             BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    col_ok = cols < dim
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    first = pid * rows_per_program
    stop = tl.minimum(first + rows_per_program, n_rows)
    for start in range(first, stop, ROWS):
        rows = (start + tl.arange(0, ROWS)).to(tl.int64)
        row_ok = rows < stop
        mask = row_ok[:, None] & col_ok[None, :]
        offs = rows[:, None] * dim + cols[None, :]
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        normed = tl.load(H + offs, mask=mask, other=0.0).to(tl.float32) * rstd[:, None]
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        dw += tl.sum(dy * normed, 0)
        g = dy * w[None, :]
        # d/dh of h * rstd * w: rstd * (g - normed * mean(g * normed))
        dh = rstd[:, None] * (g - normed * (tl.sum(g * normed, 1) / dim)[:, None])
        if HAS_DH:
            dh += tl.load(DH + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + offs, dh.to(DX.dtype.element_ty), mask=mask)
        if HAS_DDELTA:
            tl.store(DDELTA + offs, dh.to(DDELTA.dtype.element_ty), mask=mask)
    tl.store(DW_PARTS + pid.to(tl.int64) * dim + cols, dw, mask=col_ok)


def _block(dim: int) -> int:
    return triton.next_power_of_2(dim)


def _warps(dim: int) -> int:
    return 8 if dim >= 2048 else 4


def add_rms_norm_forward(x: Tensor, delta: Tensor | None, weight: Tensor, eps: float,
                         out_dtype: torch.dtype) -> tuple[Tensor | None, Tensor, Tensor]:
    """For contiguous x [..., dim] and delta of x's shape (or None): h = x + delta in their promoted dtype (None
    without delta), y = rms_norm(h) * weight in out_dtype, both of x's shape, and 1 / rms per row (fp32)."""
    dim = x.shape[-1]
    rows = x.numel() // max(dim, 1)
    h = None if delta is None else torch.empty(x.shape, dtype=torch.result_type(x, delta), device=x.device)
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        _add_rms_norm_fwd_kernel[(triton.cdiv(rows, ROWS),)](
            x, x if delta is None else delta, weight, y if h is None else h, y, rstd, rows, dim, eps,
            HAS_DELTA=delta is not None, ROWS=ROWS, BLOCK=_block(dim), num_warps=_warps(dim), enable_fp_fusion=False)
    return h, y, rstd


def add_rms_norm_backward(h: Tensor, weight: Tensor, rstd: Tensor, dy: Tensor, dh: Tensor | None, x_dtype: torch.dtype,
                          delta_dtype: torch.dtype | None) -> tuple[Tensor, Tensor | None, Tensor]:
    """Gradients of add_rms_norm_forward: for x (x_dtype), for delta (delta_dtype; None without delta: the same
    values as x's, one tensor when the dtypes agree) and the weight (fp32), from dy (y's gradient) and dh (h's, or
    None where nothing later read h). h, dy and dh contiguous, of one shape [..., dim]; h is x without delta."""
    dim = h.shape[-1]
    rows = h.numel() // max(dim, 1)
    dx = torch.empty(h.shape, dtype=x_dtype, device=h.device)
    ddelta = None
    if delta_dtype is not None:
        ddelta = dx if delta_dtype == x_dtype else torch.empty(h.shape, dtype=delta_dtype, device=h.device)
    if h.is_cuda:
        programs = torch.cuda.get_device_properties(h.device).multi_processor_count * BWD_PROGRAMS_PER_SM
    else:
        programs = 4
    rows_per_program = max(ROWS, triton.cdiv(triton.cdiv(max(rows, 1), programs), ROWS) * ROWS)
    programs = max(1, triton.cdiv(rows, rows_per_program))
    parts = torch.empty(programs, dim, dtype=torch.float32, device=h.device)
    if rows:
        _add_rms_norm_bwd_kernel[(programs,)](
            h, weight, rstd, dy, dy if dh is None else dh, dx, dx if ddelta is None else ddelta, parts,
            rows, dim, rows_per_program, HAS_DH=dh is not None, HAS_DDELTA=ddelta is not None and ddelta is not dx,
            ROWS=ROWS, BLOCK=_block(dim), num_warps=_warps(dim), enable_fp_fusion=False)
    else:
        parts.zero_()
    return dx, ddelta, parts.sum(0)
