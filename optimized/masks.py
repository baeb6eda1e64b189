"""The convention seams of the optimized path: every NSA convention is decided by one small named function here.

Every other optimized module calls these through the module object (`masks.compressed_block_visible(...)`,
never a name imported from it), so replacing one attribute of this module (what the conformance self-test
does to plant a known bug) changes the behaviour everywhere in `optimized`, decode included.

All functions work elementwise on integer tensors (positions, block indices), so one rule serves every shape.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import Tensor

from reference.config import NSAConfig


# Eq. 7: compressed blocks ------------------------------------------------------------------------------------
def compressed_block_count(n_keys: int, cfg: NSAConfig) -> int:
    """Eq. 7: compressed blocks whose l keys [i*d, i*d + l - 1] all lie in 0..n_keys-1."""
    if n_keys < cfg.cmp_block:
        return 0
    return (n_keys - cfg.cmp_block) // cfg.cmp_stride + 1


def compressed_block_visible(block_idx: Tensor, pos: Tensor, cfg: NSAConfig) -> Tensor:
    """Eq. 7: query p reads compressed block i iff its last key i*d + l - 1 is <= p ("inclusive") or < p
    ("strict" switch). Broadcasts block_idx against pos."""
    last_key = block_idx * cfg.cmp_stride + (cfg.cmp_block - 1)
    if cfg.cmp_visibility == "inclusive":
        return last_key <= pos
    return last_key < pos


# Section 3.3.3: sliding window -------------------------------------------------------------------------------
def window_start(pos: Tensor, cfg: NSAConfig) -> Tensor:
    """First key of query p's window: p - w + 1 (w keys) or p - w (window_keys="w+1"); may be negative
    (keys before 0 do not exist)."""
    return pos - (cfg.window_size - 1)


def window_key_visible(key: Tensor, pos: Tensor, cfg: NSAConfig) -> Tensor:
    """Key t is in query p's window iff window_start(p) <= t <= p. Broadcasts key against pos."""
    return (key >= window_start(pos, cfg)) & (key <= pos)


# Eq. 12: selection blocks ------------------------------------------------------------------------------------
def sel_block_count(n_keys: int, cfg: NSAConfig) -> int:
    """Selection blocks that hold at least one of keys 0..n_keys-1: ceil(n_keys / l') (block j holds keys
    j*l' .. (j+1)*l' - 1)."""
    return -(-n_keys // cfg.sel_block)


def current_sel_block(pos: Tensor, cfg: NSAConfig) -> Tensor:
    """J = p // l': the selection block holding query p (blocks 0..J exist for p; block J is partial)."""
    return torch.div(pos, cfg.sel_block, rounding_mode="floor")


def selected_token_visible(token: Tensor, pos: Tensor, cfg: NSAConfig) -> Tensor:
    """Eq. 12 with causality: a token of a selected block is read iff it is at or before the query (block J
    is partial)."""
    return token <= pos


def forced_blocks(block_idx: Tensor, J: Tensor, cfg: NSAConfig) -> Tensor:
    """Eq. 11's always-selected blocks: the n_init initial blocks and the n_local most recent blocks J-n_local+1..J,
    among the blocks 0..J that exist. Broadcasts block_idx against J."""
    return ((block_idx < cfg.n_init) | (block_idx > J - cfg.n_local)) & (block_idx <= J)


# Eq. 8-10: selection scores ----------------------------------------------------------------------------------
def cmp_importance(logits: Tensor, visible: Tensor, cfg: NSAConfig) -> Tensor:
    """Eq. 8: p_cmp over the compressed blocks (last dim) from the scaled logits q.k_cmp/sqrt(d_k): the
    compression branch's softmax probabilities over the visible blocks ("probs"), or the scaled logits
    ("logits" switch). Blocks that are not visible get exactly 0 (they add nothing in Eq. 9)."""
    if cfg.selection_score == "logits":
        return torch.where(visible, logits, torch.zeros((), dtype=logits.dtype, device=logits.device))
    if logits.shape[-1] == 0:
        return logits
    masked = logits.masked_fill(~visible, float("-inf"))
    row_max = masked.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    e = torch.exp(masked - row_max)  # exactly 0 where not visible
    total = fixed_order_sum(e)
    return e / torch.where(total > 0, total, torch.ones_like(total))


class Eq9Band(NamedTuple):
    """Eq. 9 as a banded weight: p_slc[j] = sum_k weights[k] * p_cmp[(l'/d) * j + first_offset + k],
    with p_cmp = 0 outside the blocks that exist."""

    first_offset: int
    weights: tuple[float, ...]


def eq9_pool_weights(cfg: NSAConfig) -> Eq9Band:
    """Eq. 9 weights: weight(i -> j) = (tokens shared by compressed block i and selection block j) / d.
    The band is the same for every j (shifting j by one shifts i by l'/d), so it is built once per
    (l, d, l') and cached."""
    return _overlap_band(cfg.cmp_block, cfg.cmp_stride, cfg.sel_block)


@functools.lru_cache(maxsize=None)
def _overlap_band(l: int, d: int, lp: int) -> Eq9Band:
    j = l // d + 1  # a selection block far enough from 0 that no compressed block index is negative
    base = j * (lp // d)
    weights = {}
    for i in range(base - l // d - 1, base + lp // d + 1):
        first = max(i * d, j * lp)
        last = min(i * d + l, (j + 1) * lp)  # exclusive
        if last > first:
            weights[i - base] = (last - first) / d
    offsets = sorted(weights)
    return Eq9Band(offsets[0], tuple(weights[r] for r in range(offsets[0], offsets[-1] + 1)))


def group_reduce(per_head: Tensor, cfg: NSAConfig) -> Tensor:
    """Eq. 10: p_slc' = sum (or mean, by switch) over the H query heads of a GQA group (dim -2), added head
    by head in a fixed order so a row's result never depends on how many rows are computed with it."""
    total = per_head[..., 0, :]
    for h in range(1, per_head.shape[-2]):
        total = total + per_head[..., h, :]
    if cfg.group_reduce == "mean":
        total = total / per_head.shape[-2]
    return total


# Eq. 11: top-n -----------------------------------------------------------------------------------------------
def top_n_blocks(scores: Tensor, J: Tensor, cfg: NSAConfig) -> Tensor:
    """Eq. 11: n blocks among 0..J per row of scores [..., NB] (J [...]): the forced blocks, then the highest
    scores; equal scores -> lower block index (a stable sort, no epsilon); every block if J + 1 <= n.
    Returns int64 [..., n], ascending, padded with -1."""
    n_blocks = scores.shape[-1]
    block = torch.arange(n_blocks, device=scores.device)
    exists = block <= J[..., None]
    forced = forced_blocks(block, J[..., None], cfg)
    # +0.0 turns a -0.0 score into +0.0 so the two zeros tie, as they do under '>'
    key = torch.where(exists, scores + 0.0, torch.full_like(scores, float("-inf")))
    key = torch.where(forced, torch.full_like(scores, float("inf")), key)
    order = ranked_blocks(key, min(cfg.n_sel, n_blocks))
    chosen = torch.where(torch.gather(exists, -1, order), order, torch.full_like(order, n_blocks))
    chosen = torch.sort(chosen, dim=-1).values
    chosen = torch.where(chosen == n_blocks, torch.full_like(chosen, -1), chosen)
    if chosen.shape[-1] < cfg.n_sel:
        pad = chosen.new_full((*chosen.shape[:-1], cfg.n_sel - chosen.shape[-1]), -1)
        chosen = torch.cat([chosen, pad], dim=-1)
    return chosen


def ranked_blocks(key: Tensor, k: int) -> Tensor:
    """The k block indices of the largest keys per row (last dim), best first, equal keys -> lower index first:
    the first k of a stable descending sort. Keys of 32 bits or fewer take an exact shortcut: each key becomes an
    int64 (its float32 bits in an order-preserving form, then the reversed block index in the low 32 bits), so
    torch.topk ranks exactly as the sort does without sorting the whole row (selection at 64k tokens ranks
    1024 blocks for each of 256k (query, group) rows). float64 keys are sorted."""
    n_blocks = key.shape[-1]
    if key.dtype == torch.float64 or n_blocks >= 2**31:
        return torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :k]
    bits = (key.to(torch.float32) + 0.0).view(torch.int32).to(torch.int64)  # + 0.0: -0.0 ties with +0.0, as in a sort
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # the float order as an integer order
    reverse_index = (n_blocks - 1) - torch.arange(n_blocks, device=key.device, dtype=torch.int64)
    return torch.topk(ordered * 2**32 + reverse_index, k, dim=-1, sorted=True).indices


# Shared arithmetic helper ------------------------------------------------------------------------------------
def fixed_order_sum(x: Tensor) -> Tensor:
    """Sum over the last dim (keepdim) by pairwise halving: the order of additions depends only on the length
    of that dim, never on the other dims, so a row gives the same bits whatever it is batched with."""
    n = x.shape[-1]
    if n == 0:
        return x.new_zeros((*x.shape[:-1], 1))
    width = 1 << (n - 1).bit_length()
    if width != n:
        x = torch.nn.functional.pad(x, (0, width - n))
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    return x
