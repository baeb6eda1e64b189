"""The selected-attention branch (Eq. 12) on the Triton kernels, differentiable: triton_selected_attention.

Forward kernel: group-centric (paper Section 3.4, Fig. 3). Grid (query row t, KV group g, batch b). Each program
loads the queries of all heads of group g at row t as one tile ("group-centric data loading"), then walks the
selected blocks I_t of (t, g) in key tiles of BLOCK_N rows ("shared KV fetching": one K/V load serves every head of
the group), with an online softmax in fp32 (base 2). Small groups are the tiles' columns (s^T = K q^T, the dots'
N side, which pads to 8 where rows pad to 16), larger ones their rows (common.forward_head_tile). It writes
o [B, TQ, Hq, dv] and the softmax statistics the backward kernels use to rebuild the probabilities:
stats [B, TQ, Hq, 2] fp32 = (m, 1/l), m the row max of the base-2 logits s * scale * log2(e),
l = sum 2^(s * scale * log2(e) - m), so P = 2^(s * scale * log2(e) - m) / l exactly as the forward formed it
(one rounding fewer than exp(s * scale - lse); logsumexp() gives lse). The query row t sits at absolute position
p = q_offset + t; keys after p are masked (the current block is partial). An empty key set gives o = 0 and
1/l = 0 (lse = -inf).

Packed batches (PACKED): DOC_START[t] is the first key of row t's document and block j of the row means keys
DOC_START[t] + j * SEL_BLOCK ..; the clip to <= p keeps every key inside the document.

A q/k head dim such as the paper's d_k = 192 is read in two exact tiles (128 + 64, common.head_dim_tiles) rather
than one padded to 256, here and in the backward kernels (BLOCK_DK2; the dq kernel only with one copy of its rows):
the logits' two dots chain into one accumulation, the dq and dk tiles are written part by part.

Backward: selected_attention_bwd.py (dq query-centric; dk/dv key-centric over an inverted index; deterministic,
no atomics).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from reference.config import NSAConfig

from .. import masks
from ..dispatch import KERNEL_DTYPES, MAX_KERNEL_GROUP, MAX_KERNEL_HEAD_DIM
from ..numerics import LN2, LOG2E
from ..recompute import KeptSelection
from .common import (INDEX_DTYPES, Tiling, dot_settings, forward_head_tile, forward_tiling, head_dim_tiles,
                     heads_dot, interpreting, launch_tiling, padded, selected_block_keys)
from .range_attention import range_attention_forward
from .selected_attention_bwd import selected_attention_backward


@triton.jit
def _selected_attention_fwd_kernel(
    Q, K, V, IDX, O, STATS, DOC_START,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ib, stride_it, stride_ih, stride_in,
    stride_ob, stride_ot, stride_oh,
    stride_sb, stride_st,
    n_sel, q_offset, scale_log2,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, SEL_BLOCK: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    TILES_PER_BLOCK: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    PACKED: tl.constexpr, KEY_AXIS: tl.constexpr, BLOCK_DK2: tl.constexpr,
):
    # KEY_AXIS: the logits tile's axis over keys (common.forward_head_tile). 0: the group's heads are the tiles'
    # columns, s^T = K q^T [BLOCK_N, BLOCK_H] and o^T += V^T P^T [BLOCK_DV, BLOCK_H]; 1: they are its rows,
    # s = q K^T [BLOCK_H, BLOCK_N] and o += P V [BLOCK_H, BLOCK_DV]. Reductions over keys run along KEY_AXIS.
    # 64-bit program ids: every offset below is computed in int64 (T >= 64k).
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    p = q_offset + t
    if PACKED:
        row_start = tl.load(DOC_START + t).to(tl.int64)
    else:
        row_start = 0

    offs_h = tl.arange(0, BLOCK_H)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
    head_mask = offs_h < GROUP
    dk_mask = offs_dk < DK
    dv_mask = offs_dv < DV
    heads = g * GROUP + offs_h

    # (tl.expand_dims(x, a) lays x along the other axis, 1 - a.) The group's queries, heads along 1 - KEY_AXIS:
    # q^T [BLOCK_DK, BLOCK_H] or q [BLOCK_H, BLOCK_DK].
    q = tl.load(Q + b * stride_qb + t * stride_qt + tl.expand_dims(heads, KEY_AXIS) * stride_qh
                + tl.expand_dims(offs_dk, 1 - KEY_AXIS),
                mask=tl.expand_dims(head_mask, KEY_AXIS) & tl.expand_dims(dk_mask, 1 - KEY_AXIS), other=0.0)
    if BLOCK_DK2 > 0:  # the head dim's second tile (common.head_dim_tiles): q2, k2
        offs_dk2 = BLOCK_DK + tl.arange(0, BLOCK_DK2)
        dk_mask2 = offs_dk2 < DK
        q2 = tl.load(Q + b * stride_qb + t * stride_qt + tl.expand_dims(heads, KEY_AXIS) * stride_qh
                     + tl.expand_dims(offs_dk2, 1 - KEY_AXIS),
                     mask=tl.expand_dims(head_mask, KEY_AXIS) & tl.expand_dims(dk_mask2, 1 - KEY_AXIS), other=0.0)

    k_base = K + b * stride_kb + g * stride_kh
    v_base = V + b * stride_vb + g * stride_vh
    idx_base = IDX + b * stride_ib + t * stride_it + g * stride_ih

    # Running max starts finite so a fully masked tile (padding slot, tile past p) gives alpha = 1, p = 0.
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    if KEY_AXIS == 0:
        acc = tl.zeros([BLOCK_DV, BLOCK_H], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)

    # One flat loop over (selected slot, key tile of the block) so loads pipeline across blocks.
    for it in range(0, n_sel * TILES_PER_BLOCK):
        slot = it // TILES_PER_BLOCK
        tile = it % TILES_PER_BLOCK
        block = tl.load(idx_base + slot * stride_in).to(tl.int64)
        pos, key_mask = selected_block_keys(block, tile, row_start, p, offs_n, SEL_BLOCK, BLOCK_N)

        # keys along KEY_AXIS in the K tile (K [BLOCK_N, BLOCK_DK] or K^T), along the other axis in the V tile
        k = tl.load(k_base + tl.expand_dims(pos, 1 - KEY_AXIS) * stride_kt + tl.expand_dims(offs_dk, KEY_AXIS),
                    mask=tl.expand_dims(key_mask, 1 - KEY_AXIS) & tl.expand_dims(dk_mask, KEY_AXIS), other=0.0)
        v = tl.load(v_base + tl.expand_dims(pos, KEY_AXIS) * stride_vt + tl.expand_dims(offs_dv, 1 - KEY_AXIS),
                    mask=tl.expand_dims(key_mask, KEY_AXIS) & tl.expand_dims(dv_mask, 1 - KEY_AXIS), other=0.0)
        if BLOCK_DK2 > 0:
            k2 = tl.load(k_base + tl.expand_dims(pos, 1 - KEY_AXIS) * stride_kt + tl.expand_dims(offs_dk2, KEY_AXIS),
                         mask=tl.expand_dims(key_mask, 1 - KEY_AXIS) & tl.expand_dims(dk_mask2, KEY_AXIS), other=0.0)
        s = heads_dot(q, k, KEY_AXIS, DOT_FP32, INPUT_PRECISION)  # s^T = K q^T or s = q K^T
        if BLOCK_DK2 > 0:
            s += heads_dot(q2, k2, KEY_AXIS, DOT_FP32, INPUT_PRECISION)
        s = tl.where(tl.expand_dims(key_mask, 1 - KEY_AXIS), s * scale_log2, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, KEY_AXIS))
        alpha = tl.exp2(m_i - m_new)
        probs = tl.exp2(s - tl.expand_dims(m_new, KEY_AXIS))
        l_i = l_i * alpha + tl.sum(probs, KEY_AXIS)
        acc = acc * tl.expand_dims(alpha, KEY_AXIS)
        # o^T += V^T P^T or o += P V, P in the input dtype (a no-op for fp32 inputs)
        acc += heads_dot(probs.to(v.dtype), v, KEY_AXIS, DOT_FP32, INPUT_PRECISION)
        m_i = m_new

    has_key = l_i > 0.0
    out = acc / tl.expand_dims(tl.where(has_key, l_i, 1.0), KEY_AXIS)
    tl.store(O + b * stride_ob + t * stride_ot + tl.expand_dims(heads, KEY_AXIS) * stride_oh
             + tl.expand_dims(offs_dv, 1 - KEY_AXIS), out.to(O.dtype.element_ty),
             mask=tl.expand_dims(head_mask, KEY_AXIS) & tl.expand_dims(dv_mask, 1 - KEY_AXIS))
    stats_ptr = STATS + b * stride_sb + t * stride_st + heads * 2
    tl.store(stats_ptr, tl.where(has_key, m_i, 0.0), mask=head_mask)  # empty row: m = 0, 1/l = 0 -> P = 0
    tl.store(stats_ptr + 1, tl.where(has_key, 1.0 / tl.where(has_key, l_i, 1.0), 0.0), mask=head_mask)


def logsumexp(stats: Tensor) -> Tensor:
    """Natural-log log-sum-exp [B, TQ, Hq] of the scaled logits from the forward's stats (-inf: no key)."""
    m, inv_l = stats.unbind(-1)
    has_key = inv_l > 0
    return torch.where(has_key, (m - torch.log2(torch.where(has_key, inv_l, 1.0))) * LN2, float("-inf"))


def selected_attention_forward(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, sel_block: int, scale: float,
                               tiling: Tiling | None = None, doc_start: Tensor | None = None,
                               out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """Launch the forward kernel on validated inputs (last dim contiguous). Returns (o, stats [B, TQ, Hq, 2] fp32).

    tiling: launch settings, used as given (the GPU benchmark sweeps it); default: tiling.forward_tiling's
    heuristic, shrunk if the GPU lacks the resources it needs (common.launch_tiling).
    doc_start: int32 [TQ] contiguous, the first key of each query row's document (packed batch), or None.
    out: (o, stats) tensors of those shapes (last two dims of stats and the last of o contiguous, e.g. rows of
    larger ones) to write into.
    """
    B, TQ, Hq, dk = q.shape
    TK, Hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    group = Hq // Hkv
    n_sel = indices.shape[-1]
    if out is None:
        o = torch.empty((B, TQ, Hq, dv), device=q.device, dtype=q.dtype)
        stats = torch.empty((B, TQ, Hq, 2), device=q.device, dtype=torch.float32)
    else:
        o, stats = out
    if B * TQ * Hq == 0:
        return o, stats
    block_dk, block_dv = padded(dk), padded(dv)
    block_h, key_axis = forward_head_tile(group, max(block_dk, block_dv))
    dot_fp32, precision = dot_settings(q.dtype)
    dk_tile, dk_tile2 = head_dim_tiles(dk)

    def launch(tiling: Tiling) -> None:
        _selected_attention_fwd_kernel[(TQ, Hkv, B)](
            q, k, v, indices, o, stats, indices if doc_start is None else doc_start,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            indices.stride(0), indices.stride(1), indices.stride(2), indices.stride(3),
            o.stride(0), o.stride(1), o.stride(2),
            stats.stride(0), stats.stride(1),
            n_sel, TK - TQ, scale * LOG2E,
            GROUP=group, DK=dk, DV=dv, SEL_BLOCK=sel_block,
            BLOCK_H=block_h, BLOCK_DK=dk_tile, BLOCK_DK2=dk_tile2, BLOCK_DV=block_dv, BLOCK_N=tiling.block_n,
            TILES_PER_BLOCK=math.ceil(sel_block / tiling.block_n), DOT_FP32=dot_fp32, INPUT_PRECISION=precision,
            PACKED=doc_start is not None, KEY_AXIS=key_axis, num_warps=tiling.num_warps,
            num_stages=tiling.num_stages,
        )

    launch_tiling(launch, tiling, forward_tiling(group, block_dk, block_dv, sel_block, q.dtype))
    return o, stats


class SelectedAttentionFunction(torch.autograd.Function):
    """o = Eq. 12 of (q, k, v) over the selected blocks `indices`; gradients for q, k, v.

    full_lo, full_hi (int32 [P], or None): the first P query rows select every block up to their own, so their keys
    are one contiguous run [full_lo, full_hi]; the range kernels attend to it (forward and dq) instead of
    gathering it block by block. Their stats are (lse2, 1), the same P = 2^(s log2(e) - m) / l, and the dk/dv
    kernel takes every row as before, so each key's dk/dv is still one sum, rounded once."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, indices: Tensor, sel_block: int, scale: float,
                doc_start: Tensor | None, full_lo: Tensor | None, full_hi: Tensor | None,
                kept: KeptSelection | None = None) -> Tensor:
        if kept is not None and kept.replay:  # a recomputation: the forward's own results (optimized.recompute)
            o, stats, lse2 = kept.o, kept.stats, kept.lse2
        else:
            o, stats, lse2 = _forward(q, k, v, indices, sel_block, scale, doc_start, full_lo, full_hi)
            if kept is not None:  # detached: the tape keeps the values, not this call's graph
                kept.o, kept.stats, kept.lse2 = o.detach(), stats, lse2
        ctx.save_for_backward(q, k, v, indices, o, stats, doc_start, full_lo, full_hi, lse2)
        ctx.sel_block, ctx.scale = sel_block, scale
        return o

    @staticmethod
    def backward(ctx, do: Tensor):
        q, k, v, indices, o, stats, doc_start, full_lo, full_hi, lse2 = ctx.saved_tensors
        full_rows = None if full_lo is None else (full_lo, full_hi, lse2)
        dq, dk, dv = selected_attention_backward(q, k, v, indices, o, stats, do, ctx.sel_block, ctx.scale,
                                                 doc_start=doc_start, full_rows=full_rows)
        return dq, dk, dv, None, None, None, None, None, None, None


def _forward(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, sel_block: int, scale: float,
             doc_start: Tensor | None, full_lo: Tensor | None,
             full_hi: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """SelectedAttentionFunction's forward kernels: o, stats and the full rows' lse2 (None without full rows)."""
    P = 0 if full_lo is None else full_lo.shape[0]
    B, TQ, Hq, _ = q.shape
    o = torch.empty((B, TQ, Hq, v.shape[-1]), device=q.device, dtype=q.dtype)
    stats = torch.empty((B, TQ, Hq, 2), device=q.device, dtype=torch.float32)
    lse2 = None
    if P:
        _, lse2 = range_attention_forward(q[:, :P], k, v, full_lo, full_hi, scale, out=o[:, :P])
        has_key = torch.isfinite(lse2)
        stats[:, :P, :, 0] = torch.where(has_key, lse2, 0.0)  # an empty range: m = 0, 1/l = 0 (P = 0)
        stats[:, :P, :, 1] = has_key.to(torch.float32)
    if P < TQ:
        selected_attention_forward(q[:, P:], k, v, indices[:, P:], sel_block, scale, doc_start=doc_start,
                                   out=(o[:, P:], stats[:, P:]))
    return o, stats, lse2


def triton_selected_attention(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, sel_block: int,
                              scale: float | None = None, *, doc_start: Tensor | None = None,
                              full_rows: tuple[Tensor, Tensor] | None = None,
                              kept: KeptSelection | None = None) -> Tensor:
    """Eq. 12 with the Triton kernels: o [B, TQ, Hq, dv].

    q [B, TQ, Hq, dk]: the queries at the LAST TQ positions of the TK keys (row t is position TK - TQ + t;
    prefill TQ = TK, decode TQ = 1 or a chunk). k [B, TK, Hkv, dk], v [B, TK, Hkv, dv], Hq = h * Hkv with
    group size h in 1..64, dk, dv <= 256. indices [B, TQ, Hkv, n] int32/int64: selected block indices of
    each (query, KV group), ascending, -1 padded (any negative entry is padding). Block j holds keys
    [j * sel_block, (j + 1) * sel_block) clipped to <= the query's position. scale defaults to 1/sqrt(dk).
    A query with no visible key outputs 0. fp32/bf16/fp16 inputs (all the same), fp32 accumulation; fp32
    dots are exact fp32 (no TF32). Differentiable in q, k, v; dk/dv are deterministic.
    Tensors must be on CUDA, or on CPU with TRITON_INTERPRET=1 set before the kernels were imported.

    doc_start (packed batch of documents): int32/int64 [TQ], the first key of each query row's
    document; indices are then document-relative: block j of row t holds keys doc_start[t] + j * sel_block ..,
    clipped to <= the row's position. Documents are contiguous: doc_start is non-decreasing, doc_start[t] <= the
    row's position, and a row whose doc_start differs from the previous row's starts its document
    (doc_start[t] = its position). Checked here (one device sync); a ValueError names the rule.

    full_rows (lo, hi), int32 [P] contiguous on q's device (full_selection_ranges): the first P rows' indices
    are every block up to the row's own, so their keys are the run [lo[t], hi[t]]; the range kernels attend to it
    instead of gathering it block by block (same result up to rounding). The caller vouches for those rows'
    indices (nsa_forward passes it for the indices its selection kernels computed); not with doc_start.

    kept: this call's entry of a recomputation's tape (optimized.recompute): the forward keeps o and the softmax
    statistics in it; the recomputation takes them back instead of running the kernels (its backward is the same).
    """
    _validate(q, k, v, indices, sel_block)
    if doc_start is not None:
        doc_start = _validated_doc_start(doc_start, q.shape[1], k.shape[1], q.device)
    full_lo, full_hi = (None, None) if full_rows is None else _validated_full_rows(full_rows, q, doc_start)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    return SelectedAttentionFunction.apply(q, k, v, indices, sel_block, float(scale), doc_start, full_lo, full_hi,
                                           kept)


def full_selection_ranges(first_position: int, n_rows: int, cfg: NSAConfig,
                          device: torch.device) -> tuple[Tensor, Tensor] | None:
    """The key runs of the leading rows of one sequence (queries at positions first_position ..) whose selection
    has no choice: with J + 1 <= n (J from the seam masks.current_sel_block), Eq. 11's top-n takes every block
    0..J (selection.py's top-n kernel writes all blocks that exist), so the row reads keys 0 .. min(p, (J + 1) l'
    - 1), one contiguous run. (lo, hi) int32 [P] on device for the P leading such rows, None when there are none.
    In a sequence of T tokens these are the first min(T, n l') rows: half the rows at T = 2k with the paper's
    n = 16, l' = 64. Built on the host once per shape, config, device and seam (like range_attention's
    sequence_ranges), so a layer reads nothing back from the device."""
    return _full_selection_ranges(first_position, n_rows, cfg, device, masks.current_sel_block)


@functools.lru_cache(maxsize=64)
def _full_selection_ranges(first_position: int, n_rows: int, cfg: NSAConfig, device: torch.device,
                           seam) -> tuple[Tensor, Tensor] | None:
    positions = torch.arange(first_position, first_position + n_rows)
    last_block = seam(positions, cfg)  # J of each row
    complete = (last_block + 1 <= cfg.n_sel).tolist()
    rows = complete.index(False) if False in complete else n_rows  # the leading run of rows without a choice
    if rows == 0:
        return None
    hi = torch.minimum(positions[:rows], (last_block[:rows] + 1) * cfg.sel_block - 1)
    if rows > 1 and bool((hi[1:] < hi[:-1]).any()):  # a seam whose J decreases: the range kernels need order
        return None
    lo = torch.zeros(rows, dtype=torch.int32)
    return lo.to(device), hi.clamp(min=-1).to(torch.int32).to(device)


def _validated_full_rows(full_rows, q: Tensor, doc_start: Tensor | None) -> tuple[Tensor, Tensor]:
    where = "triton_selected_attention: full_rows"
    if doc_start is not None:
        raise ValueError(f"{where} is for one sequence's rows; a packed batch (doc_start) gathers every row")
    if not isinstance(full_rows, tuple) or len(full_rows) != 2:
        raise ValueError(f"{where} must be a (lo, hi) pair of int32 tensors [P]")
    lo, hi = full_rows
    for name, x in (("lo", lo), ("hi", hi)):
        if not isinstance(x, Tensor) or x.dtype != torch.int32 or x.dim() != 1 or not x.is_contiguous() \
                or x.shape[0] != lo.shape[0] or x.device != q.device:
            raise ValueError(f"{where}: {name} must be a contiguous int32 tensor [P] on {q.device}, got "
                             f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    if not 0 < lo.shape[0] <= q.shape[1]:
        raise ValueError(f"{where}: P = {lo.shape[0]} rows must be between 1 and TQ = {q.shape[1]}")
    return lo, hi


@triton.jit
def _admitted_reads_kernel(IDX, REL, READS, n_rows, T, n_kv_heads, n_sel,
                           stride_ib, stride_it, stride_ih, stride_in,
                           SEL_BLOCK: tl.constexpr, BLOCK_S: tl.constexpr, ROWS: tl.constexpr):
    """READS[(b, t, g)] = sum over the slots s of IDX[b, t, g, s] = j >= 0 of clamp(REL[t] - j * SEL_BLOCK + 1, 0,
    SEL_BLOCK), in int64, for ROWS (b, t, g) rows (admitted_reads)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    slots = tl.arange(0, BLOCK_S)
    row_ok = rows < n_rows
    g = rows % n_kv_heads
    t = (rows // n_kv_heads) % T
    b = rows // (n_kv_heads * T)
    mask = row_ok[:, None] & (slots < n_sel)[None, :]
    blocks = tl.load(IDX + (b * stride_ib + t * stride_it + g * stride_ih)[:, None] + slots[None, :] * stride_in,
                     mask=mask, other=-1).to(tl.int64)
    p = tl.load(REL + t, mask=row_ok, other=0).to(tl.int64)
    admitted = tl.minimum(tl.maximum(p[:, None] - blocks * SEL_BLOCK + 1, 0), SEL_BLOCK)
    tl.store(READS + rows, tl.sum(tl.where(blocks >= 0, admitted, 0), 1), mask=row_ok)


def admitted_reads(indices: Tensor, relative: Tensor, sel_block: int) -> Tensor:
    """reads [B, TQ, Hkv] (int64) of the kernel: the keys it admits for each (query, KV group), summed over the
    selected blocks: block j >= 0 of a query at document-relative position p admits its keys j*l' .. (j+1)*l' - 1
    that are <= p (Eq. 12's clip), clamp(p - j*l' + 1, 0, l') of them. indices [B, TQ, Hkv, n] (-1 padded),
    relative [TQ]. One launch (the torch expression of the same sum took about eight over [B, TQ, Hkv, n])."""
    B, TQ, Hkv, n = indices.shape
    reads = torch.empty((B, TQ, Hkv), dtype=torch.int64, device=indices.device)
    n_rows = B * TQ * Hkv
    if n_rows == 0:
        return reads
    if n == 0:
        return reads.zero_()
    block_s = triton.next_power_of_2(n)
    rows = max(1, 1024 // block_s)
    _admitted_reads_kernel[(triton.cdiv(n_rows, rows),)](
        indices, relative.contiguous(), reads, n_rows, TQ, Hkv, n, *indices.stride(), SEL_BLOCK=sel_block,
        BLOCK_S=block_s, ROWS=rows, num_warps=4)
    return reads


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
    if Hq // Hkv > MAX_KERNEL_GROUP:
        raise ValueError(f"triton_selected_attention: group size Hq/Hkv = {Hq // Hkv} exceeds "
                         f"{MAX_KERNEL_GROUP}")
    if max(dk, v.shape[-1]) > MAX_KERNEL_HEAD_DIM:
        raise ValueError(f"triton_selected_attention: head dims dk={dk}, dv={v.shape[-1]} must be <= "
                         f"{MAX_KERNEL_HEAD_DIM}")
    if TQ > TK:
        raise ValueError(f"triton_selected_attention: TQ ({TQ}) must be <= TK ({TK}): queries are the last TQ keys")
    if tuple(indices.shape[:3]) != (B, TQ, Hkv):
        raise ValueError(f"triton_selected_attention: indices must be [B, TQ, Hkv, n] = [{B}, {TQ}, {Hkv}, n], "
                         f"got {tuple(indices.shape)}")
    if indices.dtype not in INDEX_DTYPES:
        raise ValueError(f"triton_selected_attention: indices must be int32 or int64, got {indices.dtype}")
    if q.dtype not in KERNEL_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
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
