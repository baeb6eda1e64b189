"""What one decode call does before any attention, as a pure function of the cache's state (no writes, no host
synchronisation): query positions, the slots the new tokens go to, the compressed tokens they complete (Eq. 7),
and the window's keys with the window seam's mask. NSADecodeCache.advance applies the writes, runs the branches,
and may compile this function (torch.compile), which is why it only reads.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from reference.config import NSAConfig
from reference.contract import KV, BranchKV, PhiWeights

from .. import masks
from .buffers import history_write_slots, ring_slot_positions, ring_write_slots
from .emission import NewBlocks, complete_blocks, new_compressed_blocks


class CallPlan(NamedTuple):
    positions: Tensor  # [B, TQ] absolute query positions, -1 for padding queries
    real: Tensor  # [B, TQ] bool, False for padding
    emitted: Tensor  # [B] compressed blocks complete after the call
    raw_slots: Tensor  # [B, TQ] slots of the new raw compression keys in their ring (trash for padding)
    history_slots: Tensor  # [B, TQ] slots of the new selection keys in the history
    window_slots: Tensor  # [B, TQ] slots of the new window keys in the window ring
    new_blocks: NewBlocks | None  # compressed tokens the call completes (None when it completes none)
    window_chunk: KV | None  # TQ > 1: the window ring before the call followed by the chunk's keys (a copy)
    window_admitted: Tensor  # [B, TQ, K] the window keys each query attends to (window seam)


def query_positions(lengths: Tensor, n_new: Tensor, n_queries: int) -> tuple[Tensor, Tensor]:
    """(positions [B, TQ], real [B, TQ]): query i of row b sits at lengths[b] + i if i < n_new[b]; padding
    queries get position -1 (they see no key)."""
    offsets = torch.arange(n_queries, device=lengths.device)[None, :]
    real = offsets < n_new[:, None]
    positions = torch.where(real, lengths[:, None] + offsets, torch.full_like(offsets, -1))
    return positions, real


def plan_call(lengths: Tensor, n_new: Tensor, new: BranchKV, raw_ring: KV, window_ring: KV, cfg: NSAConfig,
              phi: PhiWeights | None, *, emit: bool, history_trash: int, compressed_trash: int) -> CallPlan:
    """The plan of appending n_new[b] tokens (new: each branch's keys/values [B, TQ, Hkv, D]) to rows holding
    lengths[b] tokens. raw_ring / window_ring: the rings' usable slots [B, Hkv, R, D] before the call (each ring's
    trash slot is index R); history_trash / compressed_trash: the trash slots of the history and of the compressed
    store. emit=False: the caller knows no row completes a compressed block."""
    TQ = new.win.k.shape[1]
    R_raw, R_win = raw_ring.k.shape[2], window_ring.k.shape[2]
    positions, real = query_positions(lengths, n_new, TQ)
    after = lengths + n_new
    new_blocks = None
    if emit:  # Eq. 7: built from the raw ring before the call's keys replace anything in it
        new_blocks = new_compressed_blocks(raw_ring, lengths, n_new, new.cmp.k, new.cmp.v, cfg, phi,
                                           trash=compressed_trash)
    window_chunk = None
    if TQ == 1:  # the new key replaces the one leaving the window: attend over the ring after the write
        key_positions = ring_slot_positions(after, R_win)
    else:  # the chunk's first queries still need the keys its last tokens replace
        window_chunk = KV(torch.cat([window_ring.k, new.win.k.transpose(1, 2)], dim=2),
                          torch.cat([window_ring.v, new.win.v.transpose(1, 2)], dim=2))
        key_positions = torch.cat([ring_slot_positions(lengths, R_win), positions], dim=1)
    admitted = masks.window_key_visible(key_positions[:, None, :], positions[:, :, None], cfg)
    admitted = admitted & (key_positions >= 0)[:, None, :]
    return CallPlan(positions=positions, real=real, emitted=complete_blocks(after, cfg),
                    raw_slots=ring_write_slots(positions, real, R_raw, R_raw),
                    history_slots=history_write_slots(positions, real, history_trash),
                    window_slots=ring_write_slots(positions, real, R_win, R_win),
                    new_blocks=new_blocks, window_chunk=window_chunk, window_admitted=admitted)
