"""GO/NO-GO records: what `nox -s preflight` writes, and the check that the launcher and the trainer share.

A record (reports/preflight/<config-hash>.json) holds the decision, the code identity (git commit and source
digest, code.py), the config hash, the GPUs and versions, and one entry per gate with its verdict, exit code,
report paths and timestamps. The decision is GO only when every required gate passed. A record authorizes a
launch only when it is GO, names the same config hash, the same commit and the same source digest as the code
about to run, and its oldest gate started less than policy.GO_RECORD_MAX_AGE_S ago.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..config import RunConfig
from . import policy
from .code import REPO_ROOT, CodeIdentity, code_identity

log = logging.getLogger("sentinels.launch")

RECORDS_DIR = REPO_ROOT / "reports" / "preflight"
REQUIRED_GATES = ("code", "env", "config", "conformance-gpu", "sentinels-gpu")
PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
GO, NO_GO = "GO", "NO-GO"


def utc_iso(unix: float) -> str:
    return datetime.fromtimestamp(unix, timezone.utc).isoformat(timespec="seconds")


def record_path(config_hash: str, records_dir: Path = RECORDS_DIR) -> Path:
    return records_dir / f"{config_hash}.json"


@dataclass
class GateResult:
    name: str
    verdict: str  # PASS | FAIL | SKIP (not run because an earlier gate failed)
    detail: str  # one line: why it failed, or what passed
    started_unix: float
    finished_unix: float
    exit_code: int | None = None  # subprocess gates
    command: list[str] | None = None
    reports: list[str] = field(default_factory=list)  # report files the gate wrote
    log: str | None = None  # its console output, saved next to the record

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "verdict": self.verdict, "detail": self.detail, "exit_code": self.exit_code,
                "command": self.command, "reports": self.reports, "log": self.log,
                "started_at": utc_iso(self.started_unix), "finished_at": utc_iso(self.finished_unix),
                "duration_s": round(self.finished_unix - self.started_unix, 3),
                "started_unix": self.started_unix, "finished_unix": self.finished_unix}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "GateResult":
        return cls(name=data["name"], verdict=data["verdict"], detail=data["detail"],
                   started_unix=float(data["started_unix"]), finished_unix=float(data["finished_unix"]),
                   exit_code=data.get("exit_code"), command=data.get("command"), reports=list(data.get("reports", [])),
                   log=data.get("log"))


def decide(gates: list[GateResult]) -> tuple[str, list[str]]:
    """GO only if every required gate ran and passed; otherwise NO-GO with one reason per missing/failed gate."""
    by_name = {g.name: g for g in gates}
    reasons = [f"gate {name} did not run" for name in REQUIRED_GATES if name not in by_name]
    reasons += [f"gate {g.name}: {g.verdict}: {g.detail}" for g in gates if g.verdict != PASS]
    return (GO if not reasons else NO_GO), reasons


def build_record(*, cfg: RunConfig, config_path: str, overrides: list[str], resume: bool, code: CodeIdentity,
                 env: dict[str, Any], gates: list[GateResult], started_unix: float, finished_unix: float,
                 host: str) -> dict[str, Any]:
    decision, reasons = decide(gates)
    return {
        "schema": policy.RECORD_SCHEMA,
        "decision": decision,
        "reasons": reasons,
        "config_hash": cfg.config_hash(),
        "config_path": config_path,
        "overrides": list(overrides),
        "resume": resume,
        "config": cfg.to_dict(),
        "code": code.as_dict(),
        "host": host,
        "gpus": env.get("gpus", []),
        "versions": {k: env.get(k) for k in ("python", "torch", "cuda", "triton")},
        "gates": [g.as_dict() for g in gates],
        "started_at": utc_iso(started_unix),
        "finished_at": utc_iso(finished_unix),
        "finished_unix": finished_unix,
        # the oldest gate's start (gates reused by --reuse-passed keep theirs): the record's age counts from here
        "evidence_since_unix": min([g.started_unix for g in gates] + [started_unix]),
        "max_age_s": policy.GO_RECORD_MAX_AGE_S,
    }


def write_record(record: dict[str, Any], records_dir: Path = RECORDS_DIR) -> Path:
    """Atomically write reports/preflight/<config-hash>.json (a later preflight of the same config replaces it:
    a NO-GO revokes an earlier GO)."""
    records_dir.mkdir(parents=True, exist_ok=True)
    path = record_path(record["config_hash"], records_dir)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=2, default=str) + "\n")
    os.replace(tmp, path)
    return path


@dataclass(frozen=True)
class GoCheck:
    ok: bool
    reason: str  # why the launch is refused, or what authorized it
    path: Path
    record: dict[str, Any] | None = None


def check_go_record(path: Path, *, config_hash: str, code: CodeIdentity, now_unix: float | None = None,
                    max_age_s: float = policy.GO_RECORD_MAX_AGE_S) -> GoCheck:
    """Does the record at `path` authorize launching `config_hash` with the code `code` now?"""
    now_unix = time.time() if now_unix is None else now_unix

    def refuse(reason: str, record: dict[str, Any] | None = None) -> GoCheck:
        return GoCheck(False, reason, path, record)

    if not path.is_file():
        return refuse(f"no GO record at {path}: run `nox -s preflight -- --config <config>` on this host first")
    try:
        record = json.loads(path.read_text())
        decision, gates = record["decision"], record["gates"]
        rec_hash, rec_code, since = record["config_hash"], record["code"], float(record["evidence_since_unix"])
        verdicts = {g["name"]: g["verdict"] for g in gates}
        rec_commit, rec_digest = rec_code.get("commit"), rec_code.get("source_digest")
        if record.get("schema") != policy.RECORD_SCHEMA:
            return refuse(f"{path} has schema {record.get('schema')!r}, this code reads {policy.RECORD_SCHEMA}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return refuse(f"{path} is not a readable GO record ({type(exc).__name__}: {exc})")
    if decision != GO:
        return refuse(f"{path} is {decision}: " + "; ".join(map(str, record.get("reasons", []))), record)
    not_passed = [name for name in REQUIRED_GATES if verdicts.get(name) != PASS]
    if not_passed:
        return refuse(f"{path} says GO but gates {not_passed} did not pass: the record is inconsistent", record)
    if rec_hash != config_hash:
        return refuse(f"{path} is for config hash {rec_hash}, the config to launch has {config_hash}", record)
    if code.commit is not None and rec_commit != code.commit:
        return refuse(f"{path} was made at commit {rec_commit}, this checkout is at {code.commit}: "
                      f"re-run the preflight for this commit", record)
    if code.commit is None and not rec_commit:
        return refuse(f"{path} names no commit and this tree has no git commit either", record)
    if rec_digest != code.source_digest:
        return refuse(f"{path} was made for other source files (digest {rec_digest}, this "
                      f"tree {code.source_digest}): re-run the preflight", record)
    age = now_unix - since
    if age < -policy.GO_RECORD_MAX_CLOCK_SKEW_S:
        return refuse(f"{path} is dated {-age:.0f} s in the future (its gates started {utc_iso(since)}): check the "
                      f"clock", record)
    if age > max_age_s:
        return refuse(f"{path} is stale: its oldest gate started {age / 3600:.1f} h ago, a GO record is valid for "
                      f"{max_age_s / 3600:.1f} h; re-run the preflight", record)
    return GoCheck(True, f"GO record {path} ({age / 3600:.1f} h old, commit {rec_commit})", path, record)


@dataclass(frozen=True)
class Authorization:
    allowed: bool
    reason: str
    metadata: dict[str, Any]  # goes into the run's metadata.json as "launch_authorization"


def authorize_training(cfg: RunConfig, *, i_know_what_im_doing: bool, records_dir: Path = RECORDS_DIR,
                       code: CodeIdentity | None = None, now_unix: float | None = None) -> Authorization:
    """The trainer's rule: a run of >= policy.LONG_RUN_STEPS steps needs a GO record for this config and code
    (check_go_record) unless the operator overrides with --i-know-what-im-doing, which is logged."""
    steps = cfg.train.steps
    if steps < policy.LONG_RUN_STEPS:
        return Authorization(True, f"{steps} steps < {policy.LONG_RUN_STEPS}: no GO record needed",
                             {"long_run": False, "steps": steps})
    code = code_identity() if code is None else code
    check = check_go_record(record_path(cfg.config_hash(), records_dir), config_hash=cfg.config_hash(), code=code,
                            now_unix=now_unix)
    metadata = {"long_run": True, "steps": steps, "go_record": str(check.path), "go_check": check.reason,
                "go_record_valid": check.ok, "override": i_know_what_im_doing and not check.ok,
                "code": code.as_dict()}
    if check.ok:
        return Authorization(True, check.reason, metadata)
    if i_know_what_im_doing:
        log.warning("LAUNCH GATE OVERRIDDEN with --i-know-what-im-doing: %s", check.reason)
        return Authorization(True, f"overridden by --i-know-what-im-doing: {check.reason}", metadata)
    return Authorization(False, f"refusing a {steps}-step run (>= {policy.LONG_RUN_STEPS}) without a valid GO "
                                f"record: {check.reason} (or pass --i-know-what-im-doing, which is logged)",
                         metadata)
