"""nsa_forward (prefill) and decode_step: q, k, v -> compress -> score -> select -> attend -> gate.

A call is routed once (optimized.dispatch.route: device, dtype and backend) and then runs one of two paths, each
the stages top to bottom:
- the torch path (_torch_path): every input widened once to the compute dtype, every stage in torch (chunked over
  queries, so memory stays O(T * (w + n*l' + T/d)) per head), the outputs rounded once at the end;
- the kernel path (_kernel_path): the Triton kernels on the inputs' own dtype with fp32 accumulation (the
  compressed and window branches on the range-attention kernel, Eq. 8-11 on the selection kernels, Eq. 5 on one
  kernel); Eq. 7 stays in torch.
The selected branch (Eq. 12) has its own switch (`backend`), so both paths run it through selected_branch, its one
dispatch point. The files a prefill call on the kernel path crosses are listed, in order, in optimized/__init__.py.
"""

from __future__ import annotations

import torch
from torch import Tensor

from reference.config import NSAConfig
from reference.contract import KV, BranchKV, NSAOutput, PhiWeights, Reads, check_inputs

from . import masks
from .compressed import compressed_attention_rows
from .compression import compress_unrounded
from .dispatch import Route, route
from .documents import Documents, documents
from .scoring import selection_indices_rows
from .selected import selected_attention_rows
from .window import window_attention_rows


def nsa_forward(q: Tensor, kv: BranchKV, gates: Tensor, cfg: NSAConfig, phi: PhiWeights | None = None, *,
                backend: str = "auto", chunk_size: int | None = None, indices: Tensor | None = None,
                cu_seqlens: Tensor | None = None, range_backend: str = "auto") -> NSAOutput:
    """NSA prefill for queries at positions 0..T-1 over keys 0..T-1 of every branch.

    backend: the selected branch's backend, range_backend: every other stage's ("auto" | "torch" | "triton",
    optimized.dispatch); chunk_size: query positions per chunk (default: sized from a memory budget); indices:
    teacher-forced selection (default: computed); cu_seqlens: a packed batch (B = 1) of documents, each computed
    exactly as if alone (document-relative indices, reads counted per document)."""
    check_inputs(q, kv, gates, cfg)
    if q.shape[1] == 0:
        raise ValueError("q must hold at least one position (T >= 1)")
    positions = torch.arange(q.shape[1], device=q.device)
    return _forward(q, kv, gates, cfg, phi, positions, True, backend=backend, range_backend=range_backend,
                    chunk_size=chunk_size, indices=indices, cu_seqlens=cu_seqlens)


def decode_step(q: Tensor, kv: BranchKV, gates: Tensor, cfg: NSAConfig, phi: PhiWeights | None = None, *,
                backend: str = "auto", chunk_size: int | None = None, range_backend: str = "auto") -> NSAOutput:
    """Decode without a cache: q [B, TQ, Hq, d_k] holds the newest TQ queries, at positions TK-TQ .. TK-1 of the
    TK keys/values in kv (which include the new tokens' own keys). Recompresses the keys each call."""
    TQ = q.shape[1]
    check_inputs(q, kv, gates, cfg, n_queries=TQ)
    TK = kv.win.k.shape[1]
    if not 1 <= TQ <= TK:
        raise ValueError(f"decode_step needs 1 <= TQ <= TK, got TQ={TQ}, TK={TK}")
    positions = torch.arange(TK - TQ, TK, device=q.device)
    return _forward(q, kv, gates, cfg, phi, positions, True, backend=backend, range_backend=range_backend,
                    chunk_size=chunk_size)


def nsa_forward_rows(q: Tensor, kv: BranchKV, gates: Tensor, cfg: NSAConfig, phi: PhiWeights | None,
                     positions: Tensor, *, backend: str = "auto", chunk_size: int | None = None,
                     indices: Tensor | None = None, cu_seqlens: Tensor | None = None,
                     range_backend: str = "auto") -> NSAOutput:
    """NSA for queries q [B, TQ, Hq, dk] (gates [B, TQ, Hq, 3]) at absolute, increasing positions [TQ] over the
    TK keys of every branch in kv. indices: given selection indices [B, TQ, Hkv, n] replace Eq. 8-11
    (teacher forcing). cu_seqlens: the TK keys are a packed batch (B = 1) of documents (reference.packing);
    positions are packed positions and everything (compressed blocks, selection blocks and indices, windows) is
    document-relative. backend, range_backend: see nsa_forward."""
    suffix = backend == "torch" or _queries_are_suffix(positions, kv.win.k.shape[1])
    return _forward(q, kv, gates, cfg, phi, positions, suffix, backend=backend, range_backend=range_backend,
                    chunk_size=chunk_size, indices=indices, cu_seqlens=cu_seqlens)


def _forward(q: Tensor, kv: BranchKV, gates: Tensor, cfg: NSAConfig, phi: PhiWeights | None, positions: Tensor,
             queries_are_suffix: bool, *, backend: str, range_backend: str, chunk_size: int | None,
             indices: Tensor | None = None, cu_seqlens: Tensor | None = None) -> NSAOutput:
    """Route once, then run one path (queries_are_suffix: the queries sit at the last TQ key positions)."""
    n_keys = kv.win.k.shape[1]
    where = route(q, kv.slc.k, kv.slc.v, backend=backend, range_backend=range_backend,
                  queries_are_suffix=queries_are_suffix)
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of query positions, got {chunk_size}")
    docs = None if cu_seqlens is None else documents(cu_seqlens, n_keys, q.shape[0], cfg, q.device)
    n_sel_blocks = masks.sel_block_count(n_keys, cfg) if docs is None else docs.n_sel_blocks  # NB of a row
    if indices is not None:
        check_indices(indices, q, cfg)
    path = _kernel_path if where.ranges else _torch_path
    return path(q, kv, gates, cfg, phi, positions, where, n_sel_blocks, chunk_size=chunk_size, indices=indices,
                docs=docs)


def _torch_path(q: Tensor, kv: BranchKV, gates: Tensor, cfg: NSAConfig, phi: PhiWeights | None, positions: Tensor,
                where: Route, n_sel_blocks: int, *, chunk_size: int | None, indices: Tensor | None,
                docs: Documents | None) -> NSAOutput:
    """The torch path, top to bottom. Precision: every input is widened once to the compute dtype and every branch
    and Eq. 5 run in it, so a gradient summed over uses (q in three branches, a k/v shared by branches) is rounded
    once, at the input."""
    cd = where.compute
    q_wide, kv_wide, gates_wide = widen(q, kv, gates, cd)
    k_cmp, v_cmp = compress_unrounded(kv_wide.cmp.k, kv_wide.cmp.v, cfg, phi, docs=docs)  # Eq. 7
    o_cmp, reads_cmp = compressed_attention_rows(q_wide, k_cmp, v_cmp, cfg, positions, chunk_size=chunk_size,
                                                 compute=cd, docs=docs)  # Eq. 4
    if indices is None:  # Eq. 8-11, scored on the compressed keys rounded as compress() returns them, so
        # nsa_forward selects exactly what select_blocks(selection_scores(q, compress(k, v)[0])) selects
        indices = selection_indices_rows(q, k_cmp.to(q.dtype), cfg, positions, n_sel_blocks, chunk_size=chunk_size,
                                         docs=docs)
    o_slc, reads_slc = selected_branch(where, q_wide, kv_wide.slc.k, kv_wide.slc.v, indices, cfg, positions,
                                       chunk_size=chunk_size, kernel_dtype=q.dtype, docs=docs)  # Eq. 12
    o_win, reads_win = window_attention_rows(q_wide, kv_wide.win.k, kv_wide.win.v, cfg, positions,
                                             chunk_size=chunk_size, compute=cd, docs=docs)  # Section 3.3.3
    o = gated_sum(gates_wide, o_cmp, o_slc, o_win)  # Eq. 5
    return NSAOutput(o=o.to(q.dtype), indices=indices, o_cmp=o_cmp.to(q.dtype), o_slc=o_slc.to(q.dtype),
                     o_win=o_win.to(q.dtype), reads=Reads(cmp=reads_cmp, slc=reads_slc, win=reads_win))


def _kernel_path(q: Tensor, kv: BranchKV, gates: Tensor, cfg: NSAConfig, phi: PhiWeights | None, positions: Tensor,
                 where: Route, n_sel_blocks: int, *, chunk_size: int | None, indices: Tensor | None,
                 docs: Documents | None) -> NSAOutput:
    """The kernel path, top to bottom: every branch reads the inputs in their own dtype (fp32 accumulation inside
    the kernels); Eq. 7 runs in the compute dtype and is rounded to q's dtype, as compress() returns it; Eq. 5 is
    summed in the compute dtype and rounded once, in one kernel (bitwise the torch expression
    gated_sum(...widened...).to(q.dtype), with its gradients)."""
    from .kernels import gated_sum as eq5
    from .kernels import range_attention, selection

    cd = where.compute
    k_cmp, v_cmp = compress_unrounded(kv.cmp.k, kv.cmp.v, cfg, phi, docs=docs)  # Eq. 7
    k_cmp, v_cmp = k_cmp.to(q.dtype), v_cmp.to(q.dtype)
    o_cmp, cmp_softmax, reads_cmp = range_attention.compressed_branch(q, k_cmp, v_cmp, cfg, positions,
                                                                      docs)  # Eq. 4, and Eq. 8's normaliser
    o_win, reads_win = range_attention.window_branch(q, kv.win.k, kv.win.v, cfg, positions, docs)  # Section 3.3.3
    if indices is None:  # Eq. 8-11
        indices = selection.selection_indices_rows(q, k_cmp, cfg, positions, n_sel_blocks, docs=docs,
                                                   cmp_softmax=cmp_softmax, chunk_size=chunk_size)
    # Eq. 12; o_slc stays in the kernel's dtype (Eq. 5's kernel widens it, an fp32 copy would only add traffic)
    o_slc, reads_slc = selected_branch(where, q, kv.slc.k, kv.slc.v, indices, cfg, positions, chunk_size=chunk_size,
                                       compute=cd, kernel_dtype=q.dtype, widen_kernel_output=False, docs=docs)
    o = eq5.gated_sum_kernel(gates, o_cmp, o_slc, o_win, compute=cd, dtype=q.dtype)  # Eq. 5 in one pass
    return NSAOutput(o=o, indices=indices, o_cmp=o_cmp, o_slc=o_slc.to(q.dtype), o_win=o_win,
                     reads=Reads(cmp=reads_cmp, slc=reads_slc, win=reads_win))


def selected_branch(where: Route, q: Tensor, k: Tensor, v: Tensor, indices: Tensor, cfg: NSAConfig,
                    positions: Tensor, *, chunk_size: int | None = None, compute: torch.dtype | None = None,
                    kernel_dtype: torch.dtype | None = None, widen_kernel_output: bool = True,
                    docs: Documents | None = None) -> tuple[Tensor, Tensor]:
    """The selected branch (Eq. 12) for queries q [B, TQ, Hq, dk] at positions [TQ] over keys k [B, TK, Hkv, dk],
    on the selected-attention kernel when where.selected, else on the torch path's masked attention: (o_slc
    [B, TQ, Hq, dv] in the compute dtype, reads [B, TQ, Hkv]). compute: default where.compute; kernel_dtype: the
    dtype the kernel reads (default q.dtype; the torch path passes widened inputs and the caller's dtype);
    widen_kernel_output=False returns the kernel's output in kernel_dtype (without an fp32 copy). docs: the layout
    of a packed batch (indices are document-relative blocks)."""
    compute = compute or where.compute
    if not where.selected:
        return selected_attention_rows(q, k, v, indices, cfg, positions, chunk_size=chunk_size, compute=compute,
                                       docs=docs)
    from .kernels.selected_attention import admitted_reads, triton_selected_attention

    kernel_dtype = kernel_dtype or q.dtype
    doc_start = None if docs is None else docs.token_start[positions]
    o = triton_selected_attention(q.to(kernel_dtype), k.to(kernel_dtype), v.to(kernel_dtype), indices, cfg.sel_block,
                                  doc_start=None if doc_start is None else doc_start.to(torch.int32))
    relative = positions if doc_start is None else positions - doc_start
    return o.to(compute) if widen_kernel_output else o, admitted_reads(indices, relative, cfg.sel_block)


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


def check_indices(indices: Tensor, q: Tensor, cfg: NSAConfig) -> None:
    """Teacher-forced indices must be int64 [B, T, Hkv, n] on q's device (ValueError naming the rule)."""
    if not isinstance(indices, Tensor) or indices.ndim != 4 or indices.dtype != torch.int64:
        raise ValueError("indices must be an int64 tensor [B, T, Hkv, n]")
    if tuple(indices.shape[:3]) != (q.shape[0], q.shape[1], cfg.n_kv_heads):
        raise ValueError(f"indices must be [B, T, Hkv, n] = [{q.shape[0]}, {q.shape[1]}, {cfg.n_kv_heads}, n], "
                         f"got {tuple(indices.shape)}")
    if indices.device != q.device:
        raise ValueError(f"indices is on {indices.device} but q is on {q.device}")


def _queries_are_suffix(positions: Tensor, n_keys: int) -> bool:
    """Whether the queries sit at the last TQ of the n_keys key positions (one device sync)."""
    TQ = positions.shape[0]
    return TQ > 0 and int(positions[0]) == n_keys - TQ and int(positions[-1]) == n_keys - 1
