"""Eq. 11 top-n inside Triton programs, with exactly the rule of masks.top_n_blocks: the forced blocks (the n_init
initial and the n_local most recent ones) first, then the highest scores; equal scores -> lower block index (a
stable descending sort, no epsilon; -0.0 ties +0.0); blocks after J = p // l' never chosen; the result ascending,
padded with -1.

Each candidate block becomes one int64 rank key, as in masks.ranked_blocks: the float32 bits of its score in an
order-preserving integer form (forced blocks: +inf) in the high 32 bits, the reversed block index in the low 32
bits. Every key is distinct, and the largest key is the highest score with the lowest index among equals, so the
n largest keys are Eq. 11's choice: top_n_by_sort takes them with bitonic top-k selections (tl.topk), and
top_n_by_rank (for chunks narrower than a list) from every key's rank. A program keeps the n best keys of the
blocks it scored (a "list", best first, EMPTY padded); the n best of the union of several lists are the n best
overall, so a row's blocks may be scored by several programs and their lists merged later (decode_step's select and
sparse kernels: merged_blocks).

top_n_blocks_triton runs these helpers on given scores (two launches: lists, then the merge), so the tie rule is
tested on crafted scores against masks.top_n_blocks (tests/test_kernel_decode.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import float_order, padded

EMPTY = tl.constexpr(-9223372036854775807)  # below every rank key: an unused list slot
REVERSED = tl.constexpr(0x7FFFFFFF)  # low 32 bits of a rank key: REVERSED - block index


@triton.jit
def rank_key(score, block, J, N_INIT: tl.constexpr, N_LOCAL: tl.constexpr):
    """int64 rank keys of blocks `block` (int64, all <= J) with Eq. 8-10 scores `score` (fp32): forced blocks
    (masks.forced_blocks: block < n_init or block > J - n_local) rank first (+inf), -0.0 ranks as +0.0."""
    forced = (block < N_INIT) | (block > J - N_LOCAL)
    return float_order(tl.where(forced, float("inf"), score)).to(tl.int64) * 4294967296 + (REVERSED - block)


@triton.jit
def _larger_count(keys, others):
    """For each of keys [A]: how many of others [B] are larger (int32 [A]); one comparison matrix, one reduction."""
    return tl.sum((others[None, :] > keys[:, None]).to(tl.int32), 1)


@triton.jit
def _placed(keys, rank, slot):
    """[N_PAD]: the key whose rank is each slot (EMPTY where none is)."""
    return tl.max(tl.where(rank[None, :] == slot[:, None], keys[None, :], EMPTY), 1)


@triton.jit
def top_n_by_rank(cand, best, N_SEL: tl.constexpr, N_PAD: tl.constexpr):
    """The N_SEL largest keys of cand [C] and best [N_PAD] together, best first, EMPTY padded [N_PAD], from every
    key's rank (the number of larger keys among cand and best): the key of rank r goes to slot r < N_SEL. Keys are
    distinct but for EMPTY, whose entries all share the rank of the number of real keys, so a slot they land in
    stays EMPTY. For a chunk of C candidates this is [C, C + N_PAD] comparisons; score_into_list takes it only for
    chunks narrower than N_PAD (top_n_by_sort needs at least N_PAD keys, and is the faster one: perf/NOTES.md)."""
    rank_cand = _larger_count(cand, cand) + _larger_count(cand, best)
    rank_best = _larger_count(best, cand) + _larger_count(best, best)
    slot = tl.arange(0, N_PAD)
    out = tl.maximum(_placed(cand, rank_cand, slot), _placed(best, rank_best, slot))
    return tl.where(slot < N_SEL, out, EMPTY)


@triton.jit
def top_n_by_sort(cand, best, N_SEL: tl.constexpr, N_PAD: tl.constexpr):
    """top_n_by_rank's result from two bitonic top-k selections (tl.topk, largest first): the N_PAD best of cand (a
    power of two >= N_PAD keys), then the N_PAD best of those and best. Keys are distinct but for EMPTY, the
    smallest key, so the real keys come first and EMPTY pads the rest; slots >= N_SEL are EMPTY."""
    top = tl.topk(cand, N_PAD)
    merged = tl.topk(tl.reshape(tl.join(top, best), [2 * N_PAD]), N_PAD)
    return tl.where(tl.arange(0, N_PAD) < N_SEL, merged, EMPTY)


@triton.jit
def score_into_list(best, score, block, ok, J, N_INIT: tl.constexpr, N_LOCAL: tl.constexpr, N_SEL: tl.constexpr,
                    N_PAD: tl.constexpr):
    """A program's list updated with a chunk of scored blocks (ok: the lanes that are blocks <= J): by bitonic
    top-k when the chunk holds at least N_PAD lanes, else by rank."""
    cand = tl.where(ok, rank_key(score, block, J, N_INIT, N_LOCAL), EMPTY)
    if cand.shape[0] >= N_PAD:
        out = top_n_by_sort(cand, best, N_SEL, N_PAD)
    else:
        out = top_n_by_rank(cand, best, N_SEL, N_PAD)
    return out


@triton.jit
def merged_blocks(LISTS, row, n_lists, N_SEL: tl.constexpr, N_PAD: tl.constexpr, LISTS_PAD: tl.constexpr):
    """Eq. 11 for one row from its n_lists lists (LISTS [rows, n_lists, N_PAD] int64): the chosen block indices
    ascending, -1 padded (int64 [N_PAD]; slots >= N_SEL are -1)."""
    offs = tl.arange(0, LISTS_PAD * N_PAD)
    cand = tl.load(LISTS + row * n_lists * N_PAD + offs, mask=offs // N_PAD < n_lists, other=EMPTY)
    slot = tl.arange(0, N_PAD)
    best = tl.where(slot < N_SEL, tl.topk(cand, N_PAD), EMPTY)  # bitonic top-k: the N_SEL largest keys
    valid = best != EMPTY
    # ascending block order, the empty slots (sorted as the largest int64) last
    blocks = tl.sort(tl.where(valid, REVERSED - (best & 0xFFFFFFFF), 9223372036854775807))
    return tl.where(slot < tl.sum(valid.to(tl.int32), 0), blocks, -1)


@triton.jit
def _top_n_lists_kernel(SCORES, J, LISTS, n_blocks, blocks_per_list, n_lists,
                        N_INIT: tl.constexpr, N_LOCAL: tl.constexpr, N_SEL: tl.constexpr, N_PAD: tl.constexpr,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    J_row = tl.load(J + row)
    first = c * blocks_per_list
    stop = tl.minimum(first + blocks_per_list, tl.minimum(J_row + 1, n_blocks))
    best = tl.full([N_PAD], EMPTY, dtype=tl.int64)
    for start in range(first, stop, BLOCK):
        block = start + tl.arange(0, BLOCK).to(tl.int64)
        ok = block < stop
        score = tl.load(SCORES + row * n_blocks + block, mask=ok, other=0.0)
        best = score_into_list(best, score, block, ok, J_row, N_INIT, N_LOCAL, N_SEL, N_PAD)
    tl.store(LISTS + (row * n_lists + c) * N_PAD + tl.arange(0, N_PAD), best)


@triton.jit
def _top_n_merge_kernel(LISTS, INDICES, n_lists, N_SEL: tl.constexpr, N_PAD: tl.constexpr,
                        LISTS_PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    blocks = merged_blocks(LISTS, row, n_lists, N_SEL, N_PAD, LISTS_PAD)
    offs = tl.arange(0, N_PAD)
    tl.store(INDICES + row * N_SEL + offs, blocks, mask=offs < N_SEL)


def list_width(n_sel: int) -> int:
    """N_PAD: slots of a list (n padded to a power of two >= 16)."""
    return padded(n_sel)


def top_n_blocks_triton(scores: Tensor, J: Tensor, n_sel: int, n_init: int, n_local: int, *, lists: int = 1,
                        block: int = 16) -> Tensor:
    """masks.top_n_blocks(scores, J, cfg) for scores [R, NB] fp32 and J [R] int64 through the lean step's top-n
    helpers: `lists` programs per row each rank a share of the blocks (chunks of `block` lanes), then a second
    launch merges their lists. Returns int64 [R, n_sel], ascending, -1 padded."""
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(f"top_n_blocks_triton: scores must be float32 [R, NB], got {scores.dtype} "
                         f"{tuple(scores.shape)}")
    if J.shape != scores.shape[:1] or J.dtype != torch.int64:
        raise ValueError(f"top_n_blocks_triton: J must be int64 [R] = [{scores.shape[0]}], got {J.dtype} "
                         f"{tuple(J.shape)}")
    if lists < 1 or block < 16 or block & (block - 1):
        raise ValueError(f"top_n_blocks_triton: lists must be >= 1 and block a power of two >= 16, got {lists}, "
                         f"{block}")
    R, NB = scores.shape
    n_pad = list_width(n_sel)
    out = torch.empty((R, n_sel), dtype=torch.int64, device=scores.device)
    if R == 0:
        return out
    per_list = max(1, -(-NB // lists))
    scratch = torch.empty((R, lists, n_pad), dtype=torch.int64, device=scores.device)
    scores, J = scores.contiguous(), J.contiguous()
    _top_n_lists_kernel[(R, lists)](scores, J, scratch, NB, per_list, lists, N_INIT=n_init, N_LOCAL=n_local,
                                    N_SEL=n_sel, N_PAD=n_pad, BLOCK=block)
    _top_n_merge_kernel[(R,)](scratch, out, lists, N_SEL=n_sel, N_PAD=n_pad,
                              LISTS_PAD=triton.next_power_of_2(lists))
    return out
