"""The lean decode step's compressed branch and selection (docs/decode.md, "Lean step"): three launches.

1. compressed split kernel: one program per (row, KV group) and split of the compressed tokens; the queries of the
   group's heads as one tile. Visibility (Eq. 7, masks.compressed_block_visible) is computed in the kernel from the
   query position and the row's emitted count, so no [B, TQ, N] mask is built. Each program writes its partial
   (max, sum, output, keys admitted) and the Eq. 8 input of every key it admitted: the base-2 scaled logits
   q.k / sqrt(d_k) * log2(e) the softmax used (selection score "probs") or the scaled logits ("logits"). The first
   split of each (row, KV group) also appends the step's new token to the other branches' buffers
   (decode_append.py).
2. score kernel: one program per (row, KV group) and chunk of SCORE_BLOCK selection blocks j <= J = p // l'. It
   merges the compressed splits' max and sum into each head's log-sum-exp (the gate kernel merges their outputs
   into o_cmp), then head by head from the head's row of the Eq. 8 inputs (1-D loads: no [heads, blocks] tile to
   reduce per head): Eq. 8 p_cmp = 2^(x - lse2) over the visible compressed tokens (or the logits), Eq. 9 the
   banded overlap weights of masks.eq9_pool_weights added in scoring.pool_eq9's term order, Eq. 10 the sum (or
   mean) over the group's heads added in head order; the block scores go to memory (fp32 [rows, blocks]).
3. select kernel: one program (one warp: its reductions stay within the warp) per (row, KV group) and share of the
   blocks ranks their scores with Eq. 11 (optimized/kernels/top_n.py, score_into_list) into the program's list of
   its n best blocks. The sparse kernel merges the lists.
Scoring and ranking are two launches rather than one kernel of one-warp programs: there Eq. 11's [64, 80] int64
rank comparisons took most of the 255 registers and the scoring loads were latency-bound; the score kernel runs at
2 warps and 32 registers (perf/NOTES.md, "Lean decode step", has the measurements).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .decode_append import append_head_token
from .decode_tiles import (await_previous_launch, group_queries, merge_stats, qk_tile, softmax_update, step_position,
                           store_partial, visible_cmp_count)
from .top_n import EMPTY, score_into_list


@triton.jit
def compressed_split_kernel(
    Q, K, V, LENGTHS, N_NEW, LOGITS, O_PART, M_PART, L_PART, R_PART,
    NEW_K_CMP, NEW_V_CMP, NEW_K_SLC, NEW_V_SLC, NEW_K_WIN, NEW_V_WIN, RAW_K, RAW_V, HIST_K, HIST_V, WIN_K, WIN_V,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    n_slots, keys_per_split, n_split, scale_log2, scale, raw_extent, hist_extent, win_extent,
    HKV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr, STRICT: tl.constexpr, LOGIT_SCORES: tl.constexpr,
    DOT_FP32: tl.constexpr, PDL: tl.constexpr = False,
):
    await_previous_launch(PDL)
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1).to(tl.int64)
    g = row % HKV
    b = row // HKV
    if split == 0:  # the step's append of this (row, KV head): buffers this kernel does not read
        append_head_token(LENGTHS, N_NEW, NEW_K_CMP, NEW_V_CMP, NEW_K_SLC, NEW_V_SLC, NEW_K_WIN, NEW_V_WIN, RAW_K,
                          RAW_V, HIST_K, HIST_V, WIN_K, WIN_V, b, g, raw_extent, hist_extent, win_extent, HKV, DK, DV,
                          BLOCK_DK, BLOCK_DV)
    p, held = step_position(LENGTHS, N_NEW, b)
    n_visible = visible_cmp_count(p, held, CMP_BLOCK, CMP_STRIDE, STRICT)  # Eq. 7: blocks 0..n_visible-1

    offs_h = tl.arange(0, BLOCK_H)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
    head_mask = offs_h < GROUP
    dk_mask = offs_dk < DK
    dv_mask = offs_dv < DV
    q = group_queries(Q + b * stride_qb, g, stride_qh, GROUP, DK, BLOCK_H, BLOCK_DK, DOT_FP32)
    k_base = K + b * stride_kb + g * stride_kh
    v_base = V + b * stride_vb + g * stride_vh
    logit_base = LOGITS + row * GROUP * n_slots

    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)

    first = split * keys_per_split
    stop = tl.minimum(tl.minimum(first + keys_per_split, n_slots), n_visible)
    for start in range(first, stop, BLOCK_N):
        i = start + offs_n
        visible = i < stop
        kT = tl.load(k_base + i[None, :] * stride_kt + offs_dk[:, None],
                     mask=visible[None, :] & dk_mask[:, None], other=0.0)
        v = tl.load(v_base + i[:, None] * stride_vt + offs_dv[None, :],
                    mask=visible[:, None] & dv_mask[None, :], other=0.0)
        s = qk_tile(q, kT, DOT_FP32)
        x = s * scale_log2
        logits = logit_base + offs_h[:, None] * n_slots + i[None, :]
        store_mask = head_mask[:, None] & visible[None, :]
        if LOGIT_SCORES:
            tl.store(logits, s * scale, mask=store_mask)
        else:
            tl.store(logits, x, mask=store_mask)
        m_i, l_i, acc = softmax_update(tl.where(visible[None, :], x, float("-inf")), v, m_i, l_i, acc, DOT_FP32)
    reads = tl.maximum(stop - first, 0)  # the visible keys of the split, every one admitted
    store_partial(O_PART, M_PART, L_PART, R_PART, row * n_split + split, acc, m_i, l_i, reads, BLOCK_H, BLOCK_DV)


@triton.jit
def _eq9_term(logits, j, ok, lse2, n_visible, OFFSET: tl.constexpr, CMP_BLOCK: tl.constexpr,
              CMP_STRIDE: tl.constexpr, SEL_BLOCK: tl.constexpr, LOGIT_SCORES: tl.constexpr):
    """One term of Eq. 9 for one head and selection blocks j: [SCORE_BLOCK] = weight(OFFSET) * p_cmp[(l'/d) j +
    OFFSET], p_cmp = 0 outside the visible compressed tokens 0..n_visible-1 (Eq. 8: the compressed branch's own
    softmax 2^(x - lse2) with the head's base-2 log-sum-exp lse2, or the scaled logits). The weight is
    masks.eq9_pool_weights's overlap band: the tokens compressed block (l'/d) j + OFFSET shares with selection
    block j, divided by d. logits: the head's row of the Eq. 8 inputs."""
    first_token = OFFSET * CMP_STRIDE  # relative to the selection block's first token
    overlap = (tl.minimum(first_token + CMP_BLOCK, SEL_BLOCK) - tl.maximum(first_token, 0)) // CMP_STRIDE
    i = j * (SEL_BLOCK // CMP_STRIDE) + OFFSET
    mask = ok & (i >= 0) & (i < n_visible)
    x = tl.load(logits + i, mask=mask, other=0.0)
    if LOGIT_SCORES:
        p_cmp = tl.where(mask, x, 0.0)
    else:
        p_cmp = tl.exp2(tl.where(mask, x - lse2, float("-inf")))
    return overlap.to(tl.float32) * p_cmp


@triton.jit
def chunk_scores(logits, j, ok, lse2, n_visible, n_slots, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
                  SCORE_BLOCK: tl.constexpr, EQ9_FIRST: tl.constexpr, EQ9_BAND: tl.constexpr, CMP_BLOCK: tl.constexpr,
                  CMP_STRIDE: tl.constexpr, SEL_BLOCK: tl.constexpr, LOGIT_SCORES: tl.constexpr):
    """Eq. 8-10 for selection blocks j of one (row, KV group) [SCORE_BLOCK], summed over the group's heads in head
    order, each head's Eq. 9 band from its own row of the logits ([GROUP, n_slots] from `logits`); lse2 [BLOCK_H]:
    each head's base-2 log-sum-exp."""
    offs_h = tl.arange(0, BLOCK_H)
    total = tl.zeros([SCORE_BLOCK], dtype=tl.float32)
    for h in tl.static_range(GROUP):  # Eq. 10: head by head, in head order
        lse2_h = tl.sum(tl.where(offs_h == h, lse2, 0.0), 0)  # one head and zeros: exact
        pooled = _eq9_term(logits + h * n_slots, j, ok, lse2_h, n_visible, EQ9_FIRST, CMP_BLOCK, CMP_STRIDE,
                           SEL_BLOCK, LOGIT_SCORES)
        for k in tl.static_range(1, EQ9_BAND):  # Eq. 9: band terms in scoring.pool_eq9's order
            pooled = pooled + _eq9_term(logits + h * n_slots, j, ok, lse2_h, n_visible, EQ9_FIRST + k, CMP_BLOCK,
                                        CMP_STRIDE, SEL_BLOCK, LOGIT_SCORES)
        total = total + pooled
    return total


@triton.jit
def score_kernel(
    LENGTHS, N_NEW, LOGITS, M_PART, L_PART, R_PART, SCORES,
    n_slots, n_cmp_split, n_blocks,
    HKV: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
    CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr, SEL_BLOCK: tl.constexpr,
    STRICT: tl.constexpr, LOGIT_SCORES: tl.constexpr, MEAN: tl.constexpr,
    EQ9_FIRST: tl.constexpr, EQ9_BAND: tl.constexpr, SCORE_BLOCK: tl.constexpr, CMP_SPLITS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    await_previous_launch(PDL)
    row = tl.program_id(0).to(tl.int64)
    b = row // HKV
    p, held = step_position(LENGTHS, N_NEW, b)
    J = tl.where(p >= 0, p // SEL_BLOCK, -1)  # Eq. 12: blocks 0..J exist (p = -1: none)
    first = tl.program_id(1) * SCORE_BLOCK
    if first <= J:  # blocks after J are never ranked, so their scores are not written
        m_i, l_i, _ = merge_stats(M_PART, L_PART, R_PART, row * n_cmp_split, n_cmp_split, BLOCK_H, CMP_SPLITS)
        lse2 = m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0))  # each head's base-2 log-sum-exp over its visible tokens
        n_visible = tl.minimum(visible_cmp_count(p, held, CMP_BLOCK, CMP_STRIDE, STRICT), n_slots)  # Eq. 7
        j = first + tl.arange(0, SCORE_BLOCK)
        ok = j <= J
        total = chunk_scores(LOGITS + row * GROUP * n_slots, j, ok, lse2, n_visible, n_slots, GROUP, BLOCK_H,
                              SCORE_BLOCK, EQ9_FIRST, EQ9_BAND, CMP_BLOCK, CMP_STRIDE, SEL_BLOCK, LOGIT_SCORES)
        if MEAN:
            total = total / GROUP
        tl.store(SCORES + row * n_blocks + j, total, mask=ok & (j < n_blocks))


@triton.jit
def select_kernel(
    LENGTHS, N_NEW, SCORES, LISTS, n_blocks, blocks_per_list, n_lists,
    HKV: tl.constexpr, SEL_BLOCK: tl.constexpr, N_INIT: tl.constexpr, N_LOCAL: tl.constexpr, N_SEL: tl.constexpr,
    N_PAD: tl.constexpr, RANK_BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):
    await_previous_launch(PDL)
    row = tl.program_id(0).to(tl.int64)
    b = row // HKV
    p, _ = step_position(LENGTHS, N_NEW, b)
    J = tl.where(p >= 0, p // SEL_BLOCK, -1)
    first = tl.program_id(1) * blocks_per_list
    stop = tl.minimum(tl.minimum(first + blocks_per_list, J + 1), n_blocks).to(tl.int32)
    best = tl.full([N_PAD], EMPTY, dtype=tl.int64)
    for start in range(first, stop, RANK_BLOCK):
        j = start + tl.arange(0, RANK_BLOCK)
        ok = j < stop
        score = tl.load(SCORES + row * n_blocks + j, mask=ok, other=0.0)
        best = score_into_list(best, score, j, ok, J, N_INIT, N_LOCAL, N_SEL, N_PAD)  # Eq. 11
    tl.store(LISTS + (row * n_lists + tl.program_id(1)) * N_PAD + tl.arange(0, N_PAD), best)
