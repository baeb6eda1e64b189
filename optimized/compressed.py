"""Compressed-branch attention (Eq. 4 over the Eq. 7 compressed keys) with the block-visibility mask.

range_backend "torch": masked attention chunked over queries (optimized.masked_attention); "triton": the
range-attention kernel over each query's visible compressed tokens (optimized/ranges.py), in the inputs' own
precision with fp32 accumulation."""

from __future__ import annotations

import torch
from torch import Tensor

from reference.config import NSAConfig

from . import masks
from .checks import check_branch_inputs
from .documents import Documents, check_packed_compressed, stage_documents, visible_compressed
from .masked_attention import SharedKeys, auto_chunk_size, masked_attention, query_chunks
from .ranges import CompressedSoftmax, check_range_backend, compressed_ranges, range_reads


class CompressedKeyPlan:
    """Query chunks; each reads the compressed blocks visible to at least one of its queries, masked per query
    by masks.compressed_block_visible."""

    def __init__(self, positions: Tensor, n_blocks: int, cfg: NSAConfig, chunk_size: int):
        self.positions = positions
        self.blocks = torch.arange(n_blocks, device=positions.device)
        self.cfg = cfg
        self.chunk_size = chunk_size

    def chunks(self) -> list[tuple[int, int]]:
        return query_chunks(self.positions.shape[0], self.chunk_size)

    def keys(self, q0: int, q1: int) -> SharedKeys:
        visible = masks.compressed_block_visible(self.blocks[None, :], self.positions[q0:q1, None], self.cfg)
        used = torch.nonzero(visible.any(dim=0))
        if used.numel() == 0:
            return SharedKeys(0, 0, visible[:, :0])
        start, stop = int(used[0]), int(used[-1]) + 1
        return SharedKeys(start, stop, visible[:, start:stop])


class PackedCompressedKeyPlan:
    """Packed batch: query chunks; each reads the packed compressed tokens of the documents its queries lie in,
    masked per query by documents.visible_compressed (own document only, Eq. 7 visibility at the relative
    position)."""

    def __init__(self, positions: Tensor, docs: Documents, cfg: NSAConfig, chunk_size: int):
        self.positions = positions
        self.docs = docs
        self.cfg = cfg
        self.chunk_size = chunk_size

    def chunks(self) -> list[tuple[int, int]]:
        return query_chunks(self.positions.shape[0], self.chunk_size)

    def keys(self, q0: int, q1: int) -> SharedKeys:
        pos = self.positions[q0:q1]
        start, stop = self.docs.cmp_range(pos)
        cmp_tokens = torch.arange(start, stop, device=pos.device)
        return SharedKeys(start, stop, visible_compressed(self.docs, cmp_tokens, pos, self.cfg))


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
    if docs is None:
        plan = CompressedKeyPlan(positions, n_blocks, cfg, chunk_size)
    else:
        plan = PackedCompressedKeyPlan(positions, docs, cfg, chunk_size)
    return masked_attention(plan, q, k_cmp, v_cmp, compute=compute)


def compressed_attention_kernel_rows(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, cfg: NSAConfig, positions: Tensor,
                                     docs: Documents | None = None
                                     ) -> tuple[Tensor, CompressedSoftmax, Tensor]:
    """Compressed branch on the range-attention kernel for queries q [B, TQ, Hq, dk] at positions [TQ]:
    (o_cmp [B, TQ, Hq, dv] in q's dtype, the CompressedSoftmax (each query's range and the base-2 log-sum-exp
    over it, -inf without a visible block: the Eq. 8 normaliser), reads [B, TQ, Hkv] = the visible compressed
    tokens each query's range covers). k_cmp/v_cmp are cast to q's dtype (differentiably), as compress() returns
    them."""
    from .kernels.range_attention import check_range_inputs, range_attention_lse2

    k_low, v_low = k_cmp.to(q.dtype), v_cmp.to(q.dtype)
    lo, hi = check_range_inputs(q, k_low, v_low, *compressed_ranges(positions, k_cmp.shape[1], cfg, docs))
    o, lse2 = range_attention_lse2(q, k_low, v_low, lo, hi, checked=True)
    return o, CompressedSoftmax(lo, hi, lse2), range_reads(lo, hi, q.shape[0], cfg.n_kv_heads)


def compressed_attention(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, cfg: NSAConfig, *,
                         chunk_size: int | None = None, cu_seqlens: Tensor | None = None,
                         range_backend: str = "torch") -> Tensor:
    """Compressed branch for prefill queries at positions 0..T-1: o_cmp [B, T, Hq, d_v].
    A query with no visible compressed block gets exactly 0.
    cu_seqlens (packed batch, B = 1): k_cmp/v_cmp hold the packed compressed tokens of compress(..., cu_seqlens);
    a query reads only its own document's blocks, visible at its document-relative position.
    range_backend: "torch" or "triton" (module docstring)."""
    check_branch_inputs("compressed_attention", q, k_cmp, v_cmp, cfg)
    check_range_backend(range_backend, q.dtype)
    positions = torch.arange(q.shape[1], device=q.device)
    docs = stage_documents(cu_seqlens, cfg, q)
    if docs is not None:
        check_packed_compressed("k_cmp", k_cmp, docs)
    if range_backend == "triton":
        return compressed_attention_kernel_rows(q, k_cmp, v_cmp, cfg, positions, docs)[0]
    return compressed_attention_rows(q, k_cmp, v_cmp, cfg, positions, chunk_size=chunk_size,
                                     docs=docs)[0].to(q.dtype)

