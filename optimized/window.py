"""Sliding-window attention (Section 3.3.3), banded: a chunk of C queries reads the C + w - 1 keys its windows span,
so memory is O(C * (C + w)) per head, never T x T.

range_backend "torch": masked attention chunked over queries (optimized.masked_attention); "triton": the
range-attention kernel over each query's window (optimized/ranges.py), in the inputs' own precision with fp32
accumulation."""

from __future__ import annotations

import torch
from torch import Tensor

from reference.config import NSAConfig

from . import masks
from .checks import check_branch_inputs
from .documents import Documents, stage_documents
from .masked_attention import SharedKeys, auto_chunk_size, masked_attention, query_chunks
from .ranges import check_range_backend, range_reads, window_ranges


class WindowKeyPlan:
    """Query chunks; each reads the key range covering its queries' windows, masked per query by
    masks.window_key_visible."""

    def __init__(self, positions: Tensor, n_keys: int, cfg: NSAConfig, chunk_size: int):
        self.positions = positions
        self.n_keys = n_keys
        self.cfg = cfg
        self.chunk_size = chunk_size

    def chunks(self) -> list[tuple[int, int]]:
        return query_chunks(self.positions.shape[0], self.chunk_size)

    def keys(self, q0: int, q1: int) -> SharedKeys:
        pos = self.positions[q0:q1]
        start = max(0, int(masks.window_start(pos, self.cfg).min()))
        stop = min(self.n_keys, int(pos.max()) + 1)
        keys = torch.arange(start, max(start, stop), device=pos.device)
        return SharedKeys(start, max(start, stop), masks.window_key_visible(keys[None, :], pos[:, None], self.cfg))


class PackedWindowKeyPlan:
    """Packed batch: query chunks; each reads the key range covering its queries' windows, masked per query by
    masks.window_key_visible at document-relative positions (the window restarts at the document start)."""

    def __init__(self, positions: Tensor, docs: Documents, cfg: NSAConfig, chunk_size: int):
        self.positions = positions
        self.docs = docs
        self.cfg = cfg
        self.chunk_size = chunk_size

    def chunks(self) -> list[tuple[int, int]]:
        return query_chunks(self.positions.shape[0], self.chunk_size)

    def keys(self, q0: int, q1: int) -> SharedKeys:
        pos = self.positions[q0:q1]
        doc_start = self.docs.token_start[pos]
        rel = pos - doc_start
        start = int(torch.maximum(doc_start + masks.window_start(rel, self.cfg), doc_start).min())
        stop = int(pos.max()) + 1
        key_rel = torch.arange(start, stop, device=pos.device)[None, :] - doc_start[:, None]
        valid = (key_rel >= 0) & masks.window_key_visible(key_rel, rel[:, None], self.cfg)
        return SharedKeys(start, stop, valid)


def window_attention_rows(q: Tensor, k: Tensor, v: Tensor, cfg: NSAConfig, positions: Tensor, *,
                          chunk_size: int | None = None, compute: torch.dtype | None = None,
                          docs: Documents | None = None) -> tuple[Tensor, Tensor]:
    """Window branch for queries q [B, TQ, Hq, dk] at absolute positions [TQ] over keys k [B, TK, Hkv, dk]:
    (o_win [B, TQ, Hq, dv] in the compute dtype, reads [B, TQ, Hkv] = window keys counted from the mask applied).
    compute: see masked_attention. docs: the layout of a packed batch, None for independent rows."""
    B, TQ, Hq, _ = q.shape
    if chunk_size is None:
        chunk_size = auto_chunk_size(TQ, B * Hq * 2 * cfg.window_size)
        chunk_size = min(chunk_size, max(cfg.window_size, 128))  # keys per chunk stay O(C + w)
    if docs is None:
        plan = WindowKeyPlan(positions, k.shape[1], cfg, chunk_size)
    else:
        plan = PackedWindowKeyPlan(positions, docs, cfg, chunk_size)
    return masked_attention(plan, q, k, v, compute=compute)


def window_attention_kernel_rows(q: Tensor, k: Tensor, v: Tensor, cfg: NSAConfig, positions: Tensor,
                                 docs: Documents | None = None) -> tuple[Tensor, Tensor]:
    """Window branch on the range-attention kernel for queries q [B, TQ, Hq, dk] at positions [TQ]:
    (o_win [B, TQ, Hq, dv] in q's dtype, reads [B, TQ, Hkv] = the window keys each query's range covers)."""
    from .kernels import range_attention_lse2

    lo, hi = window_ranges(positions, cfg, docs)
    o, _ = range_attention_lse2(q, k, v, lo, hi)
    return o, range_reads(lo, hi, q.shape[0], cfg.n_kv_heads)


def window_attention(q: Tensor, k: Tensor, v: Tensor, cfg: NSAConfig, *, chunk_size: int | None = None,
                     cu_seqlens: Tensor | None = None, range_backend: str = "torch") -> Tensor:
    """Sliding-window branch for prefill queries 0..T-1: o_win [B, T, Hq, d_v].
    cu_seqlens (packed batch, B = 1): keys max(s, p-w+1) .. p for a query at p of the document starting at s.
    range_backend: "torch" or "triton" (module docstring)."""
    check_branch_inputs("window_attention", q, k, v, cfg)
    check_range_backend(range_backend, q.dtype)
    positions = torch.arange(q.shape[1], device=q.device)
    docs = stage_documents(cu_seqlens, cfg, q, k=k)
    if range_backend == "triton":
        return window_attention_kernel_rows(q, k, v, cfg, positions, docs)[0]
    return window_attention_rows(q, k, v, cfg, positions, chunk_size=chunk_size, docs=docs)[0].to(q.dtype)
