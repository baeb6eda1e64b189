"""Pure-torch oracles of the attention kernels, for tests and small shapes: dense masks and a masked softmax.

Deliberately simple and independent of the vectorized path in `optimized/`: range_attention_naive materializes
the whole [TQ, TK] logits; selected_attention_naive gathers every (query, group) token list [n * l'] explicitly, so
it is O(TQ * n * l') in memory (tests, and sampled positions of long sequences, not training). Differentiable
through autograd.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def range_attention_naive(q: Tensor, k: Tensor, v: Tensor, lo: Tensor, hi: Tensor,
                          scale: float | None = None) -> tuple[Tensor, Tensor]:
    """(o [B, TQ, Hq, dv], lse [B, TQ, Hq]) of Eq. 2 where query row t reads keys lo[t] .. hi[t] (inclusive;
    none when hi < lo: o = 0, lse = -inf). GQA: head h reads KV head h // (Hq / Hkv). Differentiable in q, k, v."""
    B, TQ, Hq, dk = q.shape
    TK, Hkv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    if scale is None:
        scale = 1.0 / math.sqrt(dk)
    keys = torch.arange(TK, device=q.device)
    mask = (keys[None, :] >= lo.to(q.device).long()[:, None]) & (keys[None, :] <= hi.to(q.device).long()[:, None])
    k_heads = k.repeat_interleave(group, dim=2)
    v_heads = v.repeat_interleave(group, dim=2)
    logits = torch.einsum("bthd,bshd->bhts", q, k_heads) * scale
    logits = logits.masked_fill(~mask[None, None], float("-inf"))
    has_key = mask.any(-1)[None, None, :, None]
    lse = torch.logsumexp(torch.where(has_key, logits, torch.zeros_like(logits)), dim=-1)
    lse = torch.where(has_key[..., 0], lse, torch.full_like(lse, float("-inf")))
    probs = torch.softmax(torch.where(has_key, logits, torch.zeros_like(logits)), dim=-1) * mask[None, None]
    out = torch.einsum("bhts,bshd->bthd", probs, v_heads)
    return out, lse.transpose(1, 2)


def selected_attention_naive(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, sel_block: int,
                             scale: float | None = None, positions: Tensor | None = None,
                             doc_start: Tensor | None = None) -> Tensor:
    """o [B, TQ, Hq, dv] of Eq. 12 for queries q [B, TQ, Hq, dk] over keys k [B, TK, Hkv, dk], v [B, TK, Hkv, dv].

    indices [B, TQ, Hkv, n]: selected block indices (entries < 0 are padding). Block j holds keys
    [j * sel_block, (j + 1) * sel_block), clipped to <= p, the absolute position of the query. positions [TQ]
    gives p per query row (default: the last TQ positions, TK - TQ + t). A query with no key outputs 0.
    doc_start [TQ] (packed batch): the first key of each query row's document; block j then holds keys
    doc_start + j * sel_block .. (document-relative indices), clipped to <= p as above.
    Differentiable in q, k, v through autograd.
    """
    B, TQ, Hq, dk = q.shape
    TK, Hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    group = Hq // Hkv
    if scale is None:
        scale = 1.0 / math.sqrt(dk)
    if positions is None:
        positions = torch.arange(TK - TQ, TK, device=q.device)
    blocks = indices.long()
    # Token positions of every selected block: [B, TQ, Hkv, n * l']
    tokens = (blocks[..., None] * sel_block + torch.arange(sel_block, device=q.device)).flatten(-2)
    if doc_start is not None:
        tokens = tokens + doc_start.to(device=q.device, dtype=torch.int64).view(1, TQ, 1, 1)
    is_real_block = (blocks >= 0)[..., None].expand(*blocks.shape, sel_block).flatten(-2)
    visible = is_real_block & (tokens <= positions.to(q.device).view(1, TQ, 1, 1))  # causal clip, Eq. 12
    safe_tokens = tokens.clamp(0, TK - 1)
    batch_ix = torch.arange(B, device=q.device).view(B, 1, 1, 1)
    group_ix = torch.arange(Hkv, device=q.device).view(1, 1, Hkv, 1)
    keys = k[batch_ix, safe_tokens, group_ix]  # [B, TQ, Hkv, S, dk]
    values = v[batch_ix, safe_tokens, group_ix]  # [B, TQ, Hkv, S, dv]
    q_grouped = q.view(B, TQ, Hkv, group, dk)
    logits = torch.einsum("btghd,btgsd->btghs", q_grouped, keys) * scale
    mask = visible[:, :, :, None, :]
    has_key = visible.any(-1)[:, :, :, None, None]
    logits = logits.masked_fill(~mask, float("-inf"))
    logits = torch.where(has_key, logits, torch.zeros_like(logits))  # empty set: avoid softmax of all -inf
    probs = torch.softmax(logits, dim=-1) * mask
    out = torch.einsum("btghs,btgsd->btghd", probs, values)
    return out.reshape(B, TQ, Hq, dv)
