"""The lean decode step's append (docs/decode.md, "Lean step"): the new token of one (batch row, KV head), written by
the compressed split kernel's first split of that (row, head), so the append costs no launch of its own.

A row with a new token writes its keys/values into
- the selection branch's history (slot p = the token's position),
- the window ring (slot p mod W),
- the compression branch's raw ring (slot p mod R).
A row without a new token (a padding query) writes nothing: a masked store replaces the trash slot the torch path
scatters padding tokens to. The row's length is advanced by the step's last launch (the gate kernel), so every
launch of the step reads the same length before the step. The compressed split kernel reads none of these
buffers; the launches after it, which do, see the token.
Buffers are the cache's head-major TokenBuffers [B, Hkv, slots + 1, D] (contiguous); new tokens [B, 1, Hkv, D]
(contiguous).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _copy_head_token(SRC, DST, b, g, slot, extent, real, HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """DST[b, g, slot, :] = SRC[b, 0, g, :] when `real` (DST holds `extent` slots per head)."""
    offs_d = tl.arange(0, BLOCK_D)
    mask = real & (offs_d < D)
    token = tl.load(SRC + (b * HKV + g) * D + offs_d, mask=mask, other=0.0)
    tl.store(DST + ((b * HKV + g) * extent + slot) * D + offs_d, token, mask=mask)


@triton.jit
def append_head_token(LENGTHS, N_NEW, K_CMP, V_CMP, K_SLC, V_SLC, K_WIN, V_WIN, RAW_K, RAW_V, HIST_K, HIST_V, WIN_K,
                      WIN_V, b, g, raw_extent, hist_extent, win_extent,
                      HKV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
                      BLOCK_DV: tl.constexpr):
    """Write KV head g's new token of batch row b, if the row has one, into the three buffers (module docstring).
    The rings hold extent - 1 slots (the last is the trash slot)."""
    p = tl.load(LENGTHS + b)  # the new token's position: the row's length before the step
    real = tl.load(N_NEW + b) > 0
    _copy_head_token(K_SLC, HIST_K, b, g, p, hist_extent, real, HKV, DK, BLOCK_DK)  # Eq. 12: token p in slot p
    _copy_head_token(V_SLC, HIST_V, b, g, p, hist_extent, real, HKV, DV, BLOCK_DV)
    win_slot = p % (win_extent - 1)  # p >= 0
    _copy_head_token(K_WIN, WIN_K, b, g, win_slot, win_extent, real, HKV, DK, BLOCK_DK)
    _copy_head_token(V_WIN, WIN_V, b, g, win_slot, win_extent, real, HKV, DV, BLOCK_DV)
    raw_slot = p % (raw_extent - 1)
    _copy_head_token(K_CMP, RAW_K, b, g, raw_slot, raw_extent, real, HKV, DK, BLOCK_DK)
    _copy_head_token(V_CMP, RAW_V, b, g, raw_slot, raw_extent, real, HKV, DV, BLOCK_DV)


def check_append_buffers(lengths: Tensor, n_new: Tensor, new: tuple[Tensor, ...], raw: tuple[Tensor, Tensor],
                         history: tuple[Tensor, Tensor], window: tuple[Tensor, Tensor]) -> None:
    """ValueError naming the rule unless the append's operands have the layouts append_head_token assumes:
    new = (k_cmp, v_cmp, k_slc, v_slc, k_win, v_win), each [B, 1, Hkv, D] contiguous; raw, history, window = (k, v)
    buffers [B, Hkv, slots + 1, D] (contiguous, the new tokens' dtype); lengths and n_new int64 [B]."""
    if len(new) != 6:
        raise ValueError(f"lean_decode_step: new must be (k_cmp, v_cmp, k_slc, v_slc, k_win, v_win), got {len(new)}")
    B, one, Hkv, dk = new[0].shape
    dv = new[1].shape[3]
    if one != 1 or any(t.shape != (B, 1, Hkv, dk if i % 2 == 0 else dv) for i, t in enumerate(new)):
        raise ValueError("lean_decode_step: new keys must be [B, 1, Hkv, dk] and values [B, 1, Hkv, dv], got "
                         f"{[tuple(t.shape) for t in new]}")
    for name, (k, v) in (("raw", raw), ("history", history), ("window", window)):
        if (k.shape[:2] != (B, Hkv) or k.shape[3] != dk or v.shape[:3] != k.shape[:3] or v.shape[3] != dv
                or not k.is_contiguous() or not v.is_contiguous()):
            raise ValueError(f"lean_decode_step: {name} must be contiguous k [B={B}, Hkv={Hkv}, slots + 1, {dk}] and "
                             f"v [B, Hkv, slots + 1, {dv}], got {tuple(k.shape)}, {tuple(v.shape)}")
        if k.dtype != new[0].dtype or v.dtype != new[0].dtype:
            raise ValueError(f"lean_decode_step: {name} buffers must have the new tokens' dtype {new[0].dtype}")
    for name, t in (("lengths", lengths), ("n_new", n_new)):
        if t.shape != (B,) or t.dtype != torch.int64 or not t.is_contiguous():
            raise ValueError(f"lean_decode_step: {name} must be contiguous int64 [B={B}], got {t.dtype} "
                             f"{tuple(t.shape)}")
