"""Timing one callable: warm-up, then timed runs with the L2 cache flushed before each one.

On CUDA every run is bracketed by CUDA events (the time the stream spends from the start event to the end
event, so host-side gaps inside the call count, as they would in training); before each run a buffer larger
than the L2 cache is zeroed so no run finds its inputs cached by the previous one. On CPU the same loop uses
time.perf_counter (the flush then evicts the CPU caches as far as the buffer size goes).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


def bench_ms(fn: Callable[[], object], rep_ms: int) -> float:
    """The kernel probes' timing: triton.testing.do_bench's median in ms over a rep_ms window (warm-up a quarter of
    it, at least 25 ms; the L2 flushed before every run)."""
    import triton

    return float(triton.testing.do_bench(fn, warmup=max(25, rep_ms // 4), rep=rep_ms, return_mode="median"))


@dataclass
class Samples:
    """Per-run times in milliseconds of one round."""

    times_ms: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.times_ms)

    @property
    def minimum(self) -> float:
        return min(self.times_ms)

    def quantile(self, q: float) -> float:
        ordered = sorted(self.times_ms)
        pos = q * (len(ordered) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


class Timer:
    """Times callables on one device. `flush_bytes` sizes the cache-flush buffer (allocated once)."""

    def __init__(self, device: torch.device, flush_bytes: int):
        self.device = device
        self.is_cuda = device.type == "cuda"
        self._flush = torch.empty(flush_bytes // 4, dtype=torch.int32, device=device)
        self._spin: torch.Tensor | None = None  # hold_clocks' operand, allocated on first use

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def flush_cache(self) -> None:
        self._flush.zero_()

    def hold_clocks(self, seconds: float) -> None:
        """Keep the GPU busy with bf16 matmuls for `seconds` of wall time, so the timed calls that follow start at
        its working clocks: an idle GPU sits at a few hundred MHz and ramps up over a fraction of a second, more
        than a handful of microsecond-long warm-up calls (a decode step) take. Nothing on CPU."""
        if not self.is_cuda or seconds <= 0:
            return
        if self._spin is None:
            self._spin = torch.randn(2048, 2048, device=self.device, dtype=torch.bfloat16)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            for _ in range(8):
                torch.mm(self._spin, self._spin)
            self.synchronize()

    def wall_once(self, fn: Callable[[], object]) -> float:
        """One synchronized run, wall-clock seconds (used for warm-up and to estimate a case's cost)."""
        self.synchronize()
        start = time.perf_counter()
        fn()
        self.synchronize()
        return time.perf_counter() - start

    def once_ms(self, fn: Callable[[], object]) -> float:
        """One timed run of fn after an L2 flush, in ms (CUDA events on CUDA, perf_counter otherwise): for callers
        that must time consecutive calls one by one (the decode bench's steps)."""
        self.flush_cache()
        if not self.is_cuda:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def measure(self, fn: Callable[[], object], repeats: int) -> Samples:
        """`repeats` timed runs of fn, each after an L2 flush; returns their times in ms."""
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        if self.is_cuda:
            return Samples(self._measure_cuda(fn, repeats))
        return Samples(self._measure_host(fn, repeats))

    def _measure_cuda(self, fn: Callable[[], object], repeats: int) -> list[float]:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        self.synchronize()
        for start, end in zip(starts, ends):
            self.flush_cache()
            start.record()
            fn()
            end.record()
        self.synchronize()
        return [start.elapsed_time(end) for start, end in zip(starts, ends)]

    def _measure_host(self, fn: Callable[[], object], repeats: int) -> list[float]:
        times = []
        for _ in range(repeats):
            self.flush_cache()
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return times

    def release(self) -> None:
        self._flush = torch.empty(0, dtype=torch.int32, device=self.device)


def round_spread(medians: list[float]) -> float | None:
    """Run-to-run spread of one case: (max - min) / min of its round medians; None with a single round."""
    if len(medians) < 2:
        return None
    low = min(medians)
    return (max(medians) - low) / low if low > 0 else None
