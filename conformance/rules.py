"""The suite's own statement of NSA's index rules, written as closed forms (not the reference's loops).

Every property computes its expectations from these and from plain dense torch ops, never from the
implementation under test or from `reference/`, so a bug shared by both cannot hide. 0-based query
position p throughout (docs/spec.md).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from reference.config import NSAConfig


def complete_cmp_blocks(n_keys: int, cfg: NSAConfig) -> int:
    """Eq. 7: compressed blocks whose l keys all lie in 0..n_keys-1: floor((n_keys - l) / d) + 1, or 0."""
    return max(0, (n_keys - cfg.cmp_block) // cfg.cmp_stride + 1)


def visible_cmp_blocks(p: int, cfg: NSAConfig) -> int:
    """Eq. 7: how many compressed blocks query p reads (they are blocks 0..count-1).

    Block i ends at key i*d + l - 1: "inclusive" visibility needs that <= p, "strict" needs < p."""
    last_allowed = p if cfg.cmp_visibility == "inclusive" else p - 1
    return max(0, (last_allowed + 1 - cfg.cmp_block) // cfg.cmp_stride + 1)


def current_sel_block(p: int, cfg: NSAConfig) -> int:
    """J = p // l': the selection block holding p (Eq. 12); blocks 0..J exist for p."""
    return p // cfg.sel_block


def sel_block_keys(j: int, p: int, cfg: NSAConfig) -> range:
    """Eq. 12: keys of selection block j that query p may read (clipped to <= p)."""
    return range(j * cfg.sel_block, min((j + 1) * cfg.sel_block, p + 1))


def window_keys(p: int, cfg: NSAConfig) -> range:
    """Sliding window: [p-w+1, p] ("w") or [p-w, p] ("w+1"), clipped at 0."""
    return range(max(0, p + 1 - cfg.window_size), p + 1)


def forced_sel_blocks(J: int, cfg: NSAConfig) -> set[int]:
    """Eq. 11's always-selected blocks: 0..n_init-1 and J-n_local+1..J (those in 0..J)."""
    return {j for j in range(J + 1) if j < cfg.n_init or j > J - cfg.n_local}


def expected_selection(scores: list[float], J: int, cfg: NSAConfig) -> list[int]:
    """Eq. 11 by sorting: forced blocks, then the free blocks by (descending score, ascending index),
    the first n in total; every block when J + 1 <= n. Ascending."""
    if J + 1 <= cfg.n_sel:
        return list(range(J + 1))
    forced = forced_sel_blocks(J, cfg)
    free = sorted((j for j in range(J + 1) if j not in forced), key=lambda j: (-scores[j], j))
    return sorted(forced | set(free[: cfg.n_sel - len(forced)]))


def selection_is_valid_top_n(chosen: list[int], scores: list[float], J: int, cfg: NSAConfig,
                             tol: float) -> str | None:
    """Tie-aware Eq. 11 check: None if `chosen` is a top-n selection up to score differences <= tol,
    else a message saying why not."""
    if J + 1 <= cfg.n_sel:
        return None if sorted(chosen) == list(range(J + 1)) else f"expected all blocks 0..{J}, got {chosen}"
    if len(set(chosen)) != cfg.n_sel or any(not 0 <= j <= J for j in chosen):
        return f"expected {cfg.n_sel} distinct blocks in 0..{J}, got {chosen}"
    forced = forced_sel_blocks(J, cfg)
    if not forced <= set(chosen):
        return f"forced blocks {sorted(forced)} missing from {chosen}"
    picked = [j for j in chosen if j not in forced]
    left = [j for j in range(J + 1) if j not in chosen]
    if picked and left:
        worst_picked = min(scores[j] for j in picked)
        best_left = max(scores[j] for j in left)
        if best_left > worst_picked + tol:
            return (f"block {max(left, key=lambda j: scores[j])} (score {best_left!r}) outranks selected "
                    f"block {min(picked, key=lambda j: scores[j])} (score {worst_picked!r})")
    return None


def selected_keys(p: int, blocks: list[int], cfg: NSAConfig) -> list[int]:
    """Union of the keys of the selected blocks (padding < 0 skipped), clipped to <= p."""
    return [t for j in sorted(set(b for b in blocks if b >= 0)) for t in sel_block_keys(j, p, cfg)]


def attend_keys(q: Tensor, k: Tensor, v: Tensor, keys: list[int]) -> Tensor:
    """Softmax attention of the query heads q [H, dk] of one group over rows `keys` of k [T, dk], v [T, dv]
    (Eq. 2); an empty key set gives 0."""
    if not keys:
        return v.new_zeros(q.shape[0], v.shape[-1])
    idx = torch.tensor(keys, device=k.device)
    logits = q @ k[idx].T / math.sqrt(q.shape[-1])
    return torch.softmax(logits, dim=-1) @ v[idx]


def token_overlap(i: int, j: int, cfg: NSAConfig) -> int:
    """Tokens shared by compressed block i [i*d, i*d+l) and selection block j [j*l', (j+1)*l')."""
    lo = max(i * cfg.cmp_stride, j * cfg.sel_block)
    hi = min(i * cfg.cmp_stride + cfg.cmp_block, (j + 1) * cfg.sel_block)
    return max(0, hi - lo)


def dense_attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor) -> Tensor:
    """Plain GQA attention with an explicit boolean mask allowed [TQ, TK] (True = key readable): a masked
    score matrix and a softmax, computed in q's dtype; a query with no allowed key gets 0 (Eq. 2)."""
    B, TQ, Hq, dk = q.shape
    G = Hq // k.shape[2]
    kk, vv = k.repeat_interleave(G, dim=2), v.repeat_interleave(G, dim=2)
    scores = torch.einsum("bphd,bshd->bhps", q, kk) / math.sqrt(dk)
    mask = allowed.to(scores.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no allowed key: 0
    return torch.einsum("bhps,bshd->bphd", probs, vv)


def causal_mask(T: int, *, window: int | None = None, strict: bool = False) -> Tensor:
    """allowed[p, s]: s <= p (s < p if strict), and s > p - window if a window size is given."""
    p, s = torch.arange(T)[:, None], torch.arange(T)[None, :]
    allowed = s < p if strict else s <= p
    if window is not None:
        allowed &= s > p - window
    return allowed
