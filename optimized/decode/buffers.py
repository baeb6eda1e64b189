"""Token buffers of the decode cache: head-major key/value tensors [B, Hkv, slots + 1, D] whose last slot is a
trash slot (writes of padding tokens go there, so every write is a fixed-shape scatter with no host sync).

Two kinds of buffer use the same storage:
- history: slot t holds token t (the selection branch keeps the whole history, Eq. 12 may select any block);
- ring: slot t mod R holds token t (the window branch keeps the last R tokens, the compression branch the raw
  keys a block still being filled needs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from reference.contract import KV


@dataclass
class TokenBuffer:
    """Keys k [B, Hkv, slots + 1, dk] and values v [B, Hkv, slots + 1, dv]; slot `slots` is the trash slot."""

    k: Tensor
    v: Tensor

    @classmethod
    def empty(cls, batch: int, heads: int, slots: int, dk: int, dv: int, *, dtype: torch.dtype,
              device: torch.device) -> "TokenBuffer":
        return cls(torch.zeros((batch, heads, slots + 1, dk), dtype=dtype, device=device),
                   torch.zeros((batch, heads, slots + 1, dv), dtype=dtype, device=device))

    @property
    def slots(self) -> int:
        """Usable slots (the trash slot excluded)."""
        return self.k.shape[2] - 1

    @property
    def trash(self) -> int:
        return self.k.shape[2] - 1

    def write(self, slots: Tensor, k_new: Tensor, v_new: Tensor) -> None:
        """buffer[b, :, slots[b, i]] = new[b, i] for new tokens k_new [B, TQ, Hkv, dk] (sequence-first, as the
        contract gives them); slots [B, TQ] int64, padding tokens pointing at the trash slot."""
        _scatter(self.k, slots, k_new)
        _scatter(self.v, slots, v_new)

    def usable(self, count: int | None = None) -> KV:
        """Views k [B, Hkv, count, dk], v [B, Hkv, count, dv] of the first `count` slots (default: every usable
        slot), without the trash slot."""
        count = self.slots if count is None else count
        return KV(self.k[:, :, :count], self.v[:, :, :count])

    def fill_from(self, positions: Tensor, k: Tensor, v: Tensor) -> None:
        """Slot s <- token positions[b, s] of the sequence-first k [B, T, Hkv, dk], v [B, T, Hkv, dv] for every
        usable slot (positions [B, slots]; positions outside 0..T-1 leave garbage that masks never admit)."""
        T = k.shape[1]
        index = positions.clamp(0, max(T - 1, 0))
        for buf, src in ((self.k, k), (self.v, v)):
            if T == 0:
                continue
            gathered = src.gather(1, index[:, :, None, None].expand(-1, -1, src.shape[2], src.shape[3]))
            buf[:, :, : positions.shape[1]] = gathered.transpose(1, 2)


def _scatter(buf: Tensor, slots: Tensor, new: Tensor) -> None:
    B, TQ, H, D = new.shape
    index = slots[:, None, :, None].expand(B, H, TQ, D)
    buf.scatter_(2, index, new.transpose(1, 2).to(buf.dtype))


def ring_slot_positions(lengths: Tensor, ring_size: int) -> Tensor:
    """Token position held by each slot of a ring buffer (slot = t mod R) after lengths[b] tokens were written:
    the largest t < lengths[b] with t = s (mod R). Negative where the slot was never written. [B, R] int64."""
    last = lengths[:, None] - 1
    slots = torch.arange(ring_size, device=lengths.device)
    return last - torch.remainder(last - slots, ring_size)


def ring_write_slots(positions: Tensor, valid: Tensor, ring_size: int, trash: int) -> Tensor:
    """Slots for writing tokens at positions [B, TQ] (valid [B, TQ]) into a ring of ring_size slots: t mod R for
    the last R valid tokens of each row, the trash slot for the others (an earlier token of the same chunk that
    a later one overwrites would make the scatter's result depend on write order)."""
    n_valid = valid.sum(dim=1, keepdim=True)
    rank = torch.arange(positions.shape[1], device=positions.device)[None, :]
    kept = valid & (rank >= n_valid - ring_size)
    return torch.where(kept, torch.remainder(positions, ring_size), torch.full_like(positions, trash))


def history_write_slots(positions: Tensor, valid: Tensor, trash: int) -> Tensor:
    """Slots for writing tokens into a history buffer: the position itself, the trash slot for padding."""
    return torch.where(valid, positions, torch.full_like(positions, trash))
