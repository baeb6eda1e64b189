"""Selected-token attention (Eq. 12) and sliding-window attention (Section 3.3.3), as loops."""

from __future__ import annotations

import torch
from torch import Tensor

from .config import NSAConfig
from .documents import concat_documents, document_spans
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


def selected_attention(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, cfg: NSAConfig, *,
                       cu_seqlens: Tensor | None = None) -> Tensor:
    """Eq. 12 branch for prefill queries 0..T-1: o_slc [B, T, Hq, d_v].

    Packed (cu_seqlens, B = 1): each document alone; index j of a query in document [s, e) means its tokens
    s + j*l' .. s + (j+1)*l' - 1, clipped to <= the query's position."""
    if cu_seqlens is not None:
        spans = document_spans(cu_seqlens, "q", q, k=k, v=v, indices=indices)
        pieces = [selected_attention(q[:, s:e], k[:, s:e], v[:, s:e], indices[:, s:e], cfg)
                  for s, e in spans if e > s]
        return concat_documents(pieces, q.new_zeros((1, 0, q.shape[2], v.shape[-1])))
    return selected_attention_rows(q, k, v, indices, cfg, list(range(q.shape[1])))[0]


def window_attention(q: Tensor, k: Tensor, v: Tensor, cfg: NSAConfig, *, cu_seqlens: Tensor | None = None) -> Tensor:
    """Sliding-window branch for prefill queries 0..T-1: o_win [B, T, Hq, d_v].

    Packed (cu_seqlens, B = 1): each document alone, so a query at p in document [s, e) reads keys
    max(s, p - w + 1) .. p (p - w with window_keys="w+1")."""
    if cu_seqlens is not None:
        spans = document_spans(cu_seqlens, "q", q, k=k, v=v)
        pieces = [window_attention(q[:, s:e], k[:, s:e], v[:, s:e], cfg) for s, e in spans if e > s]
        return concat_documents(pieces, q.new_zeros((1, 0, q.shape[2], v.shape[-1])))
    return window_attention_rows(q, k, v, cfg, list(range(q.shape[1])))[0]
