"""NSADecodeCache: incremental NSA decoding with one cache per branch (docs/decode.md).

Per batch row the cache holds
- selection branch: every key/value so far (Eq. 12 may select any block), slot t = token t;
- compression branch: the compressed tokens emitted so far (Eq. 7; block i is built once, by the call that
  appends key i*d + l - 1) and a ring of the last l raw keys/values (what the next blocks still need);
- window branch: a ring of the last W keys/values (W = keys in a full window: w, or w + 1 by switch).

Rows may hold different numbers of tokens (`lengths`). Every call takes its new tokens right-padded: row b's
first lengths[b] tokens are real, the rest padding. Padding tokens are never stored; their queries get
o = o_cmp = o_slc = o_win = 0, indices -1 and 0 reads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from reference.config import NSAConfig
from reference.contract import BranchKV, NSAOutput, PhiWeights, Reads, check_inputs

from .. import compression, dispatch, masks
from ..dispatch import KERNEL_DTYPES, check_backend, check_kernels_run_on
from ..forward import gated_sum, nsa_forward
from ..numerics import CHUNK_ELEMENTS
from . import branches, lean
from .buffers import TokenBuffer, ring_slot_positions
from .emission import complete_blocks, new_compressed_blocks
from .plan import plan_call

RowCounts = Tensor | Sequence[int] | None


def window_capacity(cfg: NSAConfig) -> int:
    """Keys in a full window, asked from the window seam: p - window_start(p) + 1 (w, or w + 1 by switch)."""
    far = torch.tensor(1 << 40)
    return int(far - masks.window_start(far, cfg)) + 1


class NSADecodeCache:
    """Per-branch KV cache for NSA decoding of `batch_size` rows of up to `capacity` tokens each.

    prefill(q, kv, gates, lengths) runs the optimized prefill on a prompt and fills the cache; step(...) appends
    one token per row; extend(...) appends a chunk of TQ tokens per row (its queries are the last TQ positions).
    Every call returns the contract's NSAOutput for its queries, with reads [B, TQ, Hkv] counted from the entries
    each branch gathered. backend: "auto" (the kernels on CUDA, optimized.dispatch), "torch" (any device) or
    "triton" (the kernels; CPU needs TRITON_INTERPRET=1), for the prefill (both of nsa_forward's backend
    keywords) as for the decode calls. Steps on the
    kernel path run the lean step (five Triton launches, optimized/decode/lean.py) unless lean_step=False, which
    keeps them on the seam-by-seam kernel path of every other call (for comparisons). Which convention seams each
    path honours: docs/decode.md. compile_stages=True runs the
    torch stages of a call (planning, the Eq. 8-11 seams, the gates; the lean step's Eq. 7 emission in fp32) through
    torch.compile (one compilation per shape; eager calls then scan up to the next power of two of the longest row,
    so shapes change rarely).
    """

    def __init__(self, cfg: NSAConfig, batch_size: int, capacity: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", phi: PhiWeights | None = None, backend: str = "auto",
                 compile_stages: bool = False, lean_step: bool = True):
        if not isinstance(cfg, NSAConfig):
            raise ValueError(f"cfg must be an NSAConfig, got {type(cfg).__name__}")
        for name, value in (("batch_size", batch_size), ("capacity", capacity)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"NSADecodeCache.{name} must be a positive int, got {value!r}")
        if not dtype.is_floating_point:
            raise ValueError(f"NSADecodeCache.dtype must be a floating dtype, got {dtype}")
        check_backend("NSADecodeCache.backend", backend)
        compression.check_phi(cfg, phi, cfg.head_dim_qk, cfg.head_dim_v)
        self.cfg, self.batch_size, self.capacity = cfg, batch_size, capacity
        self.dtype, self.device, self.backend = dtype, _resolved_device(device), backend
        self.lean_step = lean_step
        self.phi = phi.to(dtype=dtype, device=self.device) if phi is not None else None
        if backend == "triton":
            check_kernels_run_on("NSADecodeCache.backend", self.device)
        shape = dict(dtype=dtype, device=self.device)
        B, H, dk, dv = batch_size, cfg.n_kv_heads, cfg.head_dim_qk, cfg.head_dim_v
        self.history = TokenBuffer.empty(B, H, capacity, dk, dv, **shape)  # selection branch
        self.compressed = TokenBuffer.empty(B, H, masks.compressed_block_count(capacity, cfg), dk, dv, **shape)
        self.cmp_raw = TokenBuffer.empty(B, H, cfg.cmp_block, dk, dv, **shape)  # ring, R = l >= l - 1
        self.window = TokenBuffer.empty(B, H, window_capacity(cfg), dk, dv, **shape)  # ring
        self.device_lengths = torch.zeros(B, dtype=torch.int64, device=self.device)
        self._lengths = torch.zeros(B, dtype=torch.int64)
        # The pure torch stages of a call (the seams included; the lean step's Eq. 7 emission); compile_stages=True
        # fuses each into a few kernels.
        stages = (plan_call, branches.select, gate_real, new_compressed_blocks)
        self.compiled = compile_stages
        if compile_stages:
            stages = tuple(torch.compile(stage, dynamic=False) for stage in stages)
        self._plan, self._select, self._gate, self._emit = stages

    # State --------------------------------------------------------------------------------------------------
    @property
    def lengths(self) -> Tensor:
        """Tokens stored per row (int64 [B], a CPU copy)."""
        return self._lengths.clone()

    def reset(self) -> None:
        """Forget every row (buffers are overwritten as rows grow again)."""
        self.device_lengths.zero_()
        self._lengths.zero_()

    @property
    def use_kernels(self) -> bool:
        """"triton", or "auto" where optimized.dispatch picks the kernels (CUDA, a kernel dtype), as the prefill."""
        if self.backend == "triton":
            return True
        return self.backend == "auto" and dispatch.auto_picks_kernels(self.device, self.dtype)

    def uses_lean_step(self, n_queries: int = 1) -> bool:
        """Whether a call with n_queries new tokens per row runs the lean step (optimized/decode/lean.py): steps
        (n_queries = 1) on the kernel path in a kernel dtype, unless the cache was built with lean_step=False."""
        return self.lean_step and n_queries == 1 and self.use_kernels and self.dtype in KERNEL_DTYPES

    # Filling from a prompt -----------------------------------------------------------------------------------
    def fill(self, kv: BranchKV, lengths: RowCounts = None) -> None:
        """Store a prompt's keys/values kv (each branch [B, T, Hkv, D], rows right-padded to T; lengths [B] real
        tokens per row, default T) in an empty cache, compressing its complete blocks (Eq. 7)."""
        if int(self._lengths.max()) > 0:
            raise ValueError("NSADecodeCache.fill/prefill need an empty cache (call reset() first)")
        self._check_kv("kv", kv, None)
        T = kv.win.k.shape[1]
        if T > self.capacity:
            raise ValueError(f"prompt length {T} exceeds NSADecodeCache.capacity = {self.capacity}")
        counts = self._row_counts("lengths", lengths, T)
        device_counts = counts.to(self.device)
        cfg = self.cfg
        self.history.k[:, :, :T] = kv.slc.k.transpose(1, 2)
        self.history.v[:, :, :T] = kv.slc.v.transpose(1, 2)
        n_blocks = masks.compressed_block_count(T, cfg)
        per_chunk = max(1, CHUNK_ELEMENTS // (self.batch_size * cfg.n_kv_heads * cfg.cmp_block
                                              * max(cfg.head_dim_qk, cfg.head_dim_v)))
        for i0 in range(0, n_blocks, per_chunk):
            i1 = min(n_blocks, i0 + per_chunk)
            keys = slice(i0 * cfg.cmp_stride, (i1 - 1) * cfg.cmp_stride + cfg.cmp_block)  # blocks i0..i1-1
            k_cmp, v_cmp = compression.compress(kv.cmp.k[:, keys], kv.cmp.v[:, keys], cfg, self.phi)
            self.compressed.k[:, :, i0:i1] = k_cmp.transpose(1, 2)
            self.compressed.v[:, :, i0:i1] = v_cmp.transpose(1, 2)
        self.cmp_raw.fill_from(ring_slot_positions(device_counts, self.cmp_raw.slots), kv.cmp.k, kv.cmp.v)
        self.window.fill_from(ring_slot_positions(device_counts, self.window.slots), kv.win.k, kv.win.v)
        self.device_lengths.copy_(device_counts)
        self._lengths.copy_(counts)

    def prefill(self, q: Tensor, kv: BranchKV, gates: Tensor, lengths: RowCounts = None, *,
                chunk_size: int | None = None) -> NSAOutput:
        """NSA prefill of a prompt (optimized.nsa_forward) and fill(): outputs for positions 0..T-1, zero for
        padding positions (a right-padded row's real positions never see its padding: attention is causal)."""
        check_inputs(q, kv, gates, self.cfg)
        self._check_kv("kv", kv, q.shape[1])
        T = q.shape[1]
        counts = self._row_counts("lengths", lengths, T)
        if T > self.capacity:
            raise ValueError(f"prompt length {T} exceeds NSADecodeCache.capacity = {self.capacity}")
        if int(self._lengths.max()) > 0:
            raise ValueError("NSADecodeCache.fill/prefill need an empty cache (call reset() first)")
        out = nsa_forward(q, kv, gates, self.cfg, self.phi, backend=self.backend, range_backend=self.backend,
                          chunk_size=chunk_size)
        self.fill(kv, counts)
        real = torch.arange(T)[None, :] < counts[:, None]
        return _zero_padding(out, real.to(self.device))

    # Appending ------------------------------------------------------------------------------------------------
    def extend(self, q: Tensor, kv: BranchKV, gates: Tensor, lengths: RowCounts = None) -> NSAOutput:
        """Append a chunk: q [B, TQ, Hq, dk], kv (new keys/values of each branch [B, TQ, Hkv, D]), gates
        [B, TQ, Hq, 3]; lengths [B] real new tokens per row (default TQ). Query i of row b sits at position
        cache.lengths[b] + i and sees the cached keys and the chunk's keys up to itself."""
        counts = self.check_call(q, kv, gates, lengths)
        after = self._lengths + counts
        emit = bool((complete_blocks(after, self.cfg) > complete_blocks(self._lengths, self.cfg)).any())
        bound = max(1, int(after.max()))
        if self.compiled:  # few distinct scan ranges, so few compilations
            bound = min(self.capacity, max(256, 1 << (bound - 1).bit_length()))
        out = self.advance(q, kv, gates, counts.to(self.device), bound, emit=emit)
        self._lengths.copy_(after)
        return out

    def step(self, q: Tensor, kv: BranchKV, gates: Tensor, lengths: RowCounts = None) -> NSAOutput:
        """Append one token per row (q [B, 1, Hq, dk]); lengths [B] in {0, 1} leaves rows with 0 unchanged."""
        if q.dim() != 4 or q.shape[1] != 1:
            raise ValueError(f"step needs q [B, 1, Hq, dk] (one new token per row), got {tuple(q.shape)}; "
                             "use extend for chunks")
        return self.extend(q, kv, gates, lengths)

    def advance(self, q: Tensor, kv: BranchKV, gates: Tensor, n_new: Tensor, bound: int, *,
                emit: bool = True) -> NSAOutput:
        """The decode call on validated inputs, without host synchronisation (a CUDA graph can capture it):
        n_new [B] int64 on the cache's device; bound = a static upper bound on every row's length after the call
        (it sizes the compressed-token and selection-block ranges the call scans); emit=False skips Eq. 7 when no
        row completes a compressed block. Advances device_lengths; the caller keeps the host copy
        (set_host_lengths)."""
        if not 1 <= bound <= self.capacity:
            raise ValueError(f"advance: bound must be in 1..capacity ({self.capacity}), got {bound}")
        cfg = self.cfg
        L = self.device_lengths
        if self.uses_lean_step(q.shape[1]):
            if emit and lean.emits_in_kernel(self.dtype):  # Eq. 7, before the step's key enters the raw ring
                lean.lean_emit(self, kv, n_new)
            elif emit:  # fp32 caches: phi in float64 (dispatch.compute_dtype), in torch
                blocks = self._emit(self.cmp_raw.usable(), L, n_new, kv.cmp.k, kv.cmp.v, cfg, self.phi,
                                    trash=self.compressed.trash)
                self.compressed.write(blocks.slots, blocks.k, blocks.v)
            return lean.lean_step(self, q, kv, gates, n_new, bound)  # appends, attends, advances L
        plan = self._plan(L, n_new, kv, self.cmp_raw.usable(), self.window.usable(), cfg, self.phi, emit=emit,
                          history_trash=self.history.trash, compressed_trash=self.compressed.trash)
        if plan.new_blocks is not None:
            self.compressed.write(plan.new_blocks.slots, plan.new_blocks.k, plan.new_blocks.v)
        self.cmp_raw.write(plan.raw_slots, kv.cmp.k, kv.cmp.v)
        self.history.write(plan.history_slots, kv.slc.k, kv.slc.v)
        self.window.write(plan.window_slots, kv.win.k, kv.win.v)

        use_kernels = self.use_kernels
        visible = branches.compressed_visible(plan.positions, plan.emitted, masks.compressed_block_count(bound, cfg),
                                              cfg)
        cmp, logits = branches.compressed_branch(q, self.compressed, visible, use_kernels)
        indices = self._select(logits, visible, plan.positions, masks.sel_block_count(bound, cfg), cfg)
        slc = branches.selected_branch(q, self.history, indices, plan.positions, cfg, use_kernels)
        window_keys = plan.window_chunk if plan.window_chunk is not None else self.window.usable()
        win = branches.window_branch(q, window_keys, plan.window_admitted, use_kernels)
        L.add_(n_new)
        return NSAOutput(o=self._gate(gates, cmp.o, slc.o, win.o, plan.real), indices=indices, o_cmp=cmp.o,
                         o_slc=slc.o, o_win=win.o, reads=Reads(cmp=cmp.reads, slc=slc.reads, win=win.reads))

    def check_call(self, q: Tensor, kv: BranchKV, gates: Tensor, lengths: RowCounts) -> Tensor:
        """Validate an extend/step call; returns the new tokens per row (CPU int64 [B])."""
        check_inputs(q, kv, gates, self.cfg)
        self._check_kv("kv", kv, q.shape[1])
        TQ = q.shape[1]
        if TQ == 0:
            raise ValueError("q must hold at least one new query (TQ >= 1)")
        counts = self._row_counts("lengths", lengths, TQ)
        after = self._lengths + counts
        if int(after.max()) > self.capacity:
            raise ValueError(f"appending {counts.tolist()} tokens to rows holding {self._lengths.tolist()} exceeds "
                             f"NSADecodeCache.capacity = {self.capacity}")
        return counts

    def set_host_lengths(self, lengths: Tensor) -> None:
        """Record the rows' lengths after calls that ran without the host (DecodeGraph replays)."""
        self._lengths.copy_(lengths)

    # Validation -----------------------------------------------------------------------------------------------
    def _check_kv(self, name: str, kv: BranchKV, length: int | None) -> None:
        for branch in ("cmp", "slc", "win"):
            for part, t, dim in (("k", kv.branch(branch).k, self.cfg.head_dim_qk),
                                 ("v", kv.branch(branch).v, self.cfg.head_dim_v)):
                where = f"{name}.{branch}.{part}"
                if not isinstance(t, Tensor) or t.dim() != 4:
                    raise ValueError(f"{where} must be a 4-dim tensor [B, T, Hkv, D]")
                if t.shape[0] != self.batch_size or t.shape[2] != self.cfg.n_kv_heads or t.shape[3] != dim:
                    raise ValueError(f"{where} must be [B={self.batch_size}, T, Hkv={self.cfg.n_kv_heads}, {dim}], "
                                     f"got {tuple(t.shape)}")
                if length is not None and t.shape[1] != length:
                    raise ValueError(f"{where} holds {t.shape[1]} tokens but q holds {length}")
                if t.shape[1] != kv.win.k.shape[1]:
                    raise ValueError(f"{where} holds {t.shape[1]} tokens, kv.win.k {kv.win.k.shape[1]}")
                if t.dtype != self.dtype or t.device != self.device:
                    raise ValueError(f"{where} is {t.dtype} on {t.device}; the cache is {self.dtype} on {self.device}")

    def _row_counts(self, name: str, counts: RowCounts, limit: int) -> Tensor:
        """A CPU int64 [B] tensor of per-row token counts in 0..limit (default: limit for every row)."""
        if counts is None:
            return torch.full((self.batch_size,), limit, dtype=torch.int64)
        values = torch.as_tensor(counts).detach().cpu()
        if values.dtype.is_floating_point or values.dtype == torch.bool or values.shape != (self.batch_size,):
            raise ValueError(f"{name} must hold one integer per batch row ({self.batch_size}), got "
                             f"{values.dtype} of shape {tuple(values.shape)}")
        values = values.to(torch.int64)
        if bool((values < 0).any()) or bool((values > limit).any()):
            raise ValueError(f"{name} must be in 0..{limit} (tokens per row of a right-padded batch), "
                             f"got {values.tolist()}")
        return values


def gate_real(gates: Tensor, o_cmp: Tensor, o_slc: Tensor, o_win: Tensor, real: Tensor) -> Tensor:
    """Eq. 5 gated sum for the real queries (real [B, TQ]); padding queries get 0 whatever their gates hold."""
    o = gated_sum(gates, o_cmp, o_slc, o_win)
    return torch.where(real[:, :, None, None], o, torch.zeros_like(o))


def _zero_padding(out: NSAOutput, real: Tensor) -> NSAOutput:
    """Outputs of padding positions (real [B, T] False) set to 0, their indices to -1 and reads to 0."""
    r4 = real[:, :, None, None]

    def zero(t: Tensor) -> Tensor:
        return torch.where(r4, t, torch.zeros_like(t))

    r3 = real[:, :, None]
    return NSAOutput(o=zero(out.o), indices=torch.where(r4, out.indices, torch.full_like(out.indices, -1)),
                     o_cmp=zero(out.o_cmp), o_slc=zero(out.o_slc), o_win=zero(out.o_win),
                     reads=Reads(*(torch.where(r3, r, torch.zeros_like(r)) for r in
                                   (out.reads.cmp, out.reads.slc, out.reads.win))))


__all__ = ["NSADecodeCache", "window_capacity"]


def _resolved_device(device: torch.device | str) -> torch.device:
    """The device with its index filled in ("cuda" -> "cuda:N" of the current device), so that the input
    check compares it equal to the device tensors report."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
