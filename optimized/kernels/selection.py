"""The selection (Eq. 8-11) on the Triton kernels: per chunk of query rows, two launches.

1. Group scores (Eq. 8 + Eq. 10, fused): for each (query row, KV group) the compressed branch's probabilities summed
   over the group's query heads, written per compressed token of the row's range:

       P[b, t, g, c] = sum_{h in group g} p_cmp^(h)_t[lo_t + c],   p_cmp = 2^(s * scale * log2(e) - lse2)  (Eq. 8)

   (or the scaled logits s * scale for the "logits" selection score), for c = 0 .. hi_t - lo_t; entries past a
   row's range are left as they are (the caller passes zeros, or a scratch the top-n kernel never reads past the
   range). The per-head probabilities never reach memory: only the group sum does. lse2 is the compressed branch's
   own base-2 log-sum-exp (range_attention.py), so p_cmp is exactly the softmax that branch used.

   Grid (tile of R query rows, KV group, batch). A program holds the q of its R rows for every head of the group
   as one [R * GP, d_k] tile (GP = the group size padded to a power of two, rows ordered (query, head)), so one K
   tile load serves every head (the paper's group-centric loading), and sums the heads of each query as a
   reduction over the head axis of the [R, GP, BLOCK_N] view of the tile (fp32 adds; the padded heads add 0). Key
   tiles are aligned to multiples of BLOCK_N, so a row's arithmetic does not depend on the rows it shares a
   program with (chunk- and batch-invariant scores).

2. Top-n (Eq. 9-11, fused): the group scores P pooled to selection blocks, masked past J, and ranked to the row's n
   selected blocks, written as indices. No per-block score reaches memory.

       p_slc[j] = sum_k w[k] * P[(l'/d) * j + first_offset + k]      (Eq. 9, the band of masks.eq9_pool_weights)
       I       = the n blocks among 0..J: forced blocks first, then the highest p_slc   (Eq. 11)

   bitwise as the torch code computes them on the same P (scoring.pool_eq9, the masked_fill past J,
   masks.top_n_blocks):
   - Eq. 9 adds the band's terms in the order pool_eq9 does (term 0, then + term 1, ...), each term one fp32
     product, with P = 0 outside the row's range (pool_eq9's zero padding and the zeros past the range);
     group_reduce="mean" divides P by the group size first (correctly rounded, tl.math.div_rn), as the torch
     scorer does; the launch disables fp fusion, so no multiply-add is contracted into an FMA (which rounds once).
   - Eq. 11 ranks by masks.ranked_blocks's integer key: the score's float32 bits in an order-preserving form
     (-0.0 taken as +0.0), then the reversed block index, so equal scores go to the lower block; forced blocks
     (n_init initial, n_local most recent, among 0..J) rank as +inf, blocks after J as -inf. The first min(n, NB)
     of that ranking are taken (n rounds of: the row's largest key, knocked out), the ones that exist (j <= J) are
     written in ascending block order and the rest of the n slots get -1.

   Grid (tile of ROWS query rows, KV group, batch). A program holds its rows' NB block keys as one
   [ROWS, BLOCKS_PAD] int64 tile (about 2048 keys a program: 16 per thread with 4 warps). The rounds cost in
   proportion to BLOCKS_PAD, not to the blocks a row has, so when the rows' J are known on the host (one sequence)
   a chunk is launched in segments of rows whose J + 1 pads to the same power of two (width_segments): at 64k
   tokens the rows before 8k, 16k and 32k rank 128, 256 and 512 keys instead of 1024.

The convention seams these kernels honour (read at call time): the compressed ranges come from
masks.compressed_block_visible (range_attention.compressed_ranges), the Eq. 9 band from masks.eq9_pool_weights and
J from masks.current_sel_block. They compute the rules of masks.cmp_importance, masks.group_reduce,
masks.top_n_blocks, masks.forced_blocks and masks.ranked_blocks themselves (by the config's switches): a replaced
one of those changes the torch path only.
"""

from __future__ import annotations

import functools
import math
from bisect import bisect_right
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from reference.config import NSAConfig

from .. import masks
from ..documents import Documents
from ..numerics import LOG2E
from ..scoring import pool_eq9
from .common import (INDEX_DTYPES, RangeTiling, dot_settings, float_order, head_dim_tiles, key_tile_logits,
                     key_tile_span, launch_tiling, padded, range_tiling, second_head_tile, smaller_range_tilings)
from .range_attention import (CompressedSoftmax, check_range_inputs, compressed_ranges, range_logsumexp2,
                              sequence_ranges)

KEYS_PER_PROGRAM = 2048  # [ROWS, BLOCKS_PAD] keys a program holds (rows are added while a row has fewer blocks)
MAX_ROWS = 32  # rows per program at most (small NB)
KEYS_PER_THREAD = 16  # warps = keys / (32 * KEYS_PER_THREAD), 4 to 16: the int64 keys stay at 32 registers



@triton.jit
def _group_scores_kernel(
    Q, K, LO, HI, LSE2, P,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_lb, stride_lt,
    stride_pb, stride_pt, stride_pg,
    n_queries, n_keys, width, scale_log2, scale,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr, DK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr,
    LOGITS: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_DK2: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)

    # (query, head) rows of the q tile
    offs_m = tl.arange(0, BLOCK_M)
    t_m = pid * ROWS + offs_m // GROUP_PAD
    head_m = offs_m % GROUP_PAD
    valid_m = (t_m < n_queries) & (head_m < GROUP)
    h_m = g * GROUP + head_m
    # int32 ranges and keys, int64 pointer offsets; key tiles aligned as in the range-attention kernels
    lo_m, hi_m, start, last = key_tile_span(LO, HI, t_m, valid_m, n_keys, BLOCK_N)

    offs_dk = tl.arange(0, BLOCK_DK)
    dk_mask = offs_dk < DK
    q_rows = Q + b * stride_qb + t_m[:, None] * stride_qt + h_m[:, None] * stride_qh
    q = tl.load(q_rows + offs_dk[None, :], mask=valid_m[:, None] & dk_mask[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    if BLOCK_DK2 > 0:  # the head dim's second tile (common.head_dim_tiles)
        q2, offs_dk2, dk_mask2 = second_head_tile(q_rows, valid_m, DK, BLOCK_DK, BLOCK_DK2, DOT_FP32)
    lse2 = tl.load(LSE2 + b * stride_lb + t_m * stride_lt + h_m, mask=valid_m, other=0.0)

    # query rows of the output tile
    t_r = pid * ROWS + tl.arange(0, ROWS)
    valid_r = t_r < n_queries
    lo_r = tl.load(LO + t_r, mask=valid_r, other=0)
    hi_r = tl.load(HI + t_r, mask=valid_r, other=-1)

    offs_n = tl.arange(0, BLOCK_N)
    k_base = K + b * stride_kb + g * stride_kh
    p_base = P + b * stride_pb + g * stride_pg
    for start_n in range(start, last + 1, BLOCK_N):
        keys = start_n + offs_n
        key_ok = keys < n_keys
        s = key_tile_logits(q, k_base, keys, key_ok, stride_kt, offs_dk, dk_mask, None, DOT_FP32, INPUT_PRECISION)
        if BLOCK_DK2 > 0:
            s = key_tile_logits(q2, k_base, keys, key_ok, stride_kt, offs_dk2, dk_mask2, s, DOT_FP32, INPUT_PRECISION)
        in_range = valid_m[:, None] & (keys[None, :] >= lo_m[:, None]) & (keys[None, :] <= hi_m[:, None])
        if LOGITS:
            term = s * scale
        else:
            term = tl.exp2(s * scale_log2 - lse2[:, None])  # Eq. 8: the compressed branch's own softmax
        term = tl.where(in_range, term, 0.0)
        total = tl.sum(tl.reshape(term, [ROWS, GROUP_PAD, BLOCK_N]), axis=1)  # Eq. 10: sum over the group's heads
        cols = keys[None, :] - lo_r[:, None]
        out_mask = valid_r[:, None] & (keys[None, :] >= lo_r[:, None]) & (keys[None, :] <= hi_r[:, None]) \
            & (cols < width)
        tl.store(p_base + t_r[:, None] * stride_pt + cols.to(tl.int64), total, mask=out_mask)


def group_scores(q: Tensor, k_cmp: Tensor, lo: Tensor, hi: Tensor, lse2: Tensor | None, width: int, scale: float,
                 *, logits: bool = False, tiling: RangeTiling | None = None, out: Tensor | None = None) -> Tensor:
    """P [B, TQ, Hkv, width] fp32 (zeros past each row's range) for queries q [B, TQ, Hq, dk] over the compressed
    tokens k_cmp [B, N, Hkv, dk], row t reading [lo[t], hi[t]] (int32 [TQ], non-decreasing, as
    range_attention.check_range_inputs validates; hi - lo < width). lse2 [B, TQ, Hq]: the compressed branch's
    base-2 log-sum-exp (range_attention_lse2 / range_logsumexp2), unused with logits=True.
    out: an fp32 [B, TQ, Hkv, width] tensor with a contiguous last dim to write instead of a new zeroed one; its
    entries past each row's range are left as they are (the fused top-n kernel reads only each row's range, so
    the scorer skips the zero fill). tiling: launched as given (the probes time it); default the launch table's,
    shrunk if the GPU lacks the resources (common.launch_tiling)."""
    B, TQ, Hq, dk = q.shape
    N, Hkv = k_cmp.shape[1], k_cmp.shape[2]
    group = Hq // Hkv
    if out is None:
        out = torch.zeros((B, TQ, Hkv, width), device=q.device, dtype=torch.float32)
    elif (out.dtype != torch.float32 or tuple(out.shape) != (B, TQ, Hkv, width)
          or (out.numel() and out.stride(-1) != 1)):
        raise ValueError(f"group_scores: out must be a float32 tensor [B, TQ, Hkv, width] = {[B, TQ, Hkv, width]} "
                         f"with a contiguous last dim, got {out.dtype} {tuple(out.shape)}")
    if B * TQ * Hkv == 0 or width == 0 or N == 0:
        return out
    q, k_cmp = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k_cmp))
    lse2 = torch.zeros((B, TQ, Hq), device=q.device, dtype=torch.float32) if logits else lse2.float().contiguous()
    dot_fp32, precision = dot_settings(q.dtype)
    group_pad = triton.next_power_of_2(group)
    block_dk, block_dk2 = head_dim_tiles(dk)

    def launch(t: RangeTiling) -> None:
        rows = max(1, t.block_m // group_pad)
        _group_scores_kernel[(triton.cdiv(TQ, rows), Hkv, B)](
            q, k_cmp, lo, hi, lse2, out,
            q.stride(0), q.stride(1), q.stride(2),
            k_cmp.stride(0), k_cmp.stride(1), k_cmp.stride(2),
            lse2.stride(0), lse2.stride(1),
            out.stride(0), out.stride(1), out.stride(2),
            TQ, N, width, scale * LOG2E, scale,
            GROUP=group, GROUP_PAD=group_pad, ROWS=rows,
            BLOCK_M=rows * group_pad, DK=dk, BLOCK_N=t.block_n, BLOCK_DK=block_dk, BLOCK_DK2=block_dk2, LOGITS=logits,
            DOT_FP32=dot_fp32, INPUT_PRECISION=precision, num_warps=t.num_warps, num_stages=t.num_stages,
        )

    launch_tiling(launch, tiling, range_tiling(padded(dk), padded(dk), q.dtype, "scores"), smaller_range_tilings)
    return out


@triton.jit
def _take_largest(key, chosen, blocks, n_blocks, lowest, rows_taking):
    """One round of Eq. 11's ranking over [rows, blocks] int64 rank keys: each row in rows_taking takes the block of
    its largest key (the key's low word is the reversed block index) and knocks that key out (to `lowest`)."""
    best = tl.max(key, axis=1)
    pick = tl.where(rows_taking, (n_blocks - 1) - (best & 0x7FFFFFFF).to(tl.int32), -1)
    take = blocks == pick[:, None]
    return chosen | take, tl.where(take, lowest, key)


@triton.jit
def _select_top_n_kernel(
    P, LO, HI, CURRENT, INDICES,
    stride_pb, stride_pt, stride_pg,
    stride_ob, stride_ot, stride_og,
    n_rows, width, n_blocks, n_init, n_local, group,
    BAND: tl.constexpr, FIRST_OFFSET: tl.constexpr, STRIDE: tl.constexpr, MEAN: tl.constexpr,
    N_SEL: tl.constexpr, N_FORCED: tl.constexpr, N_SEL_PAD: tl.constexpr, ROWS: tl.constexpr,
    BLOCKS_PAD: tl.constexpr,
):
    pid = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)

    offs_r = tl.arange(0, ROWS)
    t = pid * ROWS + offs_r
    row_ok = t < n_rows
    lo = tl.load(LO + t, mask=row_ok, other=0)
    hi = tl.load(HI + t, mask=row_ok, other=-1)
    n_cols = tl.minimum(hi - lo + 1, width)  # columns of P the row's range wrote (<= 0: none)
    J = tl.load(CURRENT + t, mask=row_ok, other=-1).to(tl.int32)[:, None]
    blocks = tl.arange(0, BLOCKS_PAD)[None, :]
    real = row_ok[:, None] & (blocks < n_blocks)

    # Eq. 9: the band over P's columns, terms added in pool_eq9's order (0 outside the row's range)
    p_row = P + b * stride_pb + t.to(tl.int64)[:, None] * stride_pt + g * stride_pg
    for k in tl.static_range(len(BAND)):
        col = blocks * STRIDE + (FIRST_OFFSET + k)
        p = tl.load(p_row + col, mask=real & (col >= 0) & (col < n_cols[:, None]), other=0.0)
        if MEAN:
            p = tl.math.div_rn(p, group)  # Eq. 10 "mean": the group sum / H, before pooling (as the scorer)
        if k == 0:
            score = BAND[k] * p
        else:
            score = score + BAND[k] * p

    # Eq. 11 keys (masks.top_n_blocks, then masks.ranked_blocks's integer form)
    exists = blocks <= J
    forced = ((blocks < n_init) | (blocks > J - n_local)) & exists
    value = tl.where(exists, score, float("-inf"))
    value = tl.where(forced, float("inf"), value)
    ordered = float_order(value)  # the float order as an integer order, -0.0 tying with +0.0
    key = (ordered.to(tl.int64) << 32) | (n_blocks - 1 - blocks).to(tl.int64)  # equal scores: lower block first
    lowest = -9223372036854775807 - 1
    key = tl.where(real, key, lowest)

    # the first min(n, NB) of the ranking. The forced blocks rank first (+inf) and number at most n (NSAConfig:
    # n >= n_init + n_local), so they are taken as they are; the rest are rounds of (largest key, knock it out):
    # n - (n_init + n_local) rounds for every row, then one more per forced block a row lacks (the first blocks of
    # a sequence, where the initial and local blocks overlap). Once every block is out (n > NB) the largest key is
    # `lowest`, whose low word names block NB - 1, already taken: no change.
    chosen = forced & real
    key = tl.where(chosen, lowest, key)
    lacking = N_FORCED - tl.sum(chosen.to(tl.int32), axis=1)
    for _ in range(N_SEL - N_FORCED):
        chosen, key = _take_largest(key, chosen, blocks, n_blocks, lowest, True)
    for r in range(tl.max(tl.where(row_ok, lacking, 0), axis=0)):  # rows that already hold n blocks take none
        chosen, key = _take_largest(key, chosen, blocks, n_blocks, lowest, r < lacking)

    # the chosen blocks that exist, ascending, then -1 in the remaining slots
    keep = chosen & exists & real
    rank = tl.cumsum(keep.to(tl.int32), axis=1) - 1
    count = tl.sum(keep.to(tl.int32), axis=1)
    out_row = INDICES + b * stride_ob + t.to(tl.int64)[:, None] * stride_ot + g * stride_og
    tl.store(out_row + rank, blocks.to(tl.int64), mask=keep)
    slots = tl.arange(0, N_SEL_PAD)[None, :]
    tl.store(out_row + slots, tl.full([ROWS, N_SEL_PAD], -1, tl.int64),
             mask=row_ok[:, None] & (slots >= count[:, None]) & (slots < N_SEL))


def select_top_n(p: Tensor, lo: Tensor, hi: Tensor, current: Tensor, n_blocks: int, cfg: NSAConfig,
                 out: Tensor | None = None) -> Tensor:
    """Eq. 9-11 on the group scores of a chunk of C query rows: indices int64 [B, C, Hkv, n], ascending, -1 padded.

    p: fp32 [B, C, Hkv, width] (last dim contiguous), what group_scores writes: column c of row t is the row's
    compressed token lo[t] + c (document-local block c for a packed batch); only columns 0 .. hi[t] - lo[t] are
    read (the rest may hold anything). lo, hi: int32 [C], the rows' compressed ranges. current: int32/int64 [C],
    J of each row (masks.current_sel_block of the row's document-relative position). n_blocks: NB, the
    selection blocks of a row (scores' last dim on the torch path). out: an int64 [B, C, Hkv, n] tensor (last dim
    contiguous, e.g. a view of the whole selection) to write into, else a new one."""
    where = "select_top_n"
    if not isinstance(p, Tensor) or p.dim() != 4 or p.dtype != torch.float32 or (p.numel() and p.stride(-1) != 1):
        raise ValueError(f"{where}: p must be a float32 tensor [B, C, Hkv, width] with a contiguous last dim, got "
                         f"{getattr(p, 'dtype', type(p).__name__)} {tuple(getattr(p, 'shape', ()))}")
    B, C, Hkv, width = p.shape
    for name, x, dtypes in (("lo", lo, (torch.int32,)), ("hi", hi, (torch.int32,)), ("current", current, INDEX_DTYPES)):
        if not isinstance(x, Tensor) or x.dtype not in dtypes or tuple(x.shape) != (C,) or not x.is_contiguous():
            raise ValueError(f"{where}: {name} must be a contiguous {'/'.join(str(d) for d in dtypes)} tensor [C] = "
                             f"[{C}], got {getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    if not isinstance(n_blocks, int) or n_blocks < 0:
        raise ValueError(f"{where}: n_blocks must be a non-negative int, got {n_blocks!r}")
    if Hkv != cfg.n_kv_heads:
        raise ValueError(f"{where}: p must hold n_kv_heads = {cfg.n_kv_heads} groups, got {Hkv}")
    if out is None:
        out = torch.empty((B, C, Hkv, cfg.n_sel), dtype=torch.int64, device=p.device)
    elif (not isinstance(out, Tensor) or out.dtype != torch.int64 or tuple(out.shape) != (B, C, Hkv, cfg.n_sel)
          or (out.numel() and out.stride(-1) != 1)):
        raise ValueError(f"{where}: out must be an int64 tensor [B, C, Hkv, n] = {[B, C, Hkv, cfg.n_sel]} with a "
                         f"contiguous last dim, got {getattr(out, 'dtype', type(out).__name__)} "
                         f"{tuple(getattr(out, 'shape', ()))}")
    devices = {x.device for x in (p, lo, hi, current, out)}
    if len(devices) != 1:
        raise ValueError(f"{where}: p, lo, hi, current, out must be on one device, got {devices}")
    if B * C * Hkv == 0:
        return out
    band = masks.eq9_pool_weights(cfg)
    blocks_pad = triton.next_power_of_2(max(n_blocks, 1))
    rows = min(MAX_ROWS, max(1, KEYS_PER_PROGRAM // blocks_pad))
    warps = min(16, max(4, rows * blocks_pad // (32 * KEYS_PER_THREAD)))
    _select_top_n_kernel[(triton.cdiv(C, rows), Hkv, B)](
        p, lo, hi, current, out,
        p.stride(0), p.stride(1), p.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        C, width, n_blocks, cfg.n_init, cfg.n_local, float(cfg.group_size),
        BAND=tuple(float(w) for w in band.weights), FIRST_OFFSET=band.first_offset,
        STRIDE=cfg.pieces_per_sel_block, MEAN=cfg.group_reduce == "mean",
        N_SEL=cfg.n_sel, N_FORCED=cfg.n_init + cfg.n_local, N_SEL_PAD=triton.next_power_of_2(cfg.n_sel), ROWS=rows,
        BLOCKS_PAD=blocks_pad,
        num_warps=warps, enable_fp_fusion=False,  # Eq. 9's products and sums rounded one by one, as in torch
    )
    return out


# The selection on the kernels, chunk by chunk ------------------------------------------------------------------
# Scoring chunks: the group-scores kernel writes a chunk's P [B, C, Hkv, width] fp32 and the top-n kernel reads it
# straight back, so a chunk holds as many rows as keep P within this budget. Each chunk costs two launches and some
# host work, so the budget trades scratch memory for fewer chunks; P beyond the L2 cache costs an HBM round trip,
# much less than the host time fewer chunks save (perf/NOTES.md has the measurements). The budget bounds the
# scratch, not the peak memory's growth in T. Sizing by the width each chunk actually has (a row reads ~p/d
# compressed tokens) rather than by N gives early rows larger chunks.
KERNEL_CHUNK_P_BYTES = 256 * 2**20


def kernel_chunks(widths: Tensor, bytes_per_column: int, chunk_size: int | None) -> list[tuple[int, int]]:
    """Query chunks of the selection kernels: chunk_size rows each when given, else consecutive chunks of as many
    rows as keep rows x (widest range up to the chunk's last row) x bytes_per_column within KERNEL_CHUNK_P_BYTES
    (the running maximum bounds the chunk's own widest range; it equals the row's width for one sequence, whose
    widths never decrease). widths: int64 [TQ] on the host."""
    n_rows = widths.shape[0]
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive number of query positions, got {chunk_size}")
        return [(q0, min(q0 + chunk_size, n_rows)) for q0 in range(0, n_rows, chunk_size)]
    budget = max(1, KERNEL_CHUNK_P_BYTES // bytes_per_column)  # rows x columns per chunk
    bound = torch.cummax(widths.clamp(min=1), 0).values.tolist() if n_rows else []
    chunks, q0 = [], 0
    while q0 < n_rows:
        # rows x bound[q0 + rows - 1] grows with rows: the most rows within the budget (at least one)
        rows = bisect_right(range(1, n_rows - q0 + 1), budget, key=lambda r: r * bound[q0 + r - 1])
        chunks.append((q0, q0 + max(1, rows)))
        q0 = chunks[-1][1]
    return chunks


@dataclass(frozen=True)
class SelectionRows:
    """What the group-scores kernel needs for every query row, built once per call: q and k_cmp in the kernel
    dtype, the rows' compressed ranges [lo, hi] (int32 [TQ]), the compressed branch's base-2 log-sum-exp (None for
    the "logits" score), the range widths on the host (each chunk's width without reading the device) and the
    document-relative positions."""

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
        q = self.q[:, q0:q1]
        B, C, Hq, dk = q.shape
        width = int(self.widths[q0:q1].max()) if q1 > q0 else 0
        out = None if zero_fill else torch.empty((B, C, self.k_cmp.shape[2], width), dtype=torch.float32,
                                                 device=q.device)
        lse2 = None if self.lse2 is None else self.lse2[:, q0:q1]
        return group_scores(q, self.k_cmp, self.lo[q0:q1], self.hi[q0:q1], lse2, width, 1.0 / math.sqrt(dk),
                            logits=self.lse2 is None, out=out)


def selection_rows(q: Tensor, k_cmp: Tensor, cfg: NSAConfig, positions: Tensor, docs: Documents | None,
                   cmp_softmax: CompressedSoftmax | None, first_position: int | None = None) -> SelectionRows:
    """SelectionRows of queries q at positions over k_cmp (both in the kernel dtype): each row's visible
    compressed tokens (range_attention.compressed_ranges, from the seam masks.compressed_block_visible;
    document-local columns for a packed batch). cmp_softmax: the compressed branch's ranges and normaliser for
    these rows when the caller has them (nsa_forward); otherwise both are computed here, for every row at once.
    first_position: positions is arange(first_position, first_position + TQ) of one sequence; the widths then come
    from the host side of range_attention.sequence_ranges instead of being copied back from the device (a sync)."""
    logits = cfg.selection_score == "logits"
    if cmp_softmax is None:
        lo, hi = check_range_inputs(q, k_cmp, None, *compressed_ranges(positions, k_cmp.shape[1], cfg, docs))
        lse2 = None if logits else range_logsumexp2(q, k_cmp, lo, hi, checked=True)
    else:
        lo, hi, lse2 = cmp_softmax.lo, cmp_softmax.hi, None if logits else cmp_softmax.lse2
    if first_position is not None and docs is None:
        widths = sequence_ranges("cmp", first_position, positions.shape[0], k_cmp.shape[1], cfg, q.device).widths
    else:
        widths = torch.clamp(hi - lo + 1, min=0).cpu()  # one copy to the host: each chunk's width
    relative = positions if docs is None else docs.relative(positions)
    return SelectionRows(q, k_cmp, lo, hi, lse2, widths, relative)


@torch.no_grad()
def selection_indices_rows(q: Tensor, k_cmp: Tensor, cfg: NSAConfig, positions: Tensor, n_sel_blocks: int, *,
                           docs: Documents | None = None, cmp_softmax: CompressedSoftmax | None = None,
                           chunk_size: int | None = None, first_position: int | None = None) -> Tensor:
    """Eq. 8-11 on the kernels: indices int64 [B, TQ, Hkv, n] for queries q [B, TQ, Hq, dk] at positions [TQ]
    over the compressed tokens k_cmp (cast to q's dtype). Per chunk (kernel_chunks) the group-scores kernel (Eq. 8 +
    10, P without the zero fill) and the top-n kernel (Eq. 9-11, writing the chunk's rows of the result), two
    launches. J comes from the document-relative positions (masks.current_sel_block), once for every row. The
    result does not depend on chunk_size or on the batch (bitwise)."""
    q = q.detach()
    rows = selection_rows(q, k_cmp.detach().to(q.dtype), cfg, positions, docs, cmp_softmax, first_position)
    current = masks.current_sel_block(rows.relative, cfg)
    B, TQ = q.shape[:2]
    segments = (sequence_width_segments(first_position, TQ, n_sel_blocks, cfg, masks.current_sel_block,
                                        MIN_SEGMENT_BLOCKS)
                if first_position is not None and docs is None else ((0, TQ, n_sel_blocks),))
    out = torch.empty((B, TQ, cfg.n_kv_heads, cfg.n_sel), dtype=torch.int64, device=q.device)
    for q0, q1 in kernel_chunks(rows.widths, B * cfg.n_kv_heads * 4, chunk_size):
        p = rows.group_scores(q0, q1, zero_fill=False)
        for s0, s1, n_blocks in segments:  # the chunk's part of each segment
            s0, s1 = max(s0, q0), min(s1, q1)
            if s0 < s1:
                select_top_n(p[:, s0 - q0:s1 - q0], rows.lo[s0:s1], rows.hi[s0:s1], current[s0:s1], n_blocks, cfg,
                             out=out[:, s0:s1])
    return out


MIN_SEGMENT_BLOCKS = 128  # narrower key tiles are not split further: a launch per few rows would cost more


def width_segments(current: Tensor | None, q0: int, q1: int, n_blocks: int,
                   min_blocks: int = MIN_SEGMENT_BLOCKS) -> list[tuple[int, int, int]]:
    """Rows q0..q1-1 as (s0, s1, blocks) segments for the top-n kernel: consecutive rows whose J + 1 (current,
    int64 [TQ] on the host) pads to the same power of two (at least min_blocks), each ranking blocks = the
    segment's largest J + 1 (at most n_blocks) instead of n_blocks. A row's selection does not depend on the blocks
    past its J (none of them is a candidate), so every segment gives the indices one launch over all n_blocks
    would. Without the host J (current None) the rows stay one segment of n_blocks."""
    if current is None or q1 <= q0 or n_blocks <= min_blocks:
        return [(q0, q1, n_blocks)]
    needed = (current[q0:q1] + 1).clamp(min=1, max=max(n_blocks, 1))
    pads = torch.log2(needed.double()).ceil().clamp(min=math.log2(min_blocks))  # exponent of the padded width
    cuts = [0, *(torch.nonzero(pads[1:] != pads[:-1]).flatten() + 1).tolist(), q1 - q0]
    return [(q0 + a, q0 + b, min(n_blocks, int(needed[a:b].max()))) for a, b in zip(cuts, cuts[1:])]


@functools.lru_cache(maxsize=64)
def sequence_width_segments(first_position: int, n_rows: int, n_blocks: int, cfg: NSAConfig, current_sel_block,
                            min_blocks: int) -> tuple[tuple[int, int, int], ...]:
    """width_segments of rows 0..n_rows-1 of one sequence starting at first_position, J from the seam
    current_sel_block (the function masks holds at call time) on the host's positions. Every layer and step asks
    for the same segments, so they are built once per shape, config, seam and min_blocks, as
    range_attention.sequence_ranges builds the ranges. A chunk launches its part of each segment with the segment's
    width (a chunk's few first rows may rank more blocks than they have; the indices do not depend on it)."""
    current = current_sel_block(torch.arange(first_position, first_position + n_rows), cfg)
    return tuple(width_segments(current, 0, n_rows, n_blocks, min_blocks))


@torch.no_grad()
def selection_scores_rows(q: Tensor, k_cmp: Tensor, cfg: NSAConfig, positions: Tensor, n_sel_blocks: int, *,
                          docs: Documents | None = None, chunk_size: int | None = None) -> Tensor:
    """Eq. 8-10 materialized (the contract's selection_scores) with Eq. 8 + 10 in the group-scores kernel: float32
    [B, TQ, Hkv, n_sel_blocks], -inf for blocks after J. Eq. 9 then runs as the torch path's scoring.pool_eq9
    (linear, so pooling the head sum equals summing the pooled heads), chunked by kernel_chunks."""
    q = q.detach()
    rows = selection_rows(q, k_cmp.detach().to(q.dtype), cfg, positions, docs, None)
    B, TQ = q.shape[:2]
    group = cfg.n_heads // cfg.n_kv_heads
    out = torch.empty((B, TQ, cfg.n_kv_heads, n_sel_blocks), dtype=torch.float32, device=q.device)
    sel = torch.arange(n_sel_blocks, device=q.device)
    for q0, q1 in kernel_chunks(rows.widths, B * cfg.n_kv_heads * 4, chunk_size):
        p_group = rows.group_scores(q0, q1)  # Eq. 8 + Eq. 10 (sum)
        if cfg.group_reduce == "mean":
            p_group = p_group / group
        p_slc = pool_eq9(p_group, n_sel_blocks, cfg)  # Eq. 9
        after_current = sel[None, :] > masks.current_sel_block(rows.relative[q0:q1], cfg)[:, None]
        out[:, q0:q1] = p_slc.masked_fill(after_current[None, :, None, :], float("-inf"))
    return out
