"""nsa_forward (prefill) and decode_step: the three vectorized branches combined by the gates (Eq. 5), with the
Eq. 6 reads counted from the masks and index sets each branch applied.

range_backend="triton" runs the compressed and window branches on the range-attention kernel,
Eq. 8 + 10 on the group-scores kernel (reusing the compressed branch's log-sum-exp) and Eq. 9-11 on the top-n
kernel, in the inputs' own precision with fp32 accumulation, and Eq. 5 in one kernel; the selected branch
follows `backend` as before. The torch default keeps the
next-wider-dtype arithmetic of optimized.masked_attention."""

from __future__ import annotations

import torch
from torch import Tensor

from reference.config import NSAConfig
from reference.contract import KV, BranchKV, NSAOutput, PhiWeights, Reads, check_finite_inputs, check_inputs

from .compressed import compressed_attention_kernel_rows, compressed_attention_rows
from .compression import compress_unrounded
from .documents import Documents, documents
from .masked_attention import compute_dtype
from .ranges import check_range_backend
from .scoring import selection_indices
from .selected import check_indices, selected_attention_rows
from .window import window_attention_kernel_rows, window_attention_rows


def gated_sum(gates: Tensor, o_cmp: Tensor, o_slc: Tensor, o_win: Tensor) -> Tensor:
    """Eq. 5: o = g_cmp * o_cmp + g_slc * o_slc + g_win * o_win, gates [B, T, Hq, 3] in (cmp, slc, win) order."""
    return gates[..., 0:1] * o_cmp + gates[..., 1:2] * o_slc + gates[..., 2:3] * o_win


def widen(q: Tensor, kv: BranchKV, gates: Tensor, dtype: torch.dtype) -> tuple[Tensor, BranchKV, Tensor]:
    """q, kv, gates cast to dtype, each distinct tensor once (a k/v shared by branches stays shared)."""
    cast: dict[int, Tensor] = {}

    def once(t: Tensor) -> Tensor:
        if id(t) not in cast:
            cast[id(t)] = t.to(dtype)
        return cast[id(t)]

    kv_wide = BranchKV(*(KV(once(b.k), once(b.v)) for b in (kv.cmp, kv.slc, kv.win)))
    return once(q), kv_wide, once(gates)


def nsa_forward_rows(q: Tensor, kv: BranchKV, gates: Tensor, cfg: NSAConfig, phi: PhiWeights | None,
                     positions: Tensor, *, backend: str = "auto", chunk_size: int | None = None,
                     indices: Tensor | None = None, cu_seqlens: Tensor | None = None,
                     range_backend: str = "torch") -> NSAOutput:
    """NSA for queries q [B, TQ, Hq, dk] (gates [B, TQ, Hq, 3]) at absolute, increasing positions [TQ] over the
    TK keys of every branch in kv. indices: given selection indices [B, TQ, Hkv, n] replace Eq. 8-11
    (teacher forcing); by default they are computed by scoring.selection_indices.
    cu_seqlens: the TK keys are a packed batch (B = 1) of documents (reference.packing); positions are packed
    positions and everything (compressed blocks, selection blocks and indices, windows) is document-relative.
    range_backend: "torch" or "triton" (module docstring)."""
    check_range_backend(range_backend, q.dtype)
    n_keys = kv.win.k.shape[1]
    docs = None if cu_seqlens is None else documents(cu_seqlens, n_keys, q.shape[0], cfg, q.device)
    if indices is not None:
        check_indices(indices, q, cfg)
    if range_backend == "triton":
        return _nsa_forward_rows_on_kernels(q, kv, gates, cfg, phi, positions, backend=backend,
                                            chunk_size=chunk_size, indices=indices, docs=docs)
    # Precision: every input is widened once to the compute dtype and every branch and Eq. 5 run in it, so a
    # gradient summed over uses (q in three branches, a k/v shared by branches) is rounded once, at the input.
    cd = compute_dtype(q.dtype)
    q_wide, kv_wide, gates_wide = widen(q, kv, gates, cd)
    k_cmp, v_cmp = compress_unrounded(kv_wide.cmp.k, kv_wide.cmp.v, cfg, phi, docs=docs)
    o_cmp, reads_cmp = compressed_attention_rows(q_wide, k_cmp, v_cmp, cfg, positions, chunk_size=chunk_size,
                                                 compute=cd, docs=docs)
    if indices is None:
        # scored on the compressed keys rounded as compress() returns them, so nsa_forward selects exactly what
        # select_blocks(selection_scores(q, compress(k, v)[0])) selects
        indices = selection_indices(q, k_cmp.to(q.dtype), cfg, positions=positions, n_keys=n_keys,
                                    chunk_size=chunk_size, docs=docs)
    o_slc, reads_slc = selected_attention_rows(q_wide, kv_wide.slc.k, kv_wide.slc.v, indices, cfg, positions,
                                               backend=backend, chunk_size=chunk_size, compute=cd,
                                               kernel_dtype=q.dtype, docs=docs)
    o_win, reads_win = window_attention_rows(q_wide, kv_wide.win.k, kv_wide.win.v, cfg, positions,
                                             chunk_size=chunk_size, compute=cd, docs=docs)
    o = gated_sum(gates_wide, o_cmp, o_slc, o_win)
    return NSAOutput(
        o=o.to(q.dtype),
        indices=indices,
        o_cmp=o_cmp.to(q.dtype),
        o_slc=o_slc.to(q.dtype),
        o_win=o_win.to(q.dtype),
        reads=Reads(cmp=reads_cmp, slc=reads_slc, win=reads_win),
    )


def _nsa_forward_rows_on_kernels(q: Tensor, kv: BranchKV, gates: Tensor, cfg: NSAConfig, phi: PhiWeights | None,
                                 positions: Tensor, *, backend: str, chunk_size: int | None, indices: Tensor | None,
                                 docs: Documents | None) -> NSAOutput:
    """nsa_forward_rows with range_backend="triton": every branch reads the inputs in their own dtype (fp32
    accumulation inside the kernels); Eq. 7 runs in the compute dtype and is rounded to q's dtype, as compress()
    returns it; Eq. 5 is summed in the compute dtype and rounded once, in one kernel (optimized/kernels/gated_sum.py:
    bitwise the torch expression gated_sum(...widened...).to(q.dtype), with its gradients)."""
    from .kernels.gated_sum import gated_sum_kernel

    cd = compute_dtype(q.dtype)
    k_cmp, v_cmp = compress_unrounded(kv.cmp.k, kv.cmp.v, cfg, phi, docs=docs)
    k_cmp, v_cmp = k_cmp.to(q.dtype), v_cmp.to(q.dtype)
    o_cmp, cmp_softmax, reads_cmp = compressed_attention_kernel_rows(q, k_cmp, v_cmp, cfg, positions, docs)
    if indices is None:
        indices = selection_indices(q, k_cmp, cfg, positions=positions, n_keys=kv.win.k.shape[1],
                                    chunk_size=chunk_size, docs=docs, range_backend="triton",
                                    cmp_softmax=cmp_softmax)
    # o_slc stays in the kernel's dtype (Eq. 5's kernel widens it; an fp32 copy would add ~3 GB of traffic at 64k)
    o_slc, reads_slc = selected_attention_rows(q, kv.slc.k, kv.slc.v, indices, cfg, positions, backend=backend,
                                               chunk_size=chunk_size, compute=cd, kernel_dtype=q.dtype,
                                               widen_kernel_output=False, docs=docs)
    o_win, reads_win = window_attention_kernel_rows(q, kv.win.k, kv.win.v, cfg, positions, docs)
    o = gated_sum_kernel(gates, o_cmp, o_slc, o_win, compute=cd, dtype=q.dtype)  # Eq. 5 in one pass
    return NSAOutput(o=o, indices=indices, o_cmp=o_cmp, o_slc=o_slc.to(q.dtype), o_win=o_win,
                     reads=Reads(cmp=reads_cmp, slc=reads_slc, win=reads_win))


def nsa_forward(q: Tensor, kv: BranchKV, gates: Tensor, cfg: NSAConfig, phi: PhiWeights | None = None, *,
                backend: str = "auto", chunk_size: int | None = None, indices: Tensor | None = None,
                cu_seqlens: Tensor | None = None, range_backend: str = "torch",
                check_finite: bool = False) -> NSAOutput:
    """NSA prefill for queries at positions 0..T-1 over keys 0..T-1 of every branch.

    backend: selected-branch backend ("auto" | "torch" | "triton", see optimized.selected); chunk_size: query
    positions per chunk in every branch (default: sized from a memory budget); indices: teacher-forced
    selection (default: computed); cu_seqlens: a packed batch (B = 1) of documents, each computed exactly as if
    alone (document-relative indices, reads counted per document); range_backend: "torch" (default) or "triton"
    (the compressed and window branches and Eq. 8 + 10 on the range kernels; module docstring); check_finite:
    refuse NaN/Inf inputs with a ValueError naming the tensor (off by default: it reads every input once more)."""
    check_inputs(q, kv, gates, cfg)
    if check_finite:
        check_finite_inputs(q, kv, gates, phi)
    if q.shape[1] == 0:
        raise ValueError("q must hold at least one position (T >= 1)")
    positions = torch.arange(q.shape[1], device=q.device)
    return nsa_forward_rows(q, kv, gates, cfg, phi, positions, backend=backend, chunk_size=chunk_size,
                            indices=indices, cu_seqlens=cu_seqlens, range_backend=range_backend)


def decode_step(q: Tensor, kv: BranchKV, gates: Tensor, cfg: NSAConfig, phi: PhiWeights | None = None, *,
                backend: str = "auto", chunk_size: int | None = None) -> NSAOutput:
    """Decode without a cache: q [B, TQ, Hq, d_k] holds the newest TQ queries, at positions TK-TQ .. TK-1 of the
    TK keys/values in kv (which include the new tokens' own keys). Recompresses the keys each call."""
    TQ = q.shape[1]
    check_inputs(q, kv, gates, cfg, n_queries=TQ)
    TK = kv.win.k.shape[1]
    if not 1 <= TQ <= TK:
        raise ValueError(f"decode_step needs 1 <= TQ <= TK, got TQ={TQ}, TK={TK}")
    positions = torch.arange(TK - TQ, TK, device=q.device)
    return nsa_forward_rows(q, kv, gates, cfg, phi, positions, backend=backend, chunk_size=chunk_size)
