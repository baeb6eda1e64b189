"""Pure-torch range attention: a dense [TQ, TK] mask per row's [lo, hi], masked softmax. The kernels' oracle.

Deliberately simple and independent of the vectorized path in `optimized/` (it materializes the whole logits
tensor, so it is for tests and small shapes only).
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
