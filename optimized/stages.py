"""The contract's stage functions (docs/api.md), each one dispatch point: it checks its inputs, asks
optimized.dispatch where to run once, and runs the torch path or the kernel path of its stage.

    compress -> compressed_attention -> selection_scores / select_blocks (or selection_indices, fused)
             -> selected_attention, window_attention

compress (Eq. 7) has one implementation (optimized.compression), used by both paths.
"""

from __future__ import annotations

import torch
from torch import Tensor

from reference.config import NSAConfig

from . import masks
from .compressed import compressed_attention_rows
from .compression import compress
from .dispatch import route
from .documents import Documents, check_packed_compressed, documents, stage_documents
from .forward import check_indices, selected_branch
from .scoring import select_blocks_rows, selection_indices_rows, selection_scores_rows
from .window import window_attention_rows

__all__ = ["compress", "compressed_attention", "selection_scores", "select_blocks", "selection_indices",
           "selected_attention", "window_attention"]


def compressed_attention(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, cfg: NSAConfig, *,
                         chunk_size: int | None = None, cu_seqlens: Tensor | None = None,
                         range_backend: str = "auto") -> Tensor:
    """Compressed branch for prefill queries at positions 0..T-1: o_cmp [B, T, Hq, d_v].
    A query with no visible compressed block gets exactly 0.
    cu_seqlens (packed batch, B = 1): k_cmp/v_cmp hold the packed compressed tokens of compress(..., cu_seqlens);
    a query reads only its own document's blocks, visible at its document-relative position.
    range_backend: "auto", "torch" (masked attention chunked over queries) or "triton" (the range-attention
    kernel, in the inputs' own precision with fp32 accumulation)."""
    check_branch_inputs("compressed_attention", q, k_cmp, v_cmp, cfg)
    where = route(q, k_cmp, v_cmp, range_backend=range_backend)
    positions = torch.arange(q.shape[1], device=q.device)
    docs = stage_documents(cu_seqlens, cfg, q)
    if docs is not None:
        check_packed_compressed("k_cmp", k_cmp, docs)
    if where.ranges:
        from .kernels.range_attention import compressed_branch

        return compressed_branch(q, k_cmp, v_cmp, cfg, positions, docs)[0]
    return compressed_attention_rows(q, k_cmp, v_cmp, cfg, positions, chunk_size=chunk_size,
                                     docs=docs)[0].to(q.dtype)


def selection_scores(q: Tensor, k_cmp: Tensor, cfg: NSAConfig, *, chunk_size: int | None = None,
                     cu_seqlens: Tensor | None = None, range_backend: str = "auto") -> Tensor:
    """Eq. 8-10 for prefill queries 0..T-1: [B, T, Hkv, ceil(T / l')] in compute_dtype(q.dtype) on the torch path,
    float32 on the kernels, -inf for blocks after J = p // l'.
    cu_seqlens (packed batch, B = 1; k_cmp from compress(..., cu_seqlens)): [1, T, Hkv, NB], NB = max_i
    ceil(L_i / l'); column j is the query's own document's block j, -inf after J = (p - start) // l'.
    range_backend: "auto", "torch" (vectorized) or "triton" (Eq. 8 + 10 in the group-scores kernel)."""
    _check_scoring_inputs(q, k_cmp, cfg)
    where = route(q, k_cmp, k_cmp, range_backend=range_backend)
    positions = torch.arange(q.shape[1], device=q.device)
    docs, n_sel_blocks = _scoring_layout(q, k_cmp, cfg, q.shape[1], cu_seqlens)
    if where.ranges:
        from .kernels.selection import selection_scores_rows as on_kernels

        return on_kernels(q, k_cmp, cfg, positions, n_sel_blocks, docs=docs, chunk_size=chunk_size)
    return selection_scores_rows(q, k_cmp, cfg, positions, n_sel_blocks, chunk_size=chunk_size, docs=docs)


def select_blocks(scores: Tensor, cfg: NSAConfig, *, cu_seqlens: Tensor | None = None) -> Tensor:
    """Eq. 11 for prefill queries 0..T-1: indices [B, T, Hkv, n] int64, ascending, padded with -1.
    cu_seqlens (packed batch, B = 1): document-relative block numbers (forced blocks of the query's document)."""
    if not isinstance(scores, Tensor) or scores.ndim != 4 or not scores.is_floating_point():
        raise ValueError("select_blocks: scores must be a floating tensor [B, T, Hkv, n_blocks]")
    T = scores.shape[1]
    positions = torch.arange(T, device=scores.device)
    if cu_seqlens is None:
        if scores.shape[3] < masks.sel_block_count(T, cfg):
            raise ValueError(f"select_blocks: scores has {scores.shape[3]} blocks but T={T} needs "
                             f"ceil(T/l') = {masks.sel_block_count(T, cfg)}")
        return select_blocks_rows(scores, cfg, positions)
    docs = stage_documents(cu_seqlens, cfg, scores)
    if scores.shape[3] < docs.n_sel_blocks:
        raise ValueError(f"select_blocks: scores has {scores.shape[3]} blocks but the longest document of "
                         f"cu_seqlens needs max_i ceil(L_i/l') = {docs.n_sel_blocks}")
    return select_blocks_rows(scores, cfg, positions, docs)


def selection_indices(q: Tensor, k_cmp: Tensor, cfg: NSAConfig, *, positions: Tensor | None = None,
                      n_keys: int | None = None, chunk_size: int | None = None, cu_seqlens: Tensor | None = None,
                      range_backend: str = "auto") -> Tensor:
    """Eq. 8-11 fused and chunked over queries: indices [B, TQ, Hkv, n] for queries q [B, TQ, Hq, dk] at
    positions (default 0..TQ-1) over n_keys keys (default max position + 1). Peak memory is O(chunk * N) per
    head; no [TQ, N] or [TQ, ceil(T/l')] tensor is built for all queries at once. The result does not depend on
    chunk_size or on the batch (bitwise).
    cu_seqlens (packed batch over the n_keys keys, B = 1; k_cmp packed): document-relative indices, as each
    document alone would select.
    range_backend: "auto", "torch" or "triton" (Eq. 8 + 10 in the group-scores kernel, Eq. 9-11 in the top-n
    kernel, the same indices as the torch code on the same scores)."""
    _check_scoring_inputs(q, k_cmp, cfg)
    where = route(q, k_cmp, k_cmp, range_backend=range_backend)
    TQ = q.shape[1]
    first_position = 0 if positions is None and cu_seqlens is None else None  # positions known on the host
    if positions is None:
        positions = torch.arange(TQ, device=q.device)
    if n_keys is None:
        n_keys = int(positions.max()) + 1 if TQ else 0
    docs, n_sel_blocks = _scoring_layout(q, k_cmp, cfg, n_keys, cu_seqlens)
    if where.ranges:
        from .kernels.selection import selection_indices_rows as on_kernels

        return on_kernels(q, k_cmp, cfg, positions, n_sel_blocks, docs=docs, chunk_size=chunk_size,
                          first_position=first_position)
    return selection_indices_rows(q, k_cmp, cfg, positions, n_sel_blocks, chunk_size=chunk_size, docs=docs)


def selected_attention(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, cfg: NSAConfig, *,
                       backend: str = "auto", chunk_size: int | None = None,
                       cu_seqlens: Tensor | None = None) -> Tensor:
    """Eq. 12 branch for prefill queries 0..T-1: o_slc [B, T, Hq, d_v].
    cu_seqlens (packed batch, B = 1): index j of a query in the document [s, e) means tokens s + j*l' ..
    s + (j+1)*l' - 1, clipped to <= the query's position.
    backend: "auto", "torch" (masked attention over the gathered tokens) or "triton" (the group-centric kernel,
    paper Section 3.4)."""
    check_branch_inputs("selected_attention", q, k, v, cfg)
    check_indices(indices, q, cfg)
    where = route(q, k, v, backend=backend, queries_are_suffix=0 < q.shape[1] == k.shape[1])
    positions = torch.arange(q.shape[1], device=q.device)
    docs = stage_documents(cu_seqlens, cfg, q, k=k)
    o, _ = selected_branch(where, q, k, v, indices, cfg, positions, chunk_size=chunk_size, docs=docs)
    return o.to(q.dtype)


def window_attention(q: Tensor, k: Tensor, v: Tensor, cfg: NSAConfig, *, chunk_size: int | None = None,
                     cu_seqlens: Tensor | None = None, range_backend: str = "auto") -> Tensor:
    """Sliding-window branch for prefill queries 0..T-1: o_win [B, T, Hq, d_v].
    cu_seqlens (packed batch, B = 1): keys max(s, p-w+1) .. p for a query at p of the document starting at s.
    range_backend: "auto", "torch" (banded masked attention) or "triton" (the range-attention kernel)."""
    check_branch_inputs("window_attention", q, k, v, cfg)
    where = route(q, k, v, range_backend=range_backend)
    positions = torch.arange(q.shape[1], device=q.device)
    docs = stage_documents(cu_seqlens, cfg, q, k=k)
    if where.ranges:
        from .kernels.range_attention import window_branch

        return window_branch(q, k, v, cfg, positions, docs)[0]
    return window_attention_rows(q, k, v, cfg, positions, chunk_size=chunk_size, docs=docs)[0].to(q.dtype)


def check_branch_inputs(stage: str, q: Tensor, k: Tensor, v: Tensor, cfg: NSAConfig) -> None:
    """Shapes the branch stages rely on; a ValueError names the tensor and the rule."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.ndim != 4:
            raise ValueError(f"{stage}: {name} must be a 4-dim tensor [B, T, H, D]")
    if q.shape[2] != cfg.n_heads or q.shape[3] != cfg.head_dim_qk:
        raise ValueError(f"{stage}: q must be [B, T, n_heads={cfg.n_heads}, head_dim_qk={cfg.head_dim_qk}], "
                         f"got {tuple(q.shape)}")
    if k.shape[2] != cfg.n_kv_heads or k.shape[3] != cfg.head_dim_qk:
        raise ValueError(f"{stage}: k must be [B, T, n_kv_heads={cfg.n_kv_heads}, head_dim_qk={cfg.head_dim_qk}], "
                         f"got {tuple(k.shape)}")
    if tuple(v.shape[:3]) != tuple(k.shape[:3]) or v.shape[3] != cfg.head_dim_v:
        raise ValueError(f"{stage}: v must be [B, T, n_kv_heads, head_dim_v={cfg.head_dim_v}] like k, "
                         f"got {tuple(v.shape)}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"{stage}: k batch {k.shape[0]} != q batch {q.shape[0]}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{stage}: {name} is {t.dtype} on {t.device} but q is {q.dtype} on {q.device}")


def _scoring_layout(q: Tensor, k_cmp: Tensor, cfg: NSAConfig, n_keys: int,
                    cu_seqlens: Tensor | None) -> tuple[Documents | None, int]:
    """The layout of a packed batch of n_keys keys (None without cu_seqlens; k_cmp must then hold its documents'
    compressed tokens) and NB, the selection-score columns of a row."""
    docs = None if cu_seqlens is None else documents(cu_seqlens, n_keys, q.shape[0], cfg, q.device)
    if docs is None:
        return None, masks.sel_block_count(n_keys, cfg)
    check_packed_compressed("k_cmp", k_cmp, docs)
    return docs, docs.n_sel_blocks


def _check_scoring_inputs(q: Tensor, k_cmp: Tensor, cfg: NSAConfig) -> None:
    if not isinstance(q, Tensor) or q.ndim != 4 or q.shape[2] != cfg.n_heads or q.shape[3] != cfg.head_dim_qk:
        raise ValueError(f"q must be [B, T, n_heads={cfg.n_heads}, head_dim_qk={cfg.head_dim_qk}]")
    if (not isinstance(k_cmp, Tensor) or k_cmp.ndim != 4 or k_cmp.shape[0] != q.shape[0]
            or k_cmp.shape[2] != cfg.n_kv_heads or k_cmp.shape[3] != cfg.head_dim_qk):
        raise ValueError(f"k_cmp must be [B, N, n_kv_heads={cfg.n_kv_heads}, head_dim_qk={cfg.head_dim_qk}] "
                         f"with q's batch")
