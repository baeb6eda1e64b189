"""The torch path of the sliding-window branch (Section 3.3.3), banded: a chunk of C queries reads the C + w - 1
keys its windows span, so memory is O(C * (C + w)) per head, never T x T. The kernel path of this branch is
kernels/range_attention.window_branch."""

from __future__ import annotations

import torch
from torch import Tensor

from reference.config import NSAConfig

from . import masks
from .documents import Documents
from .masked_attention import KeyPlan, SharedKeys, masked_attention
from .numerics import auto_chunk_size


def window_keys(positions: Tensor, n_keys: int, cfg: NSAConfig):
    """keys(q0, q1) of queries at positions [TQ] over n_keys keys: the key range covering the chunk's windows,
    masked per query by masks.window_key_visible."""

    def keys(q0: int, q1: int) -> SharedKeys:
        pos = positions[q0:q1]
        start = max(0, int(masks.window_start(pos, cfg).min()))
        stop = min(n_keys, int(pos.max()) + 1)
        tokens = torch.arange(start, max(start, stop), device=pos.device)
        return SharedKeys(start, max(start, stop), masks.window_key_visible(tokens[None, :], pos[:, None], cfg))

    return keys


def packed_window_keys(positions: Tensor, docs: Documents, cfg: NSAConfig):
    """keys(q0, q1) of a packed batch: the key range covering the chunk's windows, masked per query by
    masks.window_key_visible at document-relative positions (the window restarts at the document start)."""

    def keys(q0: int, q1: int) -> SharedKeys:
        pos = positions[q0:q1]
        doc_start = docs.token_start[pos]
        rel = pos - doc_start
        start = int(torch.maximum(doc_start + masks.window_start(rel, cfg), doc_start).min())
        stop = int(pos.max()) + 1
        key_rel = torch.arange(start, stop, device=pos.device)[None, :] - doc_start[:, None]
        valid = (key_rel >= 0) & masks.window_key_visible(key_rel, rel[:, None], cfg)
        return SharedKeys(start, stop, valid)

    return keys


def window_attention_rows(q: Tensor, k: Tensor, v: Tensor, cfg: NSAConfig, positions: Tensor, *,
                          chunk_size: int | None = None, compute: torch.dtype | None = None,
                          docs: Documents | None = None) -> tuple[Tensor, Tensor]:
    """Window branch for queries q [B, TQ, Hq, dk] at absolute positions [TQ] over keys k [B, TK, Hkv, dk]:
    (o_win [B, TQ, Hq, dv] in the compute dtype, reads [B, TQ, Hkv] = window keys counted from the mask applied).
    compute: see masked_attention. docs: the layout of a packed batch, None for independent rows."""
    B, TQ, Hq, _ = q.shape
    if chunk_size is None:
        chunk_size = auto_chunk_size(TQ, B * Hq * 2 * cfg.window_size)
        chunk_size = min(chunk_size, max(cfg.window_size, 128))  # keys per chunk stay O(C + w)
    keys = window_keys(positions, k.shape[1], cfg) if docs is None else packed_window_keys(positions, docs, cfg)
    return masked_attention(KeyPlan(TQ, chunk_size, keys), q, k, v, compute=compute)
