"""The lean decode step's selected and window branches and the gates (docs/decode.md, "Lean step"): two launches.

3. sparse split kernel: one program per (row, KV group) and split, over two key sets with separate softmaxes:
   - selected splits (Eq. 12): merge the select kernel's lists into the row's n blocks (Eq. 11, ascending, -1
     padded; the first split writes them as `indices`), then walk the split's share of the blocks in key tiles of
     the history, tokens clipped to <= p (masks.selected_token_visible), as selected_decode does;
   - window splits (Section 3.3.3): a share of the window ring, each slot's token position computed from the row's
     length (slot t mod W holds token t), admitted when window_start(p) = p - (window_size - 1) <= t <= p.
   Every program writes its partial (max, sum, output, keys admitted).
4. gate kernel: one program per (row, KV group) and TILE_DV output columns merges the compressed splits into
   o_cmp, the selected splits into o_slc and the window splits into o_win, and applies Eq. 5: o = g_cmp o_cmp +
   g_slc o_slc + g_win o_win, each product and sum rounded to the output dtype as torch's gated_sum does; a padding
   query gets o = 0. It also advances each row's length by its new tokens: every launch of the step before it
   reads the length before the step.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .decode_tiles import (await_previous_launch, group_queries, merge_partials, qk_tile, softmax_update,
                           step_position, store_partial)
from .top_n import merged_blocks


@triton.jit
def sparse_split_kernel(
    Q, HIST_K, HIST_V, WIN_K, WIN_V, LENGTHS, N_NEW, LISTS, INDICES, O_PART, M_PART, L_PART, R_PART,
    stride_qb, stride_qh,
    stride_hkb, stride_hkh, stride_hvb, stride_hvh, stride_wkb, stride_wkh, stride_wvb, stride_wvh,
    stride_kt, stride_vt,
    n_lists, slots_per_split, n_slc_split, tiles_per_win_split, n_win_split, win_ring, window_size, scale_log2,
    HKV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    SEL_BLOCK: tl.constexpr, TILES_PER_BLOCK: tl.constexpr, N_SEL: tl.constexpr, N_PAD: tl.constexpr,
    LISTS_PAD: tl.constexpr, DOT_FP32: tl.constexpr, PDL: tl.constexpr = False,
):
    await_previous_launch(PDL)
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1).to(tl.int64)
    g = row % HKV
    b = row // HKV
    p, held = step_position(LENGTHS, N_NEW, b)

    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
    offs_sel = tl.arange(0, N_PAD)
    dk_mask = offs_dk < DK
    dv_mask = offs_dv < DV
    q = group_queries(Q + b * stride_qb, g, stride_qh, GROUP, DK, BLOCK_H, BLOCK_DK, DOT_FP32)

    # One loop over key tiles serves both key sets (the softmaxes stay separate: a program is one or the other).
    selected = split < n_slc_split
    if selected:  # Eq. 12 over the history: tile `it` is tile it % TILES_PER_BLOCK of the block in slot it // ...
        blocks = merged_blocks(LISTS, row, n_lists, N_SEL, N_PAD, LISTS_PAD)  # Eq. 11
        if split == 0:
            tl.store(INDICES + row * N_SEL + offs_sel, blocks, mask=offs_sel < N_SEL)
        k_base = HIST_K + b * stride_hkb + g * stride_hkh
        v_base = HIST_V + b * stride_hvb + g * stride_hvh
        first = split * slots_per_split * TILES_PER_BLOCK
        stop = tl.minimum((split + 1) * slots_per_split, N_SEL) * TILES_PER_BLOCK
    else:  # the window ring: tile `it` holds slots it * BLOCK_N ..
        blocks = tl.full([N_PAD], -1, dtype=tl.int64)
        k_base = WIN_K + b * stride_wkb + g * stride_wkh
        v_base = WIN_V + b * stride_wvb + g * stride_wvh
        first = (split - n_slc_split) * tiles_per_win_split
        stop = first + tiles_per_win_split
    # slot t mod W holds token t and the step's query p is the newest token, in slot p mod W: slot s holds the
    # latest t <= p with t = s (mod W) (negative: never written)
    newest = tl.where(p >= 0, p % win_ring, 0)
    lowest = tl.maximum(p - (window_size - 1), 0)  # masks.window_start(p), and tokens exist from 0 on

    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    count = tl.zeros([BLOCK_N], dtype=tl.int32)
    for it in range(first, stop):
        # selected: the block's tokens (history slot = token), clipped to <= p
        block = tl.sum(tl.where(offs_sel == it // TILES_PER_BLOCK, blocks, 0), 0)
        in_block = (it % TILES_PER_BLOCK) * BLOCK_N + offs_n
        token = block * SEL_BLOCK + in_block
        in_selected = (block >= 0) & (in_block < SEL_BLOCK) & (token <= p)
        # window: ring slots, their tokens in masks.window_key_visible's window
        ring_slot = it * BLOCK_N + offs_n
        ring_token = p - newest + ring_slot - tl.where(ring_slot > newest, win_ring, 0)
        in_window = (ring_slot < win_ring) & (ring_token >= lowest) & (ring_token <= p)
        slot = tl.where(selected, token, ring_slot)
        admitted = tl.where(selected, in_selected, in_window)
        count += admitted.to(tl.int32)
        kT = tl.load(k_base + slot[None, :] * stride_kt + offs_dk[:, None], mask=admitted[None, :] & dk_mask[:, None],
                     other=0.0)
        v = tl.load(v_base + slot[:, None] * stride_vt + offs_dv[None, :], mask=admitted[:, None] & dv_mask[None, :],
                    other=0.0)
        x = tl.where(admitted[None, :], qk_tile(q, kT, DOT_FP32) * scale_log2, float("-inf"))
        m_i, l_i, acc = softmax_update(x, v, m_i, l_i, acc, DOT_FP32)
    store_partial(O_PART, M_PART, L_PART, R_PART, row * (n_slc_split + n_win_split) + split, acc, m_i, l_i,
                  tl.sum(count, 0), BLOCK_H, BLOCK_DV)


@triton.jit
def _normalised(acc, l_i, DTYPE: tl.constexpr):
    """A merged branch output in the output dtype (0 for a head without keys)."""
    return (acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]).to(DTYPE)


@triton.jit
def gate_kernel(
    O_PART, M_PART, L_PART, R_PART, O_CPART, M_CPART, L_CPART, R_CPART, GATES, LENGTHS, N_NEW, O, O_CMP, O_SLC,
    O_WIN, READS_CMP, READS_SLC, READS_WIN,
    stride_ob, stride_oh, stride_gb, stride_gh, stride_gc,
    n_cmp_split, n_slc_split, n_win_split,
    HKV: tl.constexpr, GROUP: tl.constexpr, DV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr,
    TILE_DV: tl.constexpr, CMP_SPLITS: tl.constexpr, SPLITS: tl.constexpr, MERGE_CHUNK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    await_previous_launch(PDL)
    row = tl.program_id(0).to(tl.int64)
    dv_first = tl.program_id(1) * TILE_DV  # this program's output columns
    g = row % HKV
    b = row // HKV
    offs_h = tl.arange(0, BLOCK_H)
    offs_dv = dv_first + tl.arange(0, TILE_DV)
    head_mask = offs_h < GROUP
    heads = g * GROUP + offs_h
    first = row * (n_slc_split + n_win_split)
    acc_c, m_c, l_c, reads_c = merge_partials(O_CPART, M_CPART, L_CPART, R_CPART, row * n_cmp_split, n_cmp_split,
                                              dv_first, BLOCK_H, BLOCK_DV, TILE_DV, CMP_SPLITS, MERGE_CHUNK)
    acc_s, m_s, l_s, reads_s = merge_partials(O_PART, M_PART, L_PART, R_PART, first, n_slc_split, dv_first, BLOCK_H,
                                              BLOCK_DV, TILE_DV, SPLITS, MERGE_CHUNK)
    acc_w, m_w, l_w, reads_w = merge_partials(O_PART, M_PART, L_PART, R_PART, first + n_slc_split, n_win_split,
                                              dv_first, BLOCK_H, BLOCK_DV, TILE_DV, SPLITS, MERGE_CHUNK)
    DTYPE: tl.constexpr = O.dtype.element_ty
    o_cmp = _normalised(acc_c, l_c, DTYPE)
    o_slc = _normalised(acc_s, l_s, DTYPE)
    o_win = _normalised(acc_w, l_w, DTYPE)
    out = b * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :]
    out_mask = head_mask[:, None] & (offs_dv < DV)[None, :]
    gate = GATES + b * stride_gb + heads * stride_gh
    g_cmp = tl.load(gate, mask=head_mask, other=0.0).to(tl.float32)
    g_slc = tl.load(gate + stride_gc, mask=head_mask, other=0.0).to(tl.float32)
    g_win = tl.load(gate + 2 * stride_gc, mask=head_mask, other=0.0).to(tl.float32)
    # Eq. 5, rounded to the output dtype after every product and sum as optimized.forward.gated_sum in torch
    term_cmp = (g_cmp[:, None] * o_cmp.to(tl.float32)).to(DTYPE)
    term_slc = (g_slc[:, None] * o_slc.to(tl.float32)).to(DTYPE)
    term_win = (g_win[:, None] * o_win.to(tl.float32)).to(DTYPE)
    o = ((term_cmp.to(tl.float32) + term_slc.to(tl.float32)).to(DTYPE).to(tl.float32)
         + term_win.to(tl.float32)).to(DTYPE)
    n_new = tl.load(N_NEW + b)
    real = n_new > 0
    tl.store(O + out, tl.where(real, o, 0.0).to(DTYPE), mask=out_mask)  # a padding query gets 0
    tl.store(O_CMP + out, o_cmp, mask=out_mask)
    tl.store(O_SLC + out, o_slc, mask=out_mask)
    tl.store(O_WIN + out, o_win, mask=out_mask)
    if tl.program_id(1) == 0:
        tl.store(READS_CMP + row, reads_c.to(tl.int64))
        tl.store(READS_SLC + row, reads_s.to(tl.int64))
        tl.store(READS_WIN + row, reads_w.to(tl.int64))
        if g == 0:  # the step's last launch advances the row's length (no program of it reads the length)
            tl.store(LENGTHS + b, tl.load(LENGTHS + b) + n_new)
