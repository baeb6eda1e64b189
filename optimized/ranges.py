"""Per-query key ranges of the branches that read one contiguous run of keys, for the range-attention kernels
(optimized/kernels/range_attention.py): the sliding window and the compressed branch.

Built from the same convention seams as the masks of the torch path (masks.window_start,
masks.compressed_block_visible), so a convention switch, or a planted bug in a seam, reaches both paths.
Every range is [lo, hi] inclusive, int64 [TQ], empty when hi = lo - 1, and non-decreasing in the row, packed
documents included (a document's ranges start at or after the previous document's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from reference.config import NSAConfig

from . import masks
from .documents import Documents

RANGE_BACKENDS = ("torch", "triton")


def check_range_backend(range_backend: str, dtype: torch.dtype) -> None:
    """range_backend must be "torch" or "triton"; the Triton kernels take fp32/bf16/fp16 (not float64)."""
    if range_backend not in RANGE_BACKENDS:
        raise ValueError(f"range_backend must be one of {RANGE_BACKENDS}, got {range_backend!r}")
    if range_backend == "triton" and dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"range_backend='triton' runs the Triton range kernels, which take fp32/bf16/fp16 inputs, "
                         f"got {dtype}")


@dataclass(frozen=True)
class CompressedSoftmax:
    """The compressed branch's softmax as the range kernel computed it: each query's range of compressed tokens
    [lo, hi] (int32 [TQ], validated) and the base-2 log-sum-exp lse2 [B, TQ, Hq] over it. The selection scoring
    reuses both (Eq. 8), so nsa_forward builds and checks the ranges once."""

    lo: Tensor
    hi: Tensor
    lse2: Tensor


def window_ranges(positions: Tensor, cfg: NSAConfig, docs: Documents | None = None) -> tuple[Tensor, Tensor]:
    """Window keys of queries at (packed) positions [TQ]: [max(doc start, doc start + window_start(rel)), p],
    rel = p - doc start (the window restarts at each document start; Section 3.3.3)."""
    start = torch.zeros_like(positions) if docs is None else docs.token_start[positions]
    rel = positions - start
    lo = start + torch.clamp(masks.window_start(rel, cfg), min=0)
    return lo, positions.clone()


def visible_block_count(rel: Tensor, n_blocks: Tensor | int, cfg: NSAConfig) -> Tensor:
    """How many of the blocks 0..n_blocks-1 are visible at relative position rel (Eq. 7), asked of
    masks.compressed_block_visible by binary search: visibility is monotone in the block index (block i is
    visible iff its last key i*d + l - 1 is early enough), so the visible blocks are 0..count-1."""
    n = torch.as_tensor(n_blocks, device=rel.device, dtype=torch.int64).expand_as(rel)
    low, high = torch.zeros_like(rel), n.clone()  # the count lies in [low, high]
    bound = int(n.max()) if n.numel() else 0
    for _ in range(bound.bit_length() + 1):
        mid = (low + high + 1) // 2
        visible = masks.compressed_block_visible(mid - 1, rel, cfg) & (mid >= 1)
        searching = low < high
        low = torch.where(searching & visible, mid, low)
        high = torch.where(searching & ~visible, mid - 1, high)
    return low


def compressed_ranges(positions: Tensor, n_compressed: int, cfg: NSAConfig,
                      docs: Documents | None = None) -> tuple[Tensor, Tensor]:
    """Compressed tokens read by queries at (packed) positions [TQ]: the first visible_block_count blocks of the
    query's own document, [first, first + count - 1] in the (packed) compressed sequence of n_compressed tokens."""
    if docs is None:
        first = torch.zeros_like(positions)
        rel, n_own = positions, n_compressed
    else:
        doc = docs.token_doc[positions]
        first = docs.cmp_bounds[doc]
        rel, n_own = docs.relative(positions), docs.cmp_bounds[doc + 1] - first
    count = visible_block_count(rel, n_own, cfg)
    return first, first + count - 1


def range_reads(lo: Tensor, hi: Tensor, batch: int, n_kv_heads: int) -> Tensor:
    """reads [B, TQ, Hkv]: the keys each (query, KV head) range covers, hi - lo + 1 (0 when empty), counted from
    the ranges the kernel read."""
    return torch.clamp(hi - lo + 1, min=0)[None, :, None].expand(batch, lo.shape[0], n_kv_heads)
