"""Decode-step latency of NSA (optimized.decode) against SDPA full-attention decode over the same cache (issue 6).

For each context s and batch B: an NSADecodeCache (bf16, 64 query heads in 4 KV groups, d_k = d_v = 128, the paper's
l, d, l', n, w, phi = MLP) is filled with s - 1 random tokens; one decode step then appends token s - 1 (Table 4's
step at context s) and the next ones. Both sides run as CUDA graphs and are timed with CUDA events around each
replay, after an L2 flush, median over the timed steps:
- NSA: DecodeGraph replays of cache.step: on the kernel path the lean step (docs/decode.md): six Triton launches
  (append to the three branch caches, compressed splits, Eq. 8-10 scores, Eq. 11 lists, selected + window splits,
  gates), plus the Eq. 7 emission in torch on the steps that complete a compressed block;
- SDPA: the new key/value written into the same selection-branch history, then
  F.scaled_dot_product_attention over its first s keys; the faster of two GQA forms (the 16 query heads of a KV
  group as 16 query rows of it, or enable_gqa=True) is the baseline.
Reads: the tokens the first NSA step gathered (counted by the kernels), next to Table 4's model s/d + n*l' + w.

    python -m perf.decode_bench                      # H100 sweep -> $OUT/decode or reports/decode
    python -m perf.decode_bench --compile            # the same with the torch stages through torch.compile
    python -m perf.decode_bench --device cpu --tiny  # CPU smoke run of the same code paths (eager, no graphs)

Writes decode_bench.csv, decode_bench.md (table next to Table 4), decode_bench.png and decode_bench.json.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from optimized.decode import NSADecodeCache
from optimized.decode.emission import complete_blocks
from optimized.decode.graph import DecodeGraph
from reference.config import NSAConfig
from reference.contract import KV, BranchKV, PhiWeights

TABLE_4 = {8192: (2048, 4.0), 16384: (2560, 6.4), 32768: (3584, 9.1), 65536: (5632, 11.6)}
FLUSH_BYTES = 256 * 2**20  # > H100 L2 (50 MiB)


@dataclass
class Case:
    context: int
    batch: int
    nsa_median_us: float | None = None
    nsa_mean_us: float | None = None
    nsa_median_no_emit_us: float | None = None
    nsa_median_emit_us: float | None = None
    sdpa_median_us: float | None = None
    sdpa_form: str = ""
    sdpa_forms_us: dict = field(default_factory=dict)
    measured_speedup: float | None = None
    reads_cmp: int | None = None
    reads_slc: int | None = None
    reads_win: int | None = None
    reads_total: int | None = None
    counted_speedup: float | None = None  # s / counted reads
    table4_tokens: int | None = None
    table4_speedup: float | None = None
    compiled: bool = False
    lean: bool = False  # the step ran the lean kernel path
    timed_steps: int = 0
    setup_s: float = 0.0
    note: str = ""


def bench_config(tiny: bool) -> NSAConfig:
    if tiny:
        return NSAConfig(cmp_block=16, cmp_stride=8, sel_block=32, n_sel=4, n_init=1, n_local=2, window=64,
                         n_heads=8, n_kv_heads=2, head_dim_qk=32, head_dim_v=32, phi="mlp")
    return NSAConfig.preset("paper", head_dim_qk=128, head_dim_v=128)


def modelled_tokens(cfg: NSAConfig, context: int) -> int:
    """Table 4's model: s/d + n*l' + w."""
    return context // cfg.cmp_stride + cfg.n_sel * cfg.sel_block + cfg.window


class Timer:
    def __init__(self, device: torch.device):
        self.device = device
        self.flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device=device) if device.type == "cuda" else None

    def time_us(self, fn) -> float:
        if self.device.type != "cuda":
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e6
        self.flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3


def random_tokens(cfg: NSAConfig, B: int, T: int, dtype, device, g: torch.Generator) -> BranchKV:
    def rnd(dim: int) -> torch.Tensor:
        return torch.randn((B, T, cfg.n_kv_heads, dim), generator=g, device=device, dtype=dtype)

    return BranchKV(*(KV(rnd(cfg.head_dim_qk), rnd(cfg.head_dim_v)) for _ in range(3)))


def run_case(cfg: NSAConfig, context: int, batch: int, args, device: torch.device, timer: Timer,
             compiled: bool) -> Case:
    case = Case(context, batch, compiled=compiled)
    t0 = time.perf_counter()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(context + batch)
    steps = args.warmup + args.steps
    phi = PhiWeights.init(cfg, cfg.head_dim_qk, dtype=dtype, device=device) if cfg.phi == "mlp" else None
    cache = NSADecodeCache(cfg, batch, context + steps, dtype=dtype, device=device, phi=phi,
                           compile_stages=case.compiled)
    prompt = BranchKV.shared(  # one k/v for the three branches of the fill (the cache stores them separately)
        torch.randn((batch, context - 1, cfg.n_kv_heads, cfg.head_dim_qk), generator=g, device=device, dtype=dtype),
        torch.randn((batch, context - 1, cfg.n_kv_heads, cfg.head_dim_v), generator=g, device=device, dtype=dtype))
    cache.fill(prompt)
    del prompt
    case.lean = cache.uses_lean_step()
    q = torch.randn((batch, 1, cfg.n_heads, cfg.head_dim_qk), generator=g, device=device, dtype=dtype)
    new = random_tokens(cfg, batch, 1, dtype, device, g)
    gates = torch.rand((batch, 1, cfg.n_heads, 3), generator=g, device=device, dtype=dtype)

    if device.type == "cuda":
        graph = DecodeGraph(cache, context + steps)
        graph.load_inputs(q, new, gates, 1)
        ones = torch.ones(batch, dtype=torch.int64)

        def nsa_step(emit: bool):
            graph.replay(emit)
            cache.set_host_lengths(cache.lengths + ones)
            return graph.outputs[emit]
    else:
        def nsa_step(emit: bool):
            return cache.step(q, new, gates)  # decides on emission itself
    case.setup_s = time.perf_counter() - t0

    times, emits = [], []
    for i in range(steps):
        L = cache.lengths
        emit = bool((complete_blocks(L + 1, cfg) > complete_blocks(L, cfg)).any())
        box = {}
        us = timer.time_us(lambda: box.setdefault("out", nsa_step(emit)))
        if i == 0:  # the step at position context - 1: Table 4's decode step at context s
            reads = box["out"].reads
            case.reads_cmp, case.reads_slc, case.reads_win = (int(r[0, 0, 0]) for r in (reads.cmp, reads.slc,
                                                                                           reads.win))
        if i >= args.warmup:
            times.append(us)
            emits.append(emit)
    case.timed_steps = len(times)
    case.nsa_median_us = statistics.median(times)
    case.nsa_mean_us = statistics.fmean(times)
    no_emit = [t for t, e in zip(times, emits) if not e]
    with_emit = [t for t, e in zip(times, emits) if e]
    case.nsa_median_no_emit_us = statistics.median(no_emit) if no_emit else None
    case.nsa_median_emit_us = statistics.median(with_emit) if with_emit else None
    case.reads_total = case.reads_cmp + case.reads_slc + case.reads_win
    case.counted_speedup = context / case.reads_total
    if device.type == "cuda":
        del graph
    sdpa_forms = sdpa_decode(cache, q, new, context, device)
    for name, fn in sdpa_forms.items():
        try:
            case.sdpa_forms_us[name] = median_us(fn, args, device, timer)
        except (RuntimeError, TypeError) as exc:  # a form this torch build does not support
            case.note += f"{name}: {str(exc).splitlines()[0][:80]}; "
    if case.sdpa_forms_us:
        case.sdpa_form, case.sdpa_median_us = min(case.sdpa_forms_us.items(), key=lambda kv: kv[1])
        case.measured_speedup = case.sdpa_median_us / case.nsa_median_us
    if context in TABLE_4 and cfg.n_sel * cfg.sel_block == 1024:
        case.table4_tokens, case.table4_speedup = TABLE_4[context]
    else:
        case.table4_tokens = modelled_tokens(cfg, context)
        case.table4_speedup = round(context / case.table4_tokens, 2)
    return case


def sdpa_decode(cache: NSADecodeCache, q: torch.Tensor, new: BranchKV, context: int, device: torch.device):
    """Full-attention decode of the token at position context - 1 over the selection branch's history (the same
    cache): write its key/value, then SDPA over keys 0..context-1."""
    cfg = cache.cfg
    B, H, G = cache.batch_size, cfg.n_kv_heads, cfg.group_size
    k_all, v_all = cache.history.k, cache.history.v  # [B, Hkv, capacity + 1, d]
    slot = context - 1
    k_new, v_new = new.slc.k.transpose(1, 2), new.slc.v.transpose(1, 2)  # [B, Hkv, 1, d]
    q_rows = q.view(B, H, G, cfg.head_dim_qk)  # [B, Hkv, G, dk]: a group's heads as G query rows
    q_heads = q.view(B, cfg.n_heads, 1, cfg.head_dim_qk)

    def append() -> None:
        k_all[:, :, slot:slot + 1].copy_(k_new)
        v_all[:, :, slot:slot + 1].copy_(v_new)

    def group_rows() -> torch.Tensor:
        append()
        return F.scaled_dot_product_attention(q_rows, k_all[:, :, :context], v_all[:, :, :context])

    def enable_gqa() -> torch.Tensor:
        append()
        return F.scaled_dot_product_attention(q_heads, k_all[:, :, :context], v_all[:, :, :context], enable_gqa=True)

    return {"group-rows": group_rows, "enable_gqa": enable_gqa}


def median_us(fn, args, device: torch.device, timer: Timer) -> float:
    if device.type == "cuda":
        for _ in range(2):
            fn()
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    else:
        run = fn
    for _ in range(args.warmup):
        run()
    return statistics.median(timer.time_us(run) for _ in range(args.steps))


def environment(device: torch.device, args) -> dict:
    import triton

    info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu {platform.machine()}",
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "python": sys.version.split()[0], "compile": args.compile and device.type == "cuda", "steps": args.steps,
            "warmup": args.warmup, "dtype": "bf16" if device.type == "cuda" else "fp32",
            "timing": ("both sides CUDA graphs, CUDA-event time per step after an L2 flush" if device.type == "cuda"
                       else "CPU smoke run: eager steps, perf_counter time per step"),
            "l2_flush_bytes": FLUSH_BYTES, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if device.type == "cuda":
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
    return info


def report_dir(out: str | None, folder: str = "decode") -> Path:
    """Where the perf tools other than `perf run` write: `out` if given, else $OUT/<folder> on a lent GPU, else
    reports/<folder> ("decode": the decode bench, profile and probes; "perf": the prefill probe and layer profile)."""
    if out:
        return Path(out)
    return Path(os.environ["OUT"]) / folder if os.environ.get("OUT") else Path("reports") / folder


def write_probe_report(out_dir: Path, name: str, timing: str, results: list[dict]) -> None:
    """A kernel probe's results as out_dir/<name>.json, with the GPU and versions they came from."""
    import triton

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps({
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "timing": timing, "results": results}, indent=2))


def write_reports(out_dir: Path, cases: list[Case], env: dict, cfg: NSAConfig) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [asdict(c) for c in cases]
    with open(out_dir / "decode_bench.csv", "w", newline="") as fh:
        fields = [k for k in rows[0] if k != "sdpa_forms_us"] + ["sdpa_forms_us"] + list(env)
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, "sdpa_forms_us": json.dumps(row["sdpa_forms_us"]), **env})
    (out_dir / "decode_bench.json").write_text(json.dumps({"environment": env, "config": cfg.to_dict(),
                                                            "cases": rows}, indent=2))
    (out_dir / "decode_bench.md").write_text(markdown(cases, env, cfg))
    plot(out_dir / "decode_bench.png", cases, env)


def fmt(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def markdown(cases: list[Case], env: dict, cfg: NSAConfig) -> str:
    lines = [
        "# NSA decode step vs SDPA full-attention decode",
        "",
        f"{env['device']}; torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}; {env['date']}.",
        f"{env['dtype']}, {cfg.n_heads} query heads in {cfg.n_kv_heads} KV groups, d_k = {cfg.head_dim_qk}, "
        f"d_v = {cfg.head_dim_v}; l = {cfg.cmp_block}, d = {cfg.cmp_stride}, l' = {cfg.sel_block}, n = {cfg.n_sel}, "
        f"w = {cfg.window}, phi = {cfg.phi}. {env['timing']}, median of {env['steps']} steps after {env['warmup']} "
        f"warm-up steps; torch.compile of the NSA torch stages: {env['compile']}; lean step (docs/decode.md): "
        f"{', '.join(sorted({'yes' if c.lean else 'no' for c in cases if c.timed_steps})) or '-'}.",
        "",
        "| context | batch | NSA step (us) | NSA mean (us) | SDPA (us) | measured speedup | counted reads "
        "(cmp+slc+win) | counted speedup | Table 4 tokens | Table 4 speedup |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        reads = "-" if c.reads_total is None else f"{c.reads_total} ({c.reads_cmp}+{c.reads_slc}+{c.reads_win})"
        sdpa = "-" if c.sdpa_median_us is None else f"{c.sdpa_median_us:.1f} ({c.sdpa_form})"
        lines.append(f"| {c.context} | {c.batch} | {fmt(c.nsa_median_us)} | {fmt(c.nsa_mean_us)} | {sdpa} | "
                     f"{fmt(c.measured_speedup, 2)}x | {reads} | {fmt(c.counted_speedup, 2)}x | "
                     f"{c.table4_tokens or '-'} | {fmt(c.table4_speedup, 1)}x |" + (f" {c.note}" if c.note else ""))
    lines += ["", "NSA step medians split by whether the step emitted a compressed token (1 step in d):", "",
              "| context | batch | no emission (us) | with emission (us) | setup (s) |", "|---|---|---|---|---|"]
    for c in cases:
        lines.append(f"| {c.context} | {c.batch} | {fmt(c.nsa_median_no_emit_us)} | {fmt(c.nsa_median_emit_us)} | "
                     f"{c.setup_s:.1f} |")
    goal = [c for c in cases if c.context == 65536 and c.measured_speedup is not None]
    if goal:
        lines += ["", "Goal (issue 6): measured speedup at 64k >= 11.6 / 2 = 5.8x: " + ", ".join(
            f"batch {c.batch}: {c.measured_speedup:.2f}x ({'met' if c.measured_speedup >= 5.8 else 'not met'})"
            for c in goal)]
    return "\n".join(lines) + "\n"


def plot(path: Path, cases: list[Case], env: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_speed, ax_lat) = plt.subplots(1, 2, figsize=(12, 4.5))
    contexts = sorted({c.context for c in cases})
    model = sorted({(c.context, c.table4_speedup) for c in cases if c.table4_speedup is not None})
    ax_speed.plot([m[0] for m in model], [m[1] for m in model], "k--", marker="x", label="Table 4 model")
    for batch in sorted({c.batch for c in cases}):
        sel = [c for c in cases if c.batch == batch and c.measured_speedup is not None]
        ax_speed.plot([c.context for c in sel], [c.measured_speedup for c in sel], marker="o",
                      label=f"measured, batch {batch}")
        ax_lat.plot([c.context for c in sel], [c.nsa_median_us for c in sel], marker="o", label=f"NSA, batch {batch}")
        ax_lat.plot([c.context for c in sel], [c.sdpa_median_us for c in sel], marker="s", linestyle=":",
                    label=f"SDPA, batch {batch}")
    for ax in (ax_speed, ax_lat):
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [f"{c // 1024}k" if c >= 1024 else str(c) for c in contexts])
        ax.set_xlabel("context (tokens)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    ax_speed.set_ylabel("speedup over SDPA full attention (x)")
    ax_lat.set_ylabel("decode step latency (us)")
    ax_lat.set_yscale("log")
    fig.suptitle(f"NSA decode step vs SDPA, {env['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--contexts", default=None, help="comma-separated (default 8k..128k; --tiny: 256,512)")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--steps", type=int, default=48, help="timed decode steps per case")
    parser.add_argument("--warmup", type=int, default=8, help="untimed steps before them (the first gives the reads)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                        help="run the NSA torch stages through torch.compile inside the graphs (the lean step's "
                        "Eq. 7 emission; the whole plan/selection/gate stages where the lean step does not apply); "
                        "default off: the lean step needs no compilation")
    parser.add_argument("--tiny", action="store_true", help="small config and contexts (CPU smoke run)")
    parser.add_argument("--budget-s", type=float, default=270.0, help="skip cases that would start after this many "
                        "seconds (keeps the sweep under ~6 minutes)")
    parser.add_argument("--out", default=None, help="output directory (default: $OUT/decode, else reports/decode)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("decode_bench: no CUDA device; run with --device cpu --tiny for a smoke run", file=sys.stderr)
        return 2
    cfg = bench_config(args.tiny)
    contexts = ([int(c) for c in args.contexts.split(",")] if args.contexts else
                [256, 512] if args.tiny else [8192, 16384, 32768, 65536, 131072])
    batches = [int(b) for b in args.batches.split(",")]
    out_dir = report_dir(args.out)
    if args.compile and device.type == "cuda":
        from torch import _dynamo

        for name in ("cache_size_limit", "recompile_limit"):  # one compilation per (batch, context) shape
            if hasattr(_dynamo.config, name):
                setattr(_dynamo.config, name, 256)
    timer = Timer(device)
    env = environment(device, args)
    start = time.perf_counter()
    cases: list[Case] = []
    for context in contexts:
        for batch in batches:
            if time.perf_counter() - start > args.budget_s:
                cases.append(Case(context, batch, note="skipped: time budget"))
                continue
            compiled = args.compile and device.type == "cuda"
            try:
                try:
                    case = run_case(cfg, context, batch, args, device, timer, compiled)
                except torch.cuda.OutOfMemoryError:
                    raise
                except Exception as exc:  # torch.compile of the stages failed: measure with eager stages
                    if not compiled:
                        raise
                    torch.cuda.empty_cache()
                    case = run_case(cfg, context, batch, args, device, timer, False)
                    case.note += f"compile failed ({type(exc).__name__}: {str(exc).splitlines()[0][:100]}); "
            except torch.cuda.OutOfMemoryError as exc:
                case = Case(context, batch, note=f"out of memory: {str(exc).splitlines()[0][:80]}")
            except Exception as exc:  # recorded, and the other cases still run
                traceback.print_exc()
                case = Case(context, batch, note=f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
            cases.append(case)
            print(f"context {context:>6} batch {batch:>2}: NSA {fmt(case.nsa_median_us)} us, SDPA "
                  f"{fmt(case.sdpa_median_us)} us ({case.sdpa_form}), speedup {fmt(case.measured_speedup, 2)}x, "
                  f"reads {case.reads_total}, setup {case.setup_s:.1f} s, elapsed {time.perf_counter() - start:.0f} s"
                  + (f" [{case.note}]" if case.note else ""), flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    env["wall_s"] = round(time.perf_counter() - start, 1)
    write_reports(out_dir, cases, env, cfg)
    print(f"wrote {out_dir}/decode_bench.{{csv,md,png,json}}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
