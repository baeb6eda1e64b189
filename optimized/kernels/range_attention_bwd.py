"""Backward Triton kernels of range attention (range_attention.py), FlashAttention-2 style, deterministic.

With lse2 from the forward and delta = rowsum(dO * O) (FlashAttention-2's D, one pass over dO and O:
range_attention_delta, or handed over with dO by Eq. 5's backward, which reads both anyway: kernels/gated_sum.py),
the probabilities are rebuilt as
P = 2^(s * scale * log2(e) - lse2) inside each row's range (exactly 0 outside it, so an empty row sends nothing
back), dP = dO V^T, dS = P * (dP - delta), and
- dq: one program per tile of (query row, head) rows, as the forward's, walks the key tiles of its rows' ranges:
  dq = dS K;
- dk/dv: one program per (key tile, KV head) walks every head of its group and the query rows whose ranges can
  reach the tile, a step of (query row, head) columns at a time (HEADS heads of the group per step):
  dv = P^T dO, dk = dS^T q. Ranges are non-decreasing in the row (checked by the wrapper), so
  the rows reading a key tile [k0, k1] are the contiguous run first(hi >= k0) .. last(lo <= k1), found once per
  tile by searchsorted. Each key's gradient is summed by one program in a fixed order: no atomics.
  fp32 inputs (COMPENSATED): the exact fp32 dots are sequential FMA chains, and `acc += dot(a, b)` would fuse the
  accumulator into one chain over every (query, head) term of a key (a compressed key is read by every later
  query of all the group's heads); each step's dot is added with Kahan compensation instead (as the selected
  kernel's dk/dv), without which dk/dv miss the error-ratio rule.
  And D is made consistent with the kernel's own P and dP (CONSISTENT_D, as the selected kernel's dq does), in
  every dtype: FlashAttention-2's D = rowsum(dO * O) differs from sum_s P_s dP_s by the rounding of O and of P (O
  stored in half precision carries a ~2^-9 relative rounding into D0), so a row's dS does not sum to 0 and every
  key of the row inherits a shared bias, which a shift-invariant parameter (phi's b1 and b2, added to every
  compressed key) sums up past the error-ratio rule. The dq kernel accumulates sum P, sum P (dP - D0) and sum P k
  in its pass, corrects dq to D = D0 sum P + sum P (dP - D0) and stores that D for the dk/dv kernel. In half
  precision sum P k is a bf16 tensor-core dot (P rounded: its error enters dq multiplied by the small D - D0); an
  exact fp32 dot on CUDA cores would be much slower. perf/NOTES.md has the measurements behind these choices.
A head dim read in two tiles (common.head_dim_tiles, BLOCK_DK2 > 0) keeps each q, k, dq, dk and sum P k tile in two
parts, the logits summed over both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.utils.weak import WeakTensorKeyDictionary

from ..device_tables import capturing
from ..numerics import LOG2E
from .common import (RangeTiling, compensated_add, dot, dot_settings, head_dim_tiles, head_packed_grid,
                     head_packed_rows, key_tile_span, launch_tiling, packed_heads, padded, range_tiling,
                     row_pass_shape, row_view, second_head_tile, smaller_range_tilings)


@triton.jit
def _range_attention_dq_kernel(
    Q, K, V, LO, HI, DO, LSE2, DELTA, DQ,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_dob, stride_dot, stride_doh,
    stride_lb, stride_lt,
    stride_dqb, stride_dqt, stride_dqh,
    n_queries, n_keys, scale_log2, scale,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    HEADS: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr, CONSISTENT_D: tl.constexpr,
    BLOCK_DK2: tl.constexpr,
):
    # tile rows are (query row, head) pairs of one KV group, as in the forward; a head dim read in two tiles
    # (common.head_dim_tiles) keeps its second part (q2, k2, dq2, pk2) beside the first
    offs_m, h, row_mask, kvh = head_packed_rows(n_queries, GROUP, HEADS, BLOCK_M)
    b = tl.program_id(2).to(tl.int64)

    offs_n = tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    dk_mask = offs_dk < DK
    dv_mask = offs_dv < DV

    # int32 ranges and keys, int64 pointer offsets; the same key tiles as the forward
    lo, hi, start, last = key_tile_span(LO, HI, offs_m, row_mask, n_keys, BLOCK_N)

    q_rows = Q + b * stride_qb + offs_m[:, None] * stride_qt + h[:, None] * stride_qh
    q = tl.load(q_rows + offs_dk[None, :], mask=row_mask[:, None] & dk_mask[None, :], other=0.0)
    do = tl.load(DO + b * stride_dob + offs_m[:, None] * stride_dot + h[:, None] * stride_doh + offs_dv[None, :],
                 mask=row_mask[:, None] & dv_mask[None, :], other=0.0)
    lse2 = tl.load(LSE2 + b * stride_lb + offs_m * stride_lt + h, mask=row_mask, other=0.0)
    delta = tl.load(DELTA + b * stride_lb + offs_m * stride_lt + h, mask=row_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    if BLOCK_DK2 > 0:
        q2, offs_dk2, dk_mask2 = second_head_tile(q_rows, row_mask, DK, BLOCK_DK, BLOCK_DK2, DOT_FP32)
        dq2 = tl.zeros([BLOCK_M, BLOCK_DK2], dtype=tl.float32)
        pk2 = tl.zeros([BLOCK_M, BLOCK_DK2], dtype=tl.float32)
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh

    dq = tl.zeros([BLOCK_M, BLOCK_DK], dtype=tl.float32)
    sum_p = tl.zeros([BLOCK_M], dtype=tl.float32)  # CONSISTENT_D: sum P, sum P (dP - D0), sum P k
    shift = tl.zeros([BLOCK_M], dtype=tl.float32)
    pk = tl.zeros([BLOCK_M, BLOCK_DK], dtype=tl.float32)
    for start_n in range(start, last + 1, BLOCK_N):
        keys = start_n + offs_n
        key_ok = keys < n_keys
        k = tl.load(k_base + keys.to(tl.int64)[:, None] * stride_kt + offs_dk[None, :],
                    mask=key_ok[:, None] & dk_mask[None, :], other=0.0)
        v = tl.load(v_base + keys.to(tl.int64)[:, None] * stride_vt + offs_dv[None, :],
                    mask=key_ok[:, None] & dv_mask[None, :], other=0.0)
        if BLOCK_DK2 > 0:
            k2 = second_head_tile(k_base + keys.to(tl.int64)[:, None] * stride_kt, key_ok, DK, BLOCK_DK, BLOCK_DK2,
                                  False)[0]  # as k: not widened (dot widens with DOT_FP32)
        s = dot(q, tl.trans(k), DOT_FP32, INPUT_PRECISION)
        if BLOCK_DK2 > 0:
            s += dot(q2, tl.trans(k2), DOT_FP32, INPUT_PRECISION)
        dp = dot(do, tl.trans(v), DOT_FP32, INPUT_PRECISION)
        in_range = (keys[None, :] >= lo[:, None]) & (keys[None, :] <= hi[:, None])
        p = tl.where(in_range, tl.exp2(s * scale_log2 - lse2[:, None]), 0.0)
        ds = p * (dp - delta[:, None])
        # dS enters the dot rounded to the input dtype, as on the GPU (with DOT_FP32 a no-op for fp32)
        dq += dot(ds.to(k.dtype), k, DOT_FP32, INPUT_PRECISION)
        if BLOCK_DK2 > 0:
            dq2 += dot(ds.to(k.dtype), k2, DOT_FP32, INPUT_PRECISION)
        if CONSISTENT_D:
            sum_p += tl.sum(p, 1)
            shift += tl.sum(ds, 1)
            # sum P k only corrects dq by the small D - D0, so half precision takes it on the tensor cores with P
            # rounded to the input dtype (a second-order error); fp32 inputs keep the exact fp32 dot
            pk += dot(p.to(k.dtype), k, DOT_FP32, INPUT_PRECISION)
            if BLOCK_DK2 > 0:
                pk2 += dot(p.to(k.dtype), k2, DOT_FP32, INPUT_PRECISION)
    if CONSISTENT_D:
        d_row = delta * sum_p + shift  # = sum_s P_s dP_s with this kernel's P and dP
        dq = dq - (d_row - delta)[:, None] * pk
        if BLOCK_DK2 > 0:
            dq2 = dq2 - (d_row - delta)[:, None] * pk2
        tl.store(DELTA + b * stride_lb + offs_m * stride_lt + h, d_row, mask=row_mask)
    dq_rows = DQ + b * stride_dqb + offs_m[:, None] * stride_dqt + h[:, None] * stride_dqh
    tl.store(dq_rows + offs_dk[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=row_mask[:, None] & dk_mask[None, :])
    if BLOCK_DK2 > 0:
        tl.store(dq_rows + offs_dk2[None, :], (dq2 * scale).to(DQ.dtype.element_ty),
                 mask=row_mask[:, None] & dk_mask2[None, :])


@triton.jit
def _range_attention_dkdv_kernel(
    Q, K, V, LO, HI, DO, LSE2, DELTA, DKEY, DVAL, QFIRST, QLAST,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_dob, stride_dot, stride_doh,
    stride_lb, stride_lt,
    stride_dks, stride_dkb, stride_dkt, stride_dkh,
    stride_dvs, stride_dvb, stride_dvt, stride_dvh,
    n_queries, n_keys, scale_log2, scale, n_split, chunk_rows,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    HEADS: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr, COMPENSATED: tl.constexpr,
    BLOCK_DK2: tl.constexpr,
):
    # program (key tile, KV head x split part, batch): part `split` of the key tile's reading rows, written to
    # slot `split` of DKEY/DVAL (the fp32 workspace when n_split > 1, summed by the wrapper in a fixed order).
    # chunk_rows = 0: part `split` of n_split equal parts of the tile's own run of rows; chunk_rows > 0 (a multiple
    # of the step's rows): the tile's rows inside the query rows [split * chunk_rows, (split + 1) * chunk_rows),
    # the same rows for every key tile, so the programs running side by side (consecutive key tiles of one KV head
    # and part) read the same q and dO rows, from L2, instead of each streaming its own from memory.
    # A step takes BLOCK_M (query row, head) columns: BLOCK_M // HEADS consecutive rows x HEADS heads of the group
    # (column c is row c // HEADS, head c % HEADS of the step's heads), so with HEADS > 1 one step's dots are
    # [BLOCK_N, BLOCK_M] wide for every head at once instead of one head's few rows.
    pid_n = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64) // n_split
    split = tl.program_id(1) % n_split
    b = tl.program_id(2).to(tl.int64)

    keys = pid_n.to(tl.int32) * BLOCK_N + tl.arange(0, BLOCK_N)  # int32 indices, int64 pointer offsets
    offs_c = tl.arange(0, BLOCK_M)
    col_row = offs_c // HEADS
    col_head = offs_c % HEADS
    ROWS = BLOCK_M // HEADS
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    key_ok = keys < n_keys
    dk_mask = offs_dk < DK
    dv_mask = offs_dv < DV

    keys64 = keys.to(tl.int64)
    k_rows = K + b * stride_kb + keys64[:, None] * stride_kt + kvh * stride_kh
    k = tl.load(k_rows + offs_dk[None, :], mask=key_ok[:, None] & dk_mask[None, :], other=0.0)
    v = tl.load(V + b * stride_vb + keys64[:, None] * stride_vt + kvh * stride_vh + offs_dv[None, :],
                mask=key_ok[:, None] & dv_mask[None, :], other=0.0)
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    if BLOCK_DK2 > 0:  # the head dim's second tile (common.head_dim_tiles): k2, q2, dkey2 beside the first
        k2, offs_dk2, dk_mask2 = second_head_tile(k_rows, key_ok, DK, BLOCK_DK, BLOCK_DK2, DOT_FP32)
        dkey2 = tl.zeros([BLOCK_N, BLOCK_DK2], dtype=tl.float32)
        dkey2_comp = tl.zeros([BLOCK_N, BLOCK_DK2], dtype=tl.float32)
    q_first = tl.load(QFIRST + pid_n)
    q_last = tl.load(QLAST + pid_n)
    aligned = (q_first // ROWS) * ROWS
    if chunk_rows > 0:
        m_start = tl.maximum(aligned, split * chunk_rows)
        m_stop = tl.minimum(q_last + 1, (split + 1) * chunk_rows)
    else:
        steps_per_part = tl.cdiv(tl.cdiv(tl.maximum(q_last + 1 - aligned, 0), ROWS), n_split)
        m_start = aligned + split * steps_per_part * ROWS
        m_stop = tl.minimum(q_last + 1, m_start + steps_per_part * ROWS)

    dkey = tl.zeros([BLOCK_N, BLOCK_DK], dtype=tl.float32)
    dval = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    dkey_comp = tl.zeros([BLOCK_N, BLOCK_DK], dtype=tl.float32)
    dval_comp = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    for g0 in range(0, GROUP, HEADS):
        head_ok = g0 + col_head < GROUP
        heads64 = (kvh * GROUP + g0 + col_head).to(tl.int64)
        for start_m in range(m_start, m_stop, ROWS):
            rows = start_m + col_row
            col_ok = (rows < n_queries) & head_ok
            rows64 = rows.to(tl.int64)
            lo = tl.load(LO + rows64, mask=col_ok, other=0)
            hi = tl.load(HI + rows64, mask=col_ok, other=-1)
            q_rows = Q + b * stride_qb + rows64[:, None] * stride_qt + heads64[:, None] * stride_qh
            q = tl.load(q_rows + offs_dk[None, :], mask=col_ok[:, None] & dk_mask[None, :], other=0.0)
            if BLOCK_DK2 > 0:
                q2 = second_head_tile(q_rows, col_ok, DK, BLOCK_DK, BLOCK_DK2, False)[0]  # as q: not widened
            do = tl.load(DO + b * stride_dob + rows64[:, None] * stride_dot + heads64[:, None] * stride_doh
                         + offs_dv[None, :], mask=col_ok[:, None] & dv_mask[None, :], other=0.0)
            lse2 = tl.load(LSE2 + b * stride_lb + rows64 * stride_lt + heads64, mask=col_ok, other=0.0)
            delta = tl.load(DELTA + b * stride_lb + rows64 * stride_lt + heads64, mask=col_ok, other=0.0)
            sT = dot(k, tl.trans(q), DOT_FP32, INPUT_PRECISION)
            if BLOCK_DK2 > 0:
                sT += dot(k2, tl.trans(q2), DOT_FP32, INPUT_PRECISION)
            dpT = dot(v, tl.trans(do), DOT_FP32, INPUT_PRECISION)
            in_range = (keys[:, None] >= lo[None, :]) & (keys[:, None] <= hi[None, :])
            pT = tl.where(in_range, tl.exp2(sT * scale_log2 - lse2[None, :]), 0.0)
            dsT = pT * (dpT - delta[None, :])
            if COMPENSATED:  # fp32: each step's dot on its own, then a Kahan add (module docstring)
                dval, dval_comp = compensated_add(dval, dval_comp, tl.dot(pT, do.to(tl.float32),
                                                                           input_precision=INPUT_PRECISION))
                dkey, dkey_comp = compensated_add(dkey, dkey_comp, tl.dot(dsT, q.to(tl.float32),
                                                                           input_precision=INPUT_PRECISION))
                if BLOCK_DK2 > 0:
                    dkey2, dkey2_comp = compensated_add(dkey2, dkey2_comp, tl.dot(dsT, q2.to(tl.float32),
                                                                                  input_precision=INPUT_PRECISION))
            else:  # P and dS enter the dots rounded to the input dtype (with DOT_FP32 as on the GPU)
                dval += dot(pT.to(do.dtype), do, DOT_FP32, INPUT_PRECISION)
                dkey += dot(dsT.to(q.dtype), q, DOT_FP32, INPUT_PRECISION)
                if BLOCK_DK2 > 0:
                    dkey2 += dot(dsT.to(q.dtype), q2, DOT_FP32, INPUT_PRECISION)
    dkey_rows = (DKEY + split.to(tl.int64) * stride_dks + b * stride_dkb + keys64[:, None] * stride_dkt
                 + kvh * stride_dkh)
    tl.store(dkey_rows + offs_dk[None, :], ((dkey - dkey_comp) * scale).to(DKEY.dtype.element_ty),
             mask=key_ok[:, None] & dk_mask[None, :])
    if BLOCK_DK2 > 0:
        tl.store(dkey_rows + offs_dk2[None, :], ((dkey2 - dkey2_comp) * scale).to(DKEY.dtype.element_ty),
                 mask=key_ok[:, None] & dk_mask2[None, :])
    dval = dval - dval_comp
    tl.store(DVAL + split.to(tl.int64) * stride_dvs + b * stride_dvb + keys64[:, None] * stride_dvt + kvh * stride_dvh
             + offs_dv[None, :], dval.to(DVAL.dtype.element_ty), mask=key_ok[:, None] & dv_mask[None, :])


def reading_rows(lo: Tensor, hi: Tensor, n_keys: int, block_n: int) -> tuple[Tensor, Tensor]:
    """For each key tile [i*block_n, min((i+1)*block_n, n_keys) - 1]: the first row whose range can reach it
    (hi >= tile start) and the last one (lo <= tile end); int32 [n_tiles]. lo/hi must be non-decreasing.
    Searched in int32 (the kernels' range dtype), so a backward spends no launch widening the ranges or narrowing
    the answers."""
    lo, hi = (x.to(torch.int32).contiguous() for x in (lo, hi))
    starts = torch.arange(0, n_keys, block_n, device=lo.device, dtype=torch.int32)
    ends = torch.arange(block_n - 1, n_keys + block_n - 1, block_n, device=lo.device, dtype=torch.int32)
    first = torch.searchsorted(hi, starts, right=False, out_int32=True)
    last = torch.searchsorted(lo, ends.clamp_(max=n_keys - 1), right=True, out_int32=True) - 1
    return first, last


_READING_ROWS = WeakTensorKeyDictionary()  # lo -> {(id(hi), versions, n_keys, block_n): (first, last, hi)}


def cached_reading_rows(lo: Tensor, hi: Tensor, n_keys: int, block_n: int) -> tuple[Tensor, Tensor]:
    """reading_rows, kept for as long as the tensor lo lives and neither lo nor hi changes: a model's layers pass the
    same cached ranges (range_attention.sequence_ranges) to every backward, whose dk/dv launch then spends no
    launch on the search (about ten small kernels per launch). Not stored while a CUDA graph is being captured
    (device_tables.capturing)."""
    key = (id(hi), lo._version, hi._version, n_keys, block_n)  # the entry keeps hi alive: its id stays its own
    entries = _READING_ROWS.get(lo)
    if entries is not None and key in entries:
        return entries[key][:2]
    first, last = reading_rows(lo, hi, n_keys, block_n)
    if not capturing(lo.device):
        if entries is None:
            entries = _READING_ROWS.setdefault(lo, {})
        entries[key] = (first, last, hi)
    return first, last


DKDV_PROGRAMS = 1024  # the dk/dv launch splits rows until it has about this many programs (132 SMs x ~8)
SHORT_RUN_DKDV_PROGRAMS = 512  # ... or this many where every key tile is read by a short run of rows (the window)
MAX_DKDV_SPLIT = 32


def dkdv_split(n_key_tiles: int, n_kv_heads: int, batch: int, n_rows: int, block_m: int,
               programs_wanted: int = DKDV_PROGRAMS) -> int:
    """Parts the reading rows of each key tile are split into: 1 when key tiles x KV heads x batch already fill the
    GPU (programs_wanted of them); more when few key tiles each take many rows (the compressed branch: T/d keys,
    each read by every later query), so the long per-tile loops run side by side instead of on a few SMs."""
    programs = max(1, n_key_tiles * n_kv_heads * batch)
    row_tiles = max(1, -(-n_rows // block_m))
    return max(1, min(MAX_DKDV_SPLIT, -(-programs_wanted // programs), row_tiles))


MIN_CHUNK_ROWS = 128  # shared row chunks: at least this many query rows each, and at most ...
TARGET_CHUNK_ROWS = 4096  # ... about this many where the workspace allows
MAX_DKDV_CHUNKS = 64
CHUNK_WORKSPACE_BYTES = 512 * 2**20  # the fp32 dk/dv partials of all chunks


def dkdv_chunks(n_key_tiles: int, n_kv_heads: int, batch: int, n_rows: int, chunk_bytes: int) -> int:
    """Shared row chunks for the compressed-like layout, where key tile j is read by every row from about j's
    position on, so about half of the (key tile, chunk) programs have rows: enough chunks for ~2 DKDV_PROGRAMS of
    those (4x dkdv_split's parts before its caps) and chunks of at most ~TARGET_CHUNK_ROWS rows, each of at least
    MIN_CHUNK_ROWS rows, their workspace (chunk_bytes per chunk) within CHUNK_WORKSPACE_BYTES."""
    programs = max(1, n_key_tiles * n_kv_heads * batch)
    wanted = max(-(-4 * DKDV_PROGRAMS // programs), -(-n_rows // TARGET_CHUNK_ROWS))
    return max(1, min(wanted, MAX_DKDV_CHUNKS, n_rows // MIN_CHUNK_ROWS, CHUNK_WORKSPACE_BYTES // max(1, chunk_bytes)))


def dkdv_parts(chunked: bool, n_key_tiles: int, n_kv_heads: int, batch: int, n_rows: int, n_keys: int,
               rows_per_step: int, width: int) -> int:
    """The dk/dv launch's default part count: dkdv_chunks for shared row chunks (workspace: batch x n_keys x
    n_kv_heads x width fp32 values per chunk, width = d_k + d_v), else dkdv_split's equal parts, aiming at
    SHORT_RUN_DKDV_PROGRAMS programs where there are as many keys as query rows (the window)."""
    if chunked:
        return dkdv_chunks(n_key_tiles, n_kv_heads, batch, n_rows, batch * n_keys * n_kv_heads * width * 4)
    wanted = SHORT_RUN_DKDV_PROGRAMS if n_keys >= n_rows else DKDV_PROGRAMS
    return dkdv_split(n_key_tiles, n_kv_heads, batch, n_rows, rows_per_step, wanted)


def rows_shared_in_l2(q: Tensor, dv: int, n_keys: int) -> bool:
    """Whether the dk/dv launch should split rows into chunks shared by every key tile: fewer keys than query rows
    (the compressed branch) and one sequence's q and dO (every head) more than twice the device's L2 cache, so the
    key tiles running side by side, each streaming its own rows, would read them from memory again and again
    (measured at the paper layout at 64k tokens: 44.5 -> 36.9 ms for that branch's backward; below that size the
    rows stay in L2 and each tile's own equal parts, better balanced, are faster; perf/NOTES.md)."""
    B, TQ, Hq, dk = q.shape
    if n_keys >= TQ:
        return False
    l2 = torch.cuda.get_device_properties(q.device).L2_cache_size if q.is_cuda else 50 * 2**20
    return TQ * Hq * (dk + dv) * q.element_size() > 2 * l2


@triton.jit
def _range_attention_delta_kernel(DO, O, DELTA, stride_do, stride_o, n_rows, dv,
                                  ROWS: tl.constexpr, BLOCK_DV: tl.constexpr):
    """FlashAttention-2's D0 = rowsum(dO * O) in fp32 for ROWS (query, head) rows of [rows, dv] views."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_DV)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols[None, :] < dv)
    do = tl.load(DO + rows[:, None] * stride_do + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    o = tl.load(O + rows[:, None] * stride_o + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(DELTA + rows, tl.sum(do * o, 1), mask=row_ok)


def range_attention_delta(do: Tensor, o: Tensor) -> Tensor:
    """D0 = rowsum(dO * O) [B, TQ, Hq] fp32 (contiguous, the layout of lse2) in one pass over dO and O, without the
    fp32 copies a torch expression makes (~12 GB of traffic per branch at 64k tokens and 64 heads)."""
    dv = o.shape[-1]
    do_rows, o_rows = row_view(do), row_view(o)
    delta = torch.empty(o.shape[:-1], device=o.device, dtype=torch.float32)
    n_rows = o_rows.shape[0]
    if n_rows == 0:
        return delta
    block_dv, rows = row_pass_shape(dv)
    _range_attention_delta_kernel[(triton.cdiv(n_rows, rows),)](
        do_rows, o_rows, delta, do_rows.stride(0), o_rows.stride(0), n_rows, dv, ROWS=rows, BLOCK_DV=block_dv,
        num_warps=4)
    return delta


@triton.jit
def _sum_parts_kernel(PARTS, GRAD, n_rows, n_keys, n_kv_heads, parts, part_stride,
                      stride_gb, stride_gt, stride_gh, stride_gd,
                      D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    """GRAD[b, t, h, :] = sum over p of PARTS[p, b, t, h, :] (fp32 [parts, B, TK, Hkv, D] contiguous), added in part
    order in fp32 and rounded once to GRAD's dtype."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (offs < D)[None, :]
    src = PARTS + rows[:, None] * D + offs[None, :]
    acc = tl.load(src, mask=mask, other=0.0)
    for p in range(1, parts):
        acc += tl.load(src + p * part_stride, mask=mask, other=0.0)
    h = rows % n_kv_heads
    t = (rows // n_kv_heads) % n_keys
    b = rows // n_kv_heads // n_keys
    dst = GRAD + b[:, None] * stride_gb + t[:, None] * stride_gt + h[:, None] * stride_gh + offs[None, :] * stride_gd
    tl.store(dst, acc.to(GRAD.dtype.element_ty), mask=mask)


def sum_parts(parts: Tensor, out: Tensor) -> Tensor:
    """out [B, TK, Hkv, d] (any strides) = parts [S, B, TK, Hkv, d] (fp32, contiguous) summed over S in order, in one
    pass: the sum and its rounding to out's dtype without an fp32 intermediate."""
    n_rows = out.shape[0] * out.shape[1] * out.shape[2]
    d = out.shape[-1]
    if n_rows * d == 0:
        return out
    block_d, rows = row_pass_shape(d)
    _sum_parts_kernel[(triton.cdiv(n_rows, rows),)](
        parts, out, n_rows, out.shape[1], out.shape[2], parts.shape[0], parts[0].numel(), *out.stride(),
        D=d, BLOCK_D=block_d, ROWS=rows, num_warps=4)
    return out


def _launch_arguments(q: Tensor, k: Tensor, v: Tensor, do: Tensor, lse2: Tensor) -> tuple[dict, tuple]:
    """The constexprs and input strides the dq and dk/dv launches share."""
    Hq, dk, Hkv, dv = q.shape[2], q.shape[3], k.shape[2], v.shape[-1]
    dot_fp32, precision = dot_settings(q.dtype)
    block_dk, block_dk2 = head_dim_tiles(dk)
    common = dict(GROUP=Hq // Hkv, DK=dk, DV=dv, BLOCK_DK=block_dk, BLOCK_DK2=block_dk2, BLOCK_DV=padded(dv),
                  DOT_FP32=dot_fp32, INPUT_PRECISION=precision)
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2),
               lse2.stride(0), lse2.stride(1))
    return common, strides


def range_attention_backward_dq(q: Tensor, k: Tensor, v: Tensor, lo: Tensor, hi: Tensor, o: Tensor, lse2: Tensor,
                                do: Tensor, scale: float, *, tiling: RangeTiling | None = None,
                                consistent_d: bool = True, out: Tensor | None = None,
                                delta0: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(dq, D) of range attention: dq [B, TQ, Hq, dk] in q's dtype and D [B, TQ, Hq] fp32 (contiguous, lse2's
    layout), the consistent sum P dP the dk/dv pass takes (FlashAttention-2's rowsum(dO * O) with
    consistent_d=False). out: a [B, TQ, Hq, dk] tensor of q's dtype (last dim contiguous) to write dq into.
    delta0: D0 = rowsum(dO * O) in that layout when the caller has it (then no pass of its own; the tensor is
    overwritten with D and returned)."""
    B, TQ, Hq, dk = q.shape
    TK = k.shape[1]
    dq = out if out is not None else torch.empty_like(q)
    # D0; the dq kernel overwrites it with the consistent D
    delta = range_attention_delta(do, o) if delta0 is None else delta0
    if B * TQ * Hq == 0 or TK == 0:
        return dq.zero_(), delta
    common, strides = _launch_arguments(q, k, v, do, lse2)

    def launch_dq(t: RangeTiling) -> None:
        grid, heads = head_packed_grid(t, TQ, Hq, k.shape[2], B)
        _range_attention_dq_kernel[grid](
            q, k, v, lo, hi, do, lse2, delta, dq, *strides, dq.stride(0), dq.stride(1), dq.stride(2),
            TQ, TK, scale * LOG2E, scale, BLOCK_M=t.block_m, BLOCK_N=t.block_n, HEADS=heads,
            CONSISTENT_D=consistent_d,
            num_warps=t.num_warps, num_stages=t.num_stages, **common)

    launch_tiling(launch_dq, tiling, range_tiling(padded(dk), padded(v.shape[-1]), q.dtype, "dq"),
                  smaller_range_tilings)
    return dq, delta


def range_attention_backward(q: Tensor, k: Tensor, v: Tensor, lo: Tensor, hi: Tensor, o: Tensor, lse2: Tensor,
                             do: Tensor, scale: float, *, dq_tiling: RangeTiling | None = None,
                             dkdv_tiling: RangeTiling | None = None, split: int | None = None,
                             row_chunks: bool | None = None,
                             consistent_d: bool = True, delta0: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of range attention for the forward's o and lse2 (inputs validated, last dims contiguous).
    dq_tiling, dkdv_tiling: launched as given (the probes time them); default the launch table's, shrunk if the GPU
    lacks the resources (common.launch_tiling).
    split: parts of each key tile's reading rows (default dkdv_parts); with more than one, each part's fp32 dk/dv
    go to a workspace [split, B, TK, Hkv, d] summed over the parts in a fixed order (deterministic).
    row_chunks: how the parts divide the rows: True, into `split` chunks of the query rows shared by every key tile
    (part p of every tile reads only rows of chunk p); False, each tile's own run of rows
    into `split` equal parts. Default: rows_shared_in_l2 (the compressed branch at long sequences, whose key tiles
    are read by long runs of mostly the same rows: shared chunks let the tiles running side by side read them once
    from memory), else equal parts (the window: each tile's run is short and its own).
    consistent_d: D = sum P dP from the dq pass instead of rowsum(dO * O) (module docstring); False is
    FlashAttention-2's D0, kept for the split test and perf.prefill_probe's before/after timing.
    delta0: as range_attention_backward_dq's."""
    B, TQ, Hq, dk = q.shape
    TK, Hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    dkey = torch.empty_like(k)
    dval = torch.empty_like(v)
    if B * Hkv == 0 or TK == 0:
        return torch.zeros_like(q), dkey, dval
    if TQ == 0:
        return torch.empty_like(q), dkey.zero_(), dval.zero_()
    dq, delta = range_attention_backward_dq(q, k, v, lo, hi, o, lse2, do, scale, tiling=dq_tiling,
                                            consistent_d=consistent_d, delta0=delta0)
    common, strides = _launch_arguments(q, k, v, do, lse2)

    def launch_dkdv(t: RangeTiling) -> tuple[Tensor, Tensor]:
        q_first, q_last = cached_reading_rows(lo, hi, TK, t.block_n)
        n_tiles = triton.cdiv(TK, t.block_n)
        heads = packed_heads(t, Hq // Hkv)  # the group's heads a step takes
        rows = t.block_m // heads  # query rows per step
        chunked = rows_shared_in_l2(q, dv, TK) if row_chunks is None else row_chunks
        parts = split or dkdv_parts(chunked, n_tiles, Hkv, B, TQ, TK, rows, dk + dv)
        chunk_rows = triton.cdiv(triton.cdiv(TQ, parts), rows) * rows if chunked and parts > 1 else 0
        if parts == 1:
            out_k, out_v = dkey[None], dval[None]
        else:
            out_k = torch.empty((parts, B, TK, Hkv, dk), device=k.device, dtype=torch.float32)
            out_v = torch.empty((parts, B, TK, Hkv, dv), device=v.device, dtype=torch.float32)
        _range_attention_dkdv_kernel[(n_tiles, Hkv * parts, B)](
            q, k, v, lo, hi, do, lse2, delta, out_k, out_v, q_first, q_last, *strides,
            *out_k.stride()[:4], *out_v.stride()[:4],
            TQ, TK, scale * LOG2E, scale, parts, chunk_rows, BLOCK_M=t.block_m, BLOCK_N=t.block_n, HEADS=heads,
            COMPENSATED=q.dtype == torch.float32, num_warps=t.num_warps, num_stages=t.num_stages, **common)
        return out_k, out_v

    out_k, out_v = launch_tiling(launch_dkdv, dkdv_tiling, range_tiling(padded(dk), padded(dv), q.dtype, "dkdv"),
                                 smaller_range_tilings)
    if out_k.shape[0] > 1:
        sum_parts(out_k, dkey)
        sum_parts(out_v, dval)
    return dq, dkey, dval
