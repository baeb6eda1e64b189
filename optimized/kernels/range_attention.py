"""triton_range_attention: Eq. 2 where every query row reads one contiguous key range, on the Triton kernels,
differentiable in q, k and v (the compressed and sliding-window branches; optimized/ranges.py builds the ranges).

Forward: range_attention_fwd (FlashAttention-2 tiles, online softmax in fp32). Backward: range_attention_bwd
(dq query-centric, dk/dv key-centric over the contiguous run of rows that can read each key tile; deterministic,
no atomics).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .range_attention_bwd import range_attention_backward
from .range_attention_fwd import range_attention_forward
from .selected_attention_fwd import LN2
from .tiling import MAX_HEAD_DIM, interpreting

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
RANGE_DTYPES = (torch.int32, torch.int64)


class RangeAttentionFunction(torch.autograd.Function):
    """(o, lse2) of Eq. 2 over each row's key range, lse2 the base-2 log-sum-exp of the scaled logits; gradients
    for q, k, v (lse2 is not differentiable)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, lo: Tensor, hi: Tensor, scale: float):
        o, lse2 = range_attention_forward(q, k, v, lo, hi, scale)
        ctx.save_for_backward(q, k, v, lo, hi, o, lse2)
        ctx.scale = scale
        ctx.mark_non_differentiable(lse2)
        return o, lse2

    @staticmethod
    def backward(ctx, do: Tensor, _dlse2: Tensor):
        q, k, v, lo, hi, o, lse2 = ctx.saved_tensors
        dq, dk, dv = range_attention_backward(q, k, v, lo, hi, o, lse2, do.contiguous(), ctx.scale)
        return dq, dk, dv, None, None, None


def triton_range_attention(q: Tensor, k: Tensor, v: Tensor, lo: Tensor, hi: Tensor,
                           scale: float | None = None) -> tuple[Tensor, Tensor]:
    """Eq. 2 for every query row over its key range [lo[t], hi[t]] (inclusive; empty when hi < lo):
    (o [B, TQ, Hq, dv] in q's dtype, lse [B, TQ, Hq] fp32 natural-log log-sum-exp of the scaled logits,
    -inf for an empty row, whose o is 0).

    q [B, TQ, Hq, dk], k [B, TK, Hkv, dk], v [B, TK, Hkv, dv] (GQA: head h reads KV head h // (Hq / Hkv));
    lo, hi int32/int64 [TQ], the same for every batch row, NON-DECREASING in t (true of the window and of the
    compressed branch, packed documents included), 0 <= lo <= TK and -1 <= hi < TK. scale defaults to
    1/sqrt(dk). fp32/bf16/fp16 inputs (all the same), fp32 accumulation; fp32 dots are exact fp32 (no TF32).
    Tensors must be on CUDA, or on CPU with TRITON_INTERPRET=1 set before the kernels were imported.
    """
    o, lse2 = range_attention_lse2(q, k, v, lo, hi, scale)
    return o, lse2 * LN2


def range_attention_lse2(q: Tensor, k: Tensor, v: Tensor, lo: Tensor, hi: Tensor,
                         scale: float | None = None, *, checked: bool = False) -> tuple[Tensor, Tensor]:
    """triton_range_attention with the normaliser as the kernel keeps it: (o, lse2), lse2 = lse * log2(e) (the
    base-2 log-sum-exp), which the group-scores kernel takes as it is (no rounding round trip).
    checked: lo, hi are what check_range_inputs returned for these tensors (not validated again)."""
    if not checked:
        lo, hi = check_range_inputs(q, k, v, lo, hi)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    return RangeAttentionFunction.apply(q, k, v, lo, hi, float(scale))


def range_logsumexp2(q: Tensor, k: Tensor, lo: Tensor, hi: Tensor, scale: float | None = None) -> Tensor:
    """lse2 [B, TQ, Hq] (base-2 log-sum-exp of the scaled logits, fp32, -inf for an empty row) over each row's key
    range, without the P.V product (the selection scoring's Eq. 8 normaliser); not differentiable."""
    lo, hi = check_range_inputs(q, k, None, lo, hi)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    q, k = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k))
    return range_attention_forward(q.detach(), k.detach(), None, lo, hi, float(scale))[1]


def check_range_inputs(q: Tensor, k: Tensor, v: Tensor | None, lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor]:
    """Validate the inputs of triton_range_attention (ValueError naming the tensor and the rule); returns lo, hi
    as contiguous int32 after checking the range rules (one device sync)."""
    where = "triton_range_attention"
    named = (("q", q), ("k", k)) + ((("v", v),) if v is not None else ())
    for name, x in named:
        if not isinstance(x, Tensor) or x.dim() != 4:
            raise ValueError(f"{where}: {name} must be a 4-D tensor, got {getattr(x, 'shape', type(x).__name__)}")
    B, TQ, Hq, dk = q.shape
    _, TK, Hkv, dk_k = k.shape
    if k.shape[0] != B or (v is not None and tuple(v.shape[:3]) != tuple(k.shape[:3])):
        raise ValueError(f"{where}: k [B, TK, Hkv, dk] and v [B, TK, Hkv, dv] must share B, TK, Hkv with q's B; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {None if v is None else tuple(v.shape)}")
    if dk_k != dk:
        raise ValueError(f"{where}: q and k must have the same head dim dk, got {dk} and {dk_k}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"{where}: Hq ({Hq}) must be a multiple of Hkv ({Hkv}) (GQA)")
    dims = (dk,) + ((v.shape[-1],) if v is not None else ())
    if max(dims) > MAX_HEAD_DIM:
        raise ValueError(f"{where}: head dims {dims} must be <= {MAX_HEAD_DIM}")
    if q.dtype not in FLOAT_DTYPES or any(x.dtype != q.dtype for _, x in named):
        raise ValueError(f"{where}: q, k, v must share one dtype among fp32/bf16/fp16, got "
                         f"{[str(x.dtype) for _, x in named]}")
    for name, r in (("lo", lo), ("hi", hi)):
        if not isinstance(r, Tensor) or r.dtype not in RANGE_DTYPES or tuple(r.shape) != (TQ,):
            raise ValueError(f"{where}: {name} must be an int32/int64 tensor [TQ] = [{TQ}], got "
                             f"{getattr(r, 'dtype', type(r).__name__)} {tuple(getattr(r, 'shape', ()))}")
    devices = {x.device for _, x in named} | {lo.device, hi.device}
    if len(devices) != 1:
        raise ValueError(f"{where}: q, k, v, lo, hi must be on one device, got {devices}")
    if q.device.type != "cuda" and not interpreting():
        raise ValueError(f"{where}: tensors must be on CUDA (or set TRITON_INTERPRET=1 before importing the "
                         f"kernels to run them on CPU), got device {q.device}")
    if TQ:
        lo64, hi64 = lo.to(torch.int64), hi.to(torch.int64)
        broken = (lo64 < 0) | (lo64 > TK) | (hi64 < -1) | (hi64 >= TK)
        broken[1:] |= (lo64[1:] < lo64[:-1]) | (hi64[1:] < hi64[:-1])
        if bool(broken.any()):
            t = int(broken.nonzero()[0])
            raise ValueError(f"{where}: the range of row {t}, [lo, hi] = [{int(lo64[t])}, {int(hi64[t])}], breaks "
                             f"the rules 0 <= lo <= TK = {TK}, -1 <= hi < TK, lo and hi non-decreasing in the row")
    return lo.to(torch.int32).contiguous(), hi.to(torch.int32).contiguous()
