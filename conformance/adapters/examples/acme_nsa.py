"""AcmeNSA: a HYPOTHETICAL third-party NSA library, written only to demonstrate an adapter (docs/adapters.md).

It is deliberately unlike the contract, as real libraries are:
- head-first tensors [B, H, T, D]; one k/v shared by the three branches (one K/V projection);
- gates as three separate [B, Hq, T] tensors; its own keyword names (block, stride, select_block, top_n, ...);
- a pluggable pooling function for the compression (mean pooling by default);
- no read counters, no selection scores, no decoding, no nn.Module;
- block indices per (KV head, query) in descending score order, padded with -1.
It computes NSA with dense [T, T] masks (fine for the short sequences of the conformance suite), with
the conventions: compressed block i visible once its last key i*stride + block - 1 <= t; the Eq. 9
weights are token overlaps / stride; the group sums the heads' probabilities; ties go to the lower block;
the window holds `window` keys ending at t.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

Pool = Callable[[Tensor], Tensor]  # [..., block, D] -> [..., D]


@dataclass
class AcmeResult:
    out: Tensor  # [B, Hq, T, Dv]
    branch_out: dict[str, Tensor]  # "cmp" / "slc" / "win" -> [B, Hq, T, Dv]
    block_index: Tensor  # [B, Hkv, T, top_n] int64, descending score, -1 padded


def compress_kv(k: Tensor, v: Tensor, *, block: int, stride: int, pool_k: Pool | None = None,
                pool_v: Pool | None = None) -> tuple[Tensor, Tensor]:
    """Pool every complete window of `block` keys, `stride` apart: [B, H, T, D] -> [B, H, N, D]."""
    T = k.shape[2]
    if T < block:
        return k[:, :, :0], v[:, :, :0]
    kb = k.unfold(2, block, stride).transpose(-1, -2)  # [B, H, N, block, D]
    vb = v.unfold(2, block, stride).transpose(-1, -2)
    return (pool_k or (lambda b: b.mean(-2)))(kb), (pool_v or (lambda b: b.mean(-2)))(vb)


def _softmax_where(logits: Tensor, allowed: Tensor) -> Tensor:
    """Softmax over the allowed entries of the last dim; rows with none give 0 (and zero gradients)."""
    if logits.shape[-1] == 0:
        return logits
    masked = logits.masked_fill(~allowed, float("-inf"))
    top = masked.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    e = torch.exp(masked - top)
    total = e.sum(-1, keepdim=True)
    return e / torch.where(total > 0, total, torch.ones_like(total))


def sparse_attention(q: Tensor, k: Tensor, v: Tensor, gate_cmp: Tensor, gate_slc: Tensor, gate_win: Tensor, *,
                     block: int, stride: int, select_block: int, top_n: int, n_initial: int, n_local: int,
                     window: int, pool_k: Pool | None = None, pool_v: Pool | None = None) -> AcmeResult:
    B, Hq, T, dk = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(dk)
    t = torch.arange(T, device=q.device)
    kk, vv = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)

    # compressed branch
    k_cmp, v_cmp = compress_kv(k, v, block=block, stride=stride, pool_k=pool_k, pool_v=pool_v)
    N = k_cmp.shape[2]
    ends = torch.arange(N, device=q.device) * stride + block - 1
    visible = ends[None, :] <= t[:, None]  # [T, N]
    p_cmp = _softmax_where(q @ k_cmp.repeat_interleave(G, 1).transpose(-1, -2) * scale, visible)
    o_cmp = p_cmp @ v_cmp.repeat_interleave(G, 1)

    # block importance: overlap weights, group sum, forced blocks, top-n with ties to the lower block
    NB = -(-T // select_block)
    first = torch.arange(N, device=q.device)[:, None] * stride
    sel = torch.arange(NB, device=q.device)[None, :] * select_block
    overlap = (torch.minimum(first + block, sel + select_block) - torch.maximum(first, sel)).clamp(min=0)
    importance = (p_cmp @ (overlap.to(p_cmp.dtype) / stride)).detach()  # [B, Hq, T, NB]
    importance = importance.view(B, Hkv, G, T, NB).sum(2)
    current = (t // select_block)[:, None]
    blocks = torch.arange(NB, device=q.device)[None, :]
    key = importance.masked_fill((blocks > current)[None, None], float("-inf"))
    forced = ((blocks < n_initial) | (blocks > current - n_local)) & (blocks <= current)
    key = key.masked_fill(forced[None, None], float("inf"))
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :top_n]
    block_index = torch.where(torch.gather((blocks <= current).expand(B, Hkv, T, NB), -1, order), order,
                              torch.full_like(order, -1))
    if NB < top_n:  # fewer blocks than top_n: pad
        block_index = torch.cat([block_index, block_index.new_full((B, Hkv, T, top_n - NB), -1)], -1)

    # selected branch: tokens of the chosen blocks, causal inside the current block
    chosen = torch.zeros(B, Hkv, T, NB + 1, dtype=torch.bool, device=q.device)
    chosen.scatter_(-1, torch.where(block_index >= 0, block_index, torch.full_like(block_index, NB)), True)
    token_block = t // select_block
    allowed_slc = chosen[..., :NB][..., token_block] & (t[None, :] <= t[:, None])  # [B, Hkv, T, T]
    logits = q @ kk.transpose(-1, -2) * scale
    o_slc = _softmax_where(logits, allowed_slc.repeat_interleave(G, 1)) @ vv

    # window branch
    in_window = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - window)
    o_win = _softmax_where(logits, in_window) @ vv

    out = gate_cmp[..., None] * o_cmp + gate_slc[..., None] * o_slc + gate_win[..., None] * o_win
    return AcmeResult(out, {"cmp": o_cmp, "slc": o_slc, "win": o_win}, block_index)
