"""DecodeGraph: an NSADecodeCache call captured as CUDA graphs, so a decode step costs one graph launch instead of
hundreds of Python-dispatched kernel launches. A step (n_queries = 1) on the kernel path captures the lean step:
five Triton launches (plus the Eq. 7 emission's one or two in the graph that emits), nothing to compile.

A captured call scans a static range of compressed tokens and selection blocks, sized by `horizon` (every row must
stay <= horizon tokens); the cache's lengths live on the device and the graph advances them itself. Two graphs are
captured: one that compresses the blocks the new tokens complete (Eq. 7) and one for calls where no row completes a
block (d - 1 of every d steps when rows move together); the host, which knows every row's length, picks one.
"""

from __future__ import annotations

import torch
from torch import Tensor

from reference.contract import KV, BranchKV, NSAOutput

from .cache import NSADecodeCache, RowCounts
from .emission import complete_blocks


class DecodeGraph:
    """Replays `cache.extend` (n_queries new tokens per row; 1 = step) for as long as rows stay <= horizon.

    Calling it copies the inputs into the graph's static buffers and replays; the returned NSAOutput's tensors are
    the graph's static outputs, overwritten by the next call (clone what you keep)."""

    def __init__(self, cache: NSADecodeCache, horizon: int, *, n_queries: int = 1, warmup: int = 2):
        if cache.device.type != "cuda":
            raise ValueError(f"DecodeGraph needs a CUDA cache, got device {cache.device}")
        if not int(cache.lengths.max()) < horizon <= cache.capacity:
            raise ValueError(f"DecodeGraph.horizon must be in ({int(cache.lengths.max())}, {cache.capacity}] (above "
                             f"every row's length, within the capacity), got {horizon}")
        if n_queries < 1:
            raise ValueError(f"DecodeGraph.n_queries must be >= 1, got {n_queries}")
        cfg = cache.cfg
        self.cache, self.horizon, self.n_queries = cache, horizon, n_queries
        B, dev, dt = cache.batch_size, cache.device, cache.dtype

        def zeros(*shape: int) -> Tensor:
            return torch.zeros(shape, dtype=dt, device=dev)

        self.q = zeros(B, n_queries, cfg.n_heads, cfg.head_dim_qk)
        self.kv = BranchKV(*(KV(zeros(B, n_queries, cfg.n_kv_heads, cfg.head_dim_qk),
                                zeros(B, n_queries, cfg.n_kv_heads, cfg.head_dim_v)) for _ in range(3)))
        self.gates = zeros(B, n_queries, cfg.n_heads, 3)
        self.n_new = torch.zeros(B, dtype=torch.int64, device=dev)  # zeros: warm-up calls leave the cache unchanged
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                for emit in (True, False):
                    self._call(emit)
        torch.cuda.current_stream(dev).wait_stream(side)
        self.graphs: dict[bool, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[bool, NSAOutput] = {}
        for emit in (True, False):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.outputs[emit] = self._call(emit)
            self.graphs[emit] = graph

    def _call(self, emit: bool) -> NSAOutput:
        return self.cache.advance(self.q, self.kv, self.gates, self.n_new, self.horizon, emit=emit)

    def needs_emission(self, counts: Tensor) -> bool:
        """Whether any row completes a compressed block among its counts[b] new tokens (host lengths)."""
        before = self.cache.lengths
        return bool((complete_blocks(before + counts, self.cache.cfg) > complete_blocks(before, self.cache.cfg)).any())

    def __call__(self, q: Tensor, kv: BranchKV, gates: Tensor, lengths: RowCounts = None) -> NSAOutput:
        cache = self.cache
        counts = cache.check_call(q, kv, gates, lengths)
        after = cache.lengths + counts
        if int(after.max()) > self.horizon:
            raise ValueError(f"a row would hold {int(after.max())} tokens, past DecodeGraph.horizon = {self.horizon}: "
                             "capture a new DecodeGraph with a larger horizon")
        self.load_inputs(q, kv, gates, counts)
        emit = self.needs_emission(counts)
        self.graphs[emit].replay()
        cache.set_host_lengths(after)
        return self.outputs[emit]

    def load_inputs(self, q: Tensor, kv: BranchKV, gates: Tensor, counts: Tensor | int) -> None:
        """Copy a call's inputs into the static buffers the graphs read (counts: new tokens per row, or one count
        for every row); benchmarks load once and time replay()."""
        self.q.copy_(q)
        self.gates.copy_(gates)
        for static, new in zip((self.kv.cmp, self.kv.slc, self.kv.win), (kv.cmp, kv.slc, kv.win)):
            static.k.copy_(new.k)
            static.v.copy_(new.v)
        if isinstance(counts, int):
            self.n_new.fill_(counts)
        else:
            self.n_new.copy_(counts, non_blocking=True)

    def replay(self, emit: bool) -> None:
        """Replay one captured call on the inputs already in the static buffers (benchmarks time this); the caller
        keeps the host lengths in step (cache.set_host_lengths)."""
        self.graphs[emit].replay()
