"""nsa_forward (prefill) and decode_step: the three branches combined by the gates (Eq. 5), with the
Eq. 6 reads counted from the index sets each branch gathered."""

from __future__ import annotations

import torch
from torch import Tensor

from .branches import selected_attention_rows, window_attention_rows
from .compression import compress, compressed_attention_rows
from .config import NSAConfig
from .contract import BRANCHES, KV, BranchKV, NSAOutput, PhiWeights, Reads, check_finite_inputs, check_inputs
from .documents import document_spans
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


def nsa_forward(q: Tensor, kv: BranchKV, gates: Tensor, cfg: NSAConfig, phi: PhiWeights | None = None, *,
                cu_seqlens: Tensor | None = None, check_finite: bool = True) -> NSAOutput:
    """NSA prefill for queries at positions 0..T-1 over keys 0..T-1 of every branch.

    Packed (cu_seqlens, B = 1): every document runs alone (positions, blocks, forced blocks and windows restart
    at its start) and the results are concatenated: indices are document-relative, reads counted per document.
    check_finite: refuse NaN/Inf in q, k, v, gates or phi with a ValueError naming the tensor (default on: the
    oracle never answers with NaN for a question that was not finite)."""
    check_inputs(q, kv, gates, cfg)
    if check_finite:
        check_finite_inputs(q, kv, gates, phi)
    if q.shape[1] == 0:
        raise ValueError("q must hold at least one position (T >= 1)")
    if cu_seqlens is not None:
        spans = document_spans(cu_seqlens, "q", q)
        return concat_outputs([nsa_forward(q[:, s:e], document_kv(kv, s, e), gates[:, s:e], cfg, phi,
                                           check_finite=False) for s, e in spans if e > s])
    return _forward_rows(q, kv, gates, cfg, phi, list(range(q.shape[1])))


def document_kv(kv: BranchKV, start: int, end: int) -> BranchKV:
    """Every branch's keys/values of the tokens start..end-1 (one document of a packed batch)."""
    return BranchKV(*(KV(kv.branch(name).k[:, start:end], kv.branch(name).v[:, start:end])
                      for name in BRANCHES))


def concat_outputs(outputs: list[NSAOutput]) -> NSAOutput:
    """The NSAOutputs of consecutive documents (at least one) as one packed NSAOutput, documents in order."""

    def cat(get) -> Tensor:
        return torch.cat([get(out) for out in outputs], dim=1)

    return NSAOutput(
        o=cat(lambda out: out.o),
        indices=cat(lambda out: out.indices),
        o_cmp=cat(lambda out: out.o_cmp),
        o_slc=cat(lambda out: out.o_slc),
        o_win=cat(lambda out: out.o_win),
        reads=Reads(cmp=cat(lambda out: out.reads.cmp), slc=cat(lambda out: out.reads.slc),
                    win=cat(lambda out: out.reads.win)),
    )


def decode_step(q: Tensor, kv: BranchKV, gates: Tensor, cfg: NSAConfig, phi: PhiWeights | None = None, *,
                check_finite: bool = True) -> NSAOutput:
    """Decode: q [B, TQ, Hq, d_k] holds the newest TQ queries (TQ = 1 for one step), i.e. positions
    TK-TQ .. TK-1 of the TK cached keys/values in kv (which include the new tokens' own keys).

    The reference keeps no incremental state: it recompresses the cache each call, which is what makes
    it a trustworthy oracle for a cached implementation. check_finite: as in nsa_forward."""
    TQ = q.shape[1]
    check_inputs(q, kv, gates, cfg, n_queries=TQ)
    if check_finite:
        check_finite_inputs(q, kv, gates, phi)
    TK = kv.win.k.shape[1]
    if not 1 <= TQ <= TK:
        raise ValueError(f"decode_step needs 1 <= TQ <= TK, got TQ={TQ}, TK={TK}")
    return _forward_rows(q, kv, gates, cfg, phi, list(range(TK - TQ, TK)))
