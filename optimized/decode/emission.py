"""The compressed tokens a decode call emits (Eq. 7, incrementally): compressed block i covers keys
[i*d, i*d + l) and is built once, when the call that appends key i*d + l - 1 runs, i.e. every d tokens after the
first l. Nothing already compressed is recompressed.

The raw keys a new block needs come from the compression branch's raw ring (the last R >= l - 1 keys before the
call) and from the call's new keys.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from reference.config import NSAConfig
from reference.contract import KV, PhiWeights

from .. import compression


def complete_blocks(n_keys: Tensor, cfg: NSAConfig) -> Tensor:
    """Eq. 7 per row: compressed blocks whose l keys all lie in 0..n_keys-1, floor((n - l)/d) + 1 or 0 (the tensor
    form of masks.compressed_block_count, on the device so a CUDA graph can replay it)."""
    after_first = torch.div(n_keys - cfg.cmp_block, cfg.cmp_stride, rounding_mode="floor") + 1
    return after_first.clamp(min=0)


def max_new_blocks(n_queries: int, cfg: NSAConfig) -> int:
    """At most ceil(TQ / d) blocks end among TQ consecutive positions (block ends are d apart)."""
    return -(-n_queries // cfg.cmp_stride)


class NewBlocks(NamedTuple):
    """Compressed tokens k [B, M, Hkv, dk], v [B, M, Hkv, dv] (sequence-first) and their store slots [B, M]
    (the trash slot for the M candidates a row does not complete)."""

    k: Tensor
    v: Tensor
    slots: Tensor


def new_compressed_blocks(raw_ring: KV, lengths: Tensor, n_new: Tensor, k_new: Tensor, v_new: Tensor,
                          cfg: NSAConfig, phi: PhiWeights | None, trash: int) -> NewBlocks:
    """Compress the blocks completed by the n_new[b] new raw keys k_new/v_new [B, TQ, Hkv, D] of each row (row b
    held lengths[b] keys before). raw_ring: the compression branch's ring before the call, k [B, Hkv, R, dk]
    (slot t mod R, R >= l - 1), v likewise; block i goes to store slot i."""
    B, TQ = k_new.shape[:2]
    l, d = cfg.cmp_block, cfg.cmp_stride
    M = max_new_blocks(TQ, cfg)
    R = raw_ring.k.shape[2]
    device = lengths.device
    first = complete_blocks(lengths, cfg)
    last = complete_blocks(lengths + n_new, cfg)
    blocks = first[:, None] + torch.arange(M, device=device)  # [B, M]
    emitted = blocks < last[:, None]
    tokens = blocks[..., None] * d + torch.arange(l, device=device)  # [B, M, l], Eq. 7 block rows
    start = lengths[:, None, None]
    # A new block's keys are >= lengths - l + 1: the old ones are still in the ring (R >= l - 1).
    source = torch.where(tokens >= start, R + tokens - start, torch.remainder(tokens, R))
    source = source.clamp(0, R + TQ - 1).reshape(B, 1, M * l, 1)  # blocks not emitted read anything
    rows = []
    for ring, new in ((raw_ring.k, k_new), (raw_ring.v, v_new)):
        H, D = ring.shape[1], ring.shape[3]
        combined = torch.cat([ring, new.transpose(1, 2).to(ring.dtype)], dim=2)  # [B, H, R + TQ, D]
        rows.append(combined.gather(2, source.expand(B, H, M * l, D)).view(B, H, M, l, D))
    if cfg.phi == "avg":
        k_cmp, v_cmp = compression.phi_avg(rows[0]), compression.phi_avg(rows[1])
    else:
        k_cmp, v_cmp = compression.phi_mlp(rows[0], phi.k), compression.phi_mlp(rows[1], phi.v)
    slots = torch.where(emitted, blocks, torch.full_like(blocks, trash))
    return NewBlocks(k_cmp.transpose(1, 2), v_cmp.transpose(1, 2), slots)
