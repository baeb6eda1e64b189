"""The sweep: ceilings, then every case in priority order, inside a wall-clock budget.

Order: phase 1 times the whole layer (SDPA, every NSA variant and every other library, fwd and fwd_bwd) for every
T, so the headline speedups are measured first; phase 2 times the NSA stages for every T.

Budget: before each warm-up call the runner checks that this call (at the last measured time per call) ends
inside the budget, and before the timed rounds that all of them (at the last warm-up's time) do; first calls
that compile or autotune are never taken for the cost of the warm calls. A case that would not fit is recorded
as skipped with its estimate, and the sweep goes on with cheaper cases. A case whose previous-T time, scaled
as T^2, already cannot fit is skipped before its inputs are built. `--resume` runs the skipped cases in a
later command and merges the rows.

Each case runs in its own memory accounting (peak stats reset, inputs built inside); an out-of-memory case
is recorded as "oom" and any other exception as "error" (with its message), and the sweep continues.
"""

from __future__ import annotations

import gc
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .cases import WORKLOADS, Inputs, Prepared, build_nsa_case, build_sdpa_case, document_lengths
from .ceilings import Ceilings, measure_ceilings
from .flops import StageWork
from .implementations import SDPA, NSAImplementation
from .results import ERROR, OK, OOM, SKIPPED, Row
from .spec import LAYER, BenchSpec
from .timing import Samples, Timer, round_spread


@dataclass
class Plan:
    """One case to run: its row identity and how to build it from the inputs of its T."""

    seq_len: int
    impl: str
    stage: str
    pass_name: str
    build: Callable[[Inputs], Prepared]


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


class Runner:
    def __init__(self, spec: BenchSpec, device: torch.device, with_sdpa: bool, variants: list[NSAImplementation],
                 log: Callable[[str], None] = print, workload: str = "single", peers: list | None = None):
        if workload not in WORKLOADS:
            raise ValueError(f"unknown workload {workload!r}; known: {sorted(WORKLOADS)}")
        self.spec, self.device, self.with_sdpa, self.variants = spec, device, with_sdpa, variants
        self.peers = list(peers or [])  # other libraries (perf.peers.FlaNSA): whole layer only, no work model
        for peer in self.peers:
            peer.check(spec, device)
            if workload != "single":
                raise ValueError(f"--impls {peer.label}: only the single-sequence workload")
        self.log, self.workload = log, workload
        self.is_cuda = device.type == "cuda"
        if not self.is_cuda:
            torch.set_num_threads(spec.cpu_threads)
        self.timer = Timer(device, spec.flush_bytes)
        self.ceilings: Ceilings | None = None
        self._call_s: dict[tuple[str, str, str], tuple[int, float]] = {}  # last (T, seconds per call) per case
        self.started = time.perf_counter()

    # budget -----------------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def remaining(self) -> float:
        return self.spec.time_budget_s - self.elapsed()

    # plan -------------------------------------------------------------------------------------------
    def plan(self) -> list[Plan]:
        spec = self.spec
        plans: list[Plan] = []
        for T in spec.seq_lens:
            for pass_name in spec.passes:
                if self.with_sdpa:
                    plans.append(Plan(T, SDPA, LAYER, pass_name,
                                      lambda inp, p=pass_name: build_sdpa_case(p, inp, spec, seed=11)))
                for impl in self.variants:
                    plans.append(Plan(T, impl.label, LAYER, pass_name,
                                      lambda inp, i=impl, p=pass_name: build_nsa_case(i, LAYER, p, inp, spec, 11)))
                for peer in self.peers:
                    plans.append(Plan(T, peer.label, LAYER, pass_name,
                                      lambda inp, q=peer, p=pass_name: q.build_case(p, inp, spec, 11)))
        for T in spec.seq_lens:
            for impl in self.variants:
                for stage in spec.stages:
                    for pass_name in spec.passes:
                        plans.append(Plan(T, impl.label, stage, pass_name,
                                          lambda inp, i=impl, s=stage, p=pass_name:
                                          build_nsa_case(i, s, p, inp, spec, 11)))
        return plans

    # run --------------------------------------------------------------------------------------------
    def measure_ceilings(self) -> Ceilings:
        spec = self.spec
        self.ceilings = measure_ceilings(self.timer, spec.torch_dtype, spec.dtype, spec.matmul_size, spec.copy_bytes,
                                         spec.repeats * spec.rounds, max(1, spec.warmup))
        c = self.ceilings
        self.log(f"ceilings: matmul {c.matmul_size}^3 {c.dtype}: {c.matmul_tflops:.1f} TFLOP/s "
                 f"({c.matmul_median_ms:.3f} ms); copy {c.copy_bytes / 2**20:.0f} MiB: {c.copy_gbps:.1f} GB/s")
        return c

    def run(self, done: frozenset[str] = frozenset(),
            on_row: Callable[[list[Row]], None] | None = None) -> list[Row]:
        """Every planned case except those whose row key is in `done` (measured by an earlier sweep).
        on_row(rows so far) runs after each case (the CLI saves the CSV there, so a killed sweep keeps its rows)."""
        if self.ceilings is None:
            self.measure_ceilings()
        rows = []
        for plan in self.plan():
            row = Row(seq_len=plan.seq_len, impl=plan.impl, stage=plan.stage, pass_name=plan.pass_name,
                      status=SKIPPED, workload=self.workload)
            if row.key in done:
                continue
            self.run_case(plan, row)
            rows.append(row)
            self.log(_describe(row))
            if on_row is not None:
                on_row(rows)
        return rows

    def _reset_memory(self) -> None:
        """Free the previous case's tensors (reference cycles included) and restart the peak statistics."""
        if self.is_cuda:
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)

    def _predicted_call_s(self, plan: Plan) -> float | None:
        """Seconds per call predicted from the same case at the previous T, scaled as T^2 (attention's upper
        bound), so a case that cannot fit is skipped before its inputs are even built."""
        previous = self._call_s.get((plan.impl, plan.stage, plan.pass_name))
        if previous is None:
            return None
        T0, seconds = previous
        return seconds * (plan.seq_len / T0) ** 2

    def _skip(self, row: Row, per_call_s: float, calls: int, how: str, use_cap: bool = True) -> bool:
        """Mark row skipped when `calls` more calls of per_call_s would end past the budget, or (use_cap) take
        longer than the per-case cap (BenchSpec.case_cap_s)."""
        cost = per_call_s * calls
        cap = self.spec.case_cap_s
        if use_cap and cap is not None and cost > cap:
            row.status = SKIPPED
            row.note = (f"skipped by the per-case cap: {calls} more calls of ~{per_call_s * 1e3:.0f} ms ({how}) need "
                        f"~{cost:.0f} s > {cap:.0f} s")
            return True
        if cost <= self.remaining():
            return False
        row.status = SKIPPED
        row.note = (f"skipped by the time budget: {calls} more calls of ~{per_call_s * 1e3:.0f} ms ({how}) need "
                    f"~{cost:.0f} s, {max(0.0, self.remaining()):.0f} s of {self.spec.time_budget_s:.0f} s left")
        return True

    def run_case(self, plan: Plan, row: Row) -> Row:
        """Fill row with the case's timing (or its skip / OOM / error) and its work and floors."""
        spec = self.spec
        timed_calls = spec.repeats * spec.rounds
        predicted = self._predicted_call_s(plan)
        if self.remaining() <= 0:
            row.note = f"skipped: the time budget of {spec.time_budget_s:.0f} s was used up before this case"
            self._fill_work(row)
            return row
        if predicted is not None and self._skip(row, predicted, 1 + spec.warmup + timed_calls,
                                                "predicted from the previous T as T^2"):
            self._fill_work(row)
            return row
        self._reset_memory()
        if self.is_cuda:
            row.start_mem_bytes = torch.cuda.memory_allocated(self.device)
        prepared = None
        try:
            inputs = WORKLOADS[self.workload](spec, plan.seq_len, self.device, seed=self._seed(plan.seq_len))
            started = time.perf_counter()
            prepared = plan.build(inputs)  # includes the first call (compilation, autotuning)
            estimate = time.perf_counter() - started
            del inputs
            row.note = prepared.note
            row.selected_tokens = prepared.token_count
            skipped = False
            for _ in range(spec.warmup):
                # The build's first call, and the first warm-ups too (a library may autotune its backward on the
                # first backward after the build, and a fresh machine loads kernels lazily), include compilation,
                # autotuning and lazy kernel loading: an autotuning call can be 1000x a warm one. So each warm-up
                # needs room for itself only, judged by the budget at the previous call's time; the timed calls are
                # judged, by the budget and the per-case cap, at the last warm-up's time.
                if self._skip(row, estimate, 1, "measured", use_cap=False):
                    skipped = True
                    break
                estimate = self.timer.wall_once(prepared.run)
            if not skipped and not self._skip(row, estimate, timed_calls, "measured"):
                rounds = [self.timer.measure(prepared.run, spec.repeats) for _ in range(spec.rounds)]
                self._fill_timing(row, rounds)
                row.status = OK
                row.note = prepared.note
                self._call_s[(plan.impl, plan.stage, plan.pass_name)] = (plan.seq_len, row.median_ms * 1e-3)
        except Exception as exc:  # noqa: BLE001 - every failure is recorded and the sweep goes on
            if _is_oom(exc):
                row.status = OOM
                row.note = f"out of memory: {str(exc).splitlines()[0][:200]}"
            else:
                row.status = ERROR
                row.note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
                self.log(traceback.format_exc(limit=4))
        finally:
            prepared = None
            if self.is_cuda:
                row.peak_mem_bytes = torch.cuda.max_memory_allocated(self.device)
        self._fill_work(row)
        return row

    @staticmethod
    def _seed(seq_len: int) -> int:
        """The inputs' (and the packed documents') seed of one T: the same in every sweep."""
        return seq_len

    def _fill_timing(self, row: Row, rounds: list[Samples]) -> None:
        everything = Samples([t for r in rounds for t in r.times_ms])
        row.median_ms = everything.median
        row.min_ms = everything.minimum
        row.p20_ms = everything.quantile(0.2)
        row.p80_ms = everything.quantile(0.8)
        medians = [r.median for r in rounds]
        row.round_medians_ms = ";".join(f"{m:.6g}" for m in medians)
        row.spread = round_spread(medians)
        row.n_runs = len(everything.times_ms)

    def _fill_work(self, row: Row) -> None:
        spec, c = self.spec, self.ceilings
        lengths = document_lengths(self.workload, row.seq_len, self._seed(row.seq_len))
        if self.workload != "single":
            row.documents = len(lengths)
        work_model = StageWork(row.seq_len, spec.cfg, spec.batch, spec.torch_dtype.itemsize, spec.phi_width,
                               lengths)
        if row.impl in {peer.label for peer in self.peers}:
            return  # another library: its useful work is not modelled here
        branches = next((tuple(v.kwargs["branches"]) for v in self.variants
                         if v.label == row.impl and "branches" in v.kwargs), ("cmp", "slc", "win"))
        work = work_model.sdpa() if row.impl == SDPA else work_model.stage(row.stage, row.selected_tokens, branches)
        if work is None:
            return
        row.flops = work.flops(row.pass_name)
        row.bytes = work.bytes(row.pass_name)
        if c is None:
            return
        row.flop_floor_ms = row.flops / (c.matmul_tflops * 1e12) * 1e3
        row.byte_floor_ms = row.bytes / (c.copy_gbps * 1e9) * 1e3
        row.floor_ms = max(row.flop_floor_ms, row.byte_floor_ms)
        if row.status == OK and row.median_ms:
            row.tflops = row.flops / (row.median_ms * 1e-3) / 1e12
            row.frac_peak = row.tflops / c.matmul_tflops


def _describe(row: Row) -> str:
    head = f"T={row.seq_len:>6d} {row.impl:>10s} {row.stage:>8s} {row.pass_name:>7s}"
    if row.status != OK:
        return f"{head}  {row.status.upper()}: {row.note}"
    spread = f"{100 * row.spread:.1f}%" if row.spread is not None else "-"
    tf = f"{row.tflops:7.1f} TFLOP/s" if row.tflops is not None else ""
    floor = f" floor {row.floor_ms:.3f} ms" if row.floor_ms is not None else ""
    mem = f" peak {row.peak_mem_bytes / 2**30:.2f} GiB" if row.peak_mem_bytes else ""
    return f"{head}  {row.median_ms:10.3f} ms (spread {spread}) {tf}{floor}{mem}"
