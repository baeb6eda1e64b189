"""Decode attention over a contiguous key range with a per-query mask: the compressed branch (keys = the
compressed tokens, mask = the visibility seam) and the window branch (keys = the window ring, mask = the window
seam) of optimized.decode.

One program per (batch row, query, KV group) and split of the key range, group-centric like selected_decode: the
queries of all heads of the group form one [BLOCK_H, BLOCK_DK] tile, each K/V tile is loaded once for all of them,
online softmax in fp32 (base 2). The mask decides which keys enter the softmax and is counted (reads). With
want_logits the program also writes the scaled logits q.k/sqrt(d_k) of every key in range (masked or not), the
input of the Eq. 8-11 seams, so the compressed keys are read once for both the branch and the selection.
Precision as in selected_decode: q.k in the inputs' dtype with fp32 accumulation, p.v with fp32 probabilities.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..numerics import LOG2E
from .common import interpreting, padded
from .decode_splits import Partials, combine, split_count
from .decode_tiles import group_queries, qk_tile, softmax_update

BLOCK_N = 64  # keys per tile


@triton.jit
def _masked_decode_kernel(
    Q, K, V, MASK, LOGITS, O_PART, M_PART, L_PART, R_PART, O, READS,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_mb, stride_mt,
    stride_lb, stride_lh, stride_lt, stride_lg,
    stride_ob, stride_ot, stride_oh,
    stride_rb, stride_rt,
    TQ, HKV, n_keys, keys_per_split, n_split, scale, scale_log2,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr, WANT_LOGITS: tl.constexpr, FINAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1).to(tl.int64)
    g = row % HKV
    t = (row // HKV) % TQ
    b = row // (HKV * TQ)

    offs_h = tl.arange(0, BLOCK_H)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, BLOCK_N)
    head_mask = offs_h < GROUP
    dk_mask = offs_dk < DK
    dv_mask = offs_dv < DV
    heads = g * GROUP + offs_h

    q = group_queries(Q + b * stride_qb + t * stride_qt, g, stride_qh, GROUP, DK, BLOCK_H, BLOCK_DK, DOT_FP32)
    k_base = K + b * stride_kb + g * stride_kh
    v_base = V + b * stride_vb + g * stride_vh
    mask_base = MASK + b * stride_mb + t * stride_mt
    logit_base = LOGITS + b * stride_lb + g * stride_lh + t * stride_lt

    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    count = tl.zeros([BLOCK_N], dtype=tl.int32)

    first = split * keys_per_split
    for start in range(0, keys_per_split, BLOCK_N):
        key = first + start + offs_n
        in_range = (start + offs_n < keys_per_split) & (key < n_keys)
        admitted = (tl.load(mask_base + key, mask=in_range, other=0) != 0) & in_range
        count += admitted.to(tl.int32)
        load_keys = in_range if WANT_LOGITS else admitted
        kT = tl.load(k_base + key[None, :] * stride_kt + offs_dk[:, None],
                     mask=load_keys[None, :] & dk_mask[:, None], other=0.0)
        v = tl.load(v_base + key[:, None] * stride_vt + offs_dv[None, :],
                    mask=admitted[:, None] & dv_mask[None, :], other=0.0)
        s = qk_tile(q, kT, DOT_FP32)
        if WANT_LOGITS:
            tl.store(logit_base + offs_h[:, None] * stride_lg + key[None, :], s * scale,
                     mask=head_mask[:, None] & in_range[None, :])
        m_i, l_i, acc = softmax_update(tl.where(admitted[None, :], s * scale_log2, float("-inf")), v, m_i, l_i,
                                       acc, DOT_FP32)

    reads = tl.sum(count, 0)
    if FINAL:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(O + b * stride_ob + t * stride_ot + heads[:, None] * stride_oh + offs_dv[None, :],
                 out.to(O.dtype.element_ty), mask=head_mask[:, None] & dv_mask[None, :])
        tl.store(READS + b * stride_rb + t * stride_rt + g, reads.to(READS.dtype.element_ty))
    else:
        part = row * n_split + split
        tl.store(O_PART + (part * BLOCK_H + offs_h[:, None]) * BLOCK_DV + offs_dv[None, :], acc)
        tl.store(M_PART + part * BLOCK_H + offs_h, m_i)
        tl.store(L_PART + part * BLOCK_H + offs_h, l_i)
        tl.store(R_PART + part, reads)


def masked_decode_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, *, want_logits: bool = False,
                            scale: float | None = None,
                            splits: int | None = None) -> tuple[Tensor, Tensor | None, Tensor]:
    """Eq. 2 for decode queries q [B, TQ, Hq, dk] over keys k [B, Hkv, K, dk], v [B, Hkv, K, dv] (head-major, last
    dim contiguous) with mask [B, TQ, K] (bool, shared by the KV groups): the keys each query attends to.

    Returns (o [B, TQ, Hq, dv] in q's dtype (0 for a query with no key), logits [B, Hkv, TQ, G, K] fp32 = scaled
    q.k of every key or None, reads int64 [B, TQ, Hkv] = keys admitted)."""
    _validate(q, k, v, mask)
    B, TQ, Hq, dk = q.shape
    Hkv, K, dv = k.shape[1], k.shape[2], v.shape[-1]
    group = Hq // Hkv
    scale = 1.0 / math.sqrt(dk) if scale is None else scale
    o = torch.empty((B, TQ, Hq, dv), dtype=q.dtype, device=q.device)
    reads = torch.empty((B, TQ, Hkv), dtype=torch.int64, device=q.device)
    logits = torch.empty((B, Hkv, TQ, group, K) if want_logits else (0, 0, 0, 0, 0), dtype=torch.float32,
                         device=q.device)
    rows = B * TQ * Hkv
    if rows == 0:
        return o, (logits if want_logits else None), reads
    tiles = max(1, -(-K // BLOCK_N))
    n_split = split_count(rows, tiles, q.device, splits)
    keys_per_split = -(-tiles // n_split) * BLOCK_N
    n_split = max(1, -(-K // keys_per_split))
    block_h, block_dk, block_dv = padded(group), padded(dk), padded(dv)
    parts = Partials.empty(rows if n_split > 1 else 0, n_split, block_h, block_dv, q.device)
    dot_fp32 = q.dtype == torch.float32 or interpreting()
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    mask = mask.contiguous().view(torch.uint8)
    _masked_decode_kernel[(rows, n_split)](
        q, k, v, mask, logits, parts.o, parts.m, parts.l, parts.reads, o, reads,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        mask.stride(0), mask.stride(1),
        *(logits.stride()[:4] if want_logits else (0, 0, 0, 0)),
        o.stride(0), o.stride(1), o.stride(2),
        reads.stride(0), reads.stride(1),
        TQ, Hkv, K, keys_per_split, n_split, scale, scale * LOG2E,
        GROUP=group, DK=dk, DV=dv, BLOCK_H=block_h, BLOCK_DK=block_dk, BLOCK_DV=block_dv, BLOCK_N=BLOCK_N,
        DOT_FP32=dot_fp32, WANT_LOGITS=want_logits, FINAL=n_split == 1,
        num_warps=4, num_stages=2,
    )
    if n_split > 1:
        combine(parts, o, reads, group)
    return o, (logits if want_logits else None), reads


def _validate(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("masked_decode_attention: q [B, TQ, Hq, dk], k [B, Hkv, K, dk], v [B, Hkv, K, dv] must be "
                         f"4-D, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, TQ, Hq, dk = q.shape
    if k.shape[0] != B or v.shape[:3] != k.shape[:3] or k.shape[3] != dk:
        raise ValueError(f"masked_decode_attention: k must be [B={B}, Hkv, K, dk={dk}] and v [B, Hkv, K, dv] like k, "
                         f"got {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[1] == 0 or Hq % k.shape[1]:
        raise ValueError(f"masked_decode_attention: Hq ({Hq}) must be a multiple of Hkv ({k.shape[1]})")
    if mask.dtype != torch.bool or tuple(mask.shape) != (B, TQ, k.shape[2]):
        raise ValueError(f"masked_decode_attention: mask must be bool [B, TQ, K] = [{B}, {TQ}, {k.shape[2]}], got "
                         f"{mask.dtype} {tuple(mask.shape)}")
    if q.dtype != k.dtype or v.dtype != k.dtype:
        raise ValueError(f"masked_decode_attention: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if len({x.device for x in (q, k, v, mask)}) != 1:
        raise ValueError("masked_decode_attention: q, k, v, mask must be on one device")
    if q.device.type != "cuda" and not interpreting():
        raise ValueError("masked_decode_attention: tensors must be on CUDA (or set TRITON_INTERPRET=1 before "
                         "importing the kernels)")
