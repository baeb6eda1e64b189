"""Split-K for the decode kernels (selected_decode, masked_decode): a decode call has only B * TQ * Hkv
(query, KV group) rows, too few programs to fill a GPU at batch 1, so each row's keys are cut into splits that
run as separate programs; each writes its unnormalised output, running max and sum, and key count, and one
combine program per row merges them (the log-sum-exp merge of FlashDecoding).

Row r of the partial buffers is (b, t, g) = (r // (TQ * Hkv), (r // Hkv) % TQ, r % Hkv).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import interpreting

PROGRAMS_PER_SM = 2  # aim for this many programs per streaming multiprocessor


@dataclass
class Partials:
    """Per (row, split): o [R, S, BLOCK_H, BLOCK_DV] (unnormalised, fp32), m and l [R, S, BLOCK_H] (base-2 running max
    and sum), reads [R, S] (int32 keys counted)."""

    o: Tensor
    m: Tensor
    l: Tensor
    reads: Tensor

    @classmethod
    def empty(cls, rows: int, splits: int, block_h: int, block_dv: int, device: torch.device) -> "Partials":
        return cls(torch.empty((rows, splits, block_h, block_dv), dtype=torch.float32, device=device),
                   torch.empty((rows, splits, block_h), dtype=torch.float32, device=device),
                   torch.empty((rows, splits, block_h), dtype=torch.float32, device=device),
                   torch.empty((rows, splits), dtype=torch.int32, device=device))


def split_count(rows: int, work_units: int, device: torch.device, requested: int | None = None) -> int:
    """Splits per row: enough programs for PROGRAMS_PER_SM per SM, at most one per work unit (a selected block
    or a key tile). `requested` overrides (tests exercise several splits in the interpreter)."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"splits must be >= 1, got {requested}")
        return min(requested, max(1, work_units))
    budget = program_budget(device)
    if budget == 1:
        return 1
    return max(1, min(work_units, -(-budget // max(rows, 1))))


def program_budget(device: torch.device) -> int:
    """Programs one launch aims for: PROGRAMS_PER_SM per streaming multiprocessor (1 off CUDA or in the
    interpreter)."""
    if device.type != "cuda" or interpreting():
        return 1
    return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def _combine_kernel(
    O_PART, M_PART, L_PART, R_PART, O, READS,
    n_split, TQ, HKV,
    stride_pr, stride_ps, stride_ph,
    stride_ob, stride_ot, stride_oh,
    stride_rb, stride_rt,
    GROUP: tl.constexpr, DV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    g = row % HKV
    t = (row // HKV) % TQ
    b = row // (HKV * TQ)
    offs_h = tl.arange(0, BLOCK_H)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_run = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_run = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    reads = tl.zeros([1], dtype=tl.int32)
    for s in range(0, n_split):
        base = row * stride_pr + s * stride_ps
        m_s = tl.load(M_PART + base + offs_h)
        l_s = tl.load(L_PART + base + offs_h)
        o_s = tl.load(O_PART + base * BLOCK_DV + offs_h[:, None] * BLOCK_DV + offs_dv[None, :])
        m_new = tl.maximum(m_run, m_s)
        alpha = tl.exp2(m_run - m_new)
        beta = tl.exp2(m_s - m_new)
        l_run = l_run * alpha + l_s * beta
        acc = acc * alpha[:, None] + o_s * beta[:, None]
        m_run = m_new
        reads += tl.load(R_PART + row * n_split + s + tl.arange(0, 1))
    out = acc / tl.where(l_run > 0.0, l_run, 1.0)[:, None]
    heads = g * GROUP + offs_h
    tl.store(O + b * stride_ob + t * stride_ot + heads[:, None] * stride_oh + offs_dv[None, :],
             out.to(O.dtype.element_ty), mask=(offs_h < GROUP)[:, None] & (offs_dv < DV)[None, :])
    tl.store(READS + b * stride_rb + t * stride_rt + g + tl.arange(0, 1), reads.to(READS.dtype.element_ty))


def combine(parts: Partials, o: Tensor, reads: Tensor, group: int) -> None:
    """Merge the splits of every row into o [B, TQ, Hq, dv] and reads [B, TQ, Hkv] (int64)."""
    rows, splits, block_h, block_dv = parts.o.shape
    TQ, dv = o.shape[1], o.shape[3]
    _combine_kernel[(rows,)](
        parts.o, parts.m, parts.l, parts.reads, o, reads,
        splits, TQ, reads.shape[2],
        parts.m.stride(0), parts.m.stride(1), parts.m.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        reads.stride(0), reads.stride(1),
        GROUP=group, DV=dv, BLOCK_H=block_h, BLOCK_DV=block_dv,
    )
