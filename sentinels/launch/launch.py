"""The launcher (`nox -s launch -- --config X [--nproc N]`): refuse unless a fresh GO record names this code and
this config, re-check what can change after the preflight (environment, out_dir), then start the trainer
under torchrun on this host."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from ..config import RunConfig
from .code import CodeIdentity
from .env import EnvFacts, check_env
from .gonogo import RECORDS_DIR, check_go_record, record_path
from .preflight import check_config


def torchrun_argv(*, config_path: str, overrides: list[str], nproc: int, resume: bool,
                  python: str = sys.executable) -> list[str]:
    """python -m torch.distributed.run --standalone --nproc_per_node N -m sentinels train --config X [...]"""
    argv = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            "-m", "sentinels", "train", "--config", config_path]
    for item in overrides:
        argv += ["-o", item]
    if resume:
        argv.append("--resume")
    return argv


@dataclass(frozen=True)
class LaunchDecision:
    ok: bool
    reasons: tuple[str, ...]  # why the launch is refused (empty when ok)
    go: str  # what the GO record check said
    argv: list[str]


def decide_launch(*, cfg: RunConfig, config_path: str, overrides: list[str], nproc: int, resume: bool,
                  code: CodeIdentity, facts: EnvFacts, records_dir: Path = RECORDS_DIR, cwd: Path | None = None,
                  now_unix: float | None = None, check_config_kwargs: dict | None = None) -> LaunchDecision:
    """The GO record must authorize (check_go_record); the environment and the config rules are applied again,
    since a GPU or out_dir may have changed since the preflight; nproc must fit the visible GPUs."""
    reasons: list[str] = []
    if nproc < 1:
        reasons.append(f"--nproc must be >= 1, got {nproc}")
    go = check_go_record(record_path(cfg.config_hash(), records_dir), config_hash=cfg.config_hash(), code=code,
                         gpus=facts.gpus, now_unix=now_unix)
    if not go.ok:
        reasons.append(go.reason)
    env = check_env(facts)
    reasons += [f"env: {r}" for r in env.reasons]
    if facts.gpus and nproc > len(facts.gpus):
        reasons.append(f"--nproc {nproc} but only {len(facts.gpus)} GPU(s) are visible")
    verdict = check_config(cfg, gpu_visible=bool(facts.gpus), resume=resume, cwd=cwd, **(check_config_kwargs or {}))
    reasons += [f"config [{f.rule}]: {f.message}" for f in verdict.findings]
    argv = torchrun_argv(config_path=config_path, overrides=overrides, nproc=nproc, resume=resume)
    return LaunchDecision(ok=not reasons, reasons=tuple(reasons), go=go.reason, argv=argv)
