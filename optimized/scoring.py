"""The torch path of selection scoring (Eq. 8-10) and top-n block selection (Eq. 11), vectorized and chunked over
queries. The kernel path of the same stages is optimized/kernels/selection.py.

Selection is discrete: nothing here carries gradients (as in the reference). Scores are computed in
dispatch.compute_dtype (float32 for half/bfloat16 inputs, float64 for float32/float64 inputs).

Chunk invariance: a query row's logits always span all N compressed blocks (invisible ones are masked), its
softmax sum, Eq. 9 band and Eq. 10 head sum are added in a fixed order, and Eq. 11 is a per-row stable sort, so the
indices of a row do not depend on which other rows (chunk, batch) are computed with it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from reference.config import NSAConfig

from . import masks
from .dispatch import compute_dtype
from .documents import Documents
from .numerics import CHUNK_ELEMENTS, query_chunks


def pool_eq9(p_cmp: Tensor, n_sel_blocks: int, cfg: NSAConfig) -> Tensor:
    """Eq. 9: p_slc[..., j] = sum_k w[k] * p_cmp[..., (l'/d) * j + first_offset + k] for j < n_sel_blocks, with the
    fixed band of masks.eq9_pool_weights; indices outside p_cmp's N blocks contribute 0."""
    band = masks.eq9_pool_weights(cfg)
    stride = cfg.pieces_per_sel_block
    n_cmp = p_cmp.shape[-1]
    lowest = band.first_offset
    highest = stride * (n_sel_blocks - 1) + band.first_offset + len(band.weights) - 1
    left, right = max(0, -lowest), max(0, highest - (n_cmp - 1))
    padded = F.pad(p_cmp, (left, right))
    span = stride * (n_sel_blocks - 1) + 1
    total = None
    for k, weight in enumerate(band.weights):
        start = lowest + left + k
        term = weight * padded[..., start:start + span:stride]
        total = term if total is None else total + term
    return total


def scores_of_chunk(q_chunk: Tensor, k_cmp: Tensor, positions: Tensor, n_sel_blocks: int,
                  cfg: NSAConfig) -> Tensor:
    """Eq. 8-10 for queries q_chunk [B, C, Hq, dk] at positions [C]; k_cmp [B, N, Hkv, dk] in the compute dtype.
    Returns [B, C, Hkv, n_sel_blocks], -inf for blocks after J = p // l'."""
    B, C, Hq, dk = q_chunk.shape
    H = cfg.n_kv_heads
    qc = q_chunk.reshape(B, C, H, Hq // H, dk).to(k_cmp.dtype)
    blocks = torch.arange(k_cmp.shape[1], device=q_chunk.device)
    logits = torch.einsum("bchgd,bnhd->bchgn", qc, k_cmp) / math.sqrt(dk)
    visible = masks.compressed_block_visible(blocks[None, :], positions[:, None], cfg)[None, :, None, None, :]
    p_cmp = masks.cmp_importance(logits, visible, cfg)  # Eq. 8
    p_slc = pool_eq9(p_cmp, n_sel_blocks, cfg)  # Eq. 9, per query head
    scores = masks.group_reduce(p_slc, cfg)  # Eq. 10
    sel = torch.arange(n_sel_blocks, device=q_chunk.device)
    after_current = sel[None, :] > masks.current_sel_block(positions, cfg)[:, None]
    return scores.masked_fill(after_current[None, :, None, :], float("-inf"))


def packed_scores_of_chunk(q_chunk: Tensor, k_cmp: Tensor, positions: Tensor, n_sel_blocks: int, cfg: NSAConfig,
                         docs: Documents) -> Tensor:
    """scores_of_chunk for a packed batch: queries at packed positions [C] score their own document's selection
    blocks. The logits against the chunk's documents' compressed tokens are moved to document-local block
    numbers (row c's local block m is packed compressed token cmp_bounds[doc] + m), so Eq. 8-10 run on exactly
    the row a document alone gives, padded with invisible (exactly 0) blocks past the document's last one.
    Returns [B, C, Hkv, n_sel_blocks], -inf for blocks after J = (p - start) // l'."""
    B, C, Hq, dk = q_chunk.shape
    H = cfg.n_kv_heads
    qc = q_chunk.reshape(B, C, H, Hq // H, dk).to(k_cmp.dtype)
    start, stop = docs.cmp_range(positions)
    rel = docs.relative(positions)
    doc = docs.token_doc[positions]
    first = docs.cmp_bounds[doc]  # [C] packed index of each row's local block 0
    n_own = docs.cmp_bounds[doc + 1] - first
    width = int(n_own.max()) if C else 0
    local = torch.arange(width, device=q_chunk.device)
    logits = torch.einsum("bchgd,bnhd->bchgn", qc, k_cmp[:, start:stop]) / math.sqrt(dk)
    if stop > start:
        column = (first - start)[:, None] + local[None, :]  # [C, width], clipped below where past the document
        column = column.clamp(max=stop - start - 1)[None, :, None, None, :].expand(B, C, H, Hq // H, width)
        logits = torch.gather(logits, -1, column)
    else:
        logits = logits.new_zeros((B, C, H, Hq // H, 0))
    in_doc = local[None, :] < n_own[:, None]
    visible = (in_doc & masks.compressed_block_visible(local[None, :], rel[:, None], cfg))[None, :, None, None, :]
    p_cmp = masks.cmp_importance(logits, visible, cfg)  # Eq. 8
    p_slc = pool_eq9(p_cmp, n_sel_blocks, cfg)  # Eq. 9, per query head, document-local blocks
    scores = masks.group_reduce(p_slc, cfg)  # Eq. 10
    sel = torch.arange(n_sel_blocks, device=q_chunk.device)
    after_current = sel[None, :] > masks.current_sel_block(rel, cfg)[:, None]
    return scores.masked_fill(after_current[None, :, None, :], float("-inf"))


def _score_chunk_size(q: Tensor, n_columns: int, n_sel_blocks: int, chunk_size: int | None) -> int:
    """Query rows per scoring chunk: chunk_size, or as many as keep the torch path's per-head temporaries within
    CHUNK_ELEMENTS."""
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive number of query positions, got {chunk_size}")
        return chunk_size
    B, _, Hq, _ = q.shape
    return max(1, CHUNK_ELEMENTS // max(1, B * Hq * (n_columns + n_sel_blocks)))


def _scorer(q: Tensor, k_cmp: Tensor, cfg: NSAConfig, positions: Tensor, n_sel_blocks: int,
            docs: Documents | None):
    """scores(q0, q1) -> [B, q1 - q0, Hkv, n_sel_blocks] for the rows q0..q1-1 of q at these positions."""
    q, k_cmp = q.detach(), k_cmp.detach().to(compute_dtype(q.dtype))
    if docs is None:
        return lambda q0, q1: scores_of_chunk(q[:, q0:q1], k_cmp, positions[q0:q1], n_sel_blocks, cfg)
    return lambda q0, q1: packed_scores_of_chunk(q[:, q0:q1], k_cmp, positions[q0:q1], n_sel_blocks, cfg, docs)


def _score_columns(n_cmp: int, docs: Documents | None) -> int:
    """Compressed-token columns one query row holds while scoring: N, or for a packed batch the chunk's packed
    range (at most N) plus its document-local copy (at most N)."""
    return n_cmp if docs is None else 2 * n_cmp


@torch.no_grad()
def selection_scores_rows(q: Tensor, k_cmp: Tensor, cfg: NSAConfig, positions: Tensor, n_sel_blocks: int, *,
                          chunk_size: int | None = None, docs: Documents | None = None) -> Tensor:
    """Eq. 8-10 for queries at absolute positions: [B, TQ, Hkv, n_sel_blocks] in compute_dtype(q.dtype)
    (materialized: the contract's selection_scores output; nsa_forward uses selection_indices_rows instead), -inf
    for blocks after J. docs: the layout of a packed batch (document-relative blocks), None for independent
    rows."""
    q = q.detach()
    B, TQ = q.shape[:2]
    out = torch.empty((B, TQ, cfg.n_kv_heads, n_sel_blocks), dtype=compute_dtype(q.dtype), device=q.device)
    scores = _scorer(q, k_cmp, cfg, positions, n_sel_blocks, docs)
    n_columns = _score_columns(k_cmp.shape[1], docs)
    for q0, q1 in query_chunks(TQ, _score_chunk_size(q, n_columns, n_sel_blocks, chunk_size)):
        out[:, q0:q1] = scores(q0, q1)
    return out


@torch.no_grad()
def select_blocks_rows(scores: Tensor, cfg: NSAConfig, positions: Tensor, docs: Documents | None = None) -> Tensor:
    """Eq. 11 for queries at absolute positions: int64 [B, TQ, Hkv, n], ascending, padded with -1.
    docs (packed batch): J and the forced blocks are those of the query's document-relative position."""
    relative = positions if docs is None else docs.relative(positions)
    J = masks.current_sel_block(relative, cfg)[None, :, None].expand(scores.shape[:3])
    return masks.top_n_blocks(scores.detach(), J, cfg)


@torch.no_grad()
def selection_indices_rows(q: Tensor, k_cmp: Tensor, cfg: NSAConfig, positions: Tensor, n_sel_blocks: int, *,
                           chunk_size: int | None = None, docs: Documents | None = None) -> Tensor:
    """Eq. 8-11 fused and chunked over queries: indices [B, TQ, Hkv, n] for queries q [B, TQ, Hq, dk] at
    positions [TQ]. Peak memory is O(chunk * N) per head; no [TQ, N] or [TQ, ceil(T/l')] tensor is built for all
    queries at once. The result does not depend on chunk_size or on the batch (bitwise)."""
    q = q.detach()
    B, TQ = q.shape[:2]
    out = torch.empty((B, TQ, cfg.n_kv_heads, cfg.n_sel), dtype=torch.int64, device=q.device)
    scores = _scorer(q, k_cmp, cfg, positions, n_sel_blocks, docs)
    n_columns = _score_columns(k_cmp.shape[1], docs)
    for q0, q1 in query_chunks(TQ, _score_chunk_size(q, n_columns, n_sel_blocks, chunk_size)):
        out[:, q0:q1] = select_blocks_rows(scores(q0, q1), cfg, positions[q0:q1], docs)
    return out
