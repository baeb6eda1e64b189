"""The torch path of the compressed branch (Eq. 4 over the Eq. 7 compressed keys): masked attention chunked over
queries (optimized.masked_attention), a chunk reading the compressed blocks visible to at least one of its queries,
masked per query by masks.compressed_block_visible. The kernel path of this branch is
kernels/range_attention.compressed_branch."""

from __future__ import annotations

import torch
from torch import Tensor

from reference.config import NSAConfig

from . import masks
from .documents import Documents, visible_compressed
from .masked_attention import KeyPlan, SharedKeys, masked_attention
from .numerics import auto_chunk_size


def visible_blocks(positions: Tensor, n_blocks: int, cfg: NSAConfig):
    """keys(q0, q1) of queries at positions [TQ]: the compressed blocks visible to at least one query of the chunk,
    masked per query by masks.compressed_block_visible."""
    blocks = torch.arange(n_blocks, device=positions.device)

    def keys(q0: int, q1: int) -> SharedKeys:
        visible = masks.compressed_block_visible(blocks[None, :], positions[q0:q1, None], cfg)
        used = torch.nonzero(visible.any(dim=0))
        if used.numel() == 0:
            return SharedKeys(0, 0, visible[:, :0])
        start, stop = int(used[0]), int(used[-1]) + 1
        return SharedKeys(start, stop, visible[:, start:stop])

    return keys


def packed_visible_blocks(positions: Tensor, docs: Documents, cfg: NSAConfig):
    """keys(q0, q1) of a packed batch: the packed compressed tokens of the documents the chunk's queries lie in,
    masked per query by documents.visible_compressed (own document only, Eq. 7 visibility at the relative
    position)."""

    def keys(q0: int, q1: int) -> SharedKeys:
        pos = positions[q0:q1]
        start, stop = docs.cmp_range(pos)
        cmp_tokens = torch.arange(start, stop, device=pos.device)
        return SharedKeys(start, stop, visible_compressed(docs, cmp_tokens, pos, cfg))

    return keys


def compressed_attention_rows(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, cfg: NSAConfig, positions: Tensor, *,
                              chunk_size: int | None = None, compute: torch.dtype | None = None,
                              docs: Documents | None = None) -> tuple[Tensor, Tensor]:
    """Compressed branch for queries q [B, TQ, Hq, dk] at absolute positions [TQ]:
    (o_cmp [B, TQ, Hq, dv] in the compute dtype, reads [B, TQ, Hkv] = visible compressed blocks counted from the
    mask applied).
    compute: see masked_attention. docs: the layout of a packed batch (positions are packed token positions,
    k_cmp/v_cmp the packed compressed tokens), None for independent rows."""
    B, TQ, Hq, _ = q.shape
    n_blocks = k_cmp.shape[1]
    if chunk_size is None:
        chunk_size = auto_chunk_size(TQ, B * Hq * max(n_blocks, 1))
    keys = visible_blocks(positions, n_blocks, cfg) if docs is None else packed_visible_blocks(positions, docs, cfg)
    return masked_attention(KeyPlan(TQ, chunk_size, keys), q, k_cmp, v_cmp, compute=compute)
