"""Eq. 2 attention of the decode queries over a masked key set, in torch (any device).

Queries are grouped by KV head: q5 [B, Hkv, TQ, G, dk] (G = query heads per group). Keys are either shared by
the TQ queries of a row (k [B, Hkv, K, dk], the compressed and window branches) or gathered per query
(k [B, Hkv, TQ, K, dk], the selected branch). Arithmetic runs in float32 (float64 for float64 inputs); a query
with no valid key gets exactly 0, as in optimized.masked_attention.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..dispatch import compute_dtype


def group_queries(q: Tensor, n_kv_heads: int) -> Tensor:
    """q [B, TQ, Hq, dk] -> q5 [B, Hkv, TQ, G, dk] in the compute dtype (query head h belongs to KV head h // G)."""
    B, TQ, Hq, dk = q.shape
    return q.view(B, TQ, n_kv_heads, Hq // n_kv_heads, dk).permute(0, 2, 1, 3, 4).to(compute_dtype(q.dtype))


def ungroup(o5: Tensor, dtype: torch.dtype) -> Tensor:
    """o5 [B, Hkv, TQ, G, dv] -> [B, TQ, Hq, dv] in dtype."""
    B, H, TQ, G, dv = o5.shape
    return o5.permute(0, 2, 1, 3, 4).reshape(B, TQ, H * G, dv).to(dtype)


def shared_logits(q5: Tensor, k: Tensor) -> Tensor:
    """Scaled logits q.k / sqrt(dk) [B, Hkv, TQ, G, K] for keys k [B, Hkv, K, dk] shared by a row's queries."""
    B, H, TQ, G, dk = q5.shape
    keys = k.to(q5.dtype)
    logits = torch.matmul(q5.reshape(B, H, TQ * G, dk), keys.transpose(-1, -2))
    return logits.view(B, H, TQ, G, k.shape[2]) / math.sqrt(dk)


def attend_logits(logits: Tensor, mask: Tensor, v: Tensor) -> Tensor:
    """softmax over the valid keys (mask broadcast to logits [B, Hkv, TQ, G, K]) times the values: shared values
    v [B, Hkv, K, dv] or per-query values v [B, Hkv, TQ, K, dv]. Returns o5 [B, Hkv, TQ, G, dv] (0 with no key)."""
    if logits.shape[-1] == 0:
        return logits.new_zeros((*logits.shape[:-1], v.shape[-1]))
    masked = logits.masked_fill(~mask, float("-inf"))
    row_max = masked.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    e = torch.exp(masked - row_max)
    total = e.sum(dim=-1, keepdim=True)
    values = v.to(logits.dtype)
    if values.dim() == 4:
        B, H, TQ, G, K = e.shape
        weighted = torch.matmul(e.reshape(B, H, TQ * G, K), values).view(B, H, TQ, G, -1)
    else:
        weighted = torch.einsum("bhtgk,bhtkd->bhtgd", e, values)
    return weighted / torch.where(total > 0, total, torch.ones_like(total))


def gathered_attention(q5: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """Attention over per-query gathered keys k [B, Hkv, TQ, K, dk] (mask [B, Hkv, TQ, 1, K])."""
    logits = torch.einsum("bhtgd,bhtkd->bhtgk", q5, k.to(q5.dtype)) / math.sqrt(q5.shape[-1])
    return attend_logits(logits, mask, v)
