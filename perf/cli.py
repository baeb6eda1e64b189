"""Command line: `python -m perf {run,report,compare,floors,train,train-report,train-profile,train-memory}` (`-h`
after a command lists its options). Outputs go where `--out` says; the defaults are under reports/ (reports/perf for
`run`, reports/perf/train for `train`, reports/perf/train_profile for `train-profile`, reports/perf/train_memory for
`train-memory`).

Exit status: 0 ok; 1 a regression against the baseline; 2 bad usage, no GPU for --device cuda, or a baseline
that cannot be compared; 3 some case raised an error other than out-of-memory (the sweep still finished).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from . import baseline as gate
from .env import describe, nvidia_smi, slug
from .flops import StageWork, selected_token_count
from .implementations import parse_impls
from .report import make_report
from .results import ERROR, OK, OOM, RESULTS_CSV, Row, merge_rows, read_meta, read_rows, write_rows
from .cases import WORKLOADS
from .runner import Runner
from .spec import DEFAULT_IMPLS, LAYER, NSA_STAGES, PASSES, PRESETS, preset

EXIT_REGRESSION, EXIT_USAGE, EXIT_CASE_ERROR = 1, 2, 3
DEFAULT_OUT = Path("reports/perf")
DEFAULT_BASELINES = Path("reports/baselines")
DEFAULT_README = Path("reports/README.md")


def parse_seq_lens(text: str) -> tuple[int, ...]:
    values = []
    for part in filter(None, (p.strip().lower() for p in text.split(","))):
        scale = 1024 if part.endswith("k") else 1
        digits = part[:-1] if part.endswith("k") else part
        if not digits.isdigit() or int(digits) <= 0:
            raise argparse.ArgumentTypeError(f"--seq-lens entry {part!r} is not a positive int (or Nk)")
        values.append(int(digits) * scale)
    if not values:
        raise argparse.ArgumentTypeError("--seq-lens needs at least one length")
    return tuple(values)


def _names(allowed: tuple[str, ...], flag: str, allow_none: bool = False):
    def parse(text: str) -> tuple[str, ...]:
        if allow_none and text.strip() == "none":
            return ()
        names = tuple(n.strip() for n in text.split(",") if n.strip())
        bad = [n for n in names if n not in allowed]
        if bad or not names:
            extra = " (or none)" if allow_none else ""
            raise argparse.ArgumentTypeError(f"{flag} must be a comma list of {allowed}{extra}, got {text!r}")
        return names
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m perf", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="time every case, write CSV/JSON/plots, optionally gate on a baseline")
    run.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    run.add_argument("--preset", choices=PRESETS, default="paper",
                     help="paper: the H100 sweep of ours against SDPA; equal_blocks: SDPA, ours with and without the "
                          "window branch, and fla's parallel_nsa at l = d = l' = 64; tiny: CPU-sized shapes of the "
                          "same code paths (perf/spec.py)")
    run.add_argument("--seq-lens", type=parse_seq_lens, help="comma list, e.g. 8k,16k,32k,64k,128k")
    run.add_argument("--batch", type=int)
    run.add_argument("--repeats", type=int, help="timed runs per round (rounds x repeats >= 20 for reported numbers)")
    run.add_argument("--rounds", type=int, help="rounds per case; their spread sizes the regression threshold")
    run.add_argument("--warmup", type=int)
    run.add_argument("--time-budget", type=float, help="seconds; cases that would end past it are skipped")
    run.add_argument("--case-cap", type=float, help="seconds; a case whose timed calls would take longer is skipped "
                     "(keeps one slow implementation from spending the budget on its largest T)")
    run.add_argument("--impls", help="sdpa, nsa, nsa[backend=torch,chunk_size=4096], nsa[branches=cmp+slc], fla "
                     f"(default per preset: {DEFAULT_IMPLS})")
    run.add_argument("--nsa-impl", default="optimized", help="module with the contract functions (or mod:attr)")
    run.add_argument("--workload", choices=tuple(WORKLOADS), default="single",
                     help="single: one sequence of T tokens per row; packed: one row of documents of mixed lengths "
                          "(cu_seqlens; SDPA one call per document). Add --merge to keep the other workload's rows")
    run.add_argument("--stages", type=_names(NSA_STAGES, "--stages", allow_none=True),
                     help=f"subset of {NSA_STAGES}, or none (the whole layer only)")
    run.add_argument("--passes", type=_names(PASSES, "--passes"), help=f"subset of {PASSES}")
    run.add_argument("--out", type=Path, help="results folder (default reports/perf for --preset paper, "
                     "reports/perf/<preset> otherwise)")
    run.add_argument("--merge", action="store_true", help="keep rows of --out that this sweep does not measure "
                     "(a case it skips for time keeps its measured row; --compare-baseline judges only this sweep)")
    run.add_argument("--resume", action="store_true", help="run only the cases --out lacks or skipped (time "
                     "budget, error) and merge; repeat until nothing is skipped")
    run.add_argument("--readme", type=Path, help="also rewrite the preset's generated section of this README "
                     "(default: reports/README.md without --out, none with --out); results.md next to the CSV "
                     "always holds the same text")
    run.add_argument("--compare-baseline", action="store_true", help="fail (exit 1) on a regression")
    run.add_argument("--update-baseline", action="store_true", help="write this sweep as the new baseline")
    run.add_argument("--baseline", type=Path, help="baseline to compare with (default "
                     "reports/baselines/perf-<device-slug>.json)")
    run.add_argument("--baseline-dir", type=Path, default=DEFAULT_BASELINES,
                     help="where --update-baseline writes (default reports/baselines)")

    rep = sub.add_parser("report", help="regenerate plots, results.md and the README section from a results CSV")
    rep.add_argument("--results", type=Path, default=DEFAULT_OUT / RESULTS_CSV)
    rep.add_argument("--readme", type=Path, default=DEFAULT_README, help="README whose generated section to rewrite "
                     "(default reports/README.md)")

    cmp = sub.add_parser("compare", help="compare a results CSV/JSON with a baseline file (no timing)")
    cmp.add_argument("--results", type=Path, default=DEFAULT_OUT / RESULTS_CSV)
    cmp.add_argument("--baseline", type=Path, required=True,
                     help="baseline file, or a folder holding perf-<device-slug>[-<preset>].json for these results")

    flo = sub.add_parser("floors", help="print per-stage FLOP and byte floors for one T (paper config)")
    flo.add_argument("--seq-len", type=parse_seq_lens, default=(65536,))
    flo.add_argument("--preset", choices=PRESETS, default="paper")
    flo.add_argument("--peak-tflops", type=float, required=True, help="matmul ceiling, TFLOP/s")
    flo.add_argument("--bandwidth-gbps", type=float, required=True, help="copy ceiling, GB/s (read + write)")

    add_train_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        commands = {"run": cmd_run, "report": cmd_report, "compare": cmd_compare, "floors": cmd_floors,
                    "train": cmd_train, "train-report": cmd_train_report, "train-profile": cmd_train_profile,
                    "train-memory": cmd_train_memory}
        return commands[args.command](args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but no CUDA GPU is visible to torch "
                         f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); run on a GPU machine or use "
                         "--device cpu --preset tiny")
    return torch.device(name)


def cmd_run(args) -> int:
    device = _device(args.device)
    overrides = {k: v for k, v in {
        "seq_lens": args.seq_lens, "batch": args.batch, "repeats": args.repeats, "rounds": args.rounds,
        "warmup": args.warmup, "time_budget_s": args.time_budget, "case_cap_s": args.case_cap, "stages": args.stages,
        "passes": args.passes,
    }.items() if v is not None}
    spec = preset(args.preset, **overrides)
    impls_text = args.impls or DEFAULT_IMPLS[spec.name]
    with_sdpa, variants, peers = parse_impls(impls_text, args.nsa_impl)
    out_dir = args.out or (DEFAULT_OUT if spec.name == "paper" else DEFAULT_OUT / spec.name)
    baseline_dir = args.baseline_dir
    readme = args.readme or (None if args.out else DEFAULT_README)

    env = describe(device)
    device_slug = slug(env["device"])
    baseline_file = args.baseline or gate.baseline_path(DEFAULT_BASELINES, device_slug, spec.name)
    if args.compare_baseline and not args.update_baseline and not baseline_file.exists():
        raise ValueError(f"--compare-baseline: no baseline {baseline_file}; write one with --update-baseline")
    print(f"perf: {env['device']} | torch {env['torch']} | triton {env['triton']} | CUDA {env['cuda']} | "
          f"spec {spec.name} T={list(spec.seq_lens)} | workload {args.workload} | impls {impls_text} | budget "
          f"{spec.time_budget_s:.0f} s")

    if spec.rounds * spec.repeats < 20:
        print(f"perf: note: {spec.rounds} rounds x {spec.repeats} runs = {spec.rounds * spec.repeats} timed runs per "
              f"case, fewer than the 20 that reported numbers need")
    old_meta = read_meta(out_dir) if (args.merge or args.resume) else {}
    if old_meta and old_meta.get("shape_key") != spec.shape_key():
        raise ValueError(f"--merge/--resume: {out_dir} holds results of different shapes/config; use another --out")
    old_rows = read_rows(out_dir / RESULTS_CSV) if old_meta and (out_dir / RESULTS_CSV).exists() else []
    done = frozenset(r.key for r in old_rows if r.status in (OK, OOM)) if args.resume else frozenset()
    runner = Runner(spec, device, with_sdpa, variants, workload=args.workload, peers=peers)
    ceilings = runner.measure_ceilings()
    meta = {"env": env, "spec": spec.to_dict(), "shape_key": spec.shape_key(), "ceilings": ceilings.to_dict(),
            "impls": impls_text, "nsa_impl": args.nsa_impl}
    if old_meta:
        meta["merged_runs"] = old_meta.get("merged_runs", [old_meta.get("env")]) + [env]

    def save(new_rows: list[Row]) -> None:
        write_rows(merge_rows(old_rows, new_rows) if old_meta else new_rows, out_dir, meta)

    sweep_rows = runner.run(done, on_row=save)
    if device.type == "cuda":
        env["nvidia_smi_end"] = nvidia_smi(device.index or 0)
    skipped = [r for r in sweep_rows if r.status == "skipped"]
    meta.update(elapsed_s=runner.elapsed(), skipped_cases=len(skipped))
    rows = merge_rows(old_rows, sweep_rows) if old_meta else sweep_rows
    write_rows(rows, out_dir, meta)
    make_report(read_rows(out_dir / RESULTS_CSV), out_dir, readme)  # the reports show what the CSV holds
    print(f"perf: wrote {out_dir}/ ({len(rows)} rows, {len(skipped)} skipped by the time budget) in "
          f"{runner.elapsed():.0f} s")
    if skipped:
        print(f"perf: {len(skipped)} case(s) skipped by the {spec.time_budget_s:.0f} s budget; run the same "
              f"command with --resume to measure them and merge")

    status = 0
    if args.compare_baseline and baseline_file.exists():
        # only what this sweep measured: a merged-in older row is no evidence about this tree
        comparisons = gate.compare(sweep_rows, gate.load_baseline(baseline_file), spec.shape_key(),
                                   spec.regression_floor, spec.spread_factor)
        print(f"perf: comparing with {baseline_file}")
        print(gate.format_comparison(comparisons))
        if any(c.verdict == "regression" for c in comparisons):
            status = EXIT_REGRESSION
    if args.update_baseline:
        path = gate.baseline_path(baseline_dir, device_slug, spec.name)
        gate.write_baseline(path, rows, meta)
        print(f"perf: wrote baseline {path}")
    errors = [r for r in rows if r.status == ERROR]
    if errors:
        print(f"perf: {len(errors)} case(s) raised errors: " + "; ".join(f"{r.key}: {r.note}" for r in errors))
        status = status or EXIT_CASE_ERROR
    return status


def cmd_report(args) -> int:
    rows = read_rows(args.results)
    paths = make_report(rows, args.results.parent, args.readme)
    print(f"perf: wrote {', '.join(str(p) for p in paths)} and the PERF section of {args.readme}")
    return 0


def cmd_compare(args) -> int:
    rows = read_rows(args.results)
    meta = read_meta(args.results.parent)
    if not meta:
        raise ValueError(f"{args.results.parent} has no results.json (its meta names the spec the rows were run with)")
    spec_dict = meta["spec"]
    path = args.baseline
    if path.is_dir():
        path = gate.baseline_path(path, slug(meta["env"]["device"]), spec_dict["name"])
    try:
        baseline = gate.load_baseline(path)
    except FileNotFoundError as exc:
        raise ValueError(str(exc)) from exc
    comparisons = gate.compare(rows, baseline, meta["shape_key"], spec_dict["regression_floor"],
                               spec_dict["spread_factor"])
    print(f"perf: comparing {args.results} with {path}")
    print(gate.format_comparison(comparisons))
    return EXIT_REGRESSION if any(c.verdict == "regression" for c in comparisons) else 0


def cmd_floors(args) -> int:
    """Predicted floors per stage (the two-numbers method of perf/NOTES.md). The selected-token count uses the
    n most recent blocks, which every valid selection matches (n - 1 full blocks plus the partial current one)."""
    spec = preset(args.preset)
    cfg = spec.cfg
    table = []
    for T in args.seq_len:
        J = torch.arange(T) // cfg.sel_block
        slots = torch.arange(cfg.n_sel) - (cfg.n_sel - 1)
        recent = (J[:, None] + slots[None, :]).clamp(min=-1)
        recent = torch.where(recent >= 0, recent, torch.full_like(recent, -1))
        indices = recent[None, :, None, :].expand(spec.batch, T, cfg.n_kv_heads, cfg.n_sel)
        tokens = selected_token_count(indices, cfg.sel_block)
        work = StageWork(T, cfg, spec.batch, spec.torch_dtype.itemsize, spec.phi_width)
        for stage in (*NSA_STAGES, LAYER, "sdpa"):
            w = work.sdpa() if stage == "sdpa" else work.stage(stage, tokens)
            for pass_name in PASSES:
                flops, nbytes = w.flops(pass_name), w.bytes(pass_name)
                flop_ms = flops / (args.peak_tflops * 1e12) * 1e3
                byte_ms = nbytes / (args.bandwidth_gbps * 1e9) * 1e3
                table.append({"T": T, "stage": stage, "pass": pass_name, "GFLOP": flops / 1e9, "GB": nbytes / 1e9,
                              "flop_floor_ms": flop_ms, "byte_floor_ms": byte_ms,
                              "bound": "compute" if flop_ms >= byte_ms else "memory"})
    print("| T | stage | pass | GFLOP | GB | FLOP floor ms | byte floor ms | bound |")
    print("|---|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['T']} | {r['stage']} | {r['pass']} | {r['GFLOP']:.1f} | {r['GB']:.3f} | "
              f"{r['flop_floor_ms']:.3f} | "
              f"{r['byte_floor_ms']:.3f} | {r['bound']} |")
    return 0


# Training throughput (perf/train_bench.py, perf/train_profile.py) ---------------------------------------------------

DEFAULT_TRAIN_OUT = Path("reports/perf/train")
DEFAULT_TRAIN_PROFILE_OUT = Path("reports/perf/train_profile")
DEFAULT_TRAIN_MEMORY_OUT = Path("reports/perf/train_memory")


def _positive_int(text: str) -> int:
    value = parse_seq_lens(text)
    if len(value) != 1:
        raise argparse.ArgumentTypeError(f"expected one positive int (or Nk), got {text!r}")
    return value[0]


def parse_checkpointing(text: str) -> dict[str, bool | str]:
    """--activation-checkpointing: a mode (off, blocks, attention) for both models, or model=mode pairs
    ("nsa=attention": NSA recomputes its attention, dense keeps everything) -> train.activation_checkpointing per
    model."""
    from .train_model import CHECKPOINTING, MODELS

    chosen: dict[str, bool | str] = {}
    for part in (p.strip() for p in text.split(",")):
        model, _, mode = part.rpartition("=")
        if mode not in CHECKPOINTING or (model and model not in MODELS):
            raise argparse.ArgumentTypeError(
                f"--activation-checkpointing takes a mode of {tuple(CHECKPOINTING)} or model=mode pairs with a model "
                f"of {MODELS}, got {text!r}")
        for m in ([model] if model else MODELS):
            chosen[m] = CHECKPOINTING[mode]
    return chosen


def add_train_parsers(sub) -> None:
    from .train_bench import DEFAULT_SEQ_LENS
    from .train_model import GEOMETRIES, MODELS

    train = sub.add_parser("train", help="tokens/s and peak memory of full training steps, NSA and dense attention")
    train.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    train.add_argument("--geometries", type=_names(tuple(GEOMETRIES), "--geometries"), default=("prod-125m", "paper"),
                       help=f"comma list of {tuple(GEOMETRIES)} (default prod-125m,paper; tiny is the CPU variant)")
    train.add_argument("--models", type=_names(MODELS, "--models"), default=MODELS,
                       help="comma list of nsa, dense (default both: nsa,dense)")
    train.add_argument("--seq-lens", type=parse_seq_lens, default=DEFAULT_SEQ_LENS,
                       help="comma list (default 2k,8k,16k,32k,64k)")
    train.add_argument("--tokens-per-step", type=_positive_int, default=65536,
                       help="tokens per optimizer step at every seq_len (default 64k)")
    train.add_argument("--micro-batch-tokens", dest="micro_tokens", type=_positive_int, default=16384,
                       help="at most this many tokens per micro-step (at least one sequence), the rest by gradient "
                            "accumulation (default 16k)")
    train.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first compiles; default 2)")
    train.add_argument("--steps", type=int, default=10, help="timed steps per case (default 10)")
    train.add_argument("--budget-s", type=float, default=420.0,
                       help="wall-clock budget: a case that would end past it is skipped (default 420 s)")
    train.add_argument("--activation-checkpointing", type=parse_checkpointing, nargs="?",
                       const=parse_checkpointing("blocks"), default={},
                       help="what backward recomputes (train.activation_checkpointing): off, blocks (whole blocks; "
                            "the flag alone), attention (each block's attention sublayer), for both models, or "
                            "model=mode pairs, e.g. nsa=attention (default off)")
    train.add_argument("--cuda-graphs", action="store_true",
                       help="train.cuda_graphs for both models: each micro-step replayed from CUDA graphs (default: "
                            "the eager step; the trainer's own default, auto, replays graphs in one CUDA process)")
    train.add_argument("--merge", action="store_true", help="keep the rows of --out that this sweep does not measure")
    train.add_argument("--out", type=Path, default=DEFAULT_TRAIN_OUT,
                       help="writes train.csv, train.json, train.md, train.png here (default reports/perf/train)")

    rep = sub.add_parser("train-report", help="regenerate train.md and train.png from a train.csv")
    rep.add_argument("--out", type=Path, default=DEFAULT_TRAIN_OUT,
                     help="folder holding train.csv and train.json (default reports/perf/train)")

    prof = sub.add_parser("train-profile", help="where one training step's time goes (torch.profiler, by region)")
    prof.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    prof.add_argument("--geometries", type=_names(tuple(GEOMETRIES), "--geometries"), default=("prod-125m",),
                      help=f"comma list of {tuple(GEOMETRIES)} (default prod-125m)")
    prof.add_argument("--models", type=_names(MODELS, "--models"), default=("nsa",),
                      help="comma list of nsa, dense (default nsa; nsa,dense profiles both)")
    prof.add_argument("--seq-len", type=_positive_int, default=16384, help="default 16k")
    prof.add_argument("--tokens-per-step", type=_positive_int, default=65536, help="default 64k, as `perf train`")
    prof.add_argument("--micro-batch-tokens", dest="micro_tokens", type=_positive_int, default=16384,
                      help="default 16k, as `perf train`")
    prof.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    prof.add_argument("--timed", type=int, default=5, help="steps timed without the profiler (default 5)")
    prof.add_argument("--profiled", type=int, default=2, help="steps under torch.profiler (default 2)")
    prof.add_argument("--out", type=Path, default=DEFAULT_TRAIN_PROFILE_OUT,
                      help="writes train_profile.json and train_profile.md here (default reports/perf/train_profile)")

    mem = sub.add_parser("train-memory", help="what one training step keeps for backward, by module and tensor")
    mem.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    mem.add_argument("--geometries", type=_names(tuple(GEOMETRIES), "--geometries"), default=("prod-125m",),
                     help=f"comma list of {tuple(GEOMETRIES)} (default prod-125m)")
    mem.add_argument("--models", type=_names(MODELS, "--models"), default=MODELS,
                     help="comma list of nsa, dense (default both: nsa,dense)")
    mem.add_argument("--seq-len", type=_positive_int, default=16384, help="tokens of the one sequence (default 16k)")
    mem.add_argument("--activation-checkpointing", type=parse_checkpointing, default={},
                     help="what backward recomputes, as for `perf train`: off, blocks, attention, or model=mode "
                          "pairs, e.g. nsa=attention (default off)")
    mem.add_argument("--out", type=Path, default=DEFAULT_TRAIN_MEMORY_OUT,
                     help="writes train_memory.json and train_memory.md here (default reports/perf/train_memory)")


def cmd_train(args) -> int:
    from .train_bench import ERROR, run_sweep

    rows, _ = run_sweep(args, _device(args.device))
    return EXIT_CASE_ERROR if any(r.status == ERROR for r in rows) else 0


def cmd_train_report(args) -> int:
    from .train_report import make_report

    paths = make_report(args.out)
    print(f"perf train-report: wrote {', '.join(str(p) for p in paths)}")
    return 0


def cmd_train_memory(args) -> int:
    from .train_memory import run_train_memory

    run_train_memory(args, _device(args.device))
    return 0


def cmd_train_profile(args) -> int:
    from .train_profile import run_profiles

    run_profiles(args, _device(args.device))
    return 0
