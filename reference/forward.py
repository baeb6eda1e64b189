"""nsa_forward (prefill) and decode_step: the three branches combined by the gates (Eq. 5), with the
Eq. 6 reads counted from the index sets each branch gathered."""

from __future__ import annotations

from torch import Tensor

from .branches import selected_attention_rows, window_attention_rows
from .compression import compress, compressed_attention_rows
from .config import NSAConfig
from .contract import BranchKV, NSAOutput, PhiWeights, Reads, check_inputs
from .selection import select_blocks_rows, selection_scores_rows


def gated_sum(gates: Tensor, o_cmp: Tensor, o_slc: Tensor, o_win: Tensor) -> Tensor:
    """Eq. 5: o = g_cmp * o_cmp + g_slc * o_slc + g_win * o_win, gates [B, T, Hq, 3] in [0, 1]."""
    return gates[..., 0:1] * o_cmp + gates[..., 1:2] * o_slc + gates[..., 2:3] * o_win


def _forward_rows(q: Tensor, kv: BranchKV, gates: Tensor, cfg: NSAConfig, phi: PhiWeights | None,
                  positions: list[int]) -> NSAOutput:
    k_cmp, v_cmp = compress(kv.cmp.k, kv.cmp.v, cfg, phi)
    o_cmp, reads_cmp = compressed_attention_rows(q, k_cmp, v_cmp, cfg, positions)
    n_sel_blocks = -(-(positions[-1] + 1) // cfg.sel_block) if positions else 0
    scores = selection_scores_rows(q, k_cmp, cfg, positions, n_sel_blocks)
    indices = select_blocks_rows(scores, cfg, positions)
    o_slc, reads_slc = selected_attention_rows(q, kv.slc.k, kv.slc.v, indices, cfg, positions)
    o_win, reads_win = window_attention_rows(q, kv.win.k, kv.win.v, cfg, positions)
    return NSAOutput(
        o=gated_sum(gates, o_cmp, o_slc, o_win),
        indices=indices,
        o_cmp=o_cmp,
        o_slc=o_slc,
        o_win=o_win,
        reads=Reads(cmp=reads_cmp, slc=reads_slc, win=reads_win),
    )


def nsa_forward(q: Tensor, kv: BranchKV, gates: Tensor, cfg: NSAConfig, phi: PhiWeights | None = None) -> NSAOutput:
    """NSA prefill for queries at positions 0..T-1 over keys 0..T-1 of every branch."""
    check_inputs(q, kv, gates, cfg)
    if q.shape[1] == 0:
        raise ValueError("q must hold at least one position (T >= 1)")
    return _forward_rows(q, kv, gates, cfg, phi, list(range(q.shape[1])))


def decode_step(q: Tensor, kv: BranchKV, gates: Tensor, cfg: NSAConfig, phi: PhiWeights | None = None) -> NSAOutput:
    """Decode: q [B, TQ, Hq, d_k] holds the newest TQ queries (TQ = 1 for one step), i.e. positions
    TK-TQ .. TK-1 of the TK cached keys/values in kv (which include the new tokens' own keys).

    The reference keeps no incremental state: it recompresses the cache each call, which is what makes
    it a trustworthy oracle for a cached implementation."""
    TQ = q.shape[1]
    check_inputs(q, kv, gates, cfg, n_queries=TQ)
    TK = kv.win.k.shape[1]
    if not 1 <= TQ <= TK:
        raise ValueError(f"decode_step needs 1 <= TQ <= TK, got TQ={TQ}, TK={TK}")
    return _forward_rows(q, kv, gates, cfg, phi, list(range(TK - TQ, TK)))
