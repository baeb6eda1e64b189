"""One decode call's three branches and its selection, for queries at per-row positions [B, TQ] (-1 marks a
padding query: it sees no key, gets 0 and reads nothing).

Every convention goes through the seams of optimized.masks (looked up on the module at call time, so a replaced
seam changes decode exactly as it changes prefill): compressed-block visibility, the window's keys, Eq. 8
importance, Eq. 9 weights (scoring.pool_eq9), Eq. 10 reduction, Eq. 11 top-n, Eq. 12 clipping. On the kernel path
(use_kernel) the masks are still built from the seams (the masked-decode kernel applies them as given), except
Eq. 12's clip, which the selected-decode kernel computes itself (token <= p).

Reads are counted from the masks and index sets the attention used: per (row, query, KV group), the compressed
entries, selected token slots and window entries that entered the softmax.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from reference.config import NSAConfig
from reference.contract import KV

from .. import masks, scoring
from . import attention
from .buffers import TokenBuffer


class BranchResult(NamedTuple):
    o: Tensor  # [B, TQ, Hq, dv]
    reads: Tensor  # int64 [B, TQ, Hkv]


# Compressed branch (Eq. 7 visibility, Eq. 2) and the logits Eq. 8 reuses ---------------------------------------
def compressed_visible(positions: Tensor, emitted: Tensor, n_blocks: int, cfg: NSAConfig) -> Tensor:
    """[B, TQ, N]: compressed block i enters query p's attention iff the visibility seam admits it and the block
    has been emitted (a prefilled row's slots past its own length hold blocks of padding)."""
    blocks = torch.arange(n_blocks, device=positions.device)
    visible = masks.compressed_block_visible(blocks[None, None, :], positions[:, :, None], cfg)
    return visible & (blocks[None, None, :] < emitted[:, None, None])


def compressed_branch(q: Tensor, store: TokenBuffer, visible: Tensor, use_kernel: bool) -> tuple[BranchResult, Tensor]:
    """o_cmp and the scaled logits [B, Hkv, TQ, G, N] (compute dtype) over the N stored compressed tokens for
    queries q [B, TQ, Hq, dk]."""
    N = visible.shape[-1]
    keys = store.usable(N)
    if use_kernel:
        from ..kernels.masked_decode import masked_decode_attention

        o, logits, reads = masked_decode_attention(q, keys.k, keys.v, visible, want_logits=True)
        return BranchResult(o, reads), logits
    q5 = attention.group_queries(q, keys.k.shape[1])
    logits = attention.shared_logits(q5, keys.k)
    o5 = attention.attend_logits(logits, visible[:, None, :, None, :], keys.v)
    reads = visible.sum(dim=-1)[:, :, None].expand(-1, -1, q5.shape[1])
    return BranchResult(attention.ungroup(o5, q.dtype), reads), logits


# Selection (Eq. 8-11) ------------------------------------------------------------------------------------------
def select(logits: Tensor, visible: Tensor, positions: Tensor, n_sel_blocks: int, cfg: NSAConfig) -> Tensor:
    """Eq. 8-11 from the compressed logits [B, Hkv, TQ, G, N]: indices [B, TQ, Hkv, n], ascending, -1 padded.
    The same seams, in the same order, as scoring.scores_of_chunk of the prefill."""
    p_cmp = masks.cmp_importance(logits, visible[:, None, :, None, :], cfg)  # Eq. 8
    p_slc = scoring.pool_eq9(p_cmp, n_sel_blocks, cfg)  # Eq. 9, per query head
    scores = masks.group_reduce(p_slc, cfg).transpose(1, 2)  # Eq. 10 -> [B, TQ, Hkv, NB]
    J = masks.current_sel_block(positions, cfg)  # [B, TQ]
    sel = torch.arange(n_sel_blocks, device=positions.device)
    scores = scores.masked_fill((sel[None, None, :] > J[:, :, None])[:, :, None, :], float("-inf"))
    return masks.top_n_blocks(scores, J[:, :, None].expand(scores.shape[:3]), cfg)  # Eq. 11


# Selected branch (Eq. 12) --------------------------------------------------------------------------------------
def selected_branch(q: Tensor, history: TokenBuffer, indices: Tensor, positions: Tensor, cfg: NSAConfig,
                    use_kernel: bool) -> BranchResult:
    """Attention over the tokens of the selected blocks, clipped by the Eq. 12 seam (block J is partial)."""
    if use_kernel:  # the kernel clips to token <= p itself (masks.selected_token_visible is the torch path's)
        from ..kernels.selected_decode import selected_decode_attention

        return BranchResult(*selected_decode_attention(q, history.k, history.v, indices, positions, cfg.sel_block))
    q5 = attention.group_queries(q, history.k.shape[1])
    B, H, TQ = q5.shape[:3]
    offsets = torch.arange(cfg.sel_block, device=indices.device)
    tokens = (indices[..., None] * cfg.sel_block + offsets).flatten(-2)  # [B, TQ, Hkv, n*l']
    valid = ((indices >= 0)[..., None].expand(*indices.shape, cfg.sel_block).flatten(-2)
             & masks.selected_token_visible(tokens, positions[:, :, None, None], cfg))
    gather = torch.where(valid, tokens, torch.zeros_like(tokens)).transpose(1, 2)  # [B, Hkv, TQ, S]
    S = gather.shape[-1]
    keys = history.k.gather(2, gather.reshape(B, H, TQ * S, 1).expand(-1, -1, -1, history.k.shape[-1]))
    values = history.v.gather(2, gather.reshape(B, H, TQ * S, 1).expand(-1, -1, -1, history.v.shape[-1]))
    mask = valid.transpose(1, 2)[:, :, :, None, :]
    o5 = attention.gathered_attention(q5, keys.view(B, H, TQ, S, -1), values.view(B, H, TQ, S, -1), mask)
    return BranchResult(attention.ungroup(o5, q.dtype), valid.sum(dim=-1))


# Window branch (Section 3.3.3) ---------------------------------------------------------------------------------
def window_branch(q: Tensor, keys: KV, admitted: Tensor, use_kernel: bool) -> BranchResult:
    """Attention over the window keys (k [B, Hkv, K, dk]) each query admits (admitted [B, TQ, K], from the window
    seam in plan.plan_call)."""
    if use_kernel:
        from ..kernels.masked_decode import masked_decode_attention

        o, _, reads = masked_decode_attention(q, keys.k, keys.v, admitted, want_logits=False)
        return BranchResult(o, reads)
    q5 = attention.group_queries(q, keys.k.shape[1])
    logits = attention.shared_logits(q5, keys.k)
    o5 = attention.attend_logits(logits, admitted[:, None, :, None, :], keys.v)
    reads = admitted.sum(dim=-1)[:, :, None].expand(-1, -1, q5.shape[1])
    return BranchResult(attention.ungroup(o5, q.dtype), reads)
