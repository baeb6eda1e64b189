"""Sliding-window attention (Section 3.3.3), banded: a chunk of C queries reads the C + w - 1 keys its windows span,
so memory is O(C * (C + w)) per head, never T x T."""

from __future__ import annotations

import torch
from torch import Tensor

from reference.config import NSAConfig

from . import masks
from .checks import check_branch_inputs
from .masked_attention import SharedKeys, auto_chunk_size, masked_attention, query_chunks


class WindowKeyPlan:
    """Query chunks; each reads the key range covering its queries' windows, masked per query by
    masks.window_key_visible."""

    def __init__(self, positions: Tensor, n_keys: int, cfg: NSAConfig, chunk_size: int):
        self.positions = positions
        self.n_keys = n_keys
        self.cfg = cfg
        self.chunk_size = chunk_size

    def chunks(self) -> list[tuple[int, int]]:
        return query_chunks(self.positions.shape[0], self.chunk_size)

    def keys(self, q0: int, q1: int) -> SharedKeys:
        pos = self.positions[q0:q1]
        start = max(0, int(masks.window_start(pos, self.cfg).min()))
        stop = min(self.n_keys, int(pos.max()) + 1)
        keys = torch.arange(start, max(start, stop), device=pos.device)
        return SharedKeys(start, max(start, stop), masks.window_key_visible(keys[None, :], pos[:, None], self.cfg))


def window_attention_rows(q: Tensor, k: Tensor, v: Tensor, cfg: NSAConfig, positions: Tensor, *,
                          chunk_size: int | None = None, compute: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """Window branch for queries q [B, TQ, Hq, dk] at absolute positions [TQ] over keys k [B, TK, Hkv, dk]:
    (o_win [B, TQ, Hq, dv] in the compute dtype, reads [B, TQ, Hkv] = window keys counted from the mask applied).
    compute: see masked_attention."""
    B, TQ, Hq, _ = q.shape
    if chunk_size is None:
        chunk_size = auto_chunk_size(TQ, B * Hq * 2 * cfg.window_size)
        chunk_size = min(chunk_size, max(cfg.window_size, 128))  # keys per chunk stay O(C + w)
    return masked_attention(WindowKeyPlan(positions, k.shape[1], cfg, chunk_size), q, k, v, compute=compute)


def window_attention(q: Tensor, k: Tensor, v: Tensor, cfg: NSAConfig, *, chunk_size: int | None = None) -> Tensor:
    """Sliding-window branch for prefill queries 0..T-1: o_win [B, T, Hq, d_v]."""
    check_branch_inputs("window_attention", q, k, v, cfg)
    positions = torch.arange(q.shape[1], device=q.device)
    return window_attention_rows(q, k, v, cfg, positions, chunk_size=chunk_size)[0].to(q.dtype)
