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
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, indices: Tensor, sel_block: int, scale: float,
                doc_start: Tensor | None) -> Tensor:
        o, stats = selected_attention_forward(q, k, v, indices, sel_block, scale, doc_start=doc_start)
        ctx.save_for_backward(q, k, v, indices, o, stats, doc_start)
        ctx.sel_block, ctx.scale = sel_block, scale
        return o

    @staticmethod
    def backward(ctx, do: Tensor):
        q, k, v, indices, o, stats, doc_start = ctx.saved_tensors
        dq, dk, dv = selected_attention_backward(q, k, v, indices, o, stats, do, ctx.sel_block, ctx.scale,
                                                 doc_start=doc_start)
        return dq, dk, dv, None, None, None, None


def triton_selected_attention(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, sel_block: int,
                              scale: float | None = None, *, doc_start: Tensor | None = None) -> Tensor:
    """Eq. 12 with the Triton kernels: o [B, TQ, Hq, dv].

    q [B, TQ, Hq, dk]: the queries at the LAST TQ positions of the TK keys (row t is position TK - TQ + t;
    prefill TQ = TK, decode TQ = 1 or a chunk). k [B, TK, Hkv, dk], v [B, TK, Hkv, dv], Hq = h * Hkv with
    group size h in 1..64, dk, dv <= 256. indices [B, TQ, Hkv, n] int32/int64: selected block indices of
    each (query, KV group), ascending, -1 padded (any negative entry is padding). Block j holds keys
    [j * sel_block, (j + 1) * sel_block) clipped to <= the query's position. scale defaults to 1/sqrt(dk).
    A query with no visible key outputs 0. fp32/bf16/fp16 inputs (all the same), fp32 accumulation; fp32
    dots are exact fp32 (no TF32). Differentiable in q, k, v; dk/dv are deterministic.
    Tensors must be on CUDA, or on CPU with TRITON_INTERPRET=1 set before the kernels were imported.

    doc_start (packed batch of documents, issue 9): int32/int64 [TQ], the first key of each query row's
    document; indices are then document-relative: block j of row t holds keys doc_start[t] + j * sel_block ..,
    clipped to <= the row's position. Documents are contiguous: doc_start is non-decreasing, doc_start[t] <= the
    row's position, and a row whose doc_start differs from the previous row's starts its document
    (doc_start[t] = its position). Checked here (one device sync); a ValueError names the rule.
    """
    _validate(q, k, v, indices, sel_block)
    if doc_start is not None:
        doc_start = _validated_doc_start(doc_start, q.shape[1], k.shape[1], q.device)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    return SelectedAttentionFunction.apply(q, k, v, indices, sel_block, float(scale), doc_start)


def _validated_doc_start(doc_start: Tensor, n_queries: int, n_keys: int, device: torch.device) -> Tensor:
    """doc_start as a contiguous int32 [TQ] tensor, after checking the packed-batch rules of
    triton_selected_attention."""
    where = "triton_selected_attention: doc_start"
    if not isinstance(doc_start, Tensor) or doc_start.dtype not in INDEX_DTYPES or tuple(doc_start.shape) != (
            n_queries,):
        raise ValueError(f"{where} must be an int32/int64 tensor [TQ] = [{n_queries}], got "
                         f"{getattr(doc_start, 'dtype', type(doc_start).__name__)} "
                         f"{tuple(getattr(doc_start, 'shape', ()))}")
    if doc_start.device != device:
        raise ValueError(f"{where} is on {doc_start.device} but q is on {device}")
    starts = doc_start.long()
    positions = torch.arange(n_keys - n_queries, n_keys, device=device)
    new_doc = torch.ones_like(starts, dtype=torch.bool)
    new_doc[1:] = starts[1:] != starts[:-1]
    broken = (starts < 0) | (starts > positions)
    broken[1:] |= starts[1:] < starts[:-1]
    broken[1:] |= new_doc[1:] & (starts[1:] != positions[1:])
    if bool(broken.any()):
        t = int(broken.nonzero()[0])
        raise ValueError(f"{where}[{t}] = {int(starts[t])} breaks the packed-batch rule: non-decreasing, "
                         f"0 <= doc_start[t] <= position {int(positions[t])}, and a new document starts at its row")
    return starts.to(torch.int32).contiguous()


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
