"""The torch path of selected-token attention (Eq. 12): each (query, KV group) attends to the tokens of its selected
blocks, clipped to the query's position by masks.selected_token_visible (block J is partial); masked attention
over the gathered tokens, chunked over queries (optimized.masked_attention). The kernel path of this branch is
kernels/selected_attention.py (which of the two runs is decided in optimized.dispatch).
"""

from __future__ import annotations

import torch
from torch import Tensor

from reference.config import NSAConfig

from . import masks
from .documents import Documents
from .masked_attention import GatheredKeys, KeyPlan, masked_attention
from .numerics import auto_chunk_size


def selected_tokens(indices: Tensor, positions: Tensor, cfg: NSAConfig,
                    doc_start: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Eq. 12 token sets: tokens [B, TQ, Hkv, n*l'] of the selected blocks (block j holds j*l' .. (j+1)*l' - 1)
    and valid [same], False for padding (-1) entries and for tokens after the query.
    doc_start [TQ] (packed batch): block j of a query holds its document's tokens doc_start + j*l' ..; positions
    are packed positions, and the clip to the query is applied at document-relative positions."""
    offsets = torch.arange(cfg.sel_block, device=indices.device)
    tokens = (indices[..., None] * cfg.sel_block + offsets).flatten(-2)
    pos = positions[None, :, None, None]
    if doc_start is not None:
        pos = pos - doc_start[None, :, None, None]
    valid = ((indices >= 0)[..., None].expand(*indices.shape, cfg.sel_block).flatten(-2)
             & masks.selected_token_visible(tokens, pos, cfg))
    if doc_start is not None:
        tokens = tokens + doc_start[None, :, None, None]
    return tokens, valid


def selected_keys(indices: Tensor, positions: Tensor, cfg: NSAConfig, doc_start: Tensor | None = None):
    """keys(q0, q1): each (query, KV head) of the chunk reads the gathered tokens of its selected blocks."""

    def keys(q0: int, q1: int) -> GatheredKeys:
        starts = None if doc_start is None else doc_start[q0:q1]
        tokens, valid = selected_tokens(indices[:, q0:q1], positions[q0:q1], cfg, starts)
        return GatheredKeys(torch.where(valid, tokens, torch.zeros_like(tokens)), valid)

    return keys


def selected_attention_rows(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, cfg: NSAConfig, positions: Tensor,
                            *, chunk_size: int | None = None, compute: torch.dtype | None = None,
                            docs: Documents | None = None) -> tuple[Tensor, Tensor]:
    """Selected branch for queries q [B, TQ, Hq, dk] at absolute positions [TQ] over keys k [B, TK, Hkv, dk]:
    (o_slc [B, TQ, Hq, dv] in the compute dtype, reads [B, TQ, Hkv] = valid tokens of the gathered blocks).
    compute: see masked_attention. docs: the layout of a packed batch (indices are document-relative blocks),
    None for independent rows."""
    B, TQ, Hq, _ = q.shape
    doc_start = None if docs is None else docs.token_start[positions]
    n_tokens = indices.shape[-1] * cfg.sel_block
    if chunk_size is None:
        per_query = B * n_tokens * (cfg.n_kv_heads * (k.shape[-1] + v.shape[-1] + 4) + Hq)
        chunk_size = auto_chunk_size(TQ, per_query)
    keys = selected_keys(indices, positions, cfg, doc_start)
    return masked_attention(KeyPlan(TQ, chunk_size, keys), q, k, v, compute=compute)
