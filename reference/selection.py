"""Selection scoring (Eq. 8-10) and top-n block selection (Eq. 11), written as loops."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .compression import visible_compressed_blocks
from .config import NSAConfig
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


def selection_scores(q: Tensor, k_cmp: Tensor, cfg: NSAConfig) -> Tensor:
    """Eq. 8-10 for prefill queries 0..T-1: float64 [B, T, Hkv, ceil(T / l')], -inf for blocks after J."""
    T = q.shape[1]
    n_sel_blocks = -(-T // cfg.sel_block)
    return selection_scores_rows(q, k_cmp, cfg, list(range(T)), n_sel_blocks)


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


def select_blocks(scores: Tensor, cfg: NSAConfig) -> Tensor:
    """Eq. 11 for prefill queries 0..T-1: indices [B, T, Hkv, n] int64, ascending, padded with -1."""
    return select_blocks_rows(scores, cfg, list(range(scores.shape[1])))
