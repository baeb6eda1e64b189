"""The LM head's cross-entropy on one chunk of logits in two Triton passes (CUDA; the interpreter in tests).

`lm_head_loss` (sentinels/model.py) computes the loss and its gradient chunk by chunk. In torch, a chunk of bf16
logits [R, V] is widened to fp32 and walked by about ten elementwise kernels (the widening, the padding's -inf, the
logsumexp's passes, the softmax in place, the one-hot, the weights, the narrowing), each reading and most writing
4 bytes per logit: at prod-125m (V = 50304, 65536 tokens per step) they took about a third of a training step.
Here the logits stay in the matmul's dtype and are read twice:

1. `_row_lse_kernel`, one program per row: the logsumexp of the row's first `vocab` logits (fp32, an online max
   and sum over column tiles) and the target's logit.
2. `_softmax_grad_kernel`, one program per (row, column tile): dlogits = w_r (softmax - onehot), fp32, written
   over the logits in their dtype (rounded once, as the torch path's final cast rounds). Columns past `vocab`
   (the matmul's padding) get 0, the softmax of a -inf logit.

The math is the torch path's (fp32 from the same rounded logits); only the order of the logsumexp's sum differs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

LSE_BLOCK = 2048  # columns per step of the logsumexp's walk along a row
GRAD_BLOCK = 2048  # columns per softmax-gradient program


@triton.jit
def _row_lse_kernel(LOGITS, LABELS, LSE, TARGET, stride_row, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride_row
    offs = tl.arange(0, BLOCK)
    lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_sum = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + offs
        x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(lane_max, x)
        seen = new_max > float("-inf")  # a lane that has only seen padding keeps sum 0
        shift = tl.where(seen, new_max, 0.0)  # (never -inf - -inf)
        lane_sum = lane_sum * tl.exp(lane_max - shift) + tl.exp(x - shift)
        lane_max = new_max
    row_max = tl.max(lane_max, 0)
    total = tl.sum(lane_sum * tl.exp(lane_max - row_max), 0)  # a lane that saw only padding: 0 * 0
    tl.store(LSE + row, row_max + tl.log(total))
    label = tl.load(LABELS + row).to(tl.int64)
    tl.store(TARGET + row, tl.load(base + label).to(tl.float32))


@triton.jit
def _softmax_grad_kernel(LOGITS, LABELS, LSE, WEIGHT, stride_row, vocab, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < width
    base = LOGITS + row * stride_row
    x = tl.load(base + cols, mask=in_row, other=0.0).to(tl.float32)
    lse = tl.load(LSE + row)
    label = tl.load(LABELS + row).to(tl.int64)
    weight = tl.load(WEIGHT + row)
    softmax = tl.where(cols < vocab, tl.exp(x - lse), 0.0)
    grad = (softmax - tl.where(cols == label, 1.0, 0.0)) * weight
    tl.store(base + cols, grad.to(LOGITS.dtype.element_ty), mask=in_row)


def softmax_cross_entropy_(logits: Tensor, labels: Tensor, weights: Tensor, vocab: int) -> Tensor:
    """For logits [R, W] (W >= vocab columns, the first vocab real; last dim contiguous), labels [R] in
    [0, vocab) and fp32 weights [R]: returns the fp32 per-row losses w_r (logsumexp_r - logits[r, y_r]) and
    overwrites the logits with their gradient w_r (softmax_r - onehot(y_r)) (0 past vocab), in their dtype."""
    rows, width = logits.shape
    if logits.stride(-1) != 1:
        raise ValueError("logits must have a contiguous last dim")
    lse = torch.empty(rows, device=logits.device, dtype=torch.float32)
    target = torch.empty_like(lse)
    if rows == 0:
        return lse
    labels = labels.contiguous()
    weights = weights.to(torch.float32).contiguous()
    _row_lse_kernel[(rows,)](logits, labels, lse, target, logits.stride(0), vocab, BLOCK=LSE_BLOCK, num_warps=8)
    _softmax_grad_kernel[(rows, triton.cdiv(width, GRAD_BLOCK))](
        logits, labels, lse, weights, logits.stride(0), vocab, width, BLOCK=GRAD_BLOCK, num_warps=8)
    return (lse - target) * weights
