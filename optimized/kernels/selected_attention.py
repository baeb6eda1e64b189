"""triton_selected_attention: the selected-attention branch (Eq. 12) on the Triton kernels, differentiable.

Forward: selected_attention_fwd (group-centric, paper Section 3.4). Backward: selected_attention_bwd (dq
query-centric; dk/dv key-centric over an inverted index; deterministic, no atomics).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .selected_attention_bwd import selected_attention_backward
from .selected_attention_fwd import selected_attention_forward
from .tiling import MAX_GROUP, MAX_HEAD_DIM, interpreting

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


class SelectedAttentionFunction(torch.autograd.Function):
    """o = Eq. 12 of (q, k, v) over the selected blocks `indices`; gradients for q, k, v."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, indices: Tensor, sel_block: int, scale: float) -> Tensor:
        o, stats = selected_attention_forward(q, k, v, indices, sel_block, scale)
        ctx.save_for_backward(q, k, v, indices, o, stats)
        ctx.sel_block, ctx.scale = sel_block, scale
        return o

    @staticmethod
    def backward(ctx, do: Tensor):
        q, k, v, indices, o, stats = ctx.saved_tensors
        dq, dk, dv = selected_attention_backward(q, k, v, indices, o, stats, do, ctx.sel_block, ctx.scale)
        return dq, dk, dv, None, None, None


def triton_selected_attention(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, sel_block: int,
                              scale: float | None = None) -> Tensor:
    """Eq. 12 with the Triton kernels: o [B, TQ, Hq, dv].

    q [B, TQ, Hq, dk]: the queries at the LAST TQ positions of the TK keys (row t is position TK - TQ + t;
    prefill TQ = TK, decode TQ = 1 or a chunk). k [B, TK, Hkv, dk], v [B, TK, Hkv, dv], Hq = h * Hkv with
    group size h in 1..64, dk, dv <= 256. indices [B, TQ, Hkv, n] int32/int64: selected block indices of
    each (query, KV group), ascending, -1 padded (any negative entry is padding). Block j holds keys
    [j * sel_block, (j + 1) * sel_block) clipped to <= the query's position. scale defaults to 1/sqrt(dk).
    A query with no visible key outputs 0. fp32/bf16/fp16 inputs (all the same), fp32 accumulation; fp32
    dots are exact fp32 (no TF32). Differentiable in q, k, v; dk/dv are deterministic.
    Tensors must be on CUDA, or on CPU with TRITON_INTERPRET=1 set before the kernels were imported.
    """
    _validate(q, k, v, indices, sel_block)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    return SelectedAttentionFunction.apply(q, k, v, indices, sel_block, float(scale))


def _validate(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, sel_block: int) -> None:
    for name, x in (("q", q), ("k", k), ("v", v), ("indices", indices)):
        if x.dim() != 4:
            raise ValueError(f"triton_selected_attention: {name} must be 4-D, got shape {tuple(x.shape)}")
    B, TQ, Hq, dk = q.shape
    Bk, TK, Hkv, dk_k = k.shape
    if k.shape[:3] != v.shape[:3] or Bk != B:
        raise ValueError("triton_selected_attention: k [B, TK, Hkv, dk] and v [B, TK, Hkv, dv] must share B, TK, "
                         f"Hkv with q's B; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if dk_k != dk:
        raise ValueError(f"triton_selected_attention: q and k must have the same head dim dk, got {dk} and {dk_k}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"triton_selected_attention: Hq ({Hq}) must be a multiple of Hkv ({Hkv}) (GQA)")
    if Hq // Hkv > MAX_GROUP:
        raise ValueError(f"triton_selected_attention: group size Hq/Hkv = {Hq // Hkv} exceeds {MAX_GROUP}")
    if max(dk, v.shape[-1]) > MAX_HEAD_DIM:
        raise ValueError(f"triton_selected_attention: head dims dk={dk}, dv={v.shape[-1]} must be <= {MAX_HEAD_DIM}")
    if TQ > TK:
        raise ValueError(f"triton_selected_attention: TQ ({TQ}) must be <= TK ({TK}): queries are the last TQ keys")
    if tuple(indices.shape[:3]) != (B, TQ, Hkv):
        raise ValueError(f"triton_selected_attention: indices must be [B, TQ, Hkv, n] = [{B}, {TQ}, {Hkv}, n], "
                         f"got {tuple(indices.shape)}")
    if indices.dtype not in INDEX_DTYPES:
        raise ValueError(f"triton_selected_attention: indices must be int32 or int64, got {indices.dtype}")
    if q.dtype not in FLOAT_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError("triton_selected_attention: q, k, v must share one dtype among fp32/bf16/fp16, got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    if isinstance(sel_block, bool) or not isinstance(sel_block, int) or sel_block <= 0:
        raise ValueError(f"triton_selected_attention: sel_block must be a positive int, got {sel_block!r}")
    devices = {x.device for x in (q, k, v, indices)}
    if len(devices) != 1:
        raise ValueError(f"triton_selected_attention: q, k, v, indices must be on one device, got {devices}")
    if q.device.type != "cuda" and not interpreting():
        raise ValueError("triton_selected_attention: tensors must be on CUDA (or set TRITON_INTERPRET=1 before "
                         f"importing the kernels to run them on CPU), got device {q.device}")
