"""Command line: `python -m sentinels run|train|prepare ...` (see docs/sentinels.md)."""

from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from .config import load_config
from .errors import InputError, add_debug_flag, run_reporting_errors
from .profiles import SENTINELS

REPO_ROOT = Path(__file__).resolve().parent.parent


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)


def device_slug() -> str:
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")


# ------------------------------------------------------------------------------------------------ train
def cmd_train(args: argparse.Namespace) -> int:
    from .trainer import Trainer

    overrides = list(args.override) + ([f"data.packing={args.packing}"] if args.packing else [])
    cfg = load_config(args.config, overrides)
    trainer = Trainer(cfg, resume=args.resume, fresh=args.fresh, synthetic_on_fail=args.synthetic_on_fail,
                      i_know_what_im_doing=args.i_know_what_im_doing,
                      extra_metadata={"config_path": str(args.config), "overrides": overrides})
    try:
        result = trainer.train()
        if trainer.dist.is_main:  # before close(), where the other ranks wait for it
            summary = json.dumps({"status": result.status, "steps_done": result.steps_done,
                                  "halt_reason": result.halt_reason, "run_dir": str(result.run_dir),
                                  "events": [e.kind for e in result.events]})
            sys.stdout.write(summary + "\n")  # one write: another rank's log line cannot land inside it
            sys.stdout.flush()
    finally:
        trainer.close()
    return 0 if result.status == "completed" else 3


# ---------------------------------------------------------------------------------------------- prepare
def cmd_prepare(args: argparse.Namespace) -> int:
    from .data.prepare import DEFAULT_WIKI_OUT, prepare_text, prepare_wiki

    if args.what == "wiki":
        info = prepare_wiki(Path(args.out or DEFAULT_WIKI_OUT), min_chars=args.min_chars)
    else:
        if not args.input:
            print("error: prepare text needs --input FILE [FILE ...]", file=sys.stderr)
            return 2
        if not args.out:
            print("error: prepare text needs --out FILE.jsonl", file=sys.stderr)
            return 2
        info = prepare_text([Path(p) for p in args.input], Path(args.out))
    print(json.dumps(info, indent=2))
    return 0


# -------------------------------------------------------------------------------------------------- run
def _resolve_corpus(arg: str | None, work_dir: Path, log) -> Path | None:
    from .data.prepare import DEFAULT_WIKI_OUT, prepare_wiki

    if arg:
        path = Path(arg)
        if not path.is_file():
            raise InputError(f"--corpus {path}: file not found")
        return path
    default = REPO_ROOT / DEFAULT_WIKI_OUT
    if default.is_file():
        return default
    try:
        info = prepare_wiki(work_dir / "wiki.jsonl")
    except (FileNotFoundError, ImportError) as exc:
        log(f"[sentinels] no real-text corpus: {exc}; the real-text sentinels are skipped")
        return None
    log(f"[sentinels] prepared the real-text corpus: {info['documents']} documents")
    return Path(info["out"])


def cmd_run(args: argparse.Namespace) -> int:
    only = None if args.only is None else {name.strip() for name in args.only.split(",") if name.strip()}
    if only is not None and (not only or only - set(SENTINELS)):
        print(f"error: --only: unknown sentinel name(s) {sorted(only - set(SENTINELS)) or [args.only]}; choose from "
              f"{', '.join(SENTINELS)}", file=sys.stderr)
        return 2
    import torch

    from .profiles import get_profile
    from .report import print_table, write_report
    from .suite import SentinelRunner, overall_verdict

    profile = get_profile(args.profile)
    if profile.device == "cuda" and not torch.cuda.is_available():
        print("error: --profile gpu needs a visible CUDA device (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    run_config_path = Path(args.config) if args.config else profile.run_config
    run_config = load_config(run_config_path, args.override)
    probe_config = load_config(profile.probe_config)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    work_dir = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="sentinels-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    out_root = Path(args.out)
    started = time.time()
    if profile.cpu_threads is not None:
        torch.set_num_threads(profile.cpu_threads)
    name = f"{profile.name}-{device_slug()}"
    corpus = None

    def report(results, planted, verdict, plots):
        return write_report(out_root, name, profile=profile, run_config=run_config, run_config_path=run_config_path,
                            probe_config=probe_config, corpus=corpus, results=results, planted=planted,
                            verdict=verdict, started=started, selftest=not args.no_selftest, plots=plots,
                            seed=args.seed, only=None if only is None else sorted(only))

    try:
        corpus = _resolve_corpus(args.corpus, work_dir, log)
        runner = SentinelRunner(profile, run_config=run_config, probe_config=probe_config, work_dir=work_dir,
                                corpus=corpus, budget_s=args.budget_s, log=log, seed=args.seed)
        results, planted = runner.run_all(selftest=not args.no_selftest, only=only,
                                          on_progress=lambda r, p: report(r, p, "RUNNING", plots=False))
    finally:
        if not args.keep_runs and not args.work_dir:
            shutil.rmtree(work_dir, ignore_errors=True)
    verdict = overall_verdict(results, planted)
    report_path = report(results, planted, verdict, plots=True)
    print_table(results, planted, verdict)
    print(f"report: {report_path}")
    return 0 if verdict == "PASS" else 1


# ---------------------------------------------------------------------------------- determinism, sensitivity
def cmd_determinism(args: argparse.Namespace) -> int:
    """Run-to-run determinism of the run model's forward on this machine, and one clean causal-isolation sweep:
    the measurement behind the CUDA bound of causal_isolation (docs/sentinels.md)."""
    import torch

    from .isolation import (check_causal_isolation, isolation_length, measure_determinism, probe_positions,
                            probes_for, summarize)
    from .model import build_model
    from .profiles import get_profile
    from .thresholds import CAUSAL_ISOLATION_CUDA_NOISE_FACTOR

    profile = get_profile(args.profile)
    if profile.device == "cuda" and not torch.cuda.is_available():
        print("error: --profile gpu needs a visible CUDA device (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    if profile.cpu_threads is not None:
        torch.set_num_threads(profile.cpu_threads)
    config_path = Path(args.config) if args.config else profile.run_config
    cfg = load_config(config_path, args.override)
    device = torch.device(profile.device)
    torch.manual_seed(0)
    model = build_model(cfg).to(device)
    nsa = cfg.model.nsa_config()
    T = isolation_length(nsa, cfg.train.seq_len)
    tokens = torch.randint(0, cfg.vocab_size(), (1, T), generator=torch.Generator().manual_seed(0)).to(device)
    t0 = time.monotonic()
    measured = measure_determinism(model, tokens, vocab=cfg.vocab_size(), precision=profile.precision,
                                   repeats=args.repeats, rows=profile.isolation_rows)
    measured["wall_s"] = time.monotonic() - t0
    probes = probes_for(probe_positions(nsa, T, n_random=profile.isolation_random_positions))
    sweep = check_causal_isolation(model, tokens, probes=probes, vocab=cfg.vocab_size(), precision=profile.precision,
                                   rows_per_forward=profile.isolation_rows)
    report = {"profile": profile.name, "device": device_slug(), "config": cfg.name, "seq_len": T,
              "precision": profile.precision, "determinism": measured, "clean_sweep": sweep.as_dict(),
              "clean_sweep_summary": summarize(sweep)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"determinism-{profile.name}-{device_slug()}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    m = measured
    stem.with_suffix(".md").write_text("\n".join([
        f"# Forward determinism: {cfg.name} on {device_slug()} ({profile.precision}, {T} tokens)", "",
        "Differences relative to max |logit|; the causal-isolation bound on CUDA is "
        f"{CAUSAL_ISOLATION_CUDA_NOISE_FACTOR:g}x the in-batch difference (0: bitwise).", "",
        "| measurement | largest difference | runs that differed |", "|---|---|---|",
        f"| same input, {m['repeats']} repeated one-row forwards | {m['repeat_max_rel']:.3e} | "
        f"{m['repeat_runs_that_differed']}/{m['repeats']} |",
        f"| {m['rows']} identical rows in one batch, {m['repeats']} times | {m['in_batch_max_rel']:.3e} | "
        f"{m['in_batch_runs_that_differed']}/{m['repeats']} |",
        f"| row 0 of a batch of other rows vs the one-row forward | {m['batch_mix_max_rel']:.3e} | - |", "",
        f"Clean causal-isolation sweep: {summarize(sweep)} ({sweep.forwards} forwards, {sweep.wall_s:.1f} s).", ""]))
    print(json.dumps(report["determinism"], indent=2))
    print(f"clean sweep: {summarize(sweep)} ({sweep.wall_s:.1f} s)")
    print(f"report: {stem.with_suffix('.md')}")
    return 0 if not sweep.leaked else 1


def cmd_sensitivity(args: argparse.Namespace) -> int:
    import torch

    from .profiles import get_profile
    from .sensitivity import measure, write

    profile = get_profile(args.profile)
    if profile.cpu_threads is not None:
        torch.set_num_threads(profile.cpu_threads)
    seeds = [int(s) for s in args.seeds.split(",")]
    report = measure(args.profile, args.plant, seeds, args.max_steps, args.every,
                     log=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(f"report: {write(report, Path(args.out))}")
    return 0


# ------------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sentinels", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run every sentinel and the planted-fault self-test; print the verdicts")
    run.add_argument("--profile", choices=("cpu", "gpu"), required=True)
    run.add_argument("--config", help="run config under test for the real-text sentinels (default: the profile's)")
    run.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                     help="dotted override of the run config, e.g. -o train.seq_len=1024")
    run.add_argument("--corpus", help="JSONL real-text corpus (default: data/sentinels/wiki.jsonl, else prepared "
                                      "from gensim into the work dir)")
    run.add_argument("--out", default=str(REPO_ROOT / "reports" / "sentinels"),
                     help="report directory: <profile>-<device>.json, .md and the plots (default: reports/sentinels "
                          "of the repository)")
    run.add_argument("--seed", type=int,
                     help="reseed every sentinel run (train.seed and data.shuffle_seed of each run, the isolation "
                          "checks' tokens and positions; default: the configs' own seeds)")
    run.add_argument("--only", metavar="NAME[,NAME]",
                     help="run only these sentinels (and the self-test rows that must trip them), e.g. "
                          "--only causal_isolation,random_label; names: " + ", ".join(SENTINELS))
    run.add_argument("--work-dir", help="where the sentinel runs write (default: a temporary directory)")
    run.add_argument("--keep-runs", action="store_true", help="keep the temporary run directories")
    run.add_argument("--budget-s", type=float, help="wall-clock budget (default: the profile's)")
    run.add_argument("--no-selftest", action="store_true", help="skip the planted-fault self-test")
    run.set_defaults(func=cmd_run)

    det = sub.add_parser("determinism", help="measure run-to-run determinism of the run model's forward (the "
                                             "causal-isolation bound on CUDA) and run one clean isolation sweep")
    det.add_argument("--profile", choices=("cpu", "gpu"), required=True)
    det.add_argument("--config", help="run config (default: the profile's)")
    det.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE")
    det.add_argument("--repeats", type=int, default=20, help="repeated forwards per measurement (default 20)")
    det.add_argument("--out", required=True, help="directory for determinism-<profile>-<device>.json and .md")
    det.set_defaults(func=cmd_determinism)

    sens = sub.add_parser("sensitivity", help="measure how many random-label steps a planted leak needs to trip")
    sens.add_argument("--profile", choices=("cpu", "gpu"), required=True)
    sens.add_argument("--plant", default="cmp_one_early",
                      help="a plant of sentinels/plants.py, or none for clean runs (default cmp_one_early)")
    sens.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    sens.add_argument("--max-steps", type=int, default=1000, help="steps per run (default 1000)")
    sens.add_argument("--every", type=int, default=25, help="held-out evaluation every N steps (default 25)")
    sens.add_argument("--out", required=True, help="directory for sensitivity-<profile>-<plant>.json and .md")
    sens.set_defaults(func=cmd_sensitivity)

    train = sub.add_parser("train", help="train a model from a run config")
    train.add_argument("--config", required=True)
    train.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE")
    train.add_argument("--packing", choices=("contiguous", "varlen"),
                       help="data.packing: contiguous token windows, or varlen = documents packed into one row per "
                            "micro-batch with their boundaries (cu_seqlens); same as -o data.packing=...")
    train.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in train.out_dir")
    train.add_argument("--fresh", action="store_true",
                       help="start over in a non-empty train.out_dir: its contents move to <out_dir>.old-N first")
    train.add_argument("--i-know-what-im-doing", action="store_true",
                       help="start a run of >= 5000 steps without a valid GO record (docs/runbook.md); the override "
                            "is logged and written into metadata.json")
    train.add_argument("--synthetic-on-fail", action="store_true",
                       help="if the data source fails, continue on synthetic tokens (logged loudly)")
    train.set_defaults(func=cmd_train)

    prep = sub.add_parser("prepare", help="build a local JSONL corpus")
    prep.add_argument("what", choices=("wiki", "text"))
    prep.add_argument("--out", help="output JSONL (wiki default: data/sentinels/wiki.jsonl)")
    prep.add_argument("--input", nargs="*", help="text: input files")
    prep.add_argument("--min-chars", type=int, default=500, help="wiki: drop articles shorter than this")
    prep.set_defaults(func=cmd_prepare)
    for command in sub.choices.values():
        add_debug_flag(command)
    return parser


def main(argv: list[str] | None = None) -> int:
    _setup_logging()
    args = build_parser().parse_args(argv)
    return run_reporting_errors(args.func, args)
