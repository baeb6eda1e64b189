"""The lean decode step's Eq. 7 emission in one or two launches: the compressed token a step's new key completes.

A step appends key L to a row holding L keys. It completes compressed block i = (L + 1 - l) / d exactly when
L + 1 - l is a non-negative multiple of d (blocks cover keys [i*d, i*d + l), Eq. 7). The block's l keys are the
new key (the last one) and l - 1 keys of the compression branch's raw ring (slot t mod R, R >= l - 1), read before
the step's append overwrites a slot. phi is mean pooling, or the MLP w2^T silu(w1^T flatten(block + pos) + b1) + b2,
computed to fp32 accuracy like optimized.compression's torch phi (half-precision weights: the fp32 operand split
into three parts of the weights' dtype, each through the tensor cores), and the result is stored in the compressed
store's slot i. Rows that complete no block (most steps; padding rows with n_new = 0) store nothing.

Work is spread so that no program walks the block's l rows one dependent load after another (the latency of such a
chain, not arithmetic, sets the time of a step's emission): mean pooling is one launch, grid (row tiles of BLOCK_M
(batch row, KV head) pairs, keys | values), its l loads unrolled. The MLP is two: the first splits the l block rows
into ROWS_PER_SPLIT-row groups and the hidden units into tiles, grid (row tiles, side x split, hidden tile), each
program writing its fp32 partial of w1^T flatten(block + pos) to a workspace; the second, grid (row tiles, side),
sums the partials in split order (deterministic), adds b1, applies silu and w2, adds b2 and stores. Replaces the ~55
small torch kernels of optimized.decode.emission.new_compressed_blocks on the lean step (docs/decode.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import MIN_DOT, interpreting, padded
from .decode_tiles import emitted_cmp_count

BLOCK_M = MIN_DOT  # (row, head) pairs per program: the smallest dot extent


@triton.jit
def _fp32_dot(x, w, acc, HALF_WEIGHTS: tl.constexpr):
    """acc + x @ w for fp32 x and weights w, to fp32 accuracy. Half-precision weights are exact in their dtype, so x
    is split into three parts of that dtype (x = hi + mid + lo up to ~2^-24 |x|) and each goes through the tensor
    cores with fp32 accumulation; fp32 weights take an exact fp32 dot."""
    if HALF_WEIGHTS:
        hi = x.to(w.dtype)
        rest = x - hi.to(tl.float32)
        mid = rest.to(w.dtype)
        lo = (rest - mid.to(tl.float32)).to(w.dtype)
        acc = tl.dot(hi, w, acc)
        acc = tl.dot(mid, w, acc)
        acc = tl.dot(lo, w, acc)
    else:
        acc += tl.dot(x, w.to(tl.float32), input_precision="ieee")
    return acc


@triton.jit
def _rows(LENGTHS, N_NEW, row0, n_rows, CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr, HKV: tl.constexpr,
          BLOCK_M: tl.constexpr):
    """The tile's (batch row, KV head) pairs: their flat index, the row's key count before the step, the block the
    step would complete (Eq. 7 count before the step) and whether it completes it."""
    rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = rows < n_rows
    b = rows // HKV
    length = tl.load(LENGTHS + b, mask=row_ok, other=0)  # keys before the step; the new key is key `length`
    after = length + tl.load(N_NEW + b, mask=row_ok, other=0)
    first = emitted_cmp_count(length, CMP_BLOCK, CMP_STRIDE)
    last = emitted_cmp_count(after, CMP_BLOCK, CMP_STRIDE)
    return rows, length, first, row_ok & (last > first)  # one new key completes at most block `first`


@triton.jit
def _block_row(RAW, NEW, rows, length, first, emitted, j, raw_extent, raw_ring, offs_d, d_ok,
               CMP_STRIDE: tl.constexpr, D: tl.constexpr):
    """Row j of each pair's block [BLOCK_M, BLOCK_D] in fp32: key first*d + j, from the raw ring (slot t mod R) or,
    for the step's own key, from the new token; 0 where the pair emits nothing."""
    token = first * CMP_STRIDE + j
    from_ring = token < length
    mask = emitted[:, None] & d_ok[None, :]
    x = tl.load(RAW + (rows * raw_extent + token % raw_ring)[:, None] * D + offs_d[None, :],
                mask=mask & from_ring[:, None], other=0.0).to(tl.float32)
    x += tl.load(NEW + rows[:, None] * D + offs_d[None, :], mask=mask & ~from_ring[:, None], other=0.0).to(tl.float32)
    return x


@triton.jit
def _store_block(STORE, out, rows, first, emitted, store_extent, offs_d, d_ok, D: tl.constexpr):
    """The pairs' compressed tokens out [BLOCK_M, BLOCK_D] into store slot `first` of each pair that emits."""
    tl.store(STORE + (rows * store_extent + first)[:, None] * D + offs_d[None, :], out.to(STORE.dtype.element_ty),
             mask=emitted[:, None] & d_ok[None, :])


@triton.jit
def _avg_side(RAW, NEW, STORE, LENGTHS, N_NEW, row0, n_rows, raw_extent, raw_ring, store_extent,
              CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    rows, length, first, emitted = _rows(LENGTHS, N_NEW, row0, n_rows, CMP_BLOCK, CMP_STRIDE, HKV, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    out = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(CMP_BLOCK):  # unrolled: the l loads are independent
        out += _block_row(RAW, NEW, rows, length, first, emitted, j, raw_extent, raw_ring, offs_d, d_ok, CMP_STRIDE,
                          D)
    _store_block(STORE, out / CMP_BLOCK, rows, first, emitted, store_extent, offs_d, d_ok, D)


@triton.jit
def _emit_avg_kernel(RAW_K, RAW_V, NEW_K, NEW_V, STORE_K, STORE_V, LENGTHS, N_NEW, n_rows, raw_extent, raw_ring,
                     store_extent, CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr, HKV: tl.constexpr,
                     DK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DK: tl.constexpr,
                     BLOCK_DV: tl.constexpr):
    row0 = tl.program_id(0) * BLOCK_M
    if tl.program_id(1) == 0:
        _avg_side(RAW_K, NEW_K, STORE_K, LENGTHS, N_NEW, row0, n_rows, raw_extent, raw_ring, store_extent, CMP_BLOCK,
                  CMP_STRIDE, HKV, DK, BLOCK_M, BLOCK_DK)
    else:
        _avg_side(RAW_V, NEW_V, STORE_V, LENGTHS, N_NEW, row0, n_rows, raw_extent, raw_ring, store_extent, CMP_BLOCK,
                  CMP_STRIDE, HKV, DV, BLOCK_M, BLOCK_DV)


@triton.jit
def _hidden_side(RAW, NEW, POS, W1, WS, LENGTHS, N_NEW, row0, n_rows, raw_extent, raw_ring, split, h0,
                 CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                 HIDDEN: tl.constexpr, ROWS_PER_SPLIT: tl.constexpr, HALF_WEIGHTS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HID: tl.constexpr):
    """WS[split, pair, h0 .. h0 + BLOCK_HID) = sum over block rows j of this split of (x_j + pos_j) @ w1[j*D .. (j+1)*D)
    (the row-major flatten of (l, D), contract.PhiMLPWeights)."""
    rows, length, first, emitted = _rows(LENGTHS, N_NEW, row0, n_rows, CMP_BLOCK, CMP_STRIDE, HKV, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    offs_hid = h0 + tl.arange(0, BLOCK_HID)
    hid_ok = offs_hid < HIDDEN
    hidden = tl.zeros([BLOCK_M, BLOCK_HID], dtype=tl.float32)
    for jj in tl.static_range(ROWS_PER_SPLIT):
        j = split * ROWS_PER_SPLIT + jj
        if j < CMP_BLOCK:
            x = _block_row(RAW, NEW, rows, length, first, emitted, j, raw_extent, raw_ring, offs_d, d_ok, CMP_STRIDE,
                           D)
            x += tl.load(POS + j * D + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
            w1 = tl.load(W1 + (j * D + offs_d)[:, None] * HIDDEN + offs_hid[None, :],
                         mask=d_ok[:, None] & hid_ok[None, :], other=0.0)
            hidden = _fp32_dot(x, w1, hidden, HALF_WEIGHTS)
    tl.store(WS + (split * n_rows + rows)[:, None] * HIDDEN + offs_hid[None, :], hidden,
             mask=emitted[:, None] & hid_ok[None, :])


@triton.jit
def _emit_hidden_kernel(RAW_K, RAW_V, NEW_K, NEW_V, POS_K, POS_V, W1_K, W1_V, WS_K, WS_V, LENGTHS, N_NEW, n_rows,
                        raw_extent, raw_ring, CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr, HKV: tl.constexpr,
                        DK: tl.constexpr, DV: tl.constexpr, HIDDEN_K: tl.constexpr, HIDDEN_V: tl.constexpr,
                        SPLITS: tl.constexpr, ROWS_PER_SPLIT: tl.constexpr, HALF_WEIGHTS: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
                        BLOCK_HID: tl.constexpr):
    row0 = tl.program_id(0) * BLOCK_M
    side = tl.program_id(1) // SPLITS
    split = tl.program_id(1) % SPLITS
    h0 = tl.program_id(2) * BLOCK_HID
    if side == 0:
        if h0 < HIDDEN_K:
            _hidden_side(RAW_K, NEW_K, POS_K, W1_K, WS_K, LENGTHS, N_NEW, row0, n_rows, raw_extent, raw_ring, split,
                         h0, CMP_BLOCK, CMP_STRIDE, HKV, DK, HIDDEN_K, ROWS_PER_SPLIT, HALF_WEIGHTS, BLOCK_M,
                         BLOCK_DK, BLOCK_HID)
    else:
        if h0 < HIDDEN_V:
            _hidden_side(RAW_V, NEW_V, POS_V, W1_V, WS_V, LENGTHS, N_NEW, row0, n_rows, raw_extent, raw_ring, split,
                         h0, CMP_BLOCK, CMP_STRIDE, HKV, DV, HIDDEN_V, ROWS_PER_SPLIT, HALF_WEIGHTS, BLOCK_M,
                         BLOCK_DV, BLOCK_HID)


@triton.jit
def _finish_side(WS, B1, W2, B2, STORE, LENGTHS, N_NEW, row0, n_rows, store_extent, CMP_BLOCK: tl.constexpr,
                 CMP_STRIDE: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HIDDEN: tl.constexpr,
                 SPLITS: tl.constexpr, HALF_WEIGHTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_HID: tl.constexpr):
    """out = w2^T silu(sum of the splits' partials + b1) + b2, stored in the completed block's slot."""
    rows, length, first, emitted = _rows(LENGTHS, N_NEW, row0, n_rows, CMP_BLOCK, CMP_STRIDE, HKV, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    out = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for h0 in tl.static_range(0, HIDDEN, BLOCK_HID):
        offs_hid = h0 + tl.arange(0, BLOCK_HID)
        hid_ok = offs_hid < HIDDEN
        hidden = tl.zeros([BLOCK_M, BLOCK_HID], dtype=tl.float32)
        for split in tl.static_range(SPLITS):  # fixed order: the same sum every run
            hidden += tl.load(WS + (split * n_rows + rows)[:, None] * HIDDEN + offs_hid[None, :],
                              mask=emitted[:, None] & hid_ok[None, :], other=0.0)
        hidden += tl.load(B1 + offs_hid, mask=hid_ok, other=0.0).to(tl.float32)[None, :]
        hidden = hidden / (1.0 + tl.exp(-hidden))  # silu
        w2 = tl.load(W2 + offs_hid[:, None] * D + offs_d[None, :], mask=hid_ok[:, None] & d_ok[None, :], other=0.0)
        out = _fp32_dot(hidden, w2, out, HALF_WEIGHTS)
    out += tl.load(B2 + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    _store_block(STORE, out, rows, first, emitted, store_extent, offs_d, d_ok, D)


@triton.jit
def _emit_finish_kernel(WS_K, WS_V, B1_K, B1_V, W2_K, W2_V, B2_K, B2_V, STORE_K, STORE_V, LENGTHS, N_NEW, n_rows,
                        store_extent, CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr, HKV: tl.constexpr,
                        DK: tl.constexpr, DV: tl.constexpr, HIDDEN_K: tl.constexpr, HIDDEN_V: tl.constexpr,
                        SPLITS: tl.constexpr, HALF_WEIGHTS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_HID: tl.constexpr):
    row0 = tl.program_id(0) * BLOCK_M
    if tl.program_id(1) == 0:
        _finish_side(WS_K, B1_K, W2_K, B2_K, STORE_K, LENGTHS, N_NEW, row0, n_rows, store_extent, CMP_BLOCK,
                     CMP_STRIDE, HKV, DK, HIDDEN_K, SPLITS, HALF_WEIGHTS, BLOCK_M, BLOCK_DK, BLOCK_HID)
    else:
        _finish_side(WS_V, B1_V, W2_V, B2_V, STORE_V, LENGTHS, N_NEW, row0, n_rows, store_extent, CMP_BLOCK,
                     CMP_STRIDE, HKV, DV, HIDDEN_V, SPLITS, HALF_WEIGHTS, BLOCK_M, BLOCK_DV, BLOCK_HID)


ROWS_PER_SPLIT = 4  # block rows per program of the MLP's first phase (l = 32: 8 splits)


def _hidden_tile(hidden: int) -> int:
    """Hidden units per program of the first phase and per chunk of the second: at most 64 (the [D, 64] w1 tile of
    D = 256 is 16384 values), at least 16 (a dot's extent)."""
    return min(64, padded(hidden))


def emit_step_block(lengths: Tensor, n_new: Tensor, new_k: Tensor, new_v: Tensor, raw: tuple[Tensor, Tensor],
                    store: tuple[Tensor, Tensor], cmp_block: int, cmp_stride: int, phi=None) -> None:
    """Write the compressed token (Eq. 7) each row's step completes into the compressed store, before the step's
    append: lengths / n_new int64 [B] on the device (keys held; 1 if the row gets a key, 0 for a padding row);
    new_k / new_v [B, 1, Hkv, D] the step's compression-branch keys/values; raw = the raw ring (k, v)
    [B, Hkv, R + 1, D] (slot t mod R, R >= l - 1); store = the compressed store (k, v) [B, Hkv, S + 1, D];
    phi: PhiWeights for phi = mlp, None for mean pooling. Every buffer contiguous."""
    raw_k, raw_v = raw
    store_k, store_v = store
    B, _, hkv, dk = new_k.shape
    dv = new_v.shape[-1]
    ring = raw_k.shape[2] - 1
    if ring < cmp_block - 1:
        raise ValueError(f"emit_step_block: the raw ring holds {ring} keys, fewer than l - 1 = {cmp_block - 1}")
    for name, t in (("new_k", new_k), ("new_v", new_v), ("raw k", raw_k), ("raw v", raw_v), ("store k", store_k),
                    ("store v", store_v)):
        if not t.is_contiguous():
            raise ValueError(f"emit_step_block: {name} must be contiguous")
    n_rows = B * hkv
    if n_rows == 0:
        return
    block_dk, block_dv = padded(dk), padded(dv)
    row_tiles = triton.cdiv(n_rows, BLOCK_M)
    shape = dict(CMP_BLOCK=cmp_block, CMP_STRIDE=cmp_stride, HKV=hkv, DK=dk, DV=dv, BLOCK_M=BLOCK_M,
                 BLOCK_DK=block_dk, BLOCK_DV=block_dv)
    stages = 1 if interpreting() else 2
    if phi is None:
        _emit_avg_kernel[(row_tiles, 2)](raw_k, raw_v, new_k, new_v, store_k, store_v, lengths, n_new, n_rows,
                                         raw_k.shape[2], ring, store_k.shape[2], **shape, num_warps=4,
                                         num_stages=stages)
        return
    wk, wv = (tuple(t.contiguous() for t in (w.pos, w.w1, w.b1, w.w2, w.b2)) for w in (phi.k, phi.v))
    hidden_k, hidden_v = wk[1].shape[1], wv[1].shape[1]
    splits = triton.cdiv(cmp_block, ROWS_PER_SPLIT)
    block_hid = _hidden_tile(max(hidden_k, hidden_v))
    half = phi.k.w1.dtype in (torch.bfloat16, torch.float16) and not interpreting()  # the interpreter's half dots
    ws_k, ws_v = (torch.empty((splits, n_rows, h), device=new_k.device, dtype=torch.float32)
                  for h in (hidden_k, hidden_v))
    mlp = dict(HIDDEN_K=hidden_k, HIDDEN_V=hidden_v, SPLITS=splits, HALF_WEIGHTS=half, BLOCK_HID=block_hid)
    _emit_hidden_kernel[(row_tiles, 2 * splits, triton.cdiv(max(hidden_k, hidden_v), block_hid))](
        raw_k, raw_v, new_k, new_v, wk[0], wv[0], wk[1], wv[1], ws_k, ws_v, lengths, n_new, n_rows, raw_k.shape[2],
        ring, ROWS_PER_SPLIT=ROWS_PER_SPLIT, **shape, **mlp, num_warps=4, num_stages=stages)
    _emit_finish_kernel[(row_tiles, 2)](
        ws_k, ws_v, wk[2], wv[2], wk[3], wv[3], wk[4], wv[4], store_k, store_v, lengths, n_new, n_rows,
        store_k.shape[2], **shape, **mlp, num_warps=4, num_stages=stages)
