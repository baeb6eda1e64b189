"""Backward Triton kernels of the selected-attention branch (Eq. 12): dq, dk, dv, deterministic (no atomics).

FlashAttention-2 math with the forward's softmax stats (m, 1/l): P = 2^(S log2(e) - m) / l, dV = P^T dO, dP = dO V^T,
D = rowsum(dO * O), dS = P * (dP - D), dQ = scale * dS K, dK = scale * dS^T Q.

- dq: query-centric like the forward, grid (t, g, b): one program per query row and KV group walks the
  selected blocks of (t, g) and owns dq of the group's heads.
- dk/dv: key-centric over the inverted index (selected_attention_index): one program per (work item, key
  tile of the block) walks the queries that selected the block and accumulates dk/dv of its key tile in fp32.
  A block split over several items writes fp32 partials to workspace slots, then `_slot_reduce_kernel`
  sums them in slot order. All sums have a fixed order, so results are bitwise reproducible run to run.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import triton
import triton.language as tl
from torch import Tensor

from .selected_attention_fwd import LOG2E, dot_settings
from .selected_attention_index import build_inverted_index
from .tiling import Tiling, backward_tiling, key_tile_rows, launch_with_fallback, padded


@triton.jit
def _selected_attention_bwd_dq_kernel(
    Q, K, V, DO, STATS, DELTA, IDX, DQ,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_dob, stride_dot, stride_doh,
    stride_sb, stride_st, stride_db, stride_dt,
    stride_ib, stride_it, stride_ih, stride_in,
    stride_dqb, stride_dqt, stride_dqh,
    n_sel, q_offset, scale, scale_log2,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, SEL_BLOCK: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    TILES_PER_BLOCK: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    p = q_offset + t

    offs_h = tl.arange(0, BLOCK_H)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
    head_mask = offs_h < GROUP
    dk_mask = offs_dk < DK
    dv_mask = offs_dv < DV
    heads = g * GROUP + offs_h

    q = tl.load(Q + b * stride_qb + t * stride_qt + heads[:, None] * stride_qh + offs_dk[None, :],
                mask=head_mask[:, None] & dk_mask[None, :], other=0.0)
    do = tl.load(DO + b * stride_dob + t * stride_dot + heads[:, None] * stride_doh + offs_dv[None, :],
                 mask=head_mask[:, None] & dv_mask[None, :], other=0.0)
    # Padding heads: q = dO = 0, m = 1/l = D = 0, so P = 0 and dS = 0.
    m2 = tl.load(STATS + b * stride_sb + t * stride_st + heads * 2, mask=head_mask, other=0.0)
    inv_l = tl.load(STATS + b * stride_sb + t * stride_st + heads * 2 + 1, mask=head_mask, other=0.0)
    delta = tl.load(DELTA + b * stride_db + t * stride_dt + heads, mask=head_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
        do = do.to(tl.float32)

    k_base = K + b * stride_kb + g * stride_kh
    v_base = V + b * stride_vb + g * stride_vh
    idx_base = IDX + b * stride_ib + t * stride_it + g * stride_ih
    dq = tl.zeros([BLOCK_H, BLOCK_DK], dtype=tl.float32)

    for it in range(0, n_sel * TILES_PER_BLOCK):
        slot = it // TILES_PER_BLOCK
        tile = it % TILES_PER_BLOCK
        block = tl.load(idx_base + slot * stride_in).to(tl.int64)
        in_block = tile * BLOCK_N + offs_n
        pos = block * SEL_BLOCK + in_block
        key_mask = (block >= 0) & (in_block < SEL_BLOCK) & (pos <= p)

        kT = tl.load(k_base + pos[None, :] * stride_kt + offs_dk[:, None],
                     mask=key_mask[None, :] & dk_mask[:, None], other=0.0)
        vT = tl.load(v_base + pos[None, :] * stride_vt + offs_dv[:, None],
                     mask=key_mask[None, :] & dv_mask[:, None], other=0.0)
        if DOT_FP32:
            kT = kT.to(tl.float32)
            s = tl.dot(q, kT, input_precision=INPUT_PRECISION)
            dp = tl.dot(do, vT.to(tl.float32), input_precision=INPUT_PRECISION)
        else:
            s = tl.dot(q, kT)
            dp = tl.dot(do, vT)
        probs = tl.where(key_mask[None, :], tl.exp2(s * scale_log2 - m2[:, None]) * inv_l[:, None], 0.0)
        ds = probs * (dp - delta[:, None])
        if DOT_FP32:
            dq += tl.dot(ds, tl.trans(kT), input_precision=INPUT_PRECISION)
        else:
            dq += tl.dot(ds.to(kT.dtype), tl.trans(kT))

    dq = dq * scale
    tl.store(DQ + b * stride_dqb + t * stride_dqt + heads[:, None] * stride_dqh + offs_dk[None, :],
             dq.to(DQ.dtype.element_ty), mask=head_mask[:, None] & dk_mask[None, :])


@triton.jit
def _selected_attention_bwd_dkdv_kernel(
    Q, K, V, DO, STATS, DELTA, DK_OUT, DV_OUT, DK_WS, DV_WS,
    QUERY_ROWS, ITEM_KEY, ITEM_BEGIN, ITEM_END, ITEM_SLOT,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_dob, stride_dot, stride_doh,
    stride_sb, stride_st, stride_db, stride_dt,
    stride_dkb, stride_dkt, stride_dkh,
    stride_dvb, stride_dvt, stride_dvh,
    n_kv_heads, n_blocks, n_keys_total, q_offset, scale, scale_log2,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, SEL_BLOCK: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    item = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1).to(tl.int64)
    key = tl.load(ITEM_KEY + item).to(tl.int64)  # (b * Hkv + g) * NB + j
    block = key % n_blocks
    g = (key // n_blocks) % n_kv_heads
    b = key // n_blocks // n_kv_heads
    begin = tl.load(ITEM_BEGIN + item).to(tl.int64)
    end = tl.load(ITEM_END + item).to(tl.int64)
    slot = tl.load(ITEM_SLOT + item).to(tl.int64)

    offs_h = tl.arange(0, BLOCK_H)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
    head_mask = offs_h < GROUP
    dk_mask = offs_dk < DK
    dv_mask = offs_dv < DV
    heads = g * GROUP + offs_h
    in_block = tile * BLOCK_N + offs_n
    pos = block * SEL_BLOCK + in_block
    key_mask = (in_block < SEL_BLOCK) & (pos < n_keys_total)

    k = tl.load(K + b * stride_kb + g * stride_kh + pos[:, None] * stride_kt + offs_dk[None, :],
                mask=key_mask[:, None] & dk_mask[None, :], other=0.0)
    v = tl.load(V + b * stride_vb + g * stride_vh + pos[:, None] * stride_vt + offs_dv[None, :],
                mask=key_mask[:, None] & dv_mask[None, :], other=0.0)
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_DK], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    for e in range(begin, end):
        t = tl.load(QUERY_ROWS + e).to(tl.int64)
        p = q_offset + t
        qT = tl.load(Q + b * stride_qb + t * stride_qt + heads[None, :] * stride_qh + offs_dk[:, None],
                     mask=head_mask[None, :] & dk_mask[:, None], other=0.0)
        do = tl.load(DO + b * stride_dob + t * stride_dot + heads[:, None] * stride_doh + offs_dv[None, :],
                     mask=head_mask[:, None] & dv_mask[None, :], other=0.0)
        m2 = tl.load(STATS + b * stride_sb + t * stride_st + heads * 2, mask=head_mask, other=0.0)
        inv_l = tl.load(STATS + b * stride_sb + t * stride_st + heads * 2 + 1, mask=head_mask, other=0.0)
        delta = tl.load(DELTA + b * stride_db + t * stride_dt + heads, mask=head_mask, other=0.0)
        visible = key_mask & (pos <= p)  # Eq. 12 clip for this query
        if DOT_FP32:
            qT = qT.to(tl.float32)
            do = do.to(tl.float32)
            sT = tl.dot(k, qT, input_precision=INPUT_PRECISION)  # [BLOCK_N, BLOCK_H]
        else:
            sT = tl.dot(k, qT)
        pT = tl.where(visible[:, None], tl.exp2(sT * scale_log2 - m2[None, :]) * inv_l[None, :], 0.0)
        if DOT_FP32:
            dv += tl.dot(pT, do, input_precision=INPUT_PRECISION)
            dpT = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
        else:
            dv += tl.dot(pT.to(do.dtype), do)
            dpT = tl.dot(v, tl.trans(do))
        dsT = pT * (dpT - delta[None, :])
        if DOT_FP32:
            dk += tl.dot(dsT, tl.trans(qT), input_precision=INPUT_PRECISION)
        else:
            dk += tl.dot(dsT.to(qT.dtype), tl.trans(qT))
    dk = dk * scale

    direct = slot < 0
    tl.store(DK_OUT + b * stride_dkb + g * stride_dkh + pos[:, None] * stride_dkt + offs_dk[None, :],
             dk.to(DK_OUT.dtype.element_ty), mask=direct & key_mask[:, None] & dk_mask[None, :])
    tl.store(DV_OUT + b * stride_dvb + g * stride_dvh + pos[:, None] * stride_dvt + offs_dv[None, :],
             dv.to(DV_OUT.dtype.element_ty), mask=direct & key_mask[:, None] & dv_mask[None, :])
    ws_rows = slot * SEL_BLOCK + in_block
    ws_mask = (slot >= 0) & (in_block < SEL_BLOCK)
    tl.store(DK_WS + ws_rows[:, None] * DK + offs_dk[None, :], dk, mask=ws_mask[:, None] & dk_mask[None, :])
    tl.store(DV_WS + ws_rows[:, None] * DV + offs_dv[None, :], dv, mask=ws_mask[:, None] & dv_mask[None, :])


@triton.jit
def _slot_reduce_kernel(
    DK_WS, DV_WS, DK_OUT, DV_OUT, SPLIT_KEY, SLOT_BEGIN, SLOT_END,
    stride_dkb, stride_dkt, stride_dkh,
    stride_dvb, stride_dvt, stride_dvh,
    n_kv_heads, n_blocks, n_keys_total,
    DK: tl.constexpr, DV: tl.constexpr, SEL_BLOCK: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dk/dv of a split block = sum of its workspace slots, in slot order (deterministic)."""
    split = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1).to(tl.int64)
    key = tl.load(SPLIT_KEY + split).to(tl.int64)
    block = key % n_blocks
    g = (key // n_blocks) % n_kv_heads
    b = key // n_blocks // n_kv_heads
    first = tl.load(SLOT_BEGIN + split).to(tl.int64)
    last = tl.load(SLOT_END + split).to(tl.int64)

    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    in_block = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    pos = block * SEL_BLOCK + in_block
    row_mask = in_block < SEL_BLOCK
    dk_mask = row_mask[:, None] & (offs_dk[None, :] < DK)
    dv_mask = row_mask[:, None] & (offs_dv[None, :] < DV)
    dk = tl.zeros([BLOCK_N, BLOCK_DK], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    for s in range(first, last):
        rows = s * SEL_BLOCK + in_block
        dk += tl.load(DK_WS + rows[:, None] * DK + offs_dk[None, :], mask=dk_mask, other=0.0)
        dv += tl.load(DV_WS + rows[:, None] * DV + offs_dv[None, :], mask=dv_mask, other=0.0)
    out_rows = (pos < n_keys_total)[:, None]
    tl.store(DK_OUT + b * stride_dkb + g * stride_dkh + pos[:, None] * stride_dkt + offs_dk[None, :],
             dk.to(DK_OUT.dtype.element_ty), mask=dk_mask & out_rows)
    tl.store(DV_OUT + b * stride_dvb + g * stride_dvh + pos[:, None] * stride_dvt + offs_dv[None, :],
             dv.to(DV_OUT.dtype.element_ty), mask=dv_mask & out_rows)


def selected_attention_backward(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, o: Tensor, stats: Tensor,
                                do: Tensor, sel_block: int, scale: float, tiling: Tiling | None = None,
                                queries_per_item: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv for validated inputs (last dims contiguous) and the forward's o, stats (m, 1/l).

    tiling: launch settings of the dq and dk/dv kernels, used as given (the GPU benchmark sweeps it); default:
    tiling.backward_tiling's heuristic, shrunk by launch_with_fallback if the GPU lacks the resources.
    queries_per_item: most queries one dk/dv program walks before its block is split over workspace slots
    (default: selected_attention_index.default_queries_per_item); tests set it small to cover the split path.
    """
    B, TQ, Hq, dk_dim = q.shape
    TK, Hkv, dv_dim = k.shape[1], k.shape[2], v.shape[-1]
    group = Hq // Hkv
    n_sel = indices.shape[-1]
    dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    dk = torch.zeros_like(k, memory_format=torch.contiguous_format)
    dv = torch.zeros_like(v, memory_format=torch.contiguous_format)
    if B * TQ * Hq == 0:
        return dq, dk, dv
    if do.stride(-1) != 1:
        do = do.contiguous()
    delta = (do.float() * o.float()).sum(-1).contiguous()  # D = rowsum(dO * O), [B, TQ, Hq]

    block_h, block_dk, block_dv = padded(group), padded(dk_dim), padded(dv_dim)
    dot_fp32, precision = dot_settings(q.dtype)
    shapes = dict(GROUP=group, DK=dk_dim, DV=dv_dim, SEL_BLOCK=sel_block, BLOCK_H=block_h,
                  BLOCK_DK=block_dk, BLOCK_DV=block_dv, DOT_FP32=dot_fp32, INPUT_PRECISION=precision)

    def launch_dq(tiling: Tiling) -> None:
        _selected_attention_bwd_dq_kernel[(TQ, Hkv, B)](
            q, k, v, do, stats, delta, indices, dq,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            do.stride(0), do.stride(1), do.stride(2),
            stats.stride(0), stats.stride(1), delta.stride(0), delta.stride(1),
            indices.stride(0), indices.stride(1), indices.stride(2), indices.stride(3),
            dq.stride(0), dq.stride(1), dq.stride(2),
            n_sel, TK - TQ, scale, scale * LOG2E, BLOCK_N=tiling.block_n,
            TILES_PER_BLOCK=math.ceil(sel_block / tiling.block_n), **shapes,
            num_warps=tiling.num_warps, num_stages=tiling.num_stages,
        )

    heuristic = backward_tiling(block_h, block_dk, block_dv, sel_block, q.dtype)
    run(launch_dq, tiling, heuristic)

    index = build_inverted_index(indices, TK, sel_block, queries_per_item)
    if index.n_items == 0:
        return dq, dk, dv
    n_slots = index.n_slots
    dk_ws = torch.empty((max(n_slots, 1), sel_block, dk_dim), device=q.device, dtype=torch.float32)
    dv_ws = torch.empty((max(n_slots, 1), sel_block, dv_dim), device=q.device, dtype=torch.float32)

    def launch_dkdv(tiling: Tiling) -> None:
        _selected_attention_bwd_dkdv_kernel[(index.n_items, math.ceil(sel_block / tiling.block_n))](
            q, k, v, do, stats, delta, dk, dv, dk_ws, dv_ws,
            index.query_rows, index.item_key, index.item_begin, index.item_end, index.item_slot,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            do.stride(0), do.stride(1), do.stride(2),
            stats.stride(0), stats.stride(1), delta.stride(0), delta.stride(1),
            dk.stride(0), dk.stride(1), dk.stride(2),
            dv.stride(0), dv.stride(1), dv.stride(2),
            Hkv, index.n_blocks, TK, TK - TQ, scale, scale * LOG2E, BLOCK_N=tiling.block_n, **shapes,
            num_warps=tiling.num_warps, num_stages=tiling.num_stages,
        )

    run(launch_dkdv, tiling, heuristic)
    if n_slots:
        rows = key_tile_rows(sel_block, 32)
        _slot_reduce_kernel[(index.split_key.numel(), math.ceil(sel_block / rows))](
            dk_ws, dv_ws, dk, dv, index.split_key, index.slot_begin, index.slot_end,
            dk.stride(0), dk.stride(1), dk.stride(2),
            dv.stride(0), dv.stride(1), dv.stride(2),
            Hkv, index.n_blocks, TK,
            DK=dk_dim, DV=dv_dim, SEL_BLOCK=sel_block, BLOCK_DK=block_dk, BLOCK_DV=block_dv, BLOCK_N=rows,
            num_warps=4,
        )
    return dq, dk, dv


def run(launch: Callable[[Tiling], None], tiling: Tiling | None, heuristic: Tiling) -> None:
    """An explicit tiling is launched as given; the heuristic one may shrink (launch_with_fallback)."""
    if tiling is None:
        launch_with_fallback(launch, heuristic)
    else:
        launch(tiling)
