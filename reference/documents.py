"""Packed batches (cu_seqlens) in the reference, the obvious way: split the packed tokens into their documents
(reference.packing.check_cu_seqlens), run each document alone through the literal loops, concatenate the
results along the token dimension in document order. No NSA arithmetic lives here."""

from __future__ import annotations

import torch
from torch import Tensor

from .packing import check_cu_seqlens


def document_spans(cu_seqlens: Tensor, x_name: str, x: Tensor, **same_tokens: Tensor) -> list[tuple[int, int]]:
    """The documents [(start, end), ...] of the packed tensor x [1, T, ...] (cu_seqlens validated against x's
    batch and T); every tensor in same_tokens must hold the same [1, T] (ValueError naming it otherwise)."""
    spans = check_cu_seqlens(cu_seqlens, x.shape[1], x.shape[0])
    for name, t in same_tokens.items():
        if tuple(t.shape[:2]) != tuple(x.shape[:2]):
            raise ValueError(f"{name} must hold the same [B, T] = {tuple(x.shape[:2])} as {x_name} in a packed batch, "
                             f"got {tuple(t.shape[:2])}")
    return spans


def concat_documents(pieces: list[Tensor], empty: Tensor) -> Tensor:
    """Per-document results (each [1, L_i, ...], documents in order) as one packed tensor; `empty` ([1, 0, ...])
    when no document holds a token (T = 0)."""
    return torch.cat(pieces, dim=1) if pieces else empty
