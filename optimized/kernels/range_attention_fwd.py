"""Forward Triton kernel of range attention: Eq. 2 for query rows that each read ONE contiguous key range.

Both dense-ish NSA branches are of this kind (optimized/ranges.py builds the ranges from the convention seams):
- the sliding window (Section 3.3.3): row p reads keys [max(doc start, p - w + 1), p];
- the compressed branch (Eq. 7-8): row p reads the compressed tokens [first of its document, + N_visible(p) - 1].
A row whose range is empty (hi < lo) outputs 0 and has lse = -inf (the empty compressed set of Eq. 7).

Grid (query tile of BLOCK_M rows, query head, batch), FlashAttention-2 style: the program loads its q tile once,
walks the key tiles covering the union of its rows' ranges (tile starts aligned to multiples of BLOCK_N, so a
row's arithmetic does not depend on which rows share its program), masks each element by its row's range,
and keeps an online softmax in fp32 (base 2). GQA: head h reads KV head h // GROUP.

Outputs o [B, TQ, Hq, dv] (input dtype) and lse2 [B, TQ, Hq] fp32, the base-2 log-sum-exp of the scaled
logits (s * scale * log2(e)); -inf for an empty row. With WITH_OUTPUT=False only lse2 is computed (no V loads,
no P.V dot): the selection scoring needs the compressed branch's normaliser and nothing else.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .selected_attention_fwd import LOG2E, dot_settings
from .tiling import RangeTiling, launch_with_fallback, padded, range_tiling, smaller_range_tilings


@triton.jit
def _key_tile_span(LO, HI, rows, valid, n_keys, BLOCK_N: tl.constexpr):
    """The ranges [lo, hi] of the given rows (int32; an invalid row reads nothing) and the key tiles covering the
    union of the rows that read something: tiles start at `start`, a multiple of BLOCK_N (so a row's arithmetic
    does not depend on the rows it shares a program with), and run while start_n <= last."""
    lo = tl.load(LO + rows, mask=valid, other=0)
    hi = tl.load(HI + rows, mask=valid, other=-1)
    reads = valid & (hi >= lo)
    first = tl.min(tl.where(reads, lo, n_keys), 0)
    last = tl.max(tl.where(reads, hi, -1), 0)
    return lo, hi, (first // BLOCK_N) * BLOCK_N, last


@triton.jit
def _range_attention_fwd_kernel(
    Q, K, V, LO, HI, O, LSE2,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh,
    stride_lb, stride_lt,
    n_queries, n_keys, scale_log2,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    WITH_OUTPUT: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    # 64-bit offsets everywhere (T >= 64k, Hq * d large).
    pid_m = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    kvh = h // GROUP

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_mask = offs_m < n_queries
    dk_mask = offs_dk < DK
    dv_mask = offs_dv < DV

    # ranges and key indices in int32 (keys < 2^31; masks stay cheap in registers), pointer offsets in int64
    lo, hi, start, last = _key_tile_span(LO, HI, offs_m, row_mask, n_keys, BLOCK_N)

    q = tl.load(Q + b * stride_qb + offs_m[:, None] * stride_qt + h * stride_qh + offs_dk[None, :],
                mask=row_mask[:, None] & dk_mask[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh

    # The running max starts finite, so a tile where a row reads nothing gives alpha = 1 and p = 0 (no NaN).
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for start_n in range(start, last + 1, BLOCK_N):
        keys = start_n + offs_n
        key_ok = keys < n_keys
        kT = tl.load(k_base + keys.to(tl.int64)[None, :] * stride_kt + offs_dk[:, None],
                     mask=key_ok[None, :] & dk_mask[:, None], other=0.0)
        if DOT_FP32:
            s = tl.dot(q, kT.to(tl.float32), input_precision=INPUT_PRECISION)
        else:
            s = tl.dot(q, kT)
        in_range = (keys[None, :] >= lo[:, None]) & (keys[None, :] <= hi[:, None])
        s = tl.where(in_range, s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if WITH_OUTPUT:
            v = tl.load(v_base + keys.to(tl.int64)[:, None] * stride_vt + offs_dv[None, :],
                        mask=key_ok[:, None] & dv_mask[None, :], other=0.0)
            acc = acc * alpha[:, None]
            if DOT_FP32:  # P enters the dot rounded to the input dtype, as on the GPU (a no-op for fp32)
                acc += tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision=INPUT_PRECISION)
            else:
                acc += tl.dot(p.to(v.dtype), v)
        m_i = m_new

    has_key = l_i > 0.0
    lse2 = tl.where(has_key, m_i + tl.log2(tl.where(has_key, l_i, 1.0)), float("-inf"))
    tl.store(LSE2 + b * stride_lb + offs_m * stride_lt + h, lse2, mask=row_mask)
    if WITH_OUTPUT:
        out = acc / tl.where(has_key, l_i, 1.0)[:, None]
        tl.store(O + b * stride_ob + offs_m[:, None] * stride_ot + h * stride_oh + offs_dv[None, :],
                 out.to(O.dtype.element_ty), mask=row_mask[:, None] & dv_mask[None, :])


def range_attention_forward(q: Tensor, k: Tensor, v: Tensor | None, lo: Tensor, hi: Tensor, scale: float, *,
                            tiling: RangeTiling | None = None) -> tuple[Tensor | None, Tensor]:
    """Launch the forward on validated inputs (range_attention.check_range_inputs): q [B, TQ, Hq, dk],
    k [B, TK, Hkv, dk], v [B, TK, Hkv, dv] or None (lse only), lo/hi int32 [TQ] contiguous.
    Returns (o [B, TQ, Hq, dv] in q's dtype or None, lse2 [B, TQ, Hq] fp32 base-2 log-sum-exp)."""
    B, TQ, Hq, dk = q.shape
    TK, Hkv = k.shape[1], k.shape[2]
    with_output = v is not None
    dv = v.shape[-1] if with_output else dk
    o = torch.empty((B, TQ, Hq, dv), device=q.device, dtype=q.dtype) if with_output else None
    lse2 = torch.empty((B, TQ, Hq), device=q.device, dtype=torch.float32)
    if B * TQ * Hq == 0:
        return o, lse2
    dot_fp32, precision = dot_settings(q.dtype)
    vv, oo = (v, o) if with_output else (k, lse2)  # placeholders the kernel never touches without output

    def launch(t: RangeTiling) -> None:
        grid = (triton.cdiv(TQ, t.block_m), Hq, B)
        _range_attention_fwd_kernel[grid](
            q, k, vv, lo, hi, oo, lse2,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            vv.stride(0), vv.stride(1), vv.stride(2),
            *((o.stride(0), o.stride(1), o.stride(2)) if with_output else (0, 0, 0)),
            lse2.stride(0), lse2.stride(1),
            TQ, TK, scale * LOG2E,
            GROUP=Hq // Hkv, DK=dk, DV=dv, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
            BLOCK_DK=padded(dk), BLOCK_DV=padded(dv), WITH_OUTPUT=with_output, DOT_FP32=dot_fp32,
            INPUT_PRECISION=precision, num_warps=t.num_warps, num_stages=t.num_stages,
        )

    first = tiling or range_tiling(padded(dk), padded(dv), q.dtype, "forward")
    launch_with_fallback(launch, first, smaller_range_tilings(first))
    return o, lse2
