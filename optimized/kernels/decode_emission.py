"""The lean decode step's Eq. 7 emission in one launch: the compressed token a step's new key completes.

A step appends key L to a row holding L keys. It completes compressed block i = (L - l) / d + 1 - 1 exactly when
L + 1 - l is a non-negative multiple of d (blocks cover keys [i*d, i*d + l), Eq. 7). The block's l keys are the
new key (the last one) and l - 1 keys of the compression branch's raw ring (slot t mod R, R >= l - 1), read before
the step's append overwrites a slot. phi is mean pooling, or the MLP w2^T silu(w1^T flatten(block + pos) + b1) + b2,
computed in fp32 (exact fp32 dots) like optimized.compression's torch phi, and the result is stored in the
compressed store's slot i. Rows that complete no block (most steps; padding rows with n_new = 0) store nothing.

Grid (row tiles of BLOCK_M (batch row, KV head) pairs, 2): axis 1 picks keys or values, each with its own phi.
The MLP streams w1 one block row at a time ([D, BLOCK_HID] tiles) and folds each hidden chunk into the output
through w2 at once, so no [rows, hidden] tensor leaves the program. Replaces the ~50 small torch kernels of
optimized.decode.emission.new_compressed_blocks on the lean step (docs/decode.md).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from .common import interpreting

BLOCK_M = 16  # (row, head) pairs per program: the smallest dot extent


@triton.jit
def _emit_side(RAW, NEW, STORE, POS, W1, B1, W2, B2, LENGTHS, N_NEW, row0, n_rows, raw_extent, raw_ring,
               store_extent, CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr, HKV: tl.constexpr,
               D: tl.constexpr, HIDDEN: tl.constexpr, PHI_MLP: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_HID: tl.constexpr):
    rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = rows < n_rows
    b = rows // HKV
    h = rows % HKV
    length = tl.load(LENGTHS + b, mask=row_ok, other=0)  # keys before the step; the new key is key `length`
    n_new = tl.load(N_NEW + b, mask=row_ok, other=0)
    after = length + n_new
    # Eq. 7 block count: floor((n - l) / d) + 1 for n >= l, else 0 (written without negative division)
    first = tl.where(length >= CMP_BLOCK, (length - CMP_BLOCK) // CMP_STRIDE + 1, 0)
    last = tl.where(after >= CMP_BLOCK, (after - CMP_BLOCK) // CMP_STRIDE + 1, 0)
    emitted = row_ok & (last > first)  # one new key completes at most one block: block `first`
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    load_mask = emitted[:, None] & d_ok[None, :]
    ring_base = RAW + (b * HKV + h) * raw_extent * D
    new_base = NEW + (b * HKV + h) * D  # new [B, 1, Hkv, D]

    out = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if PHI_MLP:
        offs_hid = tl.arange(0, BLOCK_HID)
        for h0 in range(0, HIDDEN, BLOCK_HID):
            hid_ok = h0 + offs_hid < HIDDEN
            hidden = tl.zeros([BLOCK_M, BLOCK_HID], dtype=tl.float32)
            for j in range(CMP_BLOCK):
                token = first * CMP_STRIDE + j  # Eq. 7 block row j
                from_ring = token < length
                x = tl.load(ring_base[:, None] + ((token % raw_ring) * D)[:, None] + offs_d[None, :],
                            mask=load_mask & from_ring[:, None], other=0.0).to(tl.float32)
                x += tl.load(new_base[:, None] + offs_d[None, :], mask=load_mask & ~from_ring[:, None],
                             other=0.0).to(tl.float32)
                x += tl.load(POS + j * D + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
                w1 = tl.load(W1 + (j * D + offs_d)[:, None] * HIDDEN + (h0 + offs_hid)[None, :],
                             mask=d_ok[:, None] & hid_ok[None, :], other=0.0).to(tl.float32)
                hidden += tl.dot(x, w1, input_precision="ieee")
            hidden += tl.load(B1 + h0 + offs_hid, mask=hid_ok, other=0.0).to(tl.float32)[None, :]
            hidden = hidden / (1.0 + tl.exp(-hidden))  # silu
            w2 = tl.load(W2 + (h0 + offs_hid)[:, None] * D + offs_d[None, :],
                         mask=hid_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            out += tl.dot(hidden, w2, input_precision="ieee")
        out += tl.load(B2 + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    else:
        for j in range(CMP_BLOCK):
            token = first * CMP_STRIDE + j
            from_ring = token < length
            out += tl.load(ring_base[:, None] + ((token % raw_ring) * D)[:, None] + offs_d[None, :],
                           mask=load_mask & from_ring[:, None], other=0.0).to(tl.float32)
            out += tl.load(new_base[:, None] + offs_d[None, :], mask=load_mask & ~from_ring[:, None],
                           other=0.0).to(tl.float32)
        out = out / CMP_BLOCK
    slot = (b * HKV + h) * store_extent + first
    tl.store(STORE + slot[:, None] * D + offs_d[None, :], out.to(STORE.dtype.element_ty), mask=load_mask)


@triton.jit
def _emit_kernel(RAW_K, RAW_V, NEW_K, NEW_V, STORE_K, STORE_V,
                 POS_K, W1_K, B1_K, W2_K, B2_K, POS_V, W1_V, B1_V, W2_V, B2_V,
                 LENGTHS, N_NEW, n_rows, raw_extent, raw_ring, store_extent,
                 CMP_BLOCK: tl.constexpr, CMP_STRIDE: tl.constexpr, HKV: tl.constexpr, DK: tl.constexpr,
                 DV: tl.constexpr, HIDDEN_K: tl.constexpr, HIDDEN_V: tl.constexpr, PHI_MLP: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_HID_K: tl.constexpr,
                 BLOCK_HID_V: tl.constexpr):
    row0 = tl.program_id(0) * BLOCK_M
    if tl.program_id(1) == 0:
        _emit_side(RAW_K, NEW_K, STORE_K, POS_K, W1_K, B1_K, W2_K, B2_K, LENGTHS, N_NEW, row0, n_rows, raw_extent,
                   raw_ring, store_extent, CMP_BLOCK, CMP_STRIDE, HKV, DK, HIDDEN_K, PHI_MLP, BLOCK_M, BLOCK_DK,
                   BLOCK_HID_K)
    else:
        _emit_side(RAW_V, NEW_V, STORE_V, POS_V, W1_V, B1_V, W2_V, B2_V, LENGTHS, N_NEW, row0, n_rows, raw_extent,
                   raw_ring, store_extent, CMP_BLOCK, CMP_STRIDE, HKV, DV, HIDDEN_V, PHI_MLP, BLOCK_M, BLOCK_DV,
                   BLOCK_HID_V)


def _hidden_tile(hidden: int, d: int) -> int:
    """Hidden units per chunk: the [D, chunk] fp32 w1 tile stays at <= 8192 elements (64 registers a thread with
    4 warps), at least 16 (a dot's extent)."""
    return max(16, min(triton.next_power_of_2(hidden), triton.next_power_of_2(max(1, 8192 // max(d, 1)))))


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
    mlp = phi is not None
    weights = []
    hidden = []
    for side in ((phi.k, dk), (phi.v, dv)) if mlp else ():
        w, d = side
        weights += [w.pos.contiguous(), w.w1.contiguous(), w.b1.contiguous(), w.w2.contiguous(),
                    w.b2.contiguous()]
        hidden.append(w.w1.shape[1])
    if not mlp:  # the MLP pointers are never read: pass any tensor
        weights = [new_k] * 10
        hidden = [16, 16]
    block_dk, block_dv = (max(16, triton.next_power_of_2(d)) for d in (dk, dv))
    grid = (triton.cdiv(n_rows, BLOCK_M), 2)
    _emit_kernel[grid](
        raw_k, raw_v, new_k, new_v, store_k, store_v, *weights, lengths, n_new, n_rows, raw_k.shape[2], ring,
        store_k.shape[2],
        CMP_BLOCK=cmp_block, CMP_STRIDE=cmp_stride, HKV=hkv, DK=dk, DV=dv, HIDDEN_K=hidden[0], HIDDEN_V=hidden[1],
        PHI_MLP=mlp, BLOCK_M=BLOCK_M, BLOCK_DK=block_dk, BLOCK_DV=block_dv,
        BLOCK_HID_K=_hidden_tile(hidden[0], block_dk), BLOCK_HID_V=_hidden_tile(hidden[1], block_dv),
        num_warps=4, num_stages=1 if interpreting() else 2,
    )
