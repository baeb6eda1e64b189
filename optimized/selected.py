"""Selected-token attention (Eq. 12): each (query, KV group) attends to the tokens of its selected blocks,
clipped to the query's position (block J is partial).

Backends (the `backend` keyword):
- "torch": masked attention over the gathered tokens, chunked over queries (optimized.masked_attention);
- "triton": the group-centric kernel of optimized.kernels (paper Section 3.4); on CPU it needs the Triton
  interpreter (TRITON_INTERPRET=1 set before the kernels are imported, as the root conftest.py does);
- "auto": "triton" for CUDA tensors when the kernels import and the queries are the last TQ key positions,
  "torch" otherwise.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from reference.config import NSAConfig

from . import masks
from .checks import check_branch_inputs
from .documents import Documents, stage_documents
from .masked_attention import GatheredKeys, auto_chunk_size, compute_dtype, masked_attention, query_chunks

BACKENDS = ("auto", "torch", "triton")


def selected_tokens(indices: Tensor, positions: Tensor, cfg: NSAConfig,
                    doc_start: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Eq. 12 token sets: tokens [B, TQ, Hkv, n*l'] of the selected blocks (block j holds j*l' .. (j+1)*l' - 1)
    and valid [same], False for padding (-1) entries and for tokens after the query.
    doc_start [TQ] (packed batch): block j of a query holds its document's tokens doc_start + j*l' ..; positions
    are packed positions, and the clip to the query is applied at document-relative positions."""
    offsets = torch.arange(cfg.sel_block, device=indices.device)
    tokens = (indices[..., None] * cfg.sel_block + offsets).flatten(-2)
    pos = positions[None, :, None, None]
    if doc_start is not None:
        pos = pos - doc_start[None, :, None, None]
    valid = ((indices >= 0)[..., None].expand(*indices.shape, cfg.sel_block).flatten(-2)
             & masks.selected_token_visible(tokens, pos, cfg))
    if doc_start is not None:
        tokens = tokens + doc_start[None, :, None, None]
    return tokens, valid


def selected_reads(indices: Tensor, positions: Tensor, cfg: NSAConfig, doc_start: Tensor | None = None) -> Tensor:
    """reads [B, TQ, Hkv]: the valid tokens of the gathered blocks (selected_tokens), counted in query chunks so
    the [B, C, Hkv, n*l'] token masks stay within CHUNK_ELEMENTS (at T = 64k the whole mask would be 268M
    elements, and its int64 token indices 2 GiB). doc_start: see selected_tokens."""
    B, TQ, Hkv, n = indices.shape
    chunk = auto_chunk_size(TQ, B * Hkv * n * cfg.sel_block * 10)  # int64 tokens + bool masks per element
    reads = torch.empty((B, TQ, Hkv), dtype=torch.int64, device=indices.device)
    with torch.no_grad():
        for q0, q1 in query_chunks(TQ, chunk):
            starts = None if doc_start is None else doc_start[q0:q1]
            reads[:, q0:q1] = selected_tokens(indices[:, q0:q1], positions[q0:q1], cfg, starts)[1].sum(dim=-1)
    return reads


class SelectedKeyPlan:
    """Query chunks; each (query, KV head) reads the gathered tokens of its selected blocks."""

    def __init__(self, indices: Tensor, positions: Tensor, cfg: NSAConfig, chunk_size: int,
                 doc_start: Tensor | None = None):
        self.indices = indices
        self.positions = positions
        self.cfg = cfg
        self.chunk_size = chunk_size
        self.doc_start = doc_start

    def chunks(self) -> list[tuple[int, int]]:
        return query_chunks(self.positions.shape[0], self.chunk_size)

    def keys(self, q0: int, q1: int) -> GatheredKeys:
        starts = None if self.doc_start is None else self.doc_start[q0:q1]
        tokens, valid = selected_tokens(self.indices[:, q0:q1], self.positions[q0:q1], self.cfg, starts)
        return GatheredKeys(torch.where(valid, tokens, torch.zeros_like(tokens)), valid)


def _use_triton(backend: str, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, kernel_dtype: torch.dtype) -> bool:
    """Whether the selected branch runs on the Triton kernel; "auto" falls back to torch where the kernel cannot
    run (no CUDA, no triton, float64, queries that are not the last TQ keys, sizes past the kernel's limits)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return False
    TQ, n_keys = positions.shape[0], k.shape[1]
    is_suffix = TQ > 0 and int(positions[0]) == n_keys - TQ and int(positions[-1]) == n_keys - 1
    if backend == "triton":
        if not is_suffix:
            raise ValueError("backend='triton' needs the queries to be the last TQ key positions")
        if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before the kernels "
                             "are imported")
        return True
    if not (q.is_cuda and is_suffix):
        return False
    try:
        from optimized.kernels import selected_attention as kernel
    except ImportError:
        return False
    group, head_dim = q.shape[2] // k.shape[2], max(q.shape[3], v.shape[3])
    return kernel_dtype in kernel.FLOAT_DTYPES and group <= kernel.MAX_GROUP and head_dim <= kernel.MAX_HEAD_DIM


def selected_attention_rows(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, cfg: NSAConfig, positions: Tensor,
                            *, backend: str = "auto", chunk_size: int | None = None,
                            compute: torch.dtype | None = None, kernel_dtype: torch.dtype | None = None,
                            widen_kernel_output: bool = True,
                            docs: Documents | None = None) -> tuple[Tensor, Tensor]:
    """Selected branch for queries q [B, TQ, Hq, dk] at absolute positions [TQ] over keys k [B, TK, Hkv, dk]:
    (o_slc [B, TQ, Hq, dv] in the compute dtype, reads [B, TQ, Hkv] = valid tokens of the gathered blocks).
    compute: see masked_attention; kernel_dtype: the dtype the Triton kernel reads (default q.dtype; nsa_forward
    passes widened inputs and the caller's dtype); widen_kernel_output=False returns the Triton kernel's output in
    kernel_dtype (its values, without an fp32 copy; the torch path still returns the compute dtype). docs: the
    layout of a packed batch (indices are document-relative blocks), None for independent rows."""
    B, TQ, Hq, _ = q.shape
    kernel_dtype = kernel_dtype or q.dtype
    compute = compute or compute_dtype(q.dtype)
    doc_start = None if docs is None else docs.token_start[positions]
    if _use_triton(backend, q, k, v, positions, kernel_dtype):
        from optimized.kernels import triton_selected_attention

        kernel_starts = None if doc_start is None else doc_start.to(torch.int32)
        o = triton_selected_attention(q.to(kernel_dtype), k.to(kernel_dtype), v.to(kernel_dtype), indices,
                                      cfg.sel_block, doc_start=kernel_starts)
        return o.to(compute) if widen_kernel_output else o, selected_reads(indices, positions, cfg, doc_start)
    n_tokens = indices.shape[-1] * cfg.sel_block
    if chunk_size is None:
        per_query = B * n_tokens * (cfg.n_kv_heads * (k.shape[-1] + v.shape[-1] + 4) + Hq)
        chunk_size = auto_chunk_size(TQ, per_query)
    plan = SelectedKeyPlan(indices, positions, cfg, chunk_size, doc_start)
    return masked_attention(plan, q, k, v, compute=compute)


def selected_attention(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, cfg: NSAConfig, *,
                       backend: str = "auto", chunk_size: int | None = None,
                       cu_seqlens: Tensor | None = None) -> Tensor:
    """Eq. 12 branch for prefill queries 0..T-1: o_slc [B, T, Hq, d_v].
    cu_seqlens (packed batch, B = 1): index j of a query in the document [s, e) means tokens s + j*l' ..
    s + (j+1)*l' - 1, clipped to <= the query's position."""
    check_branch_inputs("selected_attention", q, k, v, cfg)
    check_indices(indices, q, cfg)
    positions = torch.arange(q.shape[1], device=q.device)
    docs = stage_documents(cu_seqlens, cfg, q, k=k)
    o, _ = selected_attention_rows(q, k, v, indices, cfg, positions, backend=backend, chunk_size=chunk_size,
                                   docs=docs)
    return o.to(q.dtype)


def check_indices(indices: Tensor, q: Tensor, cfg: NSAConfig) -> None:
    if not isinstance(indices, Tensor) or indices.ndim != 4 or indices.dtype != torch.int64:
        raise ValueError("indices must be an int64 tensor [B, T, Hkv, n]")
    if tuple(indices.shape[:3]) != (q.shape[0], q.shape[1], cfg.n_kv_heads):
        raise ValueError(f"indices must be [B, T, Hkv, n] = [{q.shape[0]}, {q.shape[1]}, {cfg.n_kv_heads}, n], "
                         f"got {tuple(indices.shape)}")
    if indices.device != q.device:
        raise ValueError(f"indices is on {indices.device} but q is on {q.device}")
