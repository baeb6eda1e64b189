"""Triton building blocks shared by the lean decode-step kernels (optimized/kernels/decode_step.py): one key tile of
Eq. 2 with an online softmax, the log-sum-exp merge of split-K partials, and the decode cache's position rules.

A program holds the queries of all heads of one KV group as a [BLOCK_H, BLOCK_DK] tile (paper Section 3.4,
group-centric loading). Precision as in masked_decode / selected_decode: q.k in the inputs' dtype with fp32
accumulation (exact fp32 dots for fp32 inputs and in the interpreter, whose tl.dot is wrong on bf16), the online
softmax in fp32 base 2, p.v with fp32 probabilities (tf32 dot on half precision).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def await_previous_launch(PDL: tl.constexpr):
    """A lean-step launch made with programmatic dependent launch (PDL, sm_90 and later) may start while the launch
    before it still runs: wait here until that launch has finished and its writes are visible, then let the next
    launch start its programs (they wait here in turn). So a launch's start-up overlaps the tail of the one before,
    and the order of the step's launches is kept. Without PDL the stream orders the launches: nothing to do."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def group_queries(q_row, g, stride_qh, GROUP: tl.constexpr, DK: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_DK: tl.constexpr, DOT_FP32: tl.constexpr):
    """The queries of KV group g's heads as one [BLOCK_H, BLOCK_DK] tile (zeros past GROUP heads and DK dims;
    fp32 when DOT_FP32). q_row: the query row's first element (head 0, dim 0)."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_dk = tl.arange(0, BLOCK_DK)
    q = tl.load(q_row + (g * GROUP + offs_h[:, None]) * stride_qh + offs_dk[None, :],
                mask=(offs_h < GROUP)[:, None] & (offs_dk < DK)[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    return q


@triton.jit
def qk_tile(q, kT, DOT_FP32: tl.constexpr):
    """q [BLOCK_H, BLOCK_DK] times kT [BLOCK_DK, BLOCK_N]: the raw dot products q.k (fp32)."""
    if DOT_FP32:
        s = tl.dot(q, kT.to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(q, kT)
    return s


@triton.jit
def softmax_update(x, v, m_i, l_i, acc, DOT_FP32: tl.constexpr):
    """One key tile of Eq. 2's online softmax in base 2: x [BLOCK_H, BLOCK_N] = scaled logits * log2(e), -inf for
    keys that do not enter the softmax; v [BLOCK_N, BLOCK_DV]. Returns the running (max, sum, unnormalised output)."""
    m_new = tl.maximum(m_i, tl.max(x, 1))
    alpha = tl.exp2(m_i - m_new)
    probs = tl.exp2(x - m_new[:, None])
    l_i = l_i * alpha + tl.sum(probs, 1)
    acc = acc * alpha[:, None]
    if DOT_FP32:
        acc += tl.dot(probs, v.to(tl.float32), input_precision="ieee")
    else:  # probabilities stay fp32 (tf32 keeps 10 mantissa bits, bf16 7); bf16/fp16 values are exact in tf32
        acc += tl.dot(probs, v.to(tl.float32), input_precision="tf32")
    return m_new, l_i, acc


@triton.jit
def store_partial(O_PART, M_PART, L_PART, R_PART, part, acc, m_i, l_i, reads,
                  BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Write one split's (unnormalised output, base-2 max, sum, keys counted) at partial index `part`."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_dv = tl.arange(0, BLOCK_DV)
    tl.store(O_PART + (part * BLOCK_H + offs_h[:, None]) * BLOCK_DV + offs_dv[None, :], acc)
    tl.store(M_PART + part * BLOCK_H + offs_h, m_i)
    tl.store(L_PART + part * BLOCK_H + offs_h, l_i)
    tl.store(R_PART + part, reads)


@triton.jit
def merge_stats(M_PART, L_PART, R_PART, first, count, BLOCK_H: tl.constexpr, SPLITS: tl.constexpr):
    """The base-2 max and sum [BLOCK_H] and the keys counted of the `count` (<= SPLITS) partials from index `first`
    on, loaded at once (a loop would wait for one partial after another)."""
    offs_s = tl.arange(0, SPLITS)
    in_use = offs_s < count
    stat = (first + offs_s)[:, None] * BLOCK_H + tl.arange(0, BLOCK_H)[None, :]
    m_s = tl.load(M_PART + stat, mask=in_use[:, None], other=-1.0e30)
    l_s = tl.load(L_PART + stat, mask=in_use[:, None], other=0.0)
    m_run = tl.max(m_s, 0)
    l_run = tl.sum(l_s * tl.exp2(m_s - m_run[None, :]), 0)
    reads = tl.sum(tl.load(R_PART + first + offs_s, mask=in_use, other=0), 0)
    return m_run, l_run, reads


@triton.jit
def merge_partials(O_PART, M_PART, L_PART, R_PART, first, count, dv_first, BLOCK_H: tl.constexpr,
                   BLOCK_DV: tl.constexpr, TILE_DV: tl.constexpr, SPLITS: tl.constexpr, CHUNK: tl.constexpr):
    """Log-sum-exp merge (FlashDecoding) of the `count` (<= SPLITS) partials from index `first` on, output columns
    dv_first .. dv_first + TILE_DV - 1: merge_stats, then the outputs rescaled to the common max and added in split
    order, one [BLOCK_H, TILE_DV] tile per partial, CHUNK tiles unrolled per loop step so their loads are in flight
    together (no reduction over partials; docs/decode.md, "Lean step", says why). Returns (unnormalised output
    [BLOCK_H, TILE_DV], base-2 max and sum [BLOCK_H], keys counted)."""
    m_run, l_run, reads = merge_stats(M_PART, L_PART, R_PART, first, count, BLOCK_H, SPLITS)
    offs_h = tl.arange(0, BLOCK_H)
    offs_dv = dv_first + tl.arange(0, TILE_DV)
    acc = tl.zeros([BLOCK_H, TILE_DV], dtype=tl.float32)
    for start in range(0, count, CHUNK):
        for c in tl.static_range(CHUNK):
            part = first + start + c
            in_use = start + c < count
            m_s = tl.load(M_PART + part * BLOCK_H + offs_h, mask=in_use, other=float("-inf"))
            o_s = tl.load(O_PART + (part * BLOCK_H + offs_h[:, None]) * BLOCK_DV + offs_dv[None, :], mask=in_use,
                          other=0.0)
            acc += o_s * tl.exp2(m_s - m_run)[:, None]
    return acc, m_run, l_run, reads


@triton.jit
def step_position(LENGTHS, N_NEW, b):
    """(query position p, tokens held after the step) of row b: LENGTHS holds the row's tokens before the step (the
    gate kernel advances it, the last launch), and the step's query is its new token, p = lengths; a row without a
    new token (padding query) gets p = -1."""
    before = tl.load(LENGTHS + b)
    n_new = tl.load(N_NEW + b)
    p = tl.where(n_new > 0, before, -1)
    return p, before + n_new


@triton.jit
def emitted_cmp_count(held, CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr):
    """Eq. 7: the compressed blocks whose l keys all lie in the `held` tokens of a row, floor((held - l)/d) + 1 for
    held >= l, else 0 (written without dividing a negative number)."""
    return tl.where(held >= CMP_BLOCK, (held - CMP_BLOCK) // CMP_STRIDE + 1, 0)


@triton.jit
def visible_cmp_count(p, held, CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr, STRICT: tl.constexpr):
    """Eq. 7 (masks.compressed_block_visible): the compressed blocks query p reads are a prefix 0..count-1 of the
    store. Block i is visible iff its last key i*d + l - 1 is <= p ("inclusive", i <= (p - l + 1)/d) or < p
    ("strict", i <= (p - l)/d), and it was emitted (emitted_cmp_count of the row's `held` tokens)."""
    emitted = emitted_cmp_count(held, CMP_BLOCK, CMP_STRIDE)
    if STRICT:
        last = p - CMP_BLOCK  # the last block's first key is at most p - l
    else:
        last = p - CMP_BLOCK + 1
    seen = tl.where(last >= 0, last // CMP_STRIDE + 1, 0)
    return tl.minimum(seen, emitted)
