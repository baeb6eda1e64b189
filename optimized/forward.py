"""nsa_forward (prefill) and decode_step: q, k, v -> compress -> score -> select -> attend -> gate.

A call is routed once (optimized.dispatch.route: device, dtype and backend) and then runs one of two paths, each
the stages top to bottom:
- the torch path (_torch_path): every input widened once to the compute dtype, every stage in torch (chunked over
  queries, so memory stays O(T * (w + n*l' + T/d)) per head), the outputs rounded once at the end;
- the kernel path (_kernel_path): the Triton kernels on the inputs' own dtype with fp32 accumulation (the
  compressed and window branches on the range-attention kernel, Eq. 8-11 on the selection kernels, Eq. 5 on one
  kernel, Eq. 7's MLP on its own kernels under autocast, else in torch over d-row chunks).
The selected branch (Eq. 12) has its own switch (`backend`), so both paths run it through selected_branch, its one
dispatch point. The files a prefill call on the kernel path crosses are listed, in order, in optimized/__init__.py.

Convention seams (optimized.masks): the torch path asks every one at call time. The kernel path asks
compressed_block_count, sel_block_count, compressed_block_visible and window_start (as each query's key range),
eq9_pool_weights and current_sel_block, and Eq. 7's MLP kernels take block i as rows i*d .. i*d + l - 1 (as
optimized.compression.block_windows does; elsewhere Eq. 7 runs the torch seams of optimized.compression); it
computes the others itself from the config's switches (window_key_visible, cmp_importance, fixed_order_sum,
group_reduce, forced_blocks, top_n_blocks, ranked_blocks, selected_token_visible), so replacing one of those changes
the torch path only. (Decode: docs/decode.md.)
"""

from __future__ import annotations

import torch
from torch import Tensor

from reference.config import NSAConfig
from reference.contract import KV, BranchKV, NSAOutput, PhiWeights, Reads, check_finite_inputs, check_inputs

from . import masks
from .compressed import compressed_attention_rows
from .compression import compress_unrounded
from .dispatch import Route, route
from .documents import Documents, documents
from .recompute import FORWARD_TAPE, KeptSelection
from .scoring import selection_indices_rows
from .selected import selected_attention_rows
from .window import window_attention_rows

BRANCHES = ("cmp", "slc", "win")  # Eq. 5's branches, in the order of the gates


def nsa_forward(q: Tensor, kv: BranchKV, gates: Tensor, cfg: NSAConfig, phi: PhiWeights | None = None, *,
                backend: str = "auto", chunk_size: int | None = None, indices: Tensor | None = None,
                cu_seqlens: Tensor | None = None, range_backend: str = "auto",
                branches: tuple[str, ...] = BRANCHES, check_finite: bool = False) -> NSAOutput:
    """NSA prefill for queries at positions 0..T-1 over keys 0..T-1 of every branch.

    backend: the selected branch's backend, range_backend: every other stage's ("auto" | "torch" | "triton",
    optimized.dispatch); chunk_size: query positions per chunk (default: sized from a memory budget); indices:
    teacher-forced selection (default: computed); cu_seqlens: a packed batch (B = 1) of documents, each computed
    exactly as if alone (document-relative indices, reads counted per document); branches: the branches the call
    computes (default all three). A branch left out contributes nothing to o and costs no work: its output and
    reads are zero, its gate is not read (zero gradient); leaving out "slc" gives indices of -1 (leaving out "cmp"
    still compresses the keys to select blocks, without the compressed branch's attention output); check_finite:
    refuse NaN/Inf inputs with a ValueError naming the tensor (off by default: it reads every input once more)."""
    check_inputs(q, kv, gates, cfg)
    if check_finite:
        check_finite_inputs(q, kv, gates, phi)
    if q.shape[1] == 0:
        raise ValueError("q must hold at least one position (T >= 1)")
    positions = torch.arange(q.shape[1], device=q.device)
    return _forward(q, kv, gates, cfg, phi, positions, True, backend=backend, range_backend=range_backend,
                    chunk_size=chunk_size, indices=indices, cu_seqlens=cu_seqlens, branches=branches,
                    first_position=0)


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
                    chunk_size=chunk_size, first_position=TK - TQ)


def nsa_forward_rows(q: Tensor, kv: BranchKV, gates: Tensor, cfg: NSAConfig, phi: PhiWeights | None,
                     positions: Tensor, *, backend: str = "auto", chunk_size: int | None = None,
                     indices: Tensor | None = None, cu_seqlens: Tensor | None = None,
                     range_backend: str = "auto", branches: tuple[str, ...] = BRANCHES) -> NSAOutput:
    """NSA for queries q [B, TQ, Hq, dk] (gates [B, TQ, Hq, 3]) at absolute, increasing positions [TQ] over the
    TK keys of every branch in kv. indices: given selection indices [B, TQ, Hkv, n] replace Eq. 8-11
    (teacher forcing). cu_seqlens: the TK keys are a packed batch (B = 1) of documents (reference.packing);
    positions are packed positions and everything (compressed blocks, selection blocks and indices, windows) is
    document-relative. backend, range_backend, branches: see nsa_forward."""
    suffix = backend == "torch" or _queries_are_suffix(positions, kv.win.k.shape[1])
    return _forward(q, kv, gates, cfg, phi, positions, suffix, backend=backend, range_backend=range_backend,
                    chunk_size=chunk_size, indices=indices, cu_seqlens=cu_seqlens, branches=branches)


def _forward(q: Tensor, kv: BranchKV, gates: Tensor, cfg: NSAConfig, phi: PhiWeights | None, positions: Tensor,
             queries_are_suffix: bool, *, backend: str, range_backend: str, chunk_size: int | None,
             indices: Tensor | None = None, cu_seqlens: Tensor | None = None,
             branches: tuple[str, ...] = BRANCHES, first_position: int | None = None) -> NSAOutput:
    """Route once, then run one path (queries_are_suffix: the queries sit at the last TQ key positions;
    first_position: positions is arange(first_position, first_position + TQ), known on the host, so the kernel
    path plans its selection chunks without reading positions back from the device)."""
    branches = check_branches(branches)
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
    return path(q, kv, gates, cfg, phi, positions, where, n_sel_blocks, branches, chunk_size=chunk_size,
                indices=indices, docs=docs, first_position=first_position)


def _torch_path(q: Tensor, kv: BranchKV, gates: Tensor, cfg: NSAConfig, phi: PhiWeights | None, positions: Tensor,
                where: Route, n_sel_blocks: int, branches: tuple[str, ...], *, chunk_size: int | None,
                indices: Tensor | None, docs: Documents | None, first_position: int | None = None) -> NSAOutput:
    """The torch path, top to bottom. Precision: every input is widened once to the compute dtype and every branch
    and Eq. 5 run in it, so a gradient summed over uses (q in three branches, a k/v shared by branches) is rounded
    once, at the input."""
    cd = where.compute
    scoring = "slc" in branches and indices is None
    q_wide, kv_wide, gates_wide = widen(q, kv, gates, cd, _inputs_read(branches, scoring))
    o_cmp = o_slc = o_win = reads_cmp = reads_slc = reads_win = None
    if "cmp" in branches or scoring:  # Eq. 7
        k_cmp, v_cmp = compress_unrounded(kv_wide.cmp.k, kv_wide.cmp.v if "cmp" in branches else None, cfg, phi,
                                          docs=docs)
    if "cmp" in branches:  # Eq. 4
        o_cmp, reads_cmp = compressed_attention_rows(q_wide, k_cmp, v_cmp, cfg, positions, chunk_size=chunk_size,
                                                     compute=cd, docs=docs)
    if "slc" in branches:
        if indices is None:  # Eq. 8-11, scored on the compressed keys rounded as compress() returns them, so
            # nsa_forward selects exactly what select_blocks(selection_scores(q, compress(k, v)[0])) selects
            indices = selection_indices_rows(q, k_cmp.to(q.dtype), cfg, positions, n_sel_blocks,
                                             chunk_size=chunk_size, docs=docs)
        o_slc, reads_slc = selected_branch(where, q_wide, kv_wide.slc.k, kv_wide.slc.v, indices, cfg, positions,
                                           chunk_size=chunk_size, kernel_dtype=q.dtype, docs=docs)  # Eq. 12
    if "win" in branches:  # Section 3.3.3
        o_win, reads_win = window_attention_rows(q_wide, kv_wide.win.k, kv_wide.win.v, cfg, positions,
                                                 chunk_size=chunk_size, compute=cd, docs=docs)
    o = gated_sum(gates_wide, o_cmp, o_slc, o_win)  # Eq. 5
    return _output(q, cfg, o, indices, (o_cmp, o_slc, o_win), (reads_cmp, reads_slc, reads_win))


def _kernel_path(q: Tensor, kv: BranchKV, gates: Tensor, cfg: NSAConfig, phi: PhiWeights | None, positions: Tensor,
                 where: Route, n_sel_blocks: int, branches: tuple[str, ...], *, chunk_size: int | None,
                 indices: Tensor | None, docs: Documents | None, first_position: int | None = None) -> NSAOutput:
    """The kernel path, top to bottom: every branch reads the inputs in their own dtype (fp32 accumulation inside
    the kernels); Eq. 7 runs in the compute dtype and is rounded to q's dtype, as compress() returns it; Eq. 5 is
    summed in the compute dtype and rounded once, in one kernel (bitwise the torch expression
    gated_sum(...widened...).to(q.dtype), with its gradients)."""
    from .kernels import gated_sum as eq5
    from .kernels import range_attention, selection

    cd = where.compute
    scoring = "slc" in branches and indices is None
    o_cmp = o_slc = o_win = reads_cmp = reads_slc = reads_win = None
    if "cmp" in branches or scoring:
        k_cmp, v_cmp = compress_unrounded(kv.cmp.k, kv.cmp.v if "cmp" in branches else None, cfg, phi,
                                          docs=docs, on_kernels=True)  # Eq. 7
        k_cmp, v_cmp = k_cmp.to(q.dtype), None if v_cmp is None else v_cmp.to(q.dtype)
        # Eq. 4 and Eq. 8's normaliser (without v_cmp: the normaliser only)
        o_cmp, cmp_softmax, reads = range_attention.compressed_branch(q, k_cmp, v_cmp, cfg, positions, docs,
                                                                      first_position)
        reads_cmp = reads if "cmp" in branches else None
    if "win" in branches:  # Section 3.3.3
        o_win, reads_win = range_attention.window_branch(q, kv.win.k, kv.win.v, cfg, positions, docs,
                                                         first_position)
    if "slc" in branches:
        own_selection = indices is None
        # a recomputation in backward takes the forward's selection and selected output back (optimized.recompute)
        tape = FORWARD_TAPE.get() if own_selection and where.selected else None
        kept = None if tape is None else tape.next_call()
        if kept is not None and kept.replay:
            indices = kept.indices
        elif own_selection:  # Eq. 8-11
            indices = selection.selection_indices_rows(q, k_cmp, cfg, positions, n_sel_blocks, docs=docs,
                                                       cmp_softmax=cmp_softmax, chunk_size=chunk_size,
                                                       first_position=None if docs else first_position)
            if kept is not None:
                kept.indices = indices
        # Eq. 12; o_slc stays in the kernel's dtype (Eq. 5's kernel widens it, an fp32 copy would only add traffic)
        o_slc, reads_slc = selected_branch(where, q, kv.slc.k, kv.slc.v, indices, cfg, positions,
                                           chunk_size=chunk_size, compute=cd, kernel_dtype=q.dtype,
                                           widen_kernel_output=False, docs=docs,
                                           own_selection_from=first_position if own_selection else None, kept=kept)
    o = eq5.gated_sum_kernel(gates, o_cmp, o_slc, o_win, compute=cd, dtype=q.dtype)  # Eq. 5 in one pass
    return _output(q, cfg, o, indices, (o_cmp, o_slc, o_win), (reads_cmp, reads_slc, reads_win))


def _output(q: Tensor, cfg: NSAConfig, o: Tensor, indices: Tensor | None, outs: tuple[Tensor | None, ...],
            reads: tuple[Tensor | None, ...]) -> NSAOutput:
    """The NSAOutput in q's dtype; a branch left out of the call has zero output and reads (no indices: -1)."""
    B, T, Hq = q.shape[:3]
    o_cmp, o_slc, o_win = (q.new_zeros((B, T, Hq, cfg.head_dim_v)) if x is None else x.to(q.dtype) for x in outs)
    reads_cmp, reads_slc, reads_win = (torch.zeros((B, T, cfg.n_kv_heads), dtype=torch.int64, device=q.device)
                                       if r is None else r for r in reads)
    if indices is None:
        indices = torch.full((B, T, cfg.n_kv_heads, cfg.n_sel), -1, dtype=torch.int64, device=q.device)
    return NSAOutput(o=o.to(q.dtype), indices=indices, o_cmp=o_cmp, o_slc=o_slc, o_win=o_win,
                     reads=Reads(cmp=reads_cmp, slc=reads_slc, win=reads_win))


def selected_branch(where: Route, q: Tensor, k: Tensor, v: Tensor, indices: Tensor, cfg: NSAConfig,
                    positions: Tensor, *, chunk_size: int | None = None, compute: torch.dtype | None = None,
                    kernel_dtype: torch.dtype | None = None, widen_kernel_output: bool = True,
                    docs: Documents | None = None, own_selection_from: int | None = None,
                    kept: KeptSelection | None = None) -> tuple[Tensor, Tensor]:
    """The selected branch (Eq. 12) for queries q [B, TQ, Hq, dk] at positions [TQ] over keys k [B, TK, Hkv, dk],
    on the selected-attention kernel when where.selected, else on the torch path's masked attention: (o_slc
    [B, TQ, Hq, dv] in the compute dtype, reads [B, TQ, Hkv]). compute: default where.compute; kernel_dtype: the
    dtype the kernel reads (default q.dtype; the torch path passes widened inputs and the caller's dtype);
    widen_kernel_output=False returns the kernel's output in kernel_dtype (without an fp32 copy). docs: the layout
    of a packed batch (indices are document-relative blocks). own_selection_from: the queries are one sequence's
    positions from this one to the last key, and `indices` are what the selection kernels computed for them, so
    the leading rows whose selection had no choice (every block up to their own) read one contiguous key run, which
    the kernel path attends to with the range kernels (kernels/selected_attention.full_selection_ranges); ignored
    with docs (a packed batch gathers every row). kept: the call's entry of a recomputation's tape (kernel path;
    optimized.recompute), where the kernel's output and statistics are kept or taken back."""
    compute = compute or where.compute
    if not where.selected:
        return selected_attention_rows(q, k, v, indices, cfg, positions, chunk_size=chunk_size, compute=compute,
                                       docs=docs)
    from .kernels.selected_attention import admitted_reads, full_selection_ranges, triton_selected_attention

    kernel_dtype = kernel_dtype or q.dtype
    doc_start = None if docs is None else docs.token_start[positions]
    full_rows = None if own_selection_from is None or docs is not None else full_selection_ranges(
        own_selection_from, q.shape[1], cfg, q.device)
    o = triton_selected_attention(q.to(kernel_dtype), k.to(kernel_dtype), v.to(kernel_dtype), indices, cfg.sel_block,
                                  doc_start=None if doc_start is None else doc_start.to(torch.int32),
                                  full_rows=full_rows, kept=kept)
    relative = positions if doc_start is None else positions - doc_start
    return o.to(compute) if widen_kernel_output else o, admitted_reads(indices, relative, cfg.sel_block)


def gated_sum(gates: Tensor, o_cmp: Tensor | None, o_slc: Tensor | None, o_win: Tensor | None) -> Tensor:
    """Eq. 5: o = g_cmp * o_cmp + g_slc * o_slc + g_win * o_win, gates [B, T, Hq, 3] in (cmp, slc, win) order, added
    left to right; a branch left out of the call (None) is left out of the sum (its gate is not read)."""
    total = None
    for c, o_c in enumerate((o_cmp, o_slc, o_win)):
        if o_c is not None:
            term = gates[..., c:c + 1] * o_c
            total = term if total is None else total + term
    return total


def widen(q: Tensor, kv: BranchKV, gates: Tensor, dtype: torch.dtype,
          read: frozenset[str] = frozenset({"cmp.k", "cmp.v", "slc.k", "slc.v", "win.k", "win.v"}),
          ) -> tuple[Tensor, BranchKV, Tensor]:
    """q, kv, gates cast to dtype, each distinct tensor once (a k/v shared by branches stays shared); the branch
    tensors not named in `read` ("cmp.k", ...) are left as they are (a call that leaves a branch out)."""
    cast: dict[int, Tensor] = {}

    def once(t: Tensor) -> Tensor:
        if id(t) not in cast:
            cast[id(t)] = t.to(dtype)
        return cast[id(t)]

    def branch(name: str, b: KV) -> KV:
        return KV(*(once(t) if f"{name}.{part}" in read else t for part, t in (("k", b.k), ("v", b.v))))

    kv_wide = BranchKV(*(branch(name, b) for name, b in zip(BRANCHES, (kv.cmp, kv.slc, kv.win))))
    return once(q), kv_wide, once(gates)


def _inputs_read(branches: tuple[str, ...], scoring: bool) -> frozenset[str]:
    """The branch tensors a call reads: each branch's k and v, and the compressed keys when it scores blocks."""
    return frozenset({f"{b}.{part}" for b in branches for part in ("k", "v")} | ({"cmp.k"} if scoring else set()))


def check_branches(branches: tuple[str, ...]) -> tuple[str, ...]:
    """The branches a call computes, in (cmp, slc, win) order: a non-empty tuple of distinct names among BRANCHES
    (ValueError naming `branches` and the rule otherwise)."""
    if not isinstance(branches, tuple) or not all(isinstance(b, str) for b in branches):
        raise ValueError(f"branches must be a tuple of branch names among {BRANCHES}, got {branches!r}")
    unknown = [b for b in branches if b not in BRANCHES]
    if unknown:
        raise ValueError(f"branches: unknown branch name(s) {unknown}; the names are {BRANCHES}")
    if not branches:
        raise ValueError(f"branches must name at least one branch among {BRANCHES}, got ()")
    if len(set(branches)) != len(branches):
        raise ValueError(f"branches must name each branch once, got {branches!r}")
    return tuple(b for b in BRANCHES if b in branches)


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
