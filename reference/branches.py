"""Selected-token attention (Eq. 12) and sliding-window attention (Section 3.3.3), as loops."""

from __future__ import annotations

import torch
from torch import Tensor

from .config import NSAConfig
from .primitives import attend, gather_rows


def selected_tokens(p: int, blocks: list[int], cfg: NSAConfig) -> list[int]:
    """Eq. 12: the tokens of the selected blocks in ascending order, clipped to <= p (block J is partial).
    Padding entries (-1) are skipped."""
    tokens = []
    for j in sorted(blocks):
        if j < 0:
            continue
        for t in range(j * cfg.sel_block, (j + 1) * cfg.sel_block):
            if t <= p:
                tokens.append(t)
    return tokens


def window_tokens(p: int, cfg: NSAConfig) -> list[int]:
    """Sliding window: keys [p-w+1, p] (w keys) or [p-w, p] with window_keys="w+1", clipped at 0."""
    tokens = []
    for t in range(p - cfg.window_size + 1, p + 1):
        if t >= 0:
            tokens.append(t)
    return tokens


def _branch_rows(q: Tensor, k: Tensor, v: Tensor, cfg: NSAConfig, positions: list[int],
                 tokens_for) -> tuple[Tensor, Tensor]:
    B = q.shape[0]
    G = cfg.group_size
    outs, reads = [], []
    for b in range(B):
        out_b, reads_b = [], []
        for iq, p in enumerate(positions):
            out_h, reads_g = [], []
            for g in range(cfg.n_kv_heads):
                tokens = tokens_for(b, iq, p, g)
                keys = gather_rows(k, b, tokens, g)
                values = gather_rows(v, b, tokens, g)
                reads_g.append(len(tokens))
                for h in range(g * G, (g + 1) * G):
                    out_h.append(attend(q[b, iq, h], keys, values))
            out_b.append(torch.stack(out_h))
            reads_b.append(reads_g)
        outs.append(torch.stack(out_b))
        reads.append(reads_b)
    return torch.stack(outs), torch.tensor(reads, dtype=torch.int64)


def selected_attention_rows(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, cfg: NSAConfig,
                            positions: list[int]) -> tuple[Tensor, Tensor]:
    """Selected branch for queries at absolute positions; returns (o_slc, reads [B, TQ, Hkv])."""

    def tokens_for(b: int, iq: int, p: int, g: int) -> list[int]:
        return selected_tokens(p, [int(j) for j in indices[b, iq, g]], cfg)

    return _branch_rows(q, k, v, cfg, positions, tokens_for)


def window_attention_rows(q: Tensor, k: Tensor, v: Tensor, cfg: NSAConfig,
                          positions: list[int]) -> tuple[Tensor, Tensor]:
    """Window branch for queries at absolute positions; returns (o_win, reads [B, TQ, Hkv])."""
    return _branch_rows(q, k, v, cfg, positions, lambda b, iq, p, g: window_tokens(p, cfg))


def selected_attention(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, cfg: NSAConfig) -> Tensor:
    """Eq. 12 branch for prefill queries 0..T-1: o_slc [B, T, Hq, d_v]."""
    return selected_attention_rows(q, k, v, indices, cfg, list(range(q.shape[1])))[0]


def window_attention(q: Tensor, k: Tensor, v: Tensor, cfg: NSAConfig) -> Tensor:
    """Sliding-window branch for prefill queries 0..T-1: o_win [B, T, Hq, d_v]."""
    return window_attention_rows(q, k, v, cfg, list(range(q.shape[1])))[0]
