"""Packed variable-length batches (`cu_seqlens`), the contract's data rules; no NSA arithmetic lives here.

A packed batch has batch size 1 and holds N independent sequences (documents) back to back:
cu_seqlens = [0, L_0, L_0 + L_1, ..., T] (int32 or int64, 1-D, N + 1 entries, non-decreasing; an empty
document repeats a value). Document i owns tokens cu_seqlens[i] .. cu_seqlens[i+1] - 1. Everything NSA
counts restarts at each document start: positions, compressed blocks (Eq. 7 blocks never straddle a boundary),
selection blocks and their indices (Eq. 11 block j of a document covers its own tokens j*l' .. (j+1)*l' - 1,
forced blocks included), and the sliding window. So a packed batch computes exactly what running each document
alone would.

Compressed tokens of a packed batch are packed the same way: document i's compressed tokens follow those of
documents 0..i-1, cmp_cu_seqlens (compressed_cu_seqlens) says where each document's start.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .config import NSAConfig


def cu_seqlens_of(lengths: list[int], device: torch.device | str | None = None) -> Tensor:
    """cu_seqlens of documents of the given lengths: [0, L_0, L_0 + L_1, ..., T] as int32 (the flash-attn
    convention), on `device` (default CPU)."""
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + int(length))
    return torch.tensor(bounds, dtype=torch.int32, device=device)


def check_cu_seqlens(cu_seqlens: Tensor, n_tokens: int, batch: int, where: str = "cu_seqlens") -> list[tuple[int, int]]:
    """Validate cu_seqlens for a packed batch of `n_tokens` tokens and batch size `batch`; returns the document
    spans [(start, end), ...] (end exclusive). A ValueError names the rule broken."""
    if not isinstance(cu_seqlens, Tensor):
        raise ValueError(f"{where} must be a tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{where} must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{where} must be 1-D with N + 1 >= 2 entries [0, ..., T], "
                         f"got shape {tuple(cu_seqlens.shape)}")
    if batch != 1:
        raise ValueError(f"{where} needs batch size 1 (documents are packed along T), got batch {batch}")
    bounds = [int(x) for x in cu_seqlens.tolist()]
    if bounds[0] != 0:
        raise ValueError(f"{where}[0] must be 0, got {bounds[0]}")
    if bounds[-1] != n_tokens:
        raise ValueError(f"{where}[-1] must equal the number of tokens T = {n_tokens}, got {bounds[-1]}")
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if b < a:
            raise ValueError(f"{where} must be non-decreasing, got {where}[{i}] = {a} > {where}[{i + 1}] = {b}")
    return list(zip(bounds, bounds[1:]))


def n_compressed_tokens(length: int, cfg: NSAConfig) -> int:
    """Compressed tokens (Eq. 7) of a document of `length` tokens: complete blocks of l tokens with stride d."""
    return 0 if length < cfg.cmp_block else (length - cfg.cmp_block) // cfg.cmp_stride + 1


def compressed_cu_seqlens(cu_seqlens: Tensor, cfg: NSAConfig) -> Tensor:
    """cu_seqlens of the packed compressed tokens: document i's compressed tokens start at entry i."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    counts = torch.where(lengths >= cfg.cmp_block, (lengths - cfg.cmp_block) // cfg.cmp_stride + 1,
                         torch.zeros_like(lengths))
    return torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)]).to(cu_seqlens.dtype)
