"""Eq. 5's gates from the gate MLP, g = sigmoid(W2 silu(W1 x + b1) + b2) (reference.NSAAttention.gate), at half
precision without keeping its hidden activations for backward, in fewer passes than the torch expression under
torch.utils.checkpoint:

    forward   the torch expression's own ops (F.linear, silu, F.linear, sigmoid; cuBLAS's matmuls measured faster
              than one fused Triton launch over the two layers), bitwise its gates; backward keeps x (which the
              projections keep anyway), the weights in the input dtype and g, not the hidden layer.
    backward  d logits = sigmoid_backward(d g, g); pre = x W1^T + b1 recomputed as the forward computed it; one
              launch forms dh = d logits W2 (rounded, as mm rounds), d pre = silu_backward(dh, pre), h = silu(pre)
              and the column sums of d pre per tile of tokens (for d b1); then d W2 = d logits^T h, d W1 = d pre^T x
              and d x = d pre W1 (matmuls).

The checkpointed expression recomputes both layers in backward and makes separate passes for silu, the hidden
gradient, silu_backward and the reduction of d b1. Each rounding here is where torch rounds (mm, silu_backward and
silu in fp32 with one rounding to the input dtype each), so the gradients differ from the expression's only by the
order of the bias gradient's sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from ..dispatch import HALF_DTYPES
from .common import dot, dot_settings, padded


@triton.jit
def _gate_mlp_bwd_kernel(PRE, D_LOGITS, W2, D_PRE, H, DB1_PART, n_tokens, n_hidden, n_out,
                         stride_pre, stride_dl, stride_w2, stride_dp, stride_h,
                         BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_O: tl.constexpr,
                         DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    rows = tile.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    hid = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_o = tl.arange(0, BLOCK_O)
    row_ok = rows < n_tokens
    hid_ok = hid < n_hidden
    mask = row_ok[:, None] & hid_ok[None, :]
    dtype = PRE.dtype.element_ty
    d_logits = tl.load(D_LOGITS + rows[:, None] * stride_dl + offs_o[None, :],
                       mask=row_ok[:, None] & (offs_o < n_out)[None, :], other=0.0)
    w2 = tl.load(W2 + offs_o[:, None] * stride_w2 + hid[None, :], mask=(offs_o < n_out)[:, None] & hid_ok[None, :],
                 other=0.0)
    dh = dot(d_logits, w2, DOT_FP32, INPUT_PRECISION).to(dtype).to(tl.float32)  # mm, rounded
    pre = tl.load(PRE + rows[:, None] * stride_pre + hid[None, :], mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-pre))
    d_pre = (dh * sig * (1.0 + pre * (1.0 - sig))).to(dtype)  # silu_backward in fp32, rounded
    h = (pre / (1.0 + tl.exp(-pre))).to(dtype)  # silu, as the forward rounds it
    tl.store(D_PRE + rows[:, None] * stride_dp + hid[None, :], d_pre, mask=mask)
    tl.store(H + rows[:, None] * stride_h + hid[None, :], h, mask=mask)
    d_b1 = tl.sum(tl.where(mask, d_pre.to(tl.float32), 0.0), axis=0)
    tl.store(DB1_PART + tile * n_hidden + hid, d_b1, mask=hid_ok)


BACKWARD_LAUNCH = (64, 128, 4)  # BLOCK_M tokens, BLOCK_H hidden units per program, warps


def gate_mlp_forward(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> Tensor:
    """g [tokens, n_out] for x [tokens, n_in] and the layers' weights, every tensor in x's (half) dtype: the torch
    expression's ops, its hidden layer freed on return."""
    return torch.sigmoid(F.linear(F.silu(F.linear(x, w1, b1)), w2, b2))


def gate_mlp_backward(dg: Tensor, g: Tensor, x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(d x, d W1, d b1, d W2, d b2) of gate_mlp_forward for the gradient dg of its output g."""
    n_tokens = x.shape[0]
    n_hidden, n_out = w1.shape[0], w2.shape[0]
    d_logits = torch.ops.aten.sigmoid_backward(dg.contiguous(), g)
    pre = F.linear(x, w1, b1)  # as the forward computed it
    d_pre, h = torch.empty_like(pre), torch.empty_like(pre)
    block_m, block_h, warps = BACKWARD_LAUNCH
    tiles = triton.cdiv(n_tokens, block_m)
    db1_parts = torch.empty((tiles, n_hidden), dtype=torch.float32, device=x.device)
    dot_fp32, precision = dot_settings(x.dtype)
    if n_tokens:
        _gate_mlp_bwd_kernel[(tiles, triton.cdiv(n_hidden, block_h))](
            pre, d_logits, w2, d_pre, h, db1_parts, n_tokens, n_hidden, n_out,
            pre.stride(0), d_logits.stride(0), w2.stride(0), d_pre.stride(0), h.stride(0),
            BLOCK_M=block_m, BLOCK_H=block_h, BLOCK_O=padded(n_out), DOT_FP32=dot_fp32, INPUT_PRECISION=precision,
            num_warps=warps,
        )
    return (d_pre @ w1, d_pre.t() @ x, db1_parts.sum(0).to(b1.dtype), d_logits.t() @ h,
            d_logits.sum(0, dtype=torch.float32).to(b1.dtype))


class GateMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> Tensor:
        g = gate_mlp_forward(x, w1, b1, w2, b2)
        ctx.save_for_backward(x, w1, b1, w2, g)
        return g

    @staticmethod
    def backward(ctx, dg: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        x, w1, b1, w2, g = ctx.saved_tensors
        with torch.autocast(x.device.type, enabled=False):
            return gate_mlp_backward(dg, g, x, w1, b1, w2)


def gate_mlp_kernel(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> Tensor:
    """sigmoid(W2 silu(W1 x + b1) + b2) over the last dim of x [..., n_in] (bf16 or fp16), differentiable in x and
    every weight; the weights are cast to x's dtype (differentiably, as autocast casts them for a matmul)."""
    if x.dtype not in HALF_DTYPES:
        raise ValueError(f"gate_mlp_kernel: x must be bf16 or fp16, got {x.dtype}")
    n_in = x.shape[-1]
    if w1.dim() != 2 or w1.shape[1] != n_in or b1.shape != w1.shape[:1] or w2.dim() != 2 \
            or w2.shape[1] != w1.shape[0] or b2.shape != w2.shape[:1]:
        raise ValueError(f"gate_mlp_kernel: weights must be W1 [hidden, {n_in}], b1 [hidden], W2 [out, hidden], "
                         f"b2 [out]; got {tuple(w1.shape)}, {tuple(b1.shape)}, {tuple(w2.shape)}, {tuple(b2.shape)}")
    rows = x.reshape(-1, n_in)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    dtype = x.dtype
    params = (t.to(dtype) for t in (w1, b1, w2, b2))
    g = GateMLPFunction.apply(rows, *(t if t.stride(-1) == 1 else t.contiguous() for t in params))
    return g.view(*x.shape[:-1], w2.shape[0])
