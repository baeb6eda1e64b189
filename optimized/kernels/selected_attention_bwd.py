"""Backward Triton kernels of the selected-attention branch (Eq. 12): dq, dk, dv, deterministic (no atomics).

FlashAttention-2 math with the forward's softmax stats (m, 1/l): P = 2^(S log2(e) - m) / l, dV = P^T dO, dP = dO V^T,
D = sum_s P_s dP_s, dS = P * (dP - D), dQ = scale * dS K, dK = scale * dS^T Q.

- dq: query-centric like the forward, grid (t, g, b): one program per query row and KV group walks the
  selected blocks of (t, g) and owns dq of the group's heads. It also fixes D (below) and writes it for dk/dv.
  Half-precision groups of 5-8 heads are its tiles' columns (common.dq_head_tile: s^T = K q^T, dq^T += K^T dS^T,
  8 columns per product), other groups its rows.
- dk/dv: key-centric over the inverted index (selected_attention_index): one program per (work item, key
  tile of the block) takes the queries that selected the block BLOCK_COLS (query, head) columns at a time,
  so each step is four [BLOCK_N, BLOCK_COLS]-sized dots, and accumulates dk/dv of its key tile in fp32.
  A block split over several items writes fp32 partials to workspace slots, then `_slot_reduce_kernel`
  sums them in slot order. All sums have a fixed order, so results are bitwise reproducible run to run.

Accuracy (the error-ratio rule of conformance.helpers.error_ratio against a naive autograd oracle):
- D is made consistent with the kernel's own P and dP. FlashAttention's D = rowsum(dO * O) carries O's
  rounding (bf16 O, or the forward's bf16 P in its P V product), so sum_s dS_s != 0 and dq picks up a
  systematic error D_err * sum_s P_s k_s. The dq kernel starts from D0 = rowsum(dO * O), accumulates
  shift = sum_s P_s (dP_s - D0), sum P and sum_s P_s k_s in the same pass, and returns
  dq = scale * (sum_s P_s (dP_s - D0) k_s - (D - D0) sum_s P_s k_s) with D = sum_s P_s dP_s = D0 sum P + shift.
  That D is stored for the dk/dv kernel.
- Half-precision inputs (SPLIT_DS): dS is fed to the dS K dot as two half-precision parts hi + lo
  (lo = dS - hi rounded again), so dq carries dS to ~16 bits instead of 8/11 and is rounded once at the end.
  Where the group's heads are rows and (padded to a power of two) fill at most half of the 16-row tile (groups
  up to 4), the free rows repeat them (COPIES; dq_row_copies) and the lo half and P ride in the rows of the hi
  half's dot: three dots per key tile instead of five. Each part is summed in fp32 over the keys on its own, and
  the copies are added (hi + lo) once at the end. Groups of 5-8 take the three products as 8-column tiles.
- fp32 inputs (COMPENSATED, dk/dv): exact fp32 dots run as sequential FMA chains on CUDA cores, and
  `acc += dot(a, b)` is fused into one chain over every term. Each step's dot result is therefore added to the
  dk/dv accumulators with Kahan compensation, so a sum over thousands of (query, head) terms (block 0 is
  selected by every query) keeps a few-ulp error instead of one growing with the chain length. dq sums only
  the n * l' keys of one query; there the consistent D is what matters (a compensated dq measured no better
  in a float64 model of the fp32 chains).

Packed batches (PACKED): dq reads block j of row t at keys DOC_START[t] + j * SEL_BLOCK .., like the
forward; the dk/dv programs take their block's first key and its document's end from the inverted index
(BLOCK_BASE, BLOCK_END), so no program writes a key of another document.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..numerics import LOG2E
from .common import (DkdvTiling, Tiling, compensated_add, dkdv_tiling, dot, dot_settings, dq_head_dim_tiles,
                     dq_head_tile, dq_tiling, head_dim_tiles, heads_dot, heads_per_query, key_tile_rows, launch_tiling,
                     padded, second_head_tile, selected_block_keys, smaller_dkdv_tilings)
from .range_attention_bwd import range_attention_backward_dq
from .selected_attention_index import build_inverted_index


@triton.jit
def _copy_rows(x, which: tl.constexpr, N_COPIES: tl.constexpr, HEAD_ROWS: tl.constexpr, WIDTH: tl.constexpr):
    """Rows which * HEAD_ROWS .. (which + 1) * HEAD_ROWS - 1 of x [N_COPIES * HEAD_ROWS, WIDTH]."""
    copies = tl.reshape(x, [N_COPIES, HEAD_ROWS, WIDTH])
    return tl.sum(tl.where(tl.arange(0, N_COPIES)[:, None, None] == which, copies, 0.0), 0)


@triton.jit
def _copy_entries(x, which: tl.constexpr, N_COPIES: tl.constexpr, HEAD_ROWS: tl.constexpr):
    """Entries which * HEAD_ROWS .. (which + 1) * HEAD_ROWS - 1 of x [N_COPIES * HEAD_ROWS]."""
    copies = tl.reshape(x, [N_COPIES, HEAD_ROWS])
    return tl.sum(tl.where(tl.arange(0, N_COPIES)[:, None] == which, copies, 0.0), 0)


@triton.jit
def _split_ds_products(dq, dq_lo, p_k, ds_hi, ds_lo, probs, k_tile, KEY_AXIS: tl.constexpr,
                       DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """One key tile's products with one head-dim tile of k (one copy of the rows): dS hi and dS lo onto dq, P (in
    k's dtype) onto sum P k. With the heads as the tiles' columns (KEY_AXIS 0) dS lo goes to an accumulator of its
    own, dq_lo (its product need not wait for hi's); with the heads as rows it is added onto dq, and dq_lo is
    returned as given."""
    dq += heads_dot(ds_hi, k_tile, KEY_AXIS, DOT_FP32, INPUT_PRECISION)
    if KEY_AXIS == 0:
        dq_lo += heads_dot(ds_lo, k_tile, KEY_AXIS, DOT_FP32, INPUT_PRECISION)
    else:
        dq += heads_dot(ds_lo, k_tile, KEY_AXIS, DOT_FP32, INPUT_PRECISION)
    p_k += heads_dot(probs.to(k_tile.dtype), k_tile, KEY_AXIS, DOT_FP32, INPUT_PRECISION)
    return dq, dq_lo, p_k


@triton.jit
def _selected_attention_bwd_dq_kernel(
    Q, K, V, O, DO, STATS, IDX, DQ, DELTA, DOC_START,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh,
    stride_dob, stride_dot, stride_doh,
    stride_sb, stride_st, stride_db, stride_dt,
    stride_ib, stride_it, stride_ih, stride_in,
    stride_dqb, stride_dqt, stride_dqh,
    n_sel, q_offset, scale, scale_log2,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, SEL_BLOCK: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    TILES_PER_BLOCK: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    SPLIT_DS: tl.constexpr, PACKED: tl.constexpr, HEAD_ROWS: tl.constexpr, COPIES: tl.constexpr,
    KEY_AXIS: tl.constexpr, BLOCK_DK2: tl.constexpr,
):
    # KEY_AXIS: the group's heads are the tiles' columns (0: s^T = K q^T [BLOCK_N, BLOCK_H], dq^T += K^T dS^T) or
    # their rows (1: s = q K^T, dq += dS K; the only layout with COPIES > 1), as in the forward. Tiles over the
    # heads lay them along 1 - KEY_AXIS (tl.expand_dims(x, a) lays x along 1 - a); sums over keys run along
    # KEY_AXIS.
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    p = q_offset + t
    if PACKED:
        row_start = tl.load(DOC_START + t).to(tl.int64)
    else:
        row_start = 0

    # Row r of the tile: head r % HEAD_ROWS of the group, in copy r // HEAD_ROWS (rows of copies >= COPIES: zero).
    offs_h = tl.arange(0, BLOCK_H)
    copy = offs_h // HEAD_ROWS
    in_group = offs_h % HEAD_ROWS
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
    head_mask = (in_group < GROUP) & (copy < COPIES)
    dk_mask = offs_dk < DK
    dv_mask = offs_dv < DV
    heads = g * GROUP + in_group

    head_along = tl.expand_dims(heads, KEY_AXIS)
    head_ok = tl.expand_dims(head_mask, KEY_AXIS)
    q = tl.load(Q + b * stride_qb + t * stride_qt + head_along * stride_qh + tl.expand_dims(offs_dk, 1 - KEY_AXIS),
                mask=head_ok & tl.expand_dims(dk_mask, 1 - KEY_AXIS), other=0.0)
    do = tl.load(DO + b * stride_dob + t * stride_dot + head_along * stride_doh + tl.expand_dims(offs_dv, 1 - KEY_AXIS),
                 mask=head_ok & tl.expand_dims(dv_mask, 1 - KEY_AXIS), other=0.0)
    o = tl.load(O + b * stride_ob + t * stride_ot + head_along * stride_oh + tl.expand_dims(offs_dv, 1 - KEY_AXIS),
                mask=head_ok & tl.expand_dims(dv_mask, 1 - KEY_AXIS), other=0.0)
    # Padding heads: q = dO = 0, m = 1/l = 0, so P = 0 and dS = 0.
    m2 = tl.load(STATS + b * stride_sb + t * stride_st + heads * 2, mask=head_mask, other=0.0)
    inv_l = tl.load(STATS + b * stride_sb + t * stride_st + heads * 2 + 1, mask=head_mask, other=0.0)
    delta_start = tl.sum(do.to(tl.float32) * o.to(tl.float32), KEY_AXIS)  # D0 = rowsum(dO * O)
    if BLOCK_DK2 > 0:  # the head dim's second tile (common.head_dim_tiles): q2, k2, dq2, p_k2 (one copy of the rows)
        tl.static_assert(COPIES == 1)
        offs_dk2 = BLOCK_DK + tl.arange(0, BLOCK_DK2)
        dk_mask2 = offs_dk2 < DK
        q2 = tl.load(Q + b * stride_qb + t * stride_qt + head_along * stride_qh
                     + tl.expand_dims(offs_dk2, 1 - KEY_AXIS),
                     mask=head_ok & tl.expand_dims(dk_mask2, 1 - KEY_AXIS), other=0.0)
        if KEY_AXIS == 0:
            dq2 = tl.zeros([BLOCK_DK2, BLOCK_H], dtype=tl.float32)
            dq2_lo = tl.zeros([BLOCK_DK2, BLOCK_H], dtype=tl.float32)
            p_k2 = tl.zeros([BLOCK_DK2, BLOCK_H], dtype=tl.float32)
        else:
            dq2 = tl.zeros([BLOCK_H, BLOCK_DK2], dtype=tl.float32)
            dq2_lo = dq2  # not used: the rows layout adds dS lo onto dq2 (_split_ds_products)
            p_k2 = tl.zeros([BLOCK_H, BLOCK_DK2], dtype=tl.float32)

    k_base = K + b * stride_kb + g * stride_kh
    v_base = V + b * stride_vb + g * stride_vh
    idx_base = IDX + b * stride_ib + t * stride_it + g * stride_ih
    if KEY_AXIS == 0:  # the split dS's lo half in an accumulator of its own: its product need not wait for hi's
        dq = tl.zeros([BLOCK_DK, BLOCK_H], dtype=tl.float32)
        dq_lo = tl.zeros([BLOCK_DK, BLOCK_H], dtype=tl.float32)
        p_k = tl.zeros([BLOCK_DK, BLOCK_H], dtype=tl.float32)  # sum_s P_s k_s
    else:
        dq = tl.zeros([BLOCK_H, BLOCK_DK], dtype=tl.float32)
        dq_lo = dq  # not used: the rows layout adds dS lo onto dq (_split_ds_products)
        p_k = tl.zeros([BLOCK_H, BLOCK_DK], dtype=tl.float32)
    shift = tl.zeros([BLOCK_H], dtype=tl.float32)  # sum_s P_s (dP_s - D0)
    p_sum = tl.zeros([BLOCK_H], dtype=tl.float32)

    for it in range(0, n_sel * TILES_PER_BLOCK):
        slot = it // TILES_PER_BLOCK
        tile = it % TILES_PER_BLOCK
        block = tl.load(idx_base + slot * stride_in).to(tl.int64)
        pos, key_mask = selected_block_keys(block, tile, row_start, p, offs_n, SEL_BLOCK, BLOCK_N)

        # K is loaded in the orientation of its dS product (rows [BLOCK_N, BLOCK_DK] for dS K, K^T for K^T dS^T)
        # and transposed as a view for the logits' product: loaded the other way, the tile's second use needed a
        # register copy in another layout, and Triton's pipeliner then left that load synchronous in the loop.
        k_tile = tl.load(k_base + tl.expand_dims(pos, KEY_AXIS) * stride_kt + tl.expand_dims(offs_dk, 1 - KEY_AXIS),
                         mask=tl.expand_dims(key_mask, KEY_AXIS) & tl.expand_dims(dk_mask, 1 - KEY_AXIS), other=0.0)
        v_tile = tl.load(v_base + tl.expand_dims(pos, 1 - KEY_AXIS) * stride_vt + tl.expand_dims(offs_dv, KEY_AXIS),
                         mask=tl.expand_dims(key_mask, 1 - KEY_AXIS) & tl.expand_dims(dv_mask, KEY_AXIS), other=0.0)
        if BLOCK_DK2 > 0:
            k2_tile = tl.load(k_base + tl.expand_dims(pos, KEY_AXIS) * stride_kt
                              + tl.expand_dims(offs_dk2, 1 - KEY_AXIS),
                              mask=tl.expand_dims(key_mask, KEY_AXIS) & tl.expand_dims(dk_mask2, 1 - KEY_AXIS),
                              other=0.0)
        s = heads_dot(q, tl.trans(k_tile), KEY_AXIS, DOT_FP32, INPUT_PRECISION)
        if BLOCK_DK2 > 0:
            s += heads_dot(q2, tl.trans(k2_tile), KEY_AXIS, DOT_FP32, INPUT_PRECISION)
        dp = heads_dot(do, v_tile, KEY_AXIS, DOT_FP32, INPUT_PRECISION)
        probs = tl.where(tl.expand_dims(key_mask, 1 - KEY_AXIS),
                         tl.exp2(s * scale_log2 - tl.expand_dims(m2, KEY_AXIS)) * tl.expand_dims(inv_l, KEY_AXIS), 0.0)
        ds = probs * (dp - tl.expand_dims(delta_start, KEY_AXIS))
        shift += tl.sum(ds, KEY_AXIS)
        p_sum += tl.sum(probs, KEY_AXIS)
        if SPLIT_DS:
            ds_hi = ds.to(K.dtype.element_ty)
            ds_lo = (ds - ds_hi.to(tl.float32)).to(K.dtype.element_ty)
            if COPIES == 1:
                dq, dq_lo, p_k = _split_ds_products(dq, dq_lo, p_k, ds_hi, ds_lo, probs, k_tile, KEY_AXIS, DOT_FP32,
                                                    INPUT_PRECISION)
                if BLOCK_DK2 > 0:
                    dq2, dq2_lo, p_k2 = _split_ds_products(dq2, dq2_lo, p_k2, ds_hi, ds_lo, probs, k2_tile, KEY_AXIS,
                                                           DOT_FP32, INPUT_PRECISION)
            elif COPIES == 2:  # copy 0: dS hi, copy 1: dS lo, in one dot; sum P k in its own
                dq += dot(tl.where(copy[:, None] == 0, ds_hi, ds_lo), k_tile, DOT_FP32, INPUT_PRECISION)
                p_k += dot(probs.to(K.dtype.element_ty), k_tile, DOT_FP32, INPUT_PRECISION)
            else:  # copy 0: dS hi, copy 1: dS lo, copy 2: P, all three in one dot
                parts = tl.where(copy[:, None] == 0, ds_hi,
                                 tl.where(copy[:, None] == 1, ds_lo, probs.to(K.dtype.element_ty)))
                dq += dot(parts, k_tile, DOT_FP32, INPUT_PRECISION)
        else:
            dq += heads_dot(ds, k_tile, KEY_AXIS, DOT_FP32, INPUT_PRECISION)
            p_k += heads_dot(probs, k_tile, KEY_AXIS, DOT_FP32, INPUT_PRECISION)
            if BLOCK_DK2 > 0:
                dq2 += heads_dot(ds, k2_tile, KEY_AXIS, DOT_FP32, INPUT_PRECISION)
                p_k2 += heads_dot(probs, k2_tile, KEY_AXIS, DOT_FP32, INPUT_PRECISION)

    if COPIES > 1:  # back to one row per head: dq = hi + lo, sum P k, and copy 0's row sums
        if COPIES == 3:
            p_k = _copy_rows(dq, 2, BLOCK_H // HEAD_ROWS, HEAD_ROWS, BLOCK_DK)
        else:
            p_k = _copy_rows(p_k, 0, BLOCK_H // HEAD_ROWS, HEAD_ROWS, BLOCK_DK)
        dq = (_copy_rows(dq, 0, BLOCK_H // HEAD_ROWS, HEAD_ROWS, BLOCK_DK)
              + _copy_rows(dq, 1, BLOCK_H // HEAD_ROWS, HEAD_ROWS, BLOCK_DK))
        shift = _copy_entries(shift, 0, BLOCK_H // HEAD_ROWS, HEAD_ROWS)
        p_sum = _copy_entries(p_sum, 0, BLOCK_H // HEAD_ROWS, HEAD_ROWS)
        delta_start = _copy_entries(delta_start, 0, BLOCK_H // HEAD_ROWS, HEAD_ROWS)
        in_group = tl.arange(0, HEAD_ROWS)
        head_mask = in_group < GROUP
        heads = g * GROUP + in_group
    if KEY_AXIS == 0 and SPLIT_DS:
        dq += dq_lo
        if BLOCK_DK2 > 0:
            dq2 += dq2_lo
    correction = shift + delta_start * (p_sum - 1.0)  # D - D0, D = sum_s P_s dP_s = D0 * sum P + shift
    dq = (dq - tl.expand_dims(correction, KEY_AXIS) * p_k) * scale
    dq_rows = DQ + b * stride_dqb + t * stride_dqt + tl.expand_dims(heads, KEY_AXIS) * stride_dqh
    tl.store(dq_rows + tl.expand_dims(offs_dk, 1 - KEY_AXIS), dq.to(DQ.dtype.element_ty),
             mask=tl.expand_dims(head_mask, KEY_AXIS) & tl.expand_dims(dk_mask, 1 - KEY_AXIS))
    if BLOCK_DK2 > 0:
        dq2 = (dq2 - tl.expand_dims(correction, KEY_AXIS) * p_k2) * scale
        tl.store(dq_rows + tl.expand_dims(offs_dk2, 1 - KEY_AXIS), dq2.to(DQ.dtype.element_ty),
                 mask=tl.expand_dims(head_mask, KEY_AXIS) & tl.expand_dims(dk_mask2, 1 - KEY_AXIS))
    tl.store(DELTA + b * stride_db + t * stride_dt + heads, delta_start + correction, mask=head_mask)


@triton.jit
def _selected_attention_bwd_dkdv_kernel(
    Q, K, V, DO, STATS, DELTA, DK_OUT, DV_OUT, DK_WS, DV_WS,
    QUERY_ROWS, ITEM_KEY, ITEM_BEGIN, ITEM_END, ITEM_SLOT, BLOCK_BASE, BLOCK_END,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_dob, stride_dot, stride_doh,
    stride_sb, stride_st, stride_db, stride_dt,
    stride_dkb, stride_dkt, stride_dkh,
    stride_dvb, stride_dvt, stride_dvh,
    n_kv_heads, n_blocks, n_keys_total, q_offset, scale, scale_log2,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, SEL_BLOCK: tl.constexpr,
    QUERIES_PER_STEP: tl.constexpr, BLOCK_COLS: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr, COMPENSATED: tl.constexpr, PACKED: tl.constexpr,
    BLOCK_DK2: tl.constexpr,
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

    # Column c of a step is (query c // GROUP of the step, head c % GROUP of the group): the group's h heads are
    # not padded, so a step takes BLOCK_COLS // h queries and its last BLOCK_COLS % h columns none.
    offs_c = tl.arange(0, BLOCK_COLS)
    col_query = offs_c // GROUP
    col_head = offs_c % GROUP
    head_ok = col_query < QUERIES_PER_STEP
    heads = g * GROUP + col_head
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
    dk_mask = offs_dk < DK
    dv_mask = offs_dv < DV
    in_block = tile * BLOCK_N + offs_n
    if PACKED:
        pos = tl.load(BLOCK_BASE + block).to(tl.int64) + in_block
        key_mask = (in_block < SEL_BLOCK) & (pos < tl.load(BLOCK_END + block).to(tl.int64))
    else:
        pos = block * SEL_BLOCK + in_block
        key_mask = (in_block < SEL_BLOCK) & (pos < n_keys_total)

    k_rows = K + b * stride_kb + g * stride_kh + pos[:, None] * stride_kt
    k = tl.load(k_rows + offs_dk[None, :], mask=key_mask[:, None] & dk_mask[None, :], other=0.0)
    v = tl.load(V + b * stride_vb + g * stride_vh + pos[:, None] * stride_vt + offs_dv[None, :],
                mask=key_mask[:, None] & dv_mask[None, :], other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_DK], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    dk_comp = tl.zeros([BLOCK_N, BLOCK_DK], dtype=tl.float32)
    dv_comp = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    if BLOCK_DK2 > 0:  # the head dim's second tile (common.head_dim_tiles): k2, q2, dk2 beside the first
        k2, offs_dk2, dk_mask2 = second_head_tile(k_rows, key_mask, DK, BLOCK_DK, BLOCK_DK2, False)  # as k: not widened
        dk2 = tl.zeros([BLOCK_N, BLOCK_DK2], dtype=tl.float32)
        dk2_comp = tl.zeros([BLOCK_N, BLOCK_DK2], dtype=tl.float32)

    for e0 in range(begin, end, QUERIES_PER_STEP):
        e = e0 + col_query
        listed = e < end
        col_ok = head_ok & listed
        t = tl.load(QUERY_ROWS + e, mask=listed, other=0).to(tl.int64)
        q_rows = Q + b * stride_qb + t[:, None] * stride_qt + heads[:, None] * stride_qh
        q = tl.load(q_rows + offs_dk[None, :], mask=col_ok[:, None] & dk_mask[None, :],
                    other=0.0)  # [BLOCK_COLS, BLOCK_DK]
        if BLOCK_DK2 > 0:
            q2 = second_head_tile(q_rows, col_ok, DK, BLOCK_DK, BLOCK_DK2, False)[0]  # as q: not widened
        do = tl.load(DO + b * stride_dob + t[:, None] * stride_dot + heads[:, None] * stride_doh + offs_dv[None, :],
                     mask=col_ok[:, None] & dv_mask[None, :], other=0.0)
        # Unused columns: m = 1/l = D = 0 and q = dO = 0, so P = dS = 0.
        m2 = tl.load(STATS + b * stride_sb + t * stride_st + heads * 2, mask=col_ok, other=0.0)
        inv_l = tl.load(STATS + b * stride_sb + t * stride_st + heads * 2 + 1, mask=col_ok, other=0.0)
        delta = tl.load(DELTA + b * stride_db + t * stride_dt + heads, mask=col_ok, other=0.0)
        visible = key_mask[:, None] & (pos[:, None] <= (q_offset + t)[None, :]) & col_ok[None, :]  # Eq. 12 clip

        sT = dot(k, tl.trans(q), DOT_FP32, INPUT_PRECISION)  # [BLOCK_N, BLOCK_COLS]
        if BLOCK_DK2 > 0:
            sT += dot(k2, tl.trans(q2), DOT_FP32, INPUT_PRECISION)
        pT = tl.where(visible, tl.exp2(sT * scale_log2 - m2[None, :]) * inv_l[None, :], 0.0)
        dpT = dot(v, tl.trans(do), DOT_FP32, INPUT_PRECISION)
        dsT = pT * (dpT - delta[None, :])
        if COMPENSATED:
            dv, dv_comp = compensated_add(dv, dv_comp, dot(pT, do, DOT_FP32, INPUT_PRECISION))
            dk, dk_comp = compensated_add(dk, dk_comp, dot(dsT, q, DOT_FP32, INPUT_PRECISION))
            if BLOCK_DK2 > 0:
                dk2, dk2_comp = compensated_add(dk2, dk2_comp, dot(dsT, q2, DOT_FP32, INPUT_PRECISION))
        else:
            dv += dot(pT.to(do.dtype), do, DOT_FP32, INPUT_PRECISION)
            dk += dot(dsT.to(q.dtype), q, DOT_FP32, INPUT_PRECISION)
            if BLOCK_DK2 > 0:
                dk2 += dot(dsT.to(q.dtype), q2, DOT_FP32, INPUT_PRECISION)
    dk = (dk - dk_comp) * scale
    dv = dv - dv_comp

    direct = slot < 0
    tl.store(DK_OUT + b * stride_dkb + g * stride_dkh + pos[:, None] * stride_dkt + offs_dk[None, :],
             dk.to(DK_OUT.dtype.element_ty), mask=direct & key_mask[:, None] & dk_mask[None, :])
    tl.store(DV_OUT + b * stride_dvb + g * stride_dvh + pos[:, None] * stride_dvt + offs_dv[None, :],
             dv.to(DV_OUT.dtype.element_ty), mask=direct & key_mask[:, None] & dv_mask[None, :])
    ws_rows = slot * SEL_BLOCK + in_block
    ws_mask = (slot >= 0) & (in_block < SEL_BLOCK)
    tl.store(DK_WS + ws_rows[:, None] * DK + offs_dk[None, :], dk, mask=ws_mask[:, None] & dk_mask[None, :])
    tl.store(DV_WS + ws_rows[:, None] * DV + offs_dv[None, :], dv, mask=ws_mask[:, None] & dv_mask[None, :])
    if BLOCK_DK2 > 0:
        dk2 = (dk2 - dk2_comp) * scale
        tl.store(DK_OUT + b * stride_dkb + g * stride_dkh + pos[:, None] * stride_dkt + offs_dk2[None, :],
                 dk2.to(DK_OUT.dtype.element_ty), mask=direct & key_mask[:, None] & dk_mask2[None, :])
        tl.store(DK_WS + ws_rows[:, None] * DK + offs_dk2[None, :], dk2, mask=ws_mask[:, None] & dk_mask2[None, :])


@triton.jit
def _slot_reduce_kernel(
    DK_WS, DV_WS, DK_OUT, DV_OUT, SPLIT_KEY, SLOT_BEGIN, SLOT_END, BLOCK_BASE, BLOCK_END,
    stride_dkb, stride_dkt, stride_dkh,
    stride_dvb, stride_dvt, stride_dvh,
    n_kv_heads, n_blocks, n_keys_total,
    DK: tl.constexpr, DV: tl.constexpr, SEL_BLOCK: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, COMPENSATED: tl.constexpr,
    PACKED: tl.constexpr,
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
    if PACKED:
        pos = tl.load(BLOCK_BASE + block).to(tl.int64) + in_block
        key_end = tl.load(BLOCK_END + block).to(tl.int64)
    else:
        pos = block * SEL_BLOCK + in_block
        key_end = n_keys_total
    row_mask = in_block < SEL_BLOCK
    dk_mask = row_mask[:, None] & (offs_dk[None, :] < DK)
    dv_mask = row_mask[:, None] & (offs_dv[None, :] < DV)
    dk = tl.zeros([BLOCK_N, BLOCK_DK], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    dk_comp = tl.zeros([BLOCK_N, BLOCK_DK], dtype=tl.float32)
    dv_comp = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    for s in range(first, last):
        rows = s * SEL_BLOCK + in_block
        dk_part = tl.load(DK_WS + rows[:, None] * DK + offs_dk[None, :], mask=dk_mask, other=0.0)
        dv_part = tl.load(DV_WS + rows[:, None] * DV + offs_dv[None, :], mask=dv_mask, other=0.0)
        if COMPENSATED:
            dk, dk_comp = compensated_add(dk, dk_comp, dk_part)
            dv, dv_comp = compensated_add(dv, dv_comp, dv_part)
        else:
            dk += dk_part
            dv += dv_part
    out_rows = (pos < key_end)[:, None] & (last > first)  # a key with no slots was written by its one item
    tl.store(DK_OUT + b * stride_dkb + g * stride_dkh + pos[:, None] * stride_dkt + offs_dk[None, :],
             (dk - dk_comp).to(DK_OUT.dtype.element_ty), mask=dk_mask & out_rows)
    tl.store(DV_OUT + b * stride_dvb + g * stride_dvh + pos[:, None] * stride_dvt + offs_dv[None, :],
             (dv - dv_comp).to(DV_OUT.dtype.element_ty), mask=dv_mask & out_rows)


def precision_modes(dtype: torch.dtype) -> dict:
    """Constexpr numerics switches of the dk/dv kernels for an input dtype (see the module docstring)."""
    dot_fp32, precision = dot_settings(dtype)
    return dict(DOT_FP32=dot_fp32, INPUT_PRECISION=precision, COMPENSATED=dtype == torch.float32)


def selected_attention_backward(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, o: Tensor, stats: Tensor,
                                do: Tensor, sel_block: int, scale: float, tiling: Tiling | None = None,
                                dkdv_launch: DkdvTiling | None = None, queries_per_item: int | None = None,
                                doc_start: Tensor | None = None,
                                full_rows: tuple[Tensor, Tensor, Tensor] | None = None
                                ) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv for validated inputs (last dims contiguous) and the forward's o, stats (m, 1/l).

    tiling / dkdv_launch: launch settings of the dq and dk/dv kernels, used as given (the GPU benchmark sweeps
    them); default: tiling.dq_tiling / tiling.dkdv_tiling heuristics, shrunk if the GPU lacks the resources.
    queries_per_item: most queries one dk/dv program walks before its block is split over workspace slots
    (default: selected_attention_index.default_queries_per_item); tests set it small to cover the split path.
    doc_start: int32 [TQ] contiguous, the first key of each query row's document (packed batch), or None.
    full_rows: (lo, hi, lse2) of the first P rows, which the forward attended on the range kernel over their key
    runs [lo, hi] (selected_attention.SelectedAttentionFunction): their dq and D come from the range dq kernel,
    the other rows' from the dq kernel here; the dk/dv kernel then takes every row, so each key's dk/dv is still one
    sum, rounded once.
    """
    if do.stride(-1) != 1:
        do = do.contiguous()
    if full_rows is None:
        dq, delta = selected_attention_backward_dq(q, k, v, indices, o, stats, do, sel_block, scale, tiling,
                                                   doc_start=doc_start)
    else:
        lo, hi, lse2 = full_rows
        P, TQ = lo.shape[0], q.shape[1]
        dq = torch.empty_like(q)
        delta = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
        _, delta_full = range_attention_backward_dq(q[:, :P], k, v, lo, hi, o[:, :P], lse2, do[:, :P], scale,
                                                    out=dq[:, :P])
        delta[:, :P] = delta_full  # the range dq kernel keeps D in lse2's contiguous [B, P, Hq] layout
        if P < TQ:
            selected_attention_backward_dq(q[:, P:], k, v, indices[:, P:], o[:, P:], stats[:, P:], do[:, P:],
                                           sel_block, scale, tiling, out=(dq[:, P:], delta[:, P:]))
    dk, dv = selected_attention_backward_dkdv(q, k, v, indices, stats, delta, do, sel_block, scale, dkdv_launch,
                                              queries_per_item, doc_start=doc_start)
    return dq, dk, dv


def selected_attention_backward_dq(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, o: Tensor, stats: Tensor,
                                   do: Tensor, sel_block: int, scale: float, tiling: Tiling | None = None,
                                   doc_start: Tensor | None = None,
                                   out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """dq [B, TQ, Hq, dk] and D [B, TQ, Hq] fp32 = sum_s P_s dP_s (consistent with the kernels' P and dP).
    out: (dq, D) tensors of those shapes (the last dim of each contiguous, e.g. rows of larger ones) to write into."""
    B, TQ, Hq, dk_dim = q.shape
    TK, Hkv, dv_dim = k.shape[1], k.shape[2], v.shape[-1]
    group = Hq // Hkv
    if out is None:
        dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
        delta = torch.empty((B, TQ, Hq), device=q.device, dtype=torch.float32)
    else:
        dq, delta = out
    if B * TQ * Hq == 0:
        return dq, delta
    block_dk, block_dv = padded(dk_dim), padded(dv_dim)
    dot_fp32, precision = dot_settings(q.dtype)
    split_ds = q.dtype != torch.float32
    block_h, key_axis, head_rows, copies = dq_head_tile(group, split_ds, max(block_dk, block_dv))
    dk_tile, dk_tile2 = dq_head_dim_tiles(dk_dim, copies)

    def launch(tiling: Tiling) -> None:
        _selected_attention_bwd_dq_kernel[(TQ, Hkv, B)](
            q, k, v, o, do, stats, indices, dq, delta, indices if doc_start is None else doc_start,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            o.stride(0), o.stride(1), o.stride(2),
            do.stride(0), do.stride(1), do.stride(2),
            stats.stride(0), stats.stride(1), delta.stride(0), delta.stride(1),
            indices.stride(0), indices.stride(1), indices.stride(2), indices.stride(3),
            dq.stride(0), dq.stride(1), dq.stride(2),
            indices.shape[-1], TK - TQ, scale, scale * LOG2E,
            GROUP=group, DK=dk_dim, DV=dv_dim, SEL_BLOCK=sel_block, BLOCK_H=block_h, BLOCK_DK=dk_tile,
            BLOCK_DK2=dk_tile2, BLOCK_DV=block_dv, BLOCK_N=tiling.block_n,
            TILES_PER_BLOCK=math.ceil(sel_block / tiling.block_n), DOT_FP32=dot_fp32, INPUT_PRECISION=precision,
            SPLIT_DS=split_ds, PACKED=doc_start is not None, HEAD_ROWS=head_rows, COPIES=copies, KEY_AXIS=key_axis,
            num_warps=tiling.num_warps, num_stages=tiling.num_stages,
        )

    launch_tiling(launch, tiling, dq_tiling(group, block_dk, block_dv, sel_block, q.dtype))
    return dq, delta


def selected_attention_backward_dkdv(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, stats: Tensor,
                                     delta: Tensor, do: Tensor, sel_block: int, scale: float,
                                     dkdv_launch: DkdvTiling | None = None, queries_per_item: int | None = None,
                                     doc_start: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """dk, dv (zero for keys no query selected) from the dq kernel's D; deterministic."""
    B, TQ, Hq, dk_dim = q.shape
    TK, Hkv, dv_dim = k.shape[1], k.shape[2], v.shape[-1]
    group = Hq // Hkv
    dk = torch.zeros_like(k, memory_format=torch.contiguous_format)
    dv = torch.zeros_like(v, memory_format=torch.contiguous_format)
    if B * TQ * Hq == 0:
        return dk, dv
    index = build_inverted_index(indices, TK, sel_block, queries_per_item, doc_start)
    packed = index.block_base is not None
    block_base = index.block_base if packed else index.item_key  # any int tensor when not packed (never read)
    block_end = index.block_end if packed else index.item_key
    if index.n_items == 0:
        return dk, dv
    n_slots = index.n_slots  # a bound known on the host: allocating the workspace reads nothing back
    dk_ws = torch.empty((n_slots, sel_block, dk_dim), device=q.device, dtype=torch.float32)
    dv_ws = torch.empty((n_slots, sel_block, dv_dim), device=q.device, dtype=torch.float32)
    min_cols = heads_per_query(group)
    block_dk, block_dv = padded(dk_dim), padded(dv_dim)
    dk_tile, dk_tile2 = head_dim_tiles(dk_dim)
    modes = precision_modes(q.dtype)

    def launch(tiling: DkdvTiling) -> None:
        _selected_attention_bwd_dkdv_kernel[(index.n_items, math.ceil(sel_block / tiling.block_n))](
            q, k, v, do, stats, delta, dk, dv, dk_ws, dv_ws,
            index.query_rows, index.item_key, index.item_begin, index.item_end, index.item_slot, block_base, block_end,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            do.stride(0), do.stride(1), do.stride(2),
            stats.stride(0), stats.stride(1), delta.stride(0), delta.stride(1),
            dk.stride(0), dk.stride(1), dk.stride(2),
            dv.stride(0), dv.stride(1), dv.stride(2),
            Hkv, index.n_blocks, TK, TK - TQ, scale, scale * LOG2E,
            GROUP=group, DK=dk_dim, DV=dv_dim, SEL_BLOCK=sel_block,
            QUERIES_PER_STEP=tiling.block_cols // group, BLOCK_COLS=tiling.block_cols,
            BLOCK_DK=dk_tile, BLOCK_DK2=dk_tile2, BLOCK_DV=block_dv, BLOCK_N=tiling.block_n, PACKED=packed, **modes,
            num_warps=tiling.num_warps, num_stages=tiling.num_stages,
        )

    if dkdv_launch is not None and dkdv_launch.block_cols < group:
        raise ValueError(f"dkdv_launch.block_cols ({dkdv_launch.block_cols}) must hold one query's {group} heads")
    launch_tiling(launch, dkdv_launch, dkdv_tiling(group, block_dk, block_dv, sel_block, q.dtype),
                  lambda heuristic: smaller_dkdv_tilings(heuristic, min_cols))
    if index.split_key.numel():  # every key; those with an empty slot range write nothing
        rows = key_tile_rows(sel_block, 32)
        _slot_reduce_kernel[(index.split_key.numel(), math.ceil(sel_block / rows))](
            dk_ws, dv_ws, dk, dv, index.split_key, index.slot_begin, index.slot_end, block_base, block_end,
            dk.stride(0), dk.stride(1), dk.stride(2),
            dv.stride(0), dv.stride(1), dv.stride(2),
            Hkv, index.n_blocks, TK,
            DK=dk_dim, DV=dv_dim, SEL_BLOCK=sel_block, BLOCK_DK=block_dk, BLOCK_DV=block_dv, BLOCK_N=rows,
            COMPENSATED=modes["COMPENSATED"], PACKED=packed, num_warps=4,
        )
    return dk, dv

