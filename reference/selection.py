"""Selection scoring (Eq. 8-10) and top-n block selection (Eq. 11), written as loops."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .compression import compressed_spans, visible_compressed_blocks
from .config import NSAConfig
from .documents import concat_documents, document_spans
from .primitives import softmax_row


def cmp_importance_row(q_vec: Tensor, k_cmp_rows: Tensor, cfg: NSAConfig) -> list[float]:
    """Eq. 8: p_cmp for one query head over its visible compressed keys: the compression branch's own
    softmax probabilities (scaled by 1/sqrt(d_k) as in Eq. 2), or the scaled logits ("logits" switch)."""
    if k_cmp_rows.shape[0] == 0:
        return []
    logits = (k_cmp_rows @ q_vec) / math.sqrt(q_vec.shape[-1])
    values = softmax_row(logits) if cfg.selection_score == "probs" else logits
    return [float(x) for x in values.detach().to(torch.float64)]


def pool_to_selection_blocks(p_cmp: list[float], n_sel_blocks: int, cfg: NSAConfig) -> list[float]:
    """Eq. 9, literally, with 0-based vector indices (docs/spec.md derives this form):

        p_slc[j] = sum_{m=0}^{l'/d-1} sum_{n=0}^{l/d-1} p_cmp[(l'/d)*j + m - n]

    where indices outside 0..len(p_cmp)-1 (blocks not visible yet, or before block 0) contribute 0.
    """
    per_sel = cfg.pieces_per_sel_block
    per_cmp = cfg.pieces_per_cmp_block
    p_slc = []
    for j in range(n_sel_blocks):
        total = 0.0
        for m in range(per_sel):
            for n in range(per_cmp):
                i = per_sel * j + m - n
                if 0 <= i < len(p_cmp):
                    total += p_cmp[i]
        p_slc.append(total)
    return p_slc


def group_scores(per_head: list[list[float]], cfg: NSAConfig) -> list[float]:
    """Eq. 10: p_slc' = sum (or mean, by switch) of p_slc over the query heads of one GQA group."""
    n_blocks = len(per_head[0])
    out = []
    for j in range(n_blocks):
        total = 0.0
        for row in per_head:
            total += row[j]
        out.append(total / len(per_head) if cfg.group_reduce == "mean" else total)
    return out


def selection_scores_rows(q: Tensor, k_cmp: Tensor, cfg: NSAConfig, positions: list[int],
                          n_sel_blocks: int) -> Tensor:
    """Eq. 8-10 for queries at absolute positions: [B, TQ, Hkv, n_sel_blocks] in float64.
    Blocks after the query's current block J = p // l' do not exist for it and score -inf."""
    B = q.shape[0]
    G = cfg.group_size
    n_blocks = k_cmp.shape[1]
    out = torch.full((B, len(positions), cfg.n_kv_heads, n_sel_blocks), -math.inf, dtype=torch.float64)
    for b in range(B):
        for iq, p in enumerate(positions):
            blocks = visible_compressed_blocks(p, n_blocks, cfg)
            J = p // cfg.sel_block
            for g in range(cfg.n_kv_heads):
                k_rows = k_cmp[b, blocks, g] if blocks else k_cmp.new_zeros((0, k_cmp.shape[-1]))
                per_head = []
                for h in range(g * G, (g + 1) * G):
                    p_cmp = cmp_importance_row(q[b, iq, h], k_rows, cfg)
                    per_head.append(pool_to_selection_blocks(p_cmp, J + 1, cfg))
                for j, s in enumerate(group_scores(per_head, cfg)):
                    out[b, iq, g, j] = s
    return out


def selection_block_count(n_tokens: int, cfg: NSAConfig) -> int:
    """ceil(n_tokens / l'): selection blocks of a sequence of n_tokens tokens (the last may be partial)."""
    return -(-n_tokens // cfg.sel_block)


def selection_scores(q: Tensor, k_cmp: Tensor, cfg: NSAConfig, *, cu_seqlens: Tensor | None = None) -> Tensor:
    """Eq. 8-10 for prefill queries 0..T-1: float64 [B, T, Hkv, ceil(T / l')], -inf for blocks after J.

    Packed (cu_seqlens, B = 1; k_cmp packed per document): each document scored alone, its column j being its
    own selection block j; padded with -inf to NB = max_i ceil(L_i / l') columns."""
    if cu_seqlens is not None:
        spans = document_spans(cu_seqlens, "q", q)
        n_columns = max(selection_block_count(e - s, cfg) for s, e in spans)
        pieces = []
        for (s, e), (cs, ce) in zip(spans, compressed_spans(spans, k_cmp, cfg)):
            if e > s:
                own = selection_scores(q[:, s:e], k_cmp[:, cs:ce], cfg)
                padding = torch.full((*own.shape[:3], n_columns - own.shape[3]), -math.inf, dtype=own.dtype)
                pieces.append(torch.cat([own, padding], dim=3))
        return concat_documents(pieces, torch.zeros((1, 0, cfg.n_kv_heads, n_columns), dtype=torch.float64))
    T = q.shape[1]
    return selection_scores_rows(q, k_cmp, cfg, list(range(T)), selection_block_count(T, cfg))


def forced_blocks(J: int, cfg: NSAConfig) -> list[int]:
    """Eq. 11's always-selected blocks for current block J: the n_init initial blocks and the n_local
    most recent blocks (J, J-1, ...), those that exist, without duplicates, ascending."""
    forced = []
    for j in range(J + 1):
        if j < cfg.n_init or j > J - cfg.n_local:
            forced.append(j)
    return forced


def select_row(scores: list[float], J: int, cfg: NSAConfig) -> list[int]:
    """Eq. 11 for one (query, group): n blocks among 0..J, ascending. Forced blocks first, then the
    highest scores one at a time; on equal scores the lower block index wins (strict '>' scanning up).
    If J+1 <= n every existing block is selected."""
    if J + 1 <= cfg.n_sel:
        return list(range(J + 1))
    chosen = forced_blocks(J, cfg)
    while len(chosen) < cfg.n_sel:
        best = None
        for j in range(J + 1):
            if j in chosen:
                continue
            if best is None or scores[j] > scores[best]:
                best = j
        chosen.append(best)
    return sorted(chosen)


def select_blocks_rows(scores: Tensor, cfg: NSAConfig, positions: list[int]) -> Tensor:
    """Eq. 11 for queries at absolute positions: int64 [B, TQ, Hkv, n], ascending, padded with -1."""
    B, TQ, H, _ = scores.shape
    out = torch.full((B, TQ, H, cfg.n_sel), -1, dtype=torch.int64)
    for b in range(B):
        for iq, p in enumerate(positions):
            J = p // cfg.sel_block
            for g in range(H):
                row = [float(x) for x in scores[b, iq, g, : J + 1]]
                for slot, j in enumerate(select_row(row, J, cfg)):
                    out[b, iq, g, slot] = j
    return out


def select_blocks(scores: Tensor, cfg: NSAConfig, *, cu_seqlens: Tensor | None = None) -> Tensor:
    """Eq. 11 for prefill queries 0..T-1: indices [B, T, Hkv, n] int64, ascending, padded with -1.

    Packed (cu_seqlens, B = 1; scores as the packed selection_scores gives them): each document selects alone
    from its own first ceil(L_i / l') columns; indices are document-relative block numbers (forced blocks
    0..n_init-1 and J-n_local+1..J with J = (p - start) // l')."""
    if cu_seqlens is not None:
        spans = document_spans(cu_seqlens, "scores", scores)
        n_columns = max(selection_block_count(e - s, cfg) for s, e in spans)
        if scores.ndim != 4 or scores.shape[3] < n_columns:
            raise ValueError(f"scores of a packed batch must be [1, T, Hkv, NB] with NB >= {n_columns} "
                             f"(max_i ceil(L_i / l') over cu_seqlens' documents), got {tuple(scores.shape)}")
        pieces = [select_blocks(scores[:, s:e, :, : selection_block_count(e - s, cfg)], cfg)
                  for s, e in spans if e > s]
        return concat_documents(pieces, torch.full((1, 0, scores.shape[2], cfg.n_sel), -1, dtype=torch.int64))
    return select_blocks_rows(scores, cfg, list(range(scores.shape[1])))
