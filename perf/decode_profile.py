"""Where a lean decode step's time goes: per-kernel device time of one step, and the step time under
other split counts, on a GPU.

For each (context, batch): an NSADecodeCache as in perf.decode_bench (bf16, 64 query heads in 4 KV groups, d = 128,
the paper's l, d, l', n, w) filled with context - 1 tokens; then
- the default step (DecodeGraph replays, no emission) under torch.profiler: every kernel's device time, summed
  over the profiled replays and divided by their number (the bench's L2 flush runs before each replay, as there);
- the step as a CUDA graph of optimized.kernels.decode_step.lean_decode_step with explicit StepSplits, timed with
  CUDA events after an L2 flush, median of --steps replays, for the default splits and each --variants entry.

    python -m perf.decode_profile --cases 8192x1,65536x1,65536x16 --variants cmp=8,cmp=32,lists=4
Writes decode_profile.json (and prints a table) to --out (default reports/decode).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from optimized import masks
from optimized.decode import NSADecodeCache
from optimized.decode.graph import DecodeGraph
from optimized.decode.lean import step_rules
from optimized.kernels.decode_step import StepSplits, default_step_splits, lean_decode_step
from reference.contract import KV, BranchKV, PhiWeights

from .decode_bench import FLUSH_BYTES, bench_config
from .outputs import DECODE_OUT


def parse_cases(text: str) -> list[tuple[int, int]]:
    cases = []
    for item in text.split(","):
        context, _, batch = item.partition("x")
        cases.append((int(context), int(batch or 1)))
    return cases


def parse_variant(text: str, base: StepSplits) -> StepSplits:
    """'cmp=8;lists=4' -> base with those fields replaced."""
    fields = base._asdict()
    for part in filter(None, text.split(";")):
        name, _, value = part.partition("=")
        if name not in fields:
            raise ValueError(f"--variants: unknown split field {name!r} (fields: {list(fields)})")
        fields[name] = int(value)
    return StepSplits(**fields)


def filled_cache(context: int, batch: int, horizon: int, device: torch.device) -> tuple[NSADecodeCache, tuple]:
    cfg = bench_config(False)
    g = torch.Generator(device=device).manual_seed(context + batch)
    dtype = torch.bfloat16
    phi = PhiWeights.init(cfg, cfg.head_dim_qk, dtype=dtype, device=device)
    cache = NSADecodeCache(cfg, batch, horizon, dtype=dtype, device=device, phi=phi)
    prompt = BranchKV.shared(
        torch.randn((batch, context - 1, cfg.n_kv_heads, cfg.head_dim_qk), generator=g, device=device, dtype=dtype),
        torch.randn((batch, context - 1, cfg.n_kv_heads, cfg.head_dim_v), generator=g, device=device, dtype=dtype))
    cache.fill(prompt)
    del prompt
    q = torch.randn((batch, 1, cfg.n_heads, cfg.head_dim_qk), generator=g, device=device, dtype=dtype)
    new = BranchKV(*(KV(torch.randn((batch, 1, cfg.n_kv_heads, cfg.head_dim_qk), generator=g, device=device,
                                    dtype=dtype),
                        torch.randn((batch, 1, cfg.n_kv_heads, cfg.head_dim_v), generator=g, device=device,
                                    dtype=dtype)) for _ in range(3)))
    gates = torch.rand((batch, 1, cfg.n_heads, 3), generator=g, device=device, dtype=dtype)
    return cache, (q, new, gates)


def kernel_times(cache: NSADecodeCache, inputs: tuple, steps: int, flush: torch.Tensor) -> dict[str, float]:
    """Mean device time per replay of each kernel of the no-emission DecodeGraph (microseconds)."""
    q, new, gates = inputs
    graph = DecodeGraph(cache, int(cache.lengths.max()) + 2 * steps + 8)
    graph.load_inputs(q, new, gates, 1)
    torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            flush.zero_()
            graph.replay(False)
        torch.cuda.synchronize()
    for event in prof.events():
        if (event.device_type == torch.autograd.DeviceType.CUDA and "zero" not in event.name
                and "fill" not in event.name):
            totals[event.name[:60]] += event.device_time_total if hasattr(event, "device_time_total") \
                else event.cuda_time_total
    cache.set_host_lengths(cache.lengths + steps)
    del graph
    return {name: t / steps for name, t in sorted(totals.items(), key=lambda kv: -kv[1])}


def step_time(cache: NSADecodeCache, inputs: tuple, splits: StepSplits | None, steps: int,
              flush: torch.Tensor) -> float:
    """Median CUDA-event time (us) of lean_decode_step with these splits, captured as a CUDA graph."""
    q, new, gates = inputs
    cfg = cache.cfg
    bound = int(cache.lengths.max()) + steps + 4
    n_new = torch.ones(cache.batch_size, dtype=torch.int64, device=cache.device)
    args = (q, gates, (new.cmp.k, new.cmp.v, new.slc.k, new.slc.v, new.win.k, new.win.v), cache.device_lengths,
            n_new, (cache.compressed.k, cache.compressed.v), (cache.cmp_raw.k, cache.cmp_raw.v),
            (cache.history.k, cache.history.v), (cache.window.k, cache.window.v), step_rules(cfg),
            masks.compressed_block_count(bound, cfg), masks.sel_block_count(bound, cfg))
    lengths = cache.device_lengths.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        lean_decode_step(*args, splits=splits)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lean_decode_step(*args, splits=splits)
    times = []
    for _ in range(steps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    cache.device_lengths.copy_(lengths)  # every variant steps from the same lengths
    del graph
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="8192x1,65536x1,65536x16,131072x16")
    parser.add_argument("--variants", default="", help="comma-separated split overrides, e.g. 'cmp=8;lists=4,win=1'")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=Path, default=DECODE_OUT,
                        help="writes decode_profile.json here (default reports/decode)")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    out_dir = args.out
    results = []
    for context, batch in parse_cases(args.cases):
        t0 = time.perf_counter()
        horizon = context + 8 * args.steps + 64
        cache, inputs = filled_cache(context, batch, horizon, device)
        bound = horizon
        default = default_step_splits(inputs[0], (cache.history.k, cache.history.v), (cache.window.k, cache.window.v),
                                      step_rules(cache.cfg), masks.compressed_block_count(bound, cache.cfg),
                                      masks.sel_block_count(bound, cache.cfg))
        kernels = kernel_times(cache, inputs, args.steps, flush)
        variants = {"default " + str(tuple(default)): step_time(cache, inputs, None, args.steps, flush)}
        for text in filter(None, args.variants.split(",")):
            splits = parse_variant(text, default)
            try:
                variants[f"{text} {tuple(splits)}"] = step_time(cache, inputs, splits, args.steps, flush)
            except Exception as exc:  # a variant the kernels reject: recorded, the sweep goes on
                variants[f"{text} {tuple(splits)}"] = f"{type(exc).__name__}: {str(exc)[:120]}"
        row = {"context": context, "batch": batch, "kernels_us": kernels,
               "kernel_sum_us": sum(kernels.values()), "variants_us": variants,
               "wall_s": round(time.perf_counter() - t0, 1)}
        results.append(row)
        print(f"context {context} batch {batch}: kernel sum {row['kernel_sum_us']:.1f} us", flush=True)
        for name, us in kernels.items():
            print(f"    {us:8.1f} us  {name}", flush=True)
        for name, us in variants.items():
            print(f"    step {us if isinstance(us, str) else f'{us:8.1f} us'}  splits {name}", flush=True)
        del cache
        torch.cuda.empty_cache()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "decode_profile.json").write_text(json.dumps({
        "device": torch.cuda.get_device_name(device), "torch": torch.__version__, "steps": args.steps,
        "fields": list(StepSplits._fields), "cases": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
