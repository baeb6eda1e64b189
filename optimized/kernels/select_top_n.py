"""Triton kernel of the selection's Eq. 9-11, fused: for each (query row, KV group) of a scoring chunk, the group
scores P of the group-scores kernel (optimized/kernels/group_scores.py) pooled to selection blocks, masked past
J, and ranked to the row's n selected blocks, written as indices. No per-block score reaches memory.

    p_slc[j] = sum_k w[k] * P[(l'/d) * j + first_offset + k]      (Eq. 9, the band of masks.eq9_pool_weights)
    I       = the n blocks among 0..J: forced blocks first, then the highest p_slc   (Eq. 11)

bitwise as the torch code computes them on the same P (scoring.pool_eq9, the masked_fill past J,
masks.top_n_blocks):
- Eq. 9 adds the band's terms in the order pool_eq9 does (term 0, then + term 1, ...), each term one fp32
  product, with P = 0 outside the row's range (pool_eq9's zero padding and the zeros past the range);
  group_reduce="mean" divides P by the group size first (correctly rounded, tl.math.div_rn), as the scorer
  does; the launch disables fp fusion, so no multiply-add is contracted into an FMA (which rounds once).
- Eq. 11 ranks by masks.ranked_blocks's integer key: the score's float32 bits in an order-preserving form
  (-0.0 taken as +0.0), then the reversed block index, so equal scores go to the lower block; forced blocks
  (masks.forced_blocks: n_init initial, n_local most recent, among 0..J) rank as +inf, blocks after J as -inf.
  The first min(n, NB) of that ranking are taken (n rounds of: the row's largest key, knocked out), the ones
  that exist (j <= J) are written in ascending block order and the rest of the n slots get -1.

The caller (scoring.selection_indices) runs this kernel only while masks.forced_blocks, masks.top_n_blocks and
masks.ranked_blocks are the functions it implements. The band is read from masks.eq9_pool_weights at each call
and J is handed in (the caller's masks.current_sel_block of each row's document-relative position), so those two
seams are honoured as they stand.

Grid (tile of ROWS query rows, KV group, batch). A program holds its rows' NB block keys as one
[ROWS, BLOCKS_PAD] int64 tile (about 2048 keys a program: 16 per thread with 4 warps).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from reference.config import NSAConfig

from .. import masks
from .top_n import float_order

KEYS_PER_PROGRAM = 2048  # [ROWS, BLOCKS_PAD] keys a program holds (rows are added while a row has fewer blocks)
MAX_ROWS = 32  # rows per program at most (small NB)
KEYS_PER_THREAD = 16  # warps = keys / (32 * KEYS_PER_THREAD), 4 to 16: the int64 keys stay at 32 registers
INDEX_DTYPES = (torch.int32, torch.int64)


@triton.jit
def _select_top_n_kernel(
    P, LO, HI, CURRENT, OUT,
    stride_pb, stride_pt, stride_pg,
    stride_ob, stride_ot, stride_og,
    n_rows, width, n_blocks, n_init, n_local, group,
    BAND: tl.constexpr, FIRST_OFFSET: tl.constexpr, STRIDE: tl.constexpr, MEAN: tl.constexpr,
    N_SEL: tl.constexpr, N_SEL_PAD: tl.constexpr, ROWS: tl.constexpr, BLOCKS_PAD: tl.constexpr,
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

    # the first min(n, NB) of the ranking: n rounds of (largest key, knock it out). Once every block is out
    # (n > NB) the largest key is `lowest`, whose low word names block NB - 1, already taken: no change.
    chosen = real & (blocks < 0)
    for _ in range(N_SEL):
        best = tl.max(key, axis=1)
        pick = (n_blocks - 1) - (best & 0x7FFFFFFF).to(tl.int32)  # the low word: the reversed block index
        take = blocks == pick[:, None]
        chosen = chosen | take
        key = tl.where(take, lowest, key)

    # the chosen blocks that exist, ascending, then -1 in the remaining slots
    keep = chosen & exists & real
    rank = tl.cumsum(keep.to(tl.int32), axis=1) - 1
    count = tl.sum(keep.to(tl.int32), axis=1)
    out_row = OUT + b * stride_ob + t.to(tl.int64)[:, None] * stride_ot + g * stride_og
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
        N_SEL=cfg.n_sel, N_SEL_PAD=triton.next_power_of_2(cfg.n_sel), ROWS=rows, BLOCKS_PAD=blocks_pad,
        num_warps=warps, enable_fp_fusion=False,  # Eq. 9's products and sums rounded one by one, as in torch
    )
    return out
