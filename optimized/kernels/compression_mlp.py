"""Eq. 7's MLP phi on the kernel path: for every complete block i of x [B, T, H, D] (rows i*d .. i*d + l - 1),

    phi_i = w2^T silu(w1^T flatten(block_i + pos) + b1) + b2

in one forward launch and three backward launches, where the torch code (compression.phi_mlp_chunked) runs about
forty small kernels per call. flatten(block_i + pos) w1 is taken row by row of the block: sum over p < l of
(x[i*d + p] w1_p) plus the per-call constant c = flatten(pos) w1 + b1 (w1_p: rows p*D .. p*D + D - 1 of w1), so
no block is materialised.

    forward       per tile of blocks of one (sequence, head): pre = sum_p x_p w1_p + c (fp32 accumulation), out =
                  silu(pre) w2 + b2 in fp32; pre is kept for backward ([B, N, H, hidden] fp32, small).
    backward (1)  d pre = (d out w2^T) * silu'(pre), and per tile the column sums of d pre and d out and
                  silu(pre)^T d out (d b1, d b2, d w2, summed over the tiles afterwards in a fixed order);
    backward (2)  d w1_p = sum over blocks of x_p^T d pre, one program per block row p (+ flatten(pos)^T d b1);
    backward (3)  d x[t] for t = j*d + r: the sum over the m = l/d blocks i = j - a holding it of d pre_i w1_{a*d+r}^T,
                  one store per row (no atomics); rows in no complete block get 0. d pos = d b1 w1^T.

Precision: the matmul operands take the weights' compute dtype `dot_dtype` (the autocast dtype under autocast, as
the torch code's matmuls do there; else fp32 with exact fp32 dots), accumulation is fp32, phi is returned in fp32
(the compute dtype of half inputs). The kernel path calls it under autocast only (compression.compress_unrounded):
the exact fp32 dots were not timed against the torch code's cuBLAS matmuls.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from reference.contract import PhiMLPWeights

from .common import dot, dot_settings, padded

BLOCKS_PER_TILE = 64  # blocks of one (sequence, head) per program (forward and backward (1)); rows per dot in (2)
ROWS_PER_TILE = 64  # chunk indices j per program in backward (3)


@triton.jit
def _features(D: tl.constexpr, HID: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HID: tl.constexpr):
    """Offsets and masks of the padded feature (D) and hidden (HID) dimensions."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_h = tl.arange(0, BLOCK_HID)
    return offs_d, offs_d < D, offs_h, offs_h < HID


@triton.jit
def _block_tile(n_blocks, n_heads, D: tl.constexpr, HID: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_HID: tl.constexpr, BLOCK_N: tl.constexpr):
    """The blocks of this program (grid: block tiles, sequences x heads): (sequence b, head h, blocks, valid,
    [B, N, H] rows of phi and pre (int64), feature offsets and mask, hidden offsets and mask)."""
    b = tl.program_id(1) // n_heads
    h = tl.program_id(1) % n_heads
    blocks = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d, d_ok, offs_h, h_ok = _features(D, HID, BLOCK_D, BLOCK_HID)
    row = (b.to(tl.int64) * n_blocks + blocks) * n_heads + h
    return b, h, blocks, blocks < n_blocks, row, offs_d, d_ok, offs_h, h_ok


@triton.jit
def _phi_fwd_kernel(X, W1, C, W2, B2, PHI, PRE, n_blocks, n_heads,
                    stride_xb, stride_xt, stride_xh,
                    L: tl.constexpr, STRIDE: tl.constexpr, D: tl.constexpr, HID: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_HID: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
                    INPUT_PRECISION: tl.constexpr):
    b, h, blocks, ok, row, offs_d, d_ok, offs_h, h_ok = _block_tile(n_blocks, n_heads, D, HID, BLOCK_D, BLOCK_HID,
                                                                    BLOCK_N)
    dot_dtype = W1.dtype.element_ty
    x_base = X + b.to(tl.int64) * stride_xb + h * stride_xh
    pre = tl.zeros([BLOCK_N, BLOCK_HID], dtype=tl.float32)
    for p in range(L):  # row p of every block of the tile against rows p*D .. p*D + D - 1 of w1
        t = blocks.to(tl.int64) * STRIDE + p
        x = tl.load(x_base + t[:, None] * stride_xt + offs_d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        w1 = tl.load(W1 + (p * D + offs_d[:, None]) * HID + offs_h[None, :], mask=d_ok[:, None] & h_ok[None, :],
                     other=0.0)
        pre += dot(x.to(dot_dtype), w1, DOT_FP32, INPUT_PRECISION)
    pre += tl.load(C + offs_h, mask=h_ok, other=0.0)[None, :]
    act = pre / (1.0 + tl.exp(-pre))
    w2 = tl.load(W2 + offs_h[:, None] * D + offs_d[None, :], mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    out = dot(act.to(dot_dtype), w2, DOT_FP32, INPUT_PRECISION)
    out += tl.load(B2 + offs_d, mask=d_ok, other=0.0)[None, :]
    tl.store(PHI + row[:, None] * D + offs_d[None, :], out, mask=ok[:, None] & d_ok[None, :])
    tl.store(PRE + row[:, None] * HID + offs_h[None, :], pre, mask=ok[:, None] & h_ok[None, :])


@triton.jit
def _phi_bwd_hidden_kernel(D_OUT, PRE, W2, D_PRE, DB1_PART, DB2_PART, DW2_PART, n_blocks, n_heads,
                           D: tl.constexpr, HID: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HID: tl.constexpr,
                           BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    b, h, blocks, ok, row, offs_d, d_ok, offs_h, h_ok = _block_tile(n_blocks, n_heads, D, HID, BLOCK_D, BLOCK_HID,
                                                                    BLOCK_N)
    dot_dtype = W2.dtype.element_ty
    d_out = tl.load(D_OUT + row[:, None] * D + offs_d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
    pre = tl.load(PRE + row[:, None] * HID + offs_h[None, :], mask=ok[:, None] & h_ok[None, :], other=0.0)
    w2 = tl.load(W2 + offs_h[:, None] * D + offs_d[None, :], mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    d_act = dot(d_out.to(dot_dtype), tl.trans(w2), DOT_FP32, INPUT_PRECISION)  # [BLOCK_N, BLOCK_HID]
    sig = 1.0 / (1.0 + tl.exp(-pre))
    d_pre = d_act * sig * (1.0 + pre * (1.0 - sig))
    act = pre * sig
    tl.store(D_PRE + row[:, None] * HID + offs_h[None, :], d_pre, mask=ok[:, None] & h_ok[None, :])
    part = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    tl.store(DB1_PART + part * HID + offs_h, tl.sum(d_pre, axis=0), mask=h_ok)
    tl.store(DB2_PART + part * D + offs_d, tl.sum(d_out, axis=0), mask=d_ok)
    d_w2 = dot(tl.trans(act.to(dot_dtype)), d_out.to(dot_dtype), DOT_FP32, INPUT_PRECISION)  # [BLOCK_HID, BLOCK_D]
    tl.store(DW2_PART + part * HID * D + offs_h[:, None] * D + offs_d[None, :], d_w2,
             mask=h_ok[:, None] & d_ok[None, :])


@triton.jit
def _phi_bwd_w1_kernel(X, D_PRE, DW1, n_blocks, n_heads, n_rows,
                       stride_xb, stride_xt, stride_xh,
                       STRIDE: tl.constexpr, D: tl.constexpr, HID: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_HID: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
                       INPUT_PRECISION: tl.constexpr):
    p = tl.program_id(0)  # block row p: rows p*D .. p*D + D - 1 of d w1
    offs_d, d_ok, offs_h, h_ok = _features(D, HID, BLOCK_D, BLOCK_HID)
    dot_dtype = X.dtype.element_ty
    acc = tl.zeros([BLOCK_D, BLOCK_HID], dtype=tl.float32)
    for r0 in range(0, n_rows, BLOCK_N):  # the rows (b, i, h) of d pre, in order
        rows = r0 + tl.arange(0, BLOCK_N)
        ok = rows < n_rows
        h = rows % n_heads
        i = (rows // n_heads) % n_blocks
        b = rows // n_heads // n_blocks
        t = i.to(tl.int64) * STRIDE + p
        x = tl.load(X + (b.to(tl.int64) * stride_xb + t * stride_xt + h * stride_xh)[:, None] + offs_d[None, :],
                    mask=ok[:, None] & d_ok[None, :], other=0.0)
        d_pre = tl.load(D_PRE + rows.to(tl.int64)[:, None] * HID + offs_h[None, :],
                        mask=ok[:, None] & h_ok[None, :], other=0.0)
        acc += dot(tl.trans(x), d_pre.to(dot_dtype), DOT_FP32, INPUT_PRECISION)
    tl.store(DW1 + (p * D + offs_d[:, None]) * HID + offs_h[None, :], acc, mask=d_ok[:, None] & h_ok[None, :])


@triton.jit
def _phi_bwd_x_kernel(D_PRE, W1, DX, n_blocks, n_heads, n_tokens,
                      stride_db, stride_dt, stride_dh,
                      M: tl.constexpr, STRIDE: tl.constexpr, D: tl.constexpr, HID: tl.constexpr,
                      BLOCK_D: tl.constexpr, BLOCK_HID: tl.constexpr, BLOCK_J: tl.constexpr, DOT_FP32: tl.constexpr,
                      INPUT_PRECISION: tl.constexpr):
    r = tl.program_id(1) % STRIDE  # row r of each chunk j: token t = j*d + r
    bh = tl.program_id(1) // STRIDE
    b = bh // n_heads
    h = bh % n_heads
    js = tl.program_id(0) * BLOCK_J + tl.arange(0, BLOCK_J)
    t = js.to(tl.int64) * STRIDE + r
    offs_d, d_ok, offs_h, h_ok = _features(D, HID, BLOCK_D, BLOCK_HID)
    dot_dtype = W1.dtype.element_ty
    acc = tl.zeros([BLOCK_J, BLOCK_D], dtype=tl.float32)
    for a in range(M):  # block i = j - a holds token t as its row a*d + r
        i = js - a
        ok = (i >= 0) & (i < n_blocks)
        d_pre = tl.load(D_PRE + ((b.to(tl.int64) * n_blocks + i) * n_heads + h)[:, None] * HID + offs_h[None, :],
                        mask=ok[:, None] & h_ok[None, :], other=0.0)
        w1_t = tl.load(W1 + ((a * STRIDE + r) * D + offs_d[None, :]) * HID + offs_h[:, None],
                       mask=h_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_HID, BLOCK_D] of w1_p^T
        acc += dot(d_pre.to(dot_dtype), w1_t, DOT_FP32, INPUT_PRECISION)
    tl.store(DX + b.to(tl.int64) * stride_db + t[:, None] * stride_dt + h * stride_dh + offs_d[None, :],
             acc.to(DX.dtype.element_ty), mask=(t < n_tokens)[:, None] & d_ok[None, :])


def _dot_modes(dot_dtype: torch.dtype) -> dict:
    """The kernels' DOT_FP32 and INPUT_PRECISION for matmul operands in dot_dtype (common.dot_settings)."""
    dot_fp32, precision = dot_settings(dot_dtype)
    return dict(DOT_FP32=dot_fp32, INPUT_PRECISION=precision)


def phi_mlp_forward(x: Tensor, w: PhiMLPWeights, dot_w: tuple[Tensor, Tensor], block: int, stride: int
                    ) -> tuple[Tensor, Tensor]:
    """(phi [B, N, H, D] fp32, pre [B, N, H, hidden] fp32) for x [B, T, H, D] (last dim contiguous) and the
    weights w: the matmuls take dot_w = (w1, w2) in the dot dtype (contiguous), the bias terms fp32."""
    B, T, H, D = x.shape
    n_blocks = (T - block) // stride + 1 if T >= block else 0
    hidden = w.w1.shape[1]
    out = torch.empty((B, n_blocks, H, D), device=x.device, dtype=torch.float32)
    pre = torch.empty((B, n_blocks, H, hidden), device=x.device, dtype=torch.float32)
    if B * n_blocks * H == 0:
        return out, pre
    c = torch.addmv(w.b1.float(), w.w1.float().t(), w.pos.float().reshape(-1))  # flatten(pos) w1 + b1
    _phi_fwd_kernel[(triton.cdiv(n_blocks, BLOCKS_PER_TILE), B * H)](
        x, dot_w[0], c, dot_w[1], w.b2.float().contiguous(), out, pre,
        n_blocks, H, x.stride(0), x.stride(1), x.stride(2),
        L=block, STRIDE=stride, D=D, HID=hidden, BLOCK_D=padded(D), BLOCK_HID=padded(hidden),
        BLOCK_N=BLOCKS_PER_TILE, **_dot_modes(dot_w[0].dtype), num_warps=4,
    )
    return out, pre


def phi_mlp_backward(d_out: Tensor, x: Tensor, pre: Tensor, w: PhiMLPWeights, dot_w: tuple[Tensor, Tensor],
                     block: int, stride: int) -> tuple[Tensor, ...]:
    """(d x in x's dtype, d pos, d w1, d b1, d w2, d b2 in fp32) of phi_mlp_forward for d_out [B, N, H, D]."""
    B, T, H, D = x.shape
    n_blocks, hidden = pre.shape[1], pre.shape[3]
    d_out = d_out.float().contiguous()
    w1, w2 = dot_w
    dims = dict(D=D, HID=hidden, BLOCK_D=padded(D), BLOCK_HID=padded(hidden), **_dot_modes(w1.dtype))
    tiles = triton.cdiv(n_blocks, BLOCKS_PER_TILE)
    d_pre = torch.empty_like(pre)
    db1 = torch.empty((tiles * B * H, hidden), device=x.device, dtype=torch.float32)
    db2 = torch.empty((tiles * B * H, D), device=x.device, dtype=torch.float32)
    dw2 = torch.empty((tiles * B * H, hidden, D), device=x.device, dtype=torch.float32)
    _phi_bwd_hidden_kernel[(tiles, B * H)](d_out, pre, w2, d_pre, db1, db2, dw2, n_blocks, H,
                                          BLOCK_N=BLOCKS_PER_TILE, num_warps=4, **dims)
    d_b1 = db1.sum(0)
    d_w1 = torch.empty((block * D, hidden), device=x.device, dtype=torch.float32)
    _phi_bwd_w1_kernel[(block,)](x, d_pre, d_w1, n_blocks, H, B * n_blocks * H, x.stride(0), x.stride(1), x.stride(2),
                                 STRIDE=stride, BLOCK_N=BLOCKS_PER_TILE, num_warps=4, **dims)
    d_w1.addr_(w.pos.float().reshape(-1), d_b1)  # flatten(pos)^T d b1: pos is added to every block
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    n_chunks = triton.cdiv(T, stride)
    _phi_bwd_x_kernel[(triton.cdiv(n_chunks, ROWS_PER_TILE), B * H * stride)](
        d_pre, w1, dx, n_blocks, H, T, dx.stride(0), dx.stride(1), dx.stride(2),
        M=block // stride, STRIDE=stride, BLOCK_J=ROWS_PER_TILE, num_warps=4, **dims)
    d_pos = (w.w1.float() @ d_b1).view(block, D)
    return dx, d_pos, d_w1, d_b1, dw2.sum(0), db2.sum(0)


class PhiMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, pos: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, block: int, stride: int,
                dot_dtype: torch.dtype) -> Tensor:
        w = PhiMLPWeights(pos, w1, b1, w2, b2)
        dot_w = (w1.to(dot_dtype).contiguous(), w2.to(dot_dtype).contiguous())  # cast once, kept for backward
        out, pre = phi_mlp_forward(x, w, dot_w, block, stride)
        ctx.save_for_backward(x, pre, *dot_w, pos, w1, b1, w2, b2)
        ctx.shape = (block, stride)
        return out

    @staticmethod
    def backward(ctx, d_out: Tensor) -> tuple[Tensor | None, ...]:
        x, pre, dot_w1, dot_w2, *weights = ctx.saved_tensors
        block, stride = ctx.shape
        w = PhiMLPWeights(*weights)
        with torch.autocast(x.device.type, enabled=False):
            dx, d_pos, d_w1, d_b1, d_w2, d_b2 = phi_mlp_backward(d_out, x, pre, w, (dot_w1, dot_w2), block, stride)
        grads = (d_pos, d_w1, d_b1, d_w2, d_b2)
        return (dx, *(g.to(t.dtype) for g, t in zip(grads, weights)), None, None, None)


def phi_mlp_kernel(x: Tensor, w: PhiMLPWeights, block: int, stride: int) -> Tensor:
    """phi over every complete block (l = block rows every `stride`, stride | block) of x [B, T, H, D] (fp32/bf16/
    fp16): [B, N, H, D] fp32, differentiable in x and every weight. Under autocast the matmuls take the autocast
    dtype (as the torch code's do there), else exact fp32 dots."""
    if block % stride:
        raise ValueError(f"phi_mlp_kernel: the stride ({stride}) must divide the block ({block})")
    if x.stride(-1) != 1:
        x = x.contiguous()
    autocast = torch.is_autocast_enabled(x.device.type)
    dot_dtype = torch.get_autocast_dtype(x.device.type) if autocast else torch.float32
    return PhiMLPFunction.apply(x, w.pos, w.w1, w.b1, w.w2, w.b2, block, stride, dot_dtype)
