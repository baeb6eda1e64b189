"""GO/NO-GO records: what `nox -s preflight` writes, and the check that the launcher and the trainer share.

A record (reports/preflight/<config-hash>.json) holds the decision, the code identity (git commit and source
digest, code.py), the config hash, the GPUs and versions, and one entry per gate with its verdict, exit code,
report paths and timestamps. The decision is GO only when every required gate passed. A record authorizes a
launch only when it is GO and consistent (every gate once, PASS, finite times in order, the GPU gates with exit
code 0 and reports), names the same config hash, commit and source digest as the code about to run and the GPU
model of this host, and its oldest gate (recomputed from the gates, never read from the record) started less than
policy.GO_RECORD_MAX_AGE_S ago.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..config import RunConfig
from . import policy
from .code import REPO_ROOT, CodeIdentity, code_identity
from .env import EnvFacts, GpuFacts, check_env, collect_env_facts

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


SUBPROCESS_GATES = ("conformance-gpu", "sentinels-gpu")  # their evidence: exit code 0 and the reports they wrote


def _finite(value: Any, what: str) -> float:
    """A finite number (int or float, not bool), else ValueError naming `what`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    return float(value)


def _gate_problems(gates: list[dict[str, Any]], now_unix: float) -> tuple[float, list[str]]:
    """(the oldest gate start, what is wrong with the gates of a GO record): each required gate exactly once,
    PASS, with finite start <= finish times not in the future; the GPU gates with exit code 0 and reports."""
    problems: list[str] = []
    names = [g.get("name") for g in gates]
    for name in sorted({n for n in names if names.count(n) > 1}, key=str):
        problems.append(f"gate {name} is listed more than once")
    by_name = {g.get("name"): g for g in gates}
    not_passed = [name for name in REQUIRED_GATES if by_name.get(name, {}).get("verdict") != PASS]
    if not_passed:
        problems.append(f"gates {not_passed} did not pass")
    starts = []
    for name in REQUIRED_GATES:
        gate = by_name.get(name)
        if gate is None:
            continue
        try:
            started = _finite(gate.get("started_unix"), f"gate {name} started_unix")
            finished = _finite(gate.get("finished_unix"), f"gate {name} finished_unix")
        except ValueError as exc:
            problems.append(str(exc))
            continue
        if finished < started:
            problems.append(f"gate {name} finished_unix {finished} is before its started_unix {started}")
        if finished > now_unix + policy.GO_RECORD_MAX_CLOCK_SKEW_S:
            problems.append(f"gate {name} finished {finished - now_unix:.0f} s in the future ({utc_iso(finished)}): "
                            f"check the clock")
        starts.append(started)
        if name in SUBPROCESS_GATES:
            if gate.get("exit_code") != 0:
                problems.append(f"gate {name} has exit code {gate.get('exit_code')!r}, not 0: the suite did not run "
                                f"to a pass")
            reports = gate.get("reports")
            if not isinstance(reports, list) or not reports or not all(isinstance(r, str) for r in reports):
                problems.append(f"gate {name} lists no report it wrote")
    return (min(starts) if starts else math.nan), problems


def _gpu_mismatch(recorded: Any, gpus: tuple[GpuFacts, ...]) -> str | None:
    """Why the GPUs of this host are not those the record's gates ran on (None when every visible GPU is a model,
    with its capability, that the record lists)."""
    if not gpus:
        return "no GPU is visible on this host"
    try:
        models = {(str(g["name"]), str(g["capability"])) for g in recorded}
    except (TypeError, KeyError):
        return f"its gpus field is not a list of GPUs ({recorded!r})"
    foreign = [f"GPU {g.index} {g.name} ({g.capability[0]}.{g.capability[1]})" for g in gpus
               if (g.name, f"{g.capability[0]}.{g.capability[1]}") not in models]
    if foreign:
        listed = ", ".join(f"{n} ({c})" for n, c in sorted(models)) or "none"
        return f"this host's {', '.join(foreign)} is not among the GPUs its gates ran on ({listed})"
    return None


def check_go_record(path: Path, *, config_hash: str, code: CodeIdentity, gpus: tuple[GpuFacts, ...],
                    now_unix: float | None = None, max_age_s: float = policy.GO_RECORD_MAX_AGE_S) -> GoCheck:
    """Does the record at `path` authorize launching `config_hash` with the code `code` on a host whose visible
    GPUs are `gpus`, now? Nothing in the record is taken on trust: the age is recomputed from the gates' own
    start times, every number must be finite and in range, the GPU gates must show their exit code and reports,
    and the record is bound to the config hash, the commit, the source digest and the GPU model."""
    now_unix = time.time() if now_unix is None else now_unix

    def refuse(reason: str, record: dict[str, Any] | None = None) -> GoCheck:
        return GoCheck(False, reason, path, record)

    if not path.is_file():
        return refuse(f"no GO record at {path}: run `nox -s preflight -- --config <config>` on this host first")
    try:
        record = json.loads(path.read_text())
        decision, gates = record["decision"], record["gates"]
        rec_hash, rec_code = record["config_hash"], record["code"]
        rec_commit, rec_digest = rec_code.get("commit"), rec_code.get("source_digest")
        if record.get("schema") != policy.RECORD_SCHEMA:
            return refuse(f"{path} has schema {record.get('schema')!r}, this code reads {policy.RECORD_SCHEMA}")
        if not isinstance(gates, list) or not all(isinstance(g, dict) for g in gates):
            raise TypeError("gates must be a list of objects")
        claimed = _finite(record.get("evidence_since_unix"), "evidence_since_unix")
        _finite(record.get("finished_unix"), "finished_unix")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return refuse(f"{path} is not a readable GO record ({type(exc).__name__}: {exc})")
    if decision != GO:
        return refuse(f"{path} is {decision}: " + "; ".join(map(str, record.get("reasons", []))), record)
    since, problems = _gate_problems(gates, now_unix)
    if problems:
        return refuse(f"{path} says GO but {'; '.join(problems)}: the record is inconsistent", record)
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
    mismatch = _gpu_mismatch(record.get("gpus"), tuple(gpus))
    if mismatch is not None:
        return refuse(f"{path} does not vouch for this host: {mismatch}; run the preflight on this host", record)
    if claimed > since:
        return refuse(f"{path} says its evidence dates from {utc_iso(claimed)} (evidence_since_unix) but its oldest "
                      f"gate started at {utc_iso(since)}, earlier: the record was edited", record)
    since = min(since, claimed)  # the preflight's own start may precede its first gate
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


def long_run_findings(cfg: RunConfig, facts: EnvFacts, *, save_checkpoints: bool = True,
                      check_config_kwargs: dict | None = None) -> list[str]:
    """The rules the preflight and the launcher apply, applied again by the trainer: the environment guard and
    every config rule but out_dir (the trainer judges its out_dir itself), plus checkpointing being on."""
    from .preflight import check_config

    findings = [f"[env] {reason}" for reason in check_env(facts).reasons]
    verdict = check_config(cfg, gpu_visible=bool(facts.gpus), resume=False, **(check_config_kwargs or {}))
    findings += [f"[{f.rule}] {f.message}" for f in verdict.findings if f.rule != "out_dir"]
    if not save_checkpoints:
        findings.append("[checkpoints] this run saves no checkpoints: a long run must")
    return findings


def authorize_training(cfg: RunConfig, *, i_know_what_im_doing: bool, records_dir: Path | None = None,
                       code: CodeIdentity | None = None, now_unix: float | None = None,
                       facts: EnvFacts | None = None, save_checkpoints: bool = True,
                       check_config_kwargs: dict | None = None, steps: int | None = None) -> Authorization:
    """The trainer's rule, whatever launched it: a run of >= policy.LONG_RUN_STEPS steps needs a GO record for
    this config, code and GPU (check_go_record) AND must pass the long-run rules on this host (long_run_findings:
    a GPU, the minimum model size, checkpoints, ...), unless the operator overrides with --i-know-what-im-doing,
    which is logged with every reason it overrode. records_dir defaults to RECORDS_DIR; facts to this host's.
    steps: the steps the process will run (default train.steps; fewer when the trainer stops early by design)."""
    steps = cfg.train.steps if steps is None else min(steps, cfg.train.steps)
    if steps < policy.LONG_RUN_STEPS:
        return Authorization(True, f"{steps} steps < {policy.LONG_RUN_STEPS}: no GO record needed",
                             {"long_run": False, "steps": steps})
    code = code_identity() if code is None else code
    facts = collect_env_facts() if facts is None else facts
    records_dir = RECORDS_DIR if records_dir is None else records_dir
    check = check_go_record(record_path(cfg.config_hash(), records_dir), config_hash=cfg.config_hash(), code=code,
                            gpus=facts.gpus, now_unix=now_unix)
    findings = long_run_findings(cfg, facts, save_checkpoints=save_checkpoints,
                                 check_config_kwargs=check_config_kwargs)
    ok = check.ok and not findings
    metadata = {"long_run": True, "steps": steps, "go_record": str(check.path), "go_check": check.reason,
                "go_record_valid": check.ok, "rule_findings": findings, "override": i_know_what_im_doing and not ok,
                "code": code.as_dict()}
    if ok:
        return Authorization(True, check.reason, metadata)
    reasons = ([] if check.ok else [check.reason]) + findings
    if i_know_what_im_doing:
        log.warning("LAUNCH GATE OVERRIDDEN with --i-know-what-im-doing: %s", "; ".join(reasons))
        return Authorization(True, f"overridden by --i-know-what-im-doing: {'; '.join(reasons)}", metadata)
    what = "a valid GO record" if not check.ok else "passing the long-run rules"
    return Authorization(False, f"refusing a {steps}-step run (>= {policy.LONG_RUN_STEPS}) without {what}: "
                                f"{'; '.join(reasons)} (or pass --i-know-what-im-doing, which is logged)", metadata)
