"""Append one token per row to the decode cache's buffers in one launch (the lean decode step, docs/decode.md).

One program per batch row writes the row's new keys/values, if it has a new token, into
- the selection branch's history (slot p = the token's position),
- the window ring (slot p mod W),
- the compression branch's raw ring (slot p mod R),
for every KV head, and then advances the row's length. A row without a new token (a padding query) writes nothing
and keeps its length: a masked store replaces the trash slot the torch path scatters padding tokens to.
Buffers are the cache's head-major TokenBuffers [B, Hkv, slots + 1, D] (contiguous); new tokens [B, 1, Hkv, D].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _copy_token(SRC, DST, b, slot, extent, real, HKV: tl.constexpr, D: tl.constexpr, BLOCK_HKV: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """DST[b, h, slot, :] = SRC[b, 0, h, :] for every KV head h when `real` (DST holds `extent` slots per head)."""
    offs_h = tl.arange(0, BLOCK_HKV)
    offs_d = tl.arange(0, BLOCK_D)
    mask = real & (offs_h < HKV)[:, None] & (offs_d < D)[None, :]
    token = tl.load(SRC + (b * HKV + offs_h[:, None]) * D + offs_d[None, :], mask=mask, other=0.0)
    tl.store(DST + ((b * HKV + offs_h[:, None]) * extent + slot) * D + offs_d[None, :], token, mask=mask)


@triton.jit
def _append_kernel(
    LENGTHS, N_NEW,
    K_CMP, V_CMP, K_SLC, V_SLC, K_WIN, V_WIN,
    RAW_K, RAW_V, HIST_K, HIST_V, WIN_K, WIN_V,
    raw_extent, hist_extent, win_extent, raw_ring, win_ring,
    HKV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_HKV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    p = tl.load(LENGTHS + b)  # the new token's position: the row's length before the step
    n_new = tl.load(N_NEW + b)
    real = n_new > 0
    _copy_token(K_SLC, HIST_K, b, p, hist_extent, real, HKV, DK, BLOCK_HKV, BLOCK_DK)  # Eq. 12: token p in slot p
    _copy_token(V_SLC, HIST_V, b, p, hist_extent, real, HKV, DV, BLOCK_HKV, BLOCK_DV)
    win_slot = p % win_ring  # p >= 0
    _copy_token(K_WIN, WIN_K, b, win_slot, win_extent, real, HKV, DK, BLOCK_HKV, BLOCK_DK)
    _copy_token(V_WIN, WIN_V, b, win_slot, win_extent, real, HKV, DV, BLOCK_HKV, BLOCK_DV)
    raw_slot = p % raw_ring
    _copy_token(K_CMP, RAW_K, b, raw_slot, raw_extent, real, HKV, DK, BLOCK_HKV, BLOCK_DK)
    _copy_token(V_CMP, RAW_V, b, raw_slot, raw_extent, real, HKV, DV, BLOCK_HKV, BLOCK_DV)
    tl.store(LENGTHS + b, p + n_new)


def append_step_tokens(lengths: Tensor, n_new: Tensor, new: tuple[Tensor, ...], raw: tuple[Tensor, Tensor],
                       history: tuple[Tensor, Tensor], window: tuple[Tensor, Tensor]) -> None:
    """Write token lengths[b] of every row with n_new[b] = 1 (int64 [B], 0 or 1) into the buffers and add n_new to
    lengths (in place). new = (k_cmp, v_cmp, k_slc, v_slc, k_win, v_win), each [B, 1, Hkv, D]; raw, history,
    window = (k, v) buffers [B, Hkv, slots + 1, D] (contiguous; the rings hold slots = R and W tokens)."""
    _validate(lengths, n_new, new, raw, history, window)
    B, _, Hkv, dk = new[0].shape
    dv = new[1].shape[3]
    new = tuple(t.contiguous() for t in new)
    _append_kernel[(B,)](
        lengths, n_new, *new, raw[0], raw[1], history[0], history[1], window[0], window[1],
        raw[0].shape[2], history[0].shape[2], window[0].shape[2], raw[0].shape[2] - 1, window[0].shape[2] - 1,
        HKV=Hkv, DK=dk, DV=dv, BLOCK_HKV=triton.next_power_of_2(Hkv), BLOCK_DK=triton.next_power_of_2(dk),
        BLOCK_DV=triton.next_power_of_2(dv), num_warps=4,
    )


def _validate(lengths: Tensor, n_new: Tensor, new: tuple[Tensor, ...], raw: tuple[Tensor, Tensor],
              history: tuple[Tensor, Tensor], window: tuple[Tensor, Tensor]) -> None:
    if len(new) != 6:
        raise ValueError(f"append_step_tokens: new must be (k_cmp, v_cmp, k_slc, v_slc, k_win, v_win), got {len(new)}")
    B, one, Hkv, dk = new[0].shape
    dv = new[1].shape[3]
    if one != 1 or any(t.shape != (B, 1, Hkv, dk if i % 2 == 0 else dv) for i, t in enumerate(new)):
        raise ValueError("append_step_tokens: new keys must be [B, 1, Hkv, dk] and values [B, 1, Hkv, dv], got "
                         f"{[tuple(t.shape) for t in new]}")
    for name, (k, v) in (("raw", raw), ("history", history), ("window", window)):
        if (k.shape[:2] != (B, Hkv) or k.shape[3] != dk or v.shape[:3] != k.shape[:3] or v.shape[3] != dv
                or not k.is_contiguous() or not v.is_contiguous()):
            raise ValueError(f"append_step_tokens: {name} must be contiguous k [B={B}, Hkv={Hkv}, slots + 1, {dk}] and "
                             f"v [B, Hkv, slots + 1, {dv}], got {tuple(k.shape)}, {tuple(v.shape)}")
        if k.dtype != new[0].dtype or v.dtype != new[0].dtype:
            raise ValueError(f"append_step_tokens: {name} buffers must have the new tokens' dtype {new[0].dtype}")
    for name, t in (("lengths", lengths), ("n_new", n_new)):
        if t.shape != (B,) or t.dtype != torch.int64 or not t.is_contiguous():
            raise ValueError(f"append_step_tokens: {name} must be contiguous int64 [B={B}], got {t.dtype} "
                             f"{tuple(t.shape)}")
