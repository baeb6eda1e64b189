"""Selected-branch attention (Eq. 12) for decode: a few queries per row at per-row positions, group-centric.

One program per (batch row, query, KV group) and split: it loads the queries of all heads of the group as one
[BLOCK_H, BLOCK_DK] tile (paper Section 3.4, "group-centric data loading"), walks its share of the selected
blocks in key tiles of BLOCK_N rows (one K/V load serves every head of the group), with an online softmax in fp32
(base 2), and counts the keys it admitted. Split-K (decode_splits) spreads a row's n selected blocks over several
programs when there are too few rows to fill the GPU (batch 1).

Precision: q.k on the inputs' dtype with fp32 accumulation (bf16/fp16 products are exact); p.v with the
probabilities kept in fp32 (tf32 dot; fp32 inputs and the interpreter use exact fp32 dots throughout).

Keys live in the decode cache's head-major history buffer k [B, Hkv, S, dk] (token t in slot t); a query at
position p reads the tokens of its selected blocks that are <= p (block J is partial). Position -1 marks a
padding query: it reads nothing and gets 0.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..numerics import LOG2E
from .common import interpreting, key_tile_rows, padded, selected_block_keys
from .decode_splits import Partials, combine, split_count
from .decode_tiles import group_queries, qk_tile, softmax_update



@triton.jit
def _selected_decode_kernel(
    Q, K, V, IDX, POS, O_PART, M_PART, L_PART, R_PART, O, READS,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_ib, stride_it, stride_ih, stride_in,
    stride_pb, stride_pt,
    stride_ob, stride_ot, stride_oh,
    stride_rb, stride_rt,
    TQ, HKV, n_sel, slots_per_split, n_split, scale_log2,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, SEL_BLOCK: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    TILES_PER_BLOCK: tl.constexpr, DOT_FP32: tl.constexpr, FINAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1).to(tl.int64)
    g = row % HKV
    t = (row // HKV) % TQ
    b = row // (HKV * TQ)
    p = tl.load(POS + b * stride_pb + t * stride_pt).to(tl.int64)

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
    idx_base = IDX + b * stride_ib + t * stride_it + g * stride_ih

    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    count = tl.zeros([BLOCK_N], dtype=tl.int32)

    first_slot = split * slots_per_split
    for it in range(0, slots_per_split * TILES_PER_BLOCK):
        slot = first_slot + it // TILES_PER_BLOCK
        tile = it % TILES_PER_BLOCK
        block = tl.load(idx_base + slot * stride_in, mask=slot < n_sel, other=-1).to(tl.int64)
        pos, key_mask = selected_block_keys(block, tile, 0, p, offs_n, SEL_BLOCK, BLOCK_N)
        count += key_mask.to(tl.int32)

        kT = tl.load(k_base + pos[None, :] * stride_kt + offs_dk[:, None],
                     mask=key_mask[None, :] & dk_mask[:, None], other=0.0)
        v = tl.load(v_base + pos[:, None] * stride_vt + offs_dv[None, :],
                    mask=key_mask[:, None] & dv_mask[None, :], other=0.0)
        s = qk_tile(q, kT, DOT_FP32)
        m_i, l_i, acc = softmax_update(tl.where(key_mask[None, :], s * scale_log2, float("-inf")), v, m_i, l_i,
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


def selected_decode_attention(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, positions: Tensor,
                              sel_block: int, *, scale: float | None = None,
                              splits: int | None = None) -> tuple[Tensor, Tensor]:
    """Eq. 12 for decode queries q [B, TQ, Hq, dk] at positions [B, TQ] (int64, -1 = padding query) over the
    head-major key/value history k [B, Hkv, S, dk], v [B, Hkv, S, dv] (token t in slot t, S > every position).
    indices [B, TQ, Hkv, n]: selected blocks (ascending or not; negative = padding). Returns (o [B, TQ, Hq, dv]
    in q's dtype, reads int64 [B, TQ, Hkv] = keys admitted). splits: split-K count (default: fill the GPU)."""
    _validate(q, k, v, indices, positions, sel_block)
    B, TQ, Hq, dk = q.shape
    Hkv, dv = k.shape[1], v.shape[-1]
    group, n_sel = Hq // Hkv, indices.shape[-1]
    scale = 1.0 / math.sqrt(dk) if scale is None else scale
    o = torch.empty((B, TQ, Hq, dv), dtype=q.dtype, device=q.device)
    reads = torch.empty((B, TQ, Hkv), dtype=torch.int64, device=q.device)
    rows = B * TQ * Hkv
    if rows == 0:
        return o, reads
    n_split = split_count(rows, n_sel, q.device, splits)
    slots_per_split = -(-max(n_sel, 1) // n_split)
    n_split = -(-max(n_sel, 1) // slots_per_split)
    block_h, block_dk, block_dv = padded(group), padded(dk), padded(dv)
    block_n = key_tile_rows(sel_block, 64)
    parts = Partials.empty(rows if n_split > 1 else 0, n_split, block_h, block_dv, q.device)
    dot_fp32 = q.dtype == torch.float32 or interpreting()
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    _selected_decode_kernel[(rows, n_split)](
        q, k, v, indices, positions, parts.o, parts.m, parts.l, parts.reads, o, reads,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        indices.stride(0), indices.stride(1), indices.stride(2), indices.stride(3),
        positions.stride(0), positions.stride(1),
        o.stride(0), o.stride(1), o.stride(2),
        reads.stride(0), reads.stride(1),
        TQ, Hkv, n_sel, slots_per_split, n_split, scale * LOG2E,
        GROUP=group, DK=dk, DV=dv, SEL_BLOCK=sel_block,
        BLOCK_H=block_h, BLOCK_DK=block_dk, BLOCK_DV=block_dv, BLOCK_N=block_n,
        TILES_PER_BLOCK=math.ceil(sel_block / block_n), DOT_FP32=dot_fp32, FINAL=n_split == 1,
        num_warps=4, num_stages=2,
    )
    if n_split > 1:
        combine(parts, o, reads, group)
    return o, reads


def _validate(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, positions: Tensor, sel_block: int) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("selected_decode_attention: q [B, TQ, Hq, dk], k [B, Hkv, S, dk], v [B, Hkv, S, dv] "
                         f"must be 4-D, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, TQ, Hq, dk = q.shape
    if k.shape[0] != B or v.shape[:3] != k.shape[:3] or k.shape[3] != dk:
        raise ValueError(f"selected_decode_attention: k must be [B={B}, Hkv, S, dk={dk}] and v [B, Hkv, S, dv] "
                         f"like k, got {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[1] == 0 or Hq % k.shape[1]:
        raise ValueError(f"selected_decode_attention: Hq ({Hq}) must be a multiple of Hkv ({k.shape[1]})")
    if indices.dim() != 4 or tuple(indices.shape[:3]) != (B, TQ, k.shape[1]) or indices.dtype not in (
            torch.int32, torch.int64):
        raise ValueError(f"selected_decode_attention: indices must be int32/int64 [B, TQ, Hkv, n] = "
                         f"[{B}, {TQ}, {k.shape[1]}, n], got {indices.dtype} {tuple(indices.shape)}")
    if tuple(positions.shape) != (B, TQ) or positions.dtype != torch.int64:
        raise ValueError(f"selected_decode_attention: positions must be int64 [B, TQ] = [{B}, {TQ}], got "
                         f"{positions.dtype} {tuple(positions.shape)}")
    if q.dtype != k.dtype or v.dtype != k.dtype:
        raise ValueError(f"selected_decode_attention: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if isinstance(sel_block, bool) or not isinstance(sel_block, int) or sel_block <= 0:
        raise ValueError(f"selected_decode_attention: sel_block must be a positive int, got {sel_block!r}")
    if len({x.device for x in (q, k, v, indices, positions)}) != 1:
        raise ValueError("selected_decode_attention: q, k, v, indices, positions must be on one device")
    if q.device.type != "cuda" and not interpreting():
        raise ValueError("selected_decode_attention: tensors must be on CUDA (or set TRITON_INTERPRET=1 before "
                         "importing the kernels)")
