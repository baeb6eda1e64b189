"""Triton kernel of the selection scores' Eq. 8 and Eq. 10, fused: for each (query row, KV group) the compressed
branch's probabilities summed over the group's query heads, written per compressed token of the row's range.

    P[b, t, g, c] = sum_{h in group g} p_cmp^(h)_t[lo_t + c],   p_cmp = 2^(s * scale * log2(e) - lse2)  (Eq. 8)

(or the scaled logits s * scale for the "logits" selection score), for c = 0 .. hi_t - lo_t; entries past a
row's range are left as they are (the caller passes zeros). The per-head probabilities never reach memory: only
the group sum does, one value per (row, group, compressed token). lse2 is the compressed branch's own base-2
log-sum-exp (range_attention_fwd), so p_cmp is exactly the softmax that branch used. Eq. 9 (a fixed band over
the compressed axis) and Eq. 11 (top-n) then run on P (optimized/scoring.py).

Grid (tile of R query rows, KV group, batch). A program holds the q of its R rows for every head of the group
as one [R * GP, d_k] tile (GP = the group size padded to a power of two, rows ordered (query, head)), so one
K tile load serves every head (the paper's group-centric loading), and sums the heads of each query as a
reduction over the head axis of the [R, GP, BLOCK_N] view of the tile (fp32 adds; the padded heads add 0). Key
tiles are aligned to multiples of BLOCK_N, so a row's arithmetic does not depend on the rows it shares a program
with (chunk- and batch-invariant scores).

The head sum was a [16, R * GP] x [R * GP, BLOCK_N] 0/1 matrix product in exact fp32 (ieee, CUDA cores; R = 4
real rows of the 16 a dot needs); at 64k it made this kernel 48.6 of the select stage's 61 ms (perf/NOTES.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .range_attention_fwd import _key_tile_span
from .selected_attention_fwd import LOG2E, dot_settings
from .tiling import RangeTiling, launch_with_fallback, padded, range_tiling, smaller_range_tilings


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
    LOGITS: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
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
    lo_m, hi_m, start, last = _key_tile_span(LO, HI, t_m, valid_m, n_keys, BLOCK_N)

    offs_dk = tl.arange(0, BLOCK_DK)
    dk_mask = offs_dk < DK
    q = tl.load(Q + b * stride_qb + t_m[:, None] * stride_qt + h_m[:, None] * stride_qh + offs_dk[None, :],
                mask=valid_m[:, None] & dk_mask[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
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
        kT = tl.load(k_base + keys.to(tl.int64)[None, :] * stride_kt + offs_dk[:, None],
                     mask=key_ok[None, :] & dk_mask[:, None], other=0.0)
        if DOT_FP32:
            s = tl.dot(q, kT.to(tl.float32), input_precision=INPUT_PRECISION)
        else:
            s = tl.dot(q, kT)
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
    the scorer skips the zero fill)."""
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
            BLOCK_M=rows * group_pad, DK=dk, BLOCK_N=t.block_n, BLOCK_DK=padded(dk), LOGITS=logits, DOT_FP32=dot_fp32,
            INPUT_PRECISION=precision, num_warps=t.num_warps, num_stages=t.num_stages,
        )

    first = tiling or range_tiling(padded(dk), padded(dk), q.dtype, "scores")
    launch_with_fallback(launch, first, smaller_range_tilings(first))
    return out
