"""Selection scoring (Eq. 8-10) and top-n block selection (Eq. 11), vectorized and chunked over queries.

Selection is discrete: nothing here carries gradients (as in the reference). Scores are computed in
masked_attention.compute_dtype (float32 for half/bfloat16 inputs, float64 for float32/float64 inputs).

Chunk invariance: a query row's logits always span all N compressed blocks (invisible ones are masked), its
softmax sum, Eq. 9 band and Eq. 10 head sum are added in a fixed order, and Eq. 11 is a per-row stable sort, so the
indices of a row do not depend on which other rows (chunk, batch) are computed with it.

range_backend="triton" (issue 8): Eq. 8 and Eq. 10 run fused in the group-scores kernel
(optimized/kernels/group_scores.py) on the inputs' own precision (fp32/bf16/fp16, fp32 accumulation), with the
compressed branch's log-sum-exp as the softmax normaliser. selection_indices then runs Eq. 9-11 in the fused
top-n kernel (optimized/kernels/select_top_n.py: the same indices, bitwise, as the code below gives on the same
scores), so a scoring chunk is two launches. The materialized selection_scores, and selection_indices while an
Eq. 11 seam the kernel implements is replaced (top_n_seams_are_kernel_rules), run Eq. 9 and Eq. 11 as the torch
code below.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from reference.config import NSAConfig

from . import masks
from .documents import Documents, check_packed_compressed, documents, stage_documents
from .masked_attention import CHUNK_ELEMENTS, compute_dtype, query_chunks
from .ranges import CompressedSoftmax, check_range_backend, compressed_ranges
from .seams import SeamSnapshot


def sel_block_count(n_keys: int, cfg: NSAConfig) -> int:
    """Selection blocks that hold at least one of keys 0..n_keys-1: ceil(n_keys / l')."""
    return -(-n_keys // cfg.sel_block)


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


def _chunk_scores(q_chunk: Tensor, k_cmp: Tensor, positions: Tensor, n_sel_blocks: int,
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


def _packed_chunk_scores(q_chunk: Tensor, k_cmp: Tensor, positions: Tensor, n_sel_blocks: int, cfg: NSAConfig,
                         docs: Documents) -> Tensor:
    """_chunk_scores for a packed batch: queries at packed positions [C] score their own document's selection
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


@dataclass(frozen=True)
class _KernelRows:
    """What the group-scores kernel needs for every query row (range_backend="triton"), built once per call:
    q and k_cmp in the kernel dtype, the rows' compressed ranges [lo, hi] (int32 [TQ]), the compressed branch's
    base-2 log-sum-exp (None for the "logits" score), the range widths on the host (each chunk's width without a
    device sync) and the document-relative positions."""

    q: Tensor
    k_cmp: Tensor
    lo: Tensor
    hi: Tensor
    lse2: Tensor | None
    widths: Tensor
    relative: Tensor

    def group_scores(self, q0: int, q1: int, *, zero_fill: bool = True) -> Tensor:
        """P [B, q1 - q0, Hkv, width] fp32 of rows q0..q1-1: Eq. 8 + Eq. 10 (sum) in the group-scores kernel,
        width the widest range of these rows. zero_fill=False leaves the entries past each row's range unwritten
        (the fused top-n kernel never reads them)."""
        from .kernels.group_scores import group_scores

        q = self.q[:, q0:q1]
        B, C, Hq, dk = q.shape
        width = int(self.widths[q0:q1].max()) if q1 > q0 else 0
        out = None if zero_fill else torch.empty((B, C, self.k_cmp.shape[2], width), dtype=torch.float32,
                                                 device=q.device)
        lse2 = None if self.lse2 is None else self.lse2[:, q0:q1]
        return group_scores(q, self.k_cmp, self.lo[q0:q1], self.hi[q0:q1], lse2, width, 1.0 / math.sqrt(dk),
                            logits=self.lse2 is None, out=out)


def _kernel_rows(q: Tensor, k_cmp: Tensor, cfg: NSAConfig, positions: Tensor, docs: Documents | None,
                 cmp_softmax: CompressedSoftmax | None) -> _KernelRows:
    """_KernelRows of queries q at positions over k_cmp (both in the kernel dtype): each row's visible compressed
    tokens (ranges.compressed_ranges, from the seam masks.compressed_block_visible; document-local columns, as
    _packed_chunk_scores). cmp_softmax: the compressed branch's ranges and normaliser for these rows when the
    caller has them (nsa_forward); otherwise both are computed here, for every row at once."""
    from .kernels import range_logsumexp2
    from .kernels.range_attention import check_range_inputs

    logits = cfg.selection_score == "logits"
    if cmp_softmax is None:
        lo, hi = check_range_inputs(q, k_cmp, None, *compressed_ranges(positions, k_cmp.shape[1], cfg, docs))
        lse2 = None if logits else range_logsumexp2(q, k_cmp, lo, hi)
    else:
        lo, hi, lse2 = cmp_softmax.lo, cmp_softmax.hi, None if logits else cmp_softmax.lse2
    widths = torch.clamp(hi - lo + 1, min=0).cpu()  # one copy to the host: each chunk's width without a sync
    relative = positions if docs is None else docs.relative(positions)
    return _KernelRows(q, k_cmp, lo, hi, lse2, widths, relative)


def _kernel_scorer(q: Tensor, k_cmp: Tensor, cfg: NSAConfig, positions: Tensor, n_sel_blocks: int,
                   docs: Documents | None, cmp_softmax: CompressedSoftmax | None):
    """scores(q0, q1) for range_backend="triton" (the materialized scores, and selection_indices while a top-n
    seam is replaced): Eq. 8 + 10 in the group-scores kernel (_KernelRows), then Eq. 9 (pool_eq9, linear, so
    pooling the head sum equals summing the pooled heads) and -inf past J, as _chunk_scores. q and k_cmp in the
    kernel dtype."""
    rows = _kernel_rows(q, k_cmp, cfg, positions, docs, cmp_softmax)
    group = cfg.n_heads // cfg.n_kv_heads

    def scores(q0: int, q1: int) -> Tensor:
        p_group = rows.group_scores(q0, q1)  # Eq. 8 + Eq. 10 (sum)
        if cfg.group_reduce == "mean":
            p_group = p_group / group
        p_slc = pool_eq9(p_group, n_sel_blocks, cfg)  # Eq. 9
        sel = torch.arange(n_sel_blocks, device=q.device)
        after_current = sel[None, :] > masks.current_sel_block(rows.relative[q0:q1], cfg)[:, None]
        return p_slc.masked_fill(after_current[None, :, None, :], float("-inf"))

    return scores


# The Eq. 11 seams the fused top-n kernel implements (optimized/kernels/select_top_n.py), as imported: with
# another function in any of them (the conformance self-test plants bugs that way) selection_indices runs the
# torch code. The kernel takes the Eq. 9 band (masks.eq9_pool_weights) and J (masks.current_sel_block) from the
# seams at call time, so those two are honoured either way.
_TOP_N_KERNEL_SEAMS = SeamSnapshot(masks, "forced_blocks", "top_n_blocks", "ranked_blocks")


def top_n_seams_are_kernel_rules() -> bool:
    """True while masks.forced_blocks, top_n_blocks and ranked_blocks are the functions the top-n kernel
    implements."""
    return _TOP_N_KERNEL_SEAMS.unchanged()


# Scoring chunks of the fused kernel path: the group-scores kernel writes a chunk's P [B, C, Hkv, width] fp32 and
# the top-n kernel reads it straight back, so a chunk holds as many rows as keep P within this budget. Each chunk
# costs two launches and ~0.28 ms of host work (the wrappers, Triton's launcher: the 64k times below differ by
# 22 ms for 78 chunks), and since the group-scores kernel's head sum became a reduction (a4cdba2) the GPU
# finishes a 24 MiB chunk before the host has queued the next one. Measured at 64k (perf.prefill_probe, H100,
# 2026-11-25): the whole selection_indices (lse2 given) takes 41.9 / 22.5 / 20.3 / 19.8 ms with 24 / 64 / 128 /
# 256 MiB chunks (88 / 34 / 18 / 10 chunks), the same indices bitwise; P beyond the 50 MB L2 costs its HBM round
# trip (2 x 2.1 GB at 64k over all chunks, ~1.4 ms at 3 TB/s), much less than the host time it saves. The budget
# bounds the scratch, not the peak memory's growth in T. Sizing by the width each chunk actually has (a row reads
# ~p/d compressed tokens) rather than by N gives early rows larger chunks.
KERNEL_CHUNK_P_BYTES = 256 * 2**20


def _kernel_chunks(widths: Tensor, bytes_per_column: int, chunk_size: int | None) -> list[tuple[int, int]]:
    """Query chunks of the fused kernel path: chunk_size rows each when given, else consecutive chunks of as many
    rows as keep rows x (widest range up to the chunk's last row) x bytes_per_column within KERNEL_CHUNK_P_BYTES
    (the running maximum bounds the chunk's own widest range; it equals the row's width for one sequence, whose
    widths never decrease). widths: int64 [TQ] on the host."""
    n_rows = widths.shape[0]
    if chunk_size is not None:
        return query_chunks(n_rows, chunk_size)
    budget = max(1, KERNEL_CHUNK_P_BYTES // bytes_per_column)  # rows x columns per chunk
    bound = torch.cummax(widths.clamp(min=1), 0).values.tolist() if n_rows else []
    chunks, q0 = [], 0
    while q0 < n_rows:
        # rows x bound[q0 + rows - 1] grows with rows: the most rows within the budget (at least one)
        rows = bisect_right(range(1, n_rows - q0 + 1), budget, key=lambda r: r * bound[q0 + r - 1])
        chunks.append((q0, q0 + max(1, rows)))
        q0 = chunks[-1][1]
    return chunks


def _kernel_selection(q: Tensor, k_cmp: Tensor, cfg: NSAConfig, positions: Tensor, n_sel_blocks: int,
                      docs: Documents | None, cmp_softmax: CompressedSoftmax | None, chunk_size: int | None,
                      out: Tensor) -> None:
    """selection_indices on the kernels into out [B, TQ, Hkv, n]: per chunk the group-scores kernel (Eq. 8 + 10,
    P without the zero fill) and the top-n kernel (Eq. 9-11, writing the chunk's rows of out), two launches.
    J comes from the document-relative positions (masks.current_sel_block), once for every row."""
    from .kernels.select_top_n import select_top_n

    rows = _kernel_rows(q, k_cmp, cfg, positions, docs, cmp_softmax)
    current = masks.current_sel_block(rows.relative, cfg)
    B, Hkv = q.shape[0], k_cmp.shape[2]
    for q0, q1 in _kernel_chunks(rows.widths, B * Hkv * 4, chunk_size):
        select_top_n(rows.group_scores(q0, q1, zero_fill=False), rows.lo[q0:q1], rows.hi[q0:q1], current[q0:q1],
                     n_sel_blocks, cfg, out=out[:, q0:q1])


def _score_chunk_size(q: Tensor, n_columns: int, n_sel_blocks: int, chunk_size: int | None) -> int:
    """Query rows per scoring chunk: chunk_size, or as many as keep the torch path's per-head temporaries within
    CHUNK_ELEMENTS. The kernel path's materialized scores (1/group of that per chunk) keep the same chunks;
    selection_indices on the kernels sizes its chunks by P (_kernel_chunks)."""
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive number of query positions, got {chunk_size}")
        return chunk_size
    B, _, Hq, _ = q.shape
    return max(1, CHUNK_ELEMENTS // max(1, B * Hq * (n_columns + n_sel_blocks)))


def _scorer(q: Tensor, k_cmp: Tensor, cfg: NSAConfig, positions: Tensor, n_sel_blocks: int,
            docs: Documents | None, range_backend: str, cmp_softmax: CompressedSoftmax | None = None):
    """scores(q0, q1) -> [B, q1 - q0, Hkv, n_sel_blocks] for the rows q0..q1-1 of q at these positions."""
    if range_backend == "triton":
        return _kernel_scorer(q, k_cmp.to(q.dtype), cfg, positions, n_sel_blocks, docs, cmp_softmax)
    q, k_cmp = q.detach(), k_cmp.detach().to(compute_dtype(q.dtype))
    if docs is None:
        return lambda q0, q1: _chunk_scores(q[:, q0:q1], k_cmp, positions[q0:q1], n_sel_blocks, cfg)
    return lambda q0, q1: _packed_chunk_scores(q[:, q0:q1], k_cmp, positions[q0:q1], n_sel_blocks, cfg, docs)


def _score_columns(n_cmp: int, docs: Documents | None) -> int:
    """Compressed-token columns one query row holds while scoring: N, or for a packed batch the chunk's packed
    range (at most N) plus its document-local copy (at most N)."""
    return n_cmp if docs is None else 2 * n_cmp


@torch.no_grad()
def selection_scores_rows(q: Tensor, k_cmp: Tensor, cfg: NSAConfig, positions: Tensor, n_sel_blocks: int, *,
                          chunk_size: int | None = None, docs: Documents | None = None,
                          range_backend: str = "torch") -> Tensor:
    """Eq. 8-10 for queries at absolute positions: [B, TQ, Hkv, n_sel_blocks] (materialized: the contract's
    selection_scores output; nsa_forward uses selection_indices instead), in compute_dtype(q.dtype) (torch) or
    float32 (triton). docs: the layout of a packed batch (document-relative blocks), None for independent rows."""
    check_range_backend(range_backend, q.dtype)
    q = q.detach()
    B, TQ = q.shape[:2]
    dtype = torch.float32 if range_backend == "triton" else compute_dtype(q.dtype)
    out = torch.empty((B, TQ, cfg.n_kv_heads, n_sel_blocks), dtype=dtype, device=q.device)
    scores = _scorer(q, k_cmp, cfg, positions, n_sel_blocks, docs, range_backend)
    n_columns = _score_columns(k_cmp.shape[1], docs)
    for q0, q1 in query_chunks(TQ, _score_chunk_size(q, n_columns, n_sel_blocks, chunk_size)):
        out[:, q0:q1] = scores(q0, q1)
    return out


def selection_scores(q: Tensor, k_cmp: Tensor, cfg: NSAConfig, *, chunk_size: int | None = None,
                     cu_seqlens: Tensor | None = None, range_backend: str = "torch") -> Tensor:
    """Eq. 8-10 for prefill queries 0..T-1: [B, T, Hkv, ceil(T / l')] in compute_dtype(q.dtype) (float32 with
    range_backend="triton"), -inf for blocks after J = p // l'.
    cu_seqlens (packed batch, B = 1; k_cmp from compress(..., cu_seqlens)): [1, T, Hkv, NB], NB = max_i
    ceil(L_i / l'); column j is the query's own document's block j, -inf after J = (p - start) // l'.
    range_backend: "torch" (vectorized) or "triton" (the group-scores kernel, see the module docstring)."""
    _check_scoring_inputs(q, k_cmp, cfg)
    T = q.shape[1]
    positions = torch.arange(T, device=q.device)
    if cu_seqlens is None:
        return selection_scores_rows(q, k_cmp, cfg, positions, sel_block_count(T, cfg), chunk_size=chunk_size,
                                     range_backend=range_backend)
    docs = stage_documents(cu_seqlens, cfg, q)
    check_packed_compressed("k_cmp", k_cmp, docs)
    return selection_scores_rows(q, k_cmp, cfg, positions, docs.n_sel_blocks, chunk_size=chunk_size, docs=docs,
                                 range_backend=range_backend)


@torch.no_grad()
def select_blocks_rows(scores: Tensor, cfg: NSAConfig, positions: Tensor, docs: Documents | None = None) -> Tensor:
    """Eq. 11 for queries at absolute positions: int64 [B, TQ, Hkv, n], ascending, padded with -1.
    docs (packed batch): J and the forced blocks are those of the query's document-relative position."""
    relative = positions if docs is None else docs.relative(positions)
    J = masks.current_sel_block(relative, cfg)[None, :, None].expand(scores.shape[:3])
    return masks.top_n_blocks(scores.detach(), J, cfg)


def select_blocks(scores: Tensor, cfg: NSAConfig, *, cu_seqlens: Tensor | None = None) -> Tensor:
    """Eq. 11 for prefill queries 0..T-1: indices [B, T, Hkv, n] int64, ascending, padded with -1.
    cu_seqlens (packed batch, B = 1): document-relative block numbers (forced blocks of the query's document)."""
    if not isinstance(scores, Tensor) or scores.ndim != 4 or not scores.is_floating_point():
        raise ValueError("select_blocks: scores must be a floating tensor [B, T, Hkv, n_blocks]")
    T = scores.shape[1]
    positions = torch.arange(T, device=scores.device)
    if cu_seqlens is None:
        if scores.shape[3] < sel_block_count(T, cfg):
            raise ValueError(f"select_blocks: scores has {scores.shape[3]} blocks but T={T} needs "
                             f"ceil(T/l') = {sel_block_count(T, cfg)}")
        return select_blocks_rows(scores, cfg, positions)
    docs = stage_documents(cu_seqlens, cfg, scores)
    if scores.shape[3] < docs.n_sel_blocks:
        raise ValueError(f"select_blocks: scores has {scores.shape[3]} blocks but the longest document of "
                         f"cu_seqlens needs max_i ceil(L_i/l') = {docs.n_sel_blocks}")
    return select_blocks_rows(scores, cfg, positions, docs)


@torch.no_grad()
def selection_indices(q: Tensor, k_cmp: Tensor, cfg: NSAConfig, *, positions: Tensor | None = None,
                      n_keys: int | None = None, chunk_size: int | None = None,
                      cu_seqlens: Tensor | None = None, docs: Documents | None = None,
                      range_backend: str = "torch", cmp_softmax: CompressedSoftmax | None = None) -> Tensor:
    """Eq. 8-11 fused and chunked over queries: indices [B, TQ, Hkv, n] for queries q [B, TQ, Hq, dk] at
    positions (default 0..TQ-1) over n_keys keys (default max position + 1). Peak memory is
    O(chunk * N) per head; no [TQ, N] or [TQ, ceil(T/l')] tensor is built for all queries at once.
    The result does not depend on chunk_size or on the batch (bitwise).
    cu_seqlens (packed batch over the n_keys keys, B = 1; k_cmp packed) or its prebuilt layout docs:
    document-relative indices, as each document alone would select.
    range_backend: "torch" or "triton" (Eq. 8 + 10 in the group-scores kernel, Eq. 9-11 in the top-n kernel,
    chunks sized by _kernel_chunks unless chunk_size is given; module docstring); cmp_softmax:
    the compressed branch's ranges and base-2 log-sum-exp for these queries when the caller has them
    (nsa_forward with range_backend="triton")."""
    _check_scoring_inputs(q, k_cmp, cfg)
    check_range_backend(range_backend, q.dtype)
    B, TQ = q.shape[:2]
    if positions is None:
        positions = torch.arange(TQ, device=q.device)
    if n_keys is None:
        n_keys = int(positions.max()) + 1 if TQ else 0
    if docs is None and cu_seqlens is not None:
        docs = documents(cu_seqlens, n_keys, B, cfg, q.device)
    if docs is not None:
        check_packed_compressed("k_cmp", k_cmp, docs)
    n_sel_blocks = sel_block_count(n_keys, cfg) if docs is None else docs.n_sel_blocks
    q = q.detach()
    out = torch.empty((B, TQ, cfg.n_kv_heads, cfg.n_sel), dtype=torch.int64, device=q.device)
    if range_backend == "triton" and top_n_seams_are_kernel_rules():
        _kernel_selection(q, k_cmp.detach().to(q.dtype), cfg, positions, n_sel_blocks, docs, cmp_softmax,
                          chunk_size, out)
        return out
    scores = _scorer(q, k_cmp.detach(), cfg, positions, n_sel_blocks, docs, range_backend, cmp_softmax)
    n_columns = _score_columns(k_cmp.shape[1], docs)
    for q0, q1 in query_chunks(TQ, _score_chunk_size(q, n_columns, n_sel_blocks, chunk_size)):
        out[:, q0:q1] = select_blocks_rows(scores(q0, q1), cfg, positions[q0:q1], docs)
    return out


def _check_scoring_inputs(q: Tensor, k_cmp: Tensor, cfg: NSAConfig) -> None:
    if not isinstance(q, Tensor) or q.ndim != 4 or q.shape[2] != cfg.n_heads or q.shape[3] != cfg.head_dim_qk:
        raise ValueError(f"q must be [B, T, n_heads={cfg.n_heads}, head_dim_qk={cfg.head_dim_qk}]")
    if (not isinstance(k_cmp, Tensor) or k_cmp.ndim != 4 or k_cmp.shape[0] != q.shape[0]
            or k_cmp.shape[2] != cfg.n_kv_heads or k_cmp.shape[3] != cfg.head_dim_qk):
        raise ValueError(f"k_cmp must be [B, N, n_kv_heads={cfg.n_kv_heads}, head_dim_qk={cfg.head_dim_qk}] "
                         f"with q's batch")
