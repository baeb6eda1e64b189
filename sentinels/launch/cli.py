"""`python -m sentinels.launch env|config|preflight|launch` (docs/runbook.md); `python -m sentinels env` is the
same environment guard.

Exit codes: 0 supported / PASS / GO / the trainer's own code after a launch; 1 unsupported environment, refused
config, NO-GO, or refused launch; 2 bad arguments or an unreadable config (one line; `--debug` adds the traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ..config import load_config
from ..errors import add_debug_flag, run_reporting_errors
from .code import code_identity
from .env import check_env, collect_env_facts, format_facts, format_verdict


def _config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="run config YAML (configs/*.yaml)")
    parser.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                        help="dotted override of the run config (part of the config hash), e.g. -o train.steps=50000")
    parser.add_argument("--resume", action="store_true",
                        help="the run continues the checkpoints in train.out_dir (out_dir must hold one)")


def _commit_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--commit", help="commit of a copied tree without .git (must match git where git exists)")


def cmd_env(args: argparse.Namespace) -> int:
    verdict = check_env(collect_env_facts())
    print(format_verdict(verdict))
    return 0 if verdict.ok else 1


def cmd_config(args: argparse.Namespace) -> int:
    from .preflight import check_config, format_resolved

    cfg = load_config(args.config, args.override)
    facts = collect_env_facts()
    verdict = check_config(cfg, gpu_visible=args.assume_gpu or bool(facts.gpus), resume=args.resume)
    print(format_resolved(cfg, verdict))
    return 0 if verdict.ok else 1


def cmd_preflight(args: argparse.Namespace) -> int:
    from .gates import default_gate_commands, format_record, run_preflight
    from .gonogo import GO, RECORDS_DIR, record_path
    from .preflight import format_config

    cfg = load_config(args.config, args.override)
    code = code_identity(given_commit=args.commit)
    facts = collect_env_facts()
    print(format_facts(facts), flush=True)
    print(format_config(cfg), flush=True)  # the gates below judge the environment and the config, in order
    previous = None
    if args.reuse_passed and record_path(cfg.config_hash(), RECORDS_DIR).is_file():
        previous = json.loads(record_path(cfg.config_hash(), RECORDS_DIR).read_text())
    gate_commands = default_gate_commands(args.config, args.override, cfg.config_hash(), RECORDS_DIR)
    record, path = run_preflight(cfg=cfg, config_path=args.config, overrides=args.override, resume=args.resume,
                                 code=code, facts=facts, records_dir=RECORDS_DIR, reuse_from=previous,
                                 gate_commands=gate_commands, parallel=args.parallel_gates,
                                 keep_going=args.keep_going, copy_to=Path(args.out) if args.out else None)
    print(format_record(record, path))
    return 0 if record["decision"] == GO else 1


def cmd_launch(args: argparse.Namespace) -> int:
    from .launch import decide_launch

    cfg = load_config(args.config, args.override)
    decision = decide_launch(cfg=cfg, config_path=args.config, overrides=args.override, nproc=args.nproc,
                             resume=args.resume, code=code_identity(given_commit=args.commit),
                             facts=collect_env_facts())
    if not decision.ok:
        print("launch REFUSED:", file=sys.stderr)
        for reason in decision.reasons:
            print(f"  - {reason}", file=sys.stderr)
        return 1
    print(f"launch authorized: {decision.go}")
    print("exec: " + " ".join(decision.argv), flush=True)
    os.execv(decision.argv[0], decision.argv)  # torchrun replaces this process: signals reach it directly
    return 0  # pragma: no cover - execv does not return


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sentinels.launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("env", help="print python/torch/CUDA/triton/GPUs; exit 1 on an unsupported combination") \
        .set_defaults(func=cmd_env)
    config = sub.add_parser("config", help="config preflight only: resolved config, hash, refusals")
    _config_args(config)
    config.add_argument("--assume-gpu", action="store_true",
                        help="judge the config as on a GPU host (to check a GPU config on a CPU machine)")
    config.set_defaults(func=cmd_config)
    pre = sub.add_parser("preflight", help="all gates, then reports/preflight/<config-hash>.json (GO/NO-GO)")
    _config_args(pre)
    _commit_arg(pre)
    pre.add_argument("--reuse-passed", action="store_true",
                     help="keep the PASS GPU gates of this config's existing record (same commit, sources, GPUs, "
                          "versions; started < 24 h ago) and run only the others: finishes a preflight that was "
                          "cut off by a time limit")
    pre.add_argument("--parallel-gates", action="store_true",
                     help="run the GPU gates (conformance-gpu, sentinels-gpu) at the same time instead of one after "
                          "the other: about half the wall time, for hosts leased by the minute; the sentinels' "
                          "throughput figures then include the shared GPU, their verdicts do not depend on it")
    pre.add_argument("--keep-going", action="store_true",
                     help="judge every in-process gate (code, env, config) even after one failed, to see every "
                          "refusal at once; the GPU gates still never start after a failure")
    pre.add_argument("--out", metavar="DIR",
                     help="also copy the record, the gate logs and the gates' reports to DIR after every gate "
                          "(default: none; the record itself is always reports/preflight/<config-hash>.json)")
    pre.set_defaults(func=cmd_preflight)
    launch = sub.add_parser("launch", help="start the trainer with torchrun if a fresh GO record allows it")
    _config_args(launch)
    _commit_arg(launch)
    launch.add_argument("--nproc", type=int, default=1, help="processes (GPUs) on this host (default 1)")
    launch.set_defaults(func=cmd_launch)
    for command in sub.choices.values():
        add_debug_flag(command)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_reporting_errors(args.func, args)


def env_main(argv: list[str] | None = None) -> int:
    """`python -m sentinels env` (the sentinels CLI dispatches here)."""
    return main(["env", *(argv or [])])
