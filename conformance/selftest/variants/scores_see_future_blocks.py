"""Bug: the selection scores of query p are a softmax over every compressed block of the sequence, the ones not
yet visible at p included (the mask applied to the compressed branch's output but not to the scores that rank the
blocks), so a future token changes which blocks an earlier query selects. The compressed branch itself is right.

Adapter: only nsa_forward (a library with one entry point): optimized's, except that its indices are Eq. 9-11 on
p_cmp = softmax(q k_cmp / sqrt(d_k)) over all compressed blocks, and o_slc and o are recomputed with them.
Caught by: No peeking, end to end (the indices of earlier positions change when later positions are perturbed).
"""

import math
from types import SimpleNamespace

import torch

import optimized
from conformance.adapters import EVERYTHING
from reference.contract import NSAOutput


def nsa_forward_scores_see_the_future(q, kv, gates, cfg, phi=None):
    out = optimized.nsa_forward(q, kv, gates, cfg, phi)
    k_cmp, _ = optimized.compress(kv.cmp.k, kv.cmp.v, cfg, phi)
    B, T, Hq, dk = q.shape
    N, G = k_cmp.shape[1], cfg.group_size
    if N == 0:
        return out
    logits = torch.einsum("bthd,bnhd->bthn", q, k_cmp.repeat_interleave(G, dim=2)) / math.sqrt(dk)
    p_cmp = torch.softmax(logits, dim=-1)  # every block, visible or not
    NB = -(-T // cfg.sel_block)
    weight = torch.zeros(N, NB, dtype=q.dtype, device=q.device)
    for i in range(N):
        for j in range(NB):
            lo = max(i * cfg.cmp_stride, j * cfg.sel_block)
            hi = min(i * cfg.cmp_stride + cfg.cmp_block, (j + 1) * cfg.sel_block)
            weight[i, j] = max(0, hi - lo) / cfg.cmp_stride
    scores = (p_cmp @ weight).reshape(B, T, cfg.n_kv_heads, G, NB).sum(3)
    for p in range(T):
        scores[:, p, :, p // cfg.sel_block + 1:] = float("-inf")
    indices = optimized.select_blocks(scores, cfg)
    o_slc = optimized.selected_attention(q, kv.slc.k, kv.slc.v, indices, cfg)
    o = gates[..., 0:1] * out.o_cmp + gates[..., 1:2] * o_slc + gates[..., 2:3] * out.o_win
    return NSAOutput(o=o, indices=indices, o_cmp=out.o_cmp, o_slc=o_slc, o_win=out.o_win, reads=None)


IMPL = SimpleNamespace(NAME="optimized[scores_see_future_blocks]", CAPABILITIES=EVERYTHING,
                       nsa_forward=nsa_forward_scores_see_the_future)
