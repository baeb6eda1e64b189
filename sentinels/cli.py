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
            print(json.dumps({"status": result.status, "steps_done": result.steps_done,
                              "halt_reason": result.halt_reason, "run_dir": str(result.run_dir),
                              "events": [e.kind for e in result.events]}), flush=True)
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
    out_root = Path(args.out) if args.out else REPO_ROOT / "reports" / "sentinels"
    started = time.time()
    if profile.cpu_threads is not None:
        torch.set_num_threads(profile.cpu_threads)
    name = f"{profile.name}-{device_slug()}"
    corpus = None

    def report(results, planted, verdict, plots):
        return write_report(out_root, name, profile=profile, run_config=run_config, run_config_path=run_config_path,
                            probe_config=probe_config, corpus=corpus, results=results, planted=planted,
                            verdict=verdict, started=started, selftest=not args.no_selftest, plots=plots)

    try:
        corpus = _resolve_corpus(args.corpus, work_dir, log)
        runner = SentinelRunner(profile, run_config=run_config, probe_config=probe_config, work_dir=work_dir,
                                corpus=corpus, budget_s=args.budget_s, log=log)
        results, planted = runner.run_all(selftest=not args.no_selftest,
                                          on_progress=lambda r, p: report(r, p, "RUNNING", plots=False))
    finally:
        if not args.keep_runs and not args.work_dir:
            shutil.rmtree(work_dir, ignore_errors=True)
    verdict = overall_verdict(results, planted)
    report_path = report(results, planted, verdict, plots=True)
    print_table(results, planted, verdict)
    print(f"report: {report_path}")
    return 0 if verdict == "PASS" else 1


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
    run.add_argument("--out", help="report directory (default: reports/sentinels)")
    run.add_argument("--work-dir", help="where the sentinel runs write (default: a temporary directory)")
    run.add_argument("--keep-runs", action="store_true", help="keep the temporary run directories")
    run.add_argument("--budget-s", type=float, help="wall-clock budget (default: the profile's)")
    run.add_argument("--no-selftest", action="store_true", help="skip the planted-fault self-test")
    run.set_defaults(func=cmd_run)

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
