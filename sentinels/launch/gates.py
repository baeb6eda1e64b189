"""The preflight pipeline (`nox -s preflight -- --config X`): gates in order, fail fast, then a GO/NO-GO record.

Gates: code (the commit is known), env (env.py policy), config (preflight.py rules), then the GPU suites as
subprocesses: `nox -s conformance-gpu` and `nox -s sentinels-gpu -- --config X`, each writing its reports into a
directory of its own next to the record (<records>/<config-hash>.<gate>.reports/). A subprocess gate passes when
it exits 0 AND the report it wrote there says so (evidence): the conformance report ran on CUDA and has no failing
property, and the sentinels report is PASS for this very config hash. Gates after a failed one are SKIPped
(keep_going, `--keep-going`: the in-process gates are all judged, the GPU gates still never start after a failure).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..config import RunConfig
from .code import REPO_ROOT, CodeIdentity
from .env import EnvFacts, check_env
from . import policy
from .gonogo import FAIL, PASS, SKIP, GateResult, build_record, utc_iso, write_record
from .preflight import check_config

LOG_TAIL_LINES = 40


@dataclass(frozen=True)
class GateCommand:
    """A gate run as a subprocess: its command, where its JSON reports land, and what they must show."""

    name: str
    argv: list[str]
    report_dirs: tuple[Path, ...]
    evidence: Callable[[list[Path]], str | None]  # the reports it wrote -> None if they show a pass, else why not


def _load(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def conformance_evidence(reports: list[Path]) -> str | None:
    """A conformance verdict report (conformance/verdict.py) on a CUDA device with no failing property."""
    found = [(p, d) for p in reports if (d := _load(p)) is not None and "properties" in d]
    if not found:
        return "it wrote no conformance report (reports/conformance/*.json)"
    for path, data in found:
        if not str(data.get("device", "")).startswith("cuda"):
            return f"{path} ran on device {data.get('device')!r}, not CUDA"
        failed = [p.get("property") for p in data["properties"] if p.get("verdict") == "FAIL"]
        if failed:
            return f"{path} has failing properties {failed}"
    return None


def sentinels_evidence(config_hash: str) -> Callable[[list[Path]], str | None]:
    def check(reports: list[Path]) -> str | None:
        """A GPU-profile sentinel report (sentinels/report.py) of the whole suite (no `--only`, the self-test of
        planted faults included), verdict PASS, whose run config is the one to launch."""
        found = [(p, d) for p in reports if (d := _load(p)) is not None and "sentinels" in d]
        if not found:
            return "it wrote no sentinel report (reports/sentinels/*.json)"
        for path, data in found:
            if data.get("profile") != "gpu":
                return f"{path} is a sentinel report of the {data.get('profile')!r} profile, not 'gpu'"
            tested = (data.get("run_config") or {}).get("hash")
            if tested != config_hash:
                return f"{path} tested run config {tested}, not the config to launch ({config_hash})"
            if data.get("verdict") != "PASS":
                return f"{path} has verdict {data.get('verdict')!r}"
            if data.get("only"):
                return f"{path} ran only {data.get('only')} (--only): a launch needs every sentinel"
            if data.get("selftest") is not True:
                return (f"{path} ran without the self-test (--no-selftest): a launch needs the planted faults "
                        f"to trip")
        return None

    return check


def gate_report_dir(records_dir: Path, config_hash: str, gate: str) -> Path:
    """Where a subprocess gate of this config writes its reports: beside the record, one directory per gate."""
    return records_dir / f"{config_hash}.{gate}.reports"


def default_gate_commands(config_path: str, overrides: list[str], config_hash: str,
                          records_dir: Path) -> list[GateCommand]:
    nox = [sys.executable, "-m", "nox", "-s"]
    forwarded = [arg for o in overrides for arg in ("-o", o)]
    conformance_dir = gate_report_dir(records_dir, config_hash, "conformance-gpu")
    sentinels_dir = gate_report_dir(records_dir, config_hash, "sentinels-gpu")
    return [
        GateCommand("conformance-gpu", nox + ["conformance-gpu", "--", "--report-dir", str(conformance_dir)],
                    (conformance_dir,), conformance_evidence),
        GateCommand("sentinels-gpu", nox + ["sentinels-gpu", "--", "--config", config_path, *forwarded,
                                            "--out", str(sentinels_dir)],
                    (sentinels_dir,), sentinels_evidence(config_hash)),
    ]


def _new_reports(dirs: tuple[Path, ...], since_unix: float) -> list[Path]:
    found = []
    for directory in dirs:
        if directory.is_dir():
            found += [p for p in directory.glob("*.json") if p.stat().st_mtime >= since_unix - 1.0]
    return sorted(found)


def run_gate_command(gate: GateCommand, log_path: Path, *, cwd: Path = REPO_ROOT,
                     echo: Callable[[str], None] = lambda line: print(line, end="", flush=True)) -> GateResult:
    """Run the gate, echo and save its output, then judge its exit code and its reports."""
    started = time.time()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    tail: list[str] = []
    try:
        with log_path.open("w") as log_file, subprocess.Popen(
                gate.argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"}) as proc:  # lines as they come, not at exit
            assert proc.stdout is not None
            for line in proc.stdout:
                echo(line)
                log_file.write(line)
                tail = (tail + [line.rstrip("\n")])[-LOG_TAIL_LINES:]
            exit_code = proc.wait()
    except OSError as exc:
        return GateResult(gate.name, FAIL, f"could not start {gate.argv[0]}: {exc}", started, time.time(),
                          command=gate.argv, log=str(log_path))
    reports = _new_reports(gate.report_dirs, started)
    if exit_code != 0:
        last = next((line for line in reversed(tail) if line.strip()), "")
        verdict, detail = FAIL, f"exit code {exit_code}; last line: {last.strip()[:300]}"
    else:
        problem = gate.evidence(reports)
        verdict, detail = (PASS, "exit code 0 and its report agrees") if problem is None else \
            (FAIL, f"exit code 0 but {problem}")
    return GateResult(gate.name, verdict, detail, started, time.time(), exit_code=exit_code, command=gate.argv,
                      reports=[str(p) for p in reports], log=str(log_path))


def reusable_gates(previous: dict | None, *, config_hash: str, code: CodeIdentity, facts: EnvFacts,
                   now_unix: float) -> dict[str, GateResult]:
    """PASS subprocess gates of an earlier record that still vouch for this preflight: same config hash, commit,
    source digest, GPUs and versions, and started less than policy.GO_RECORD_MAX_AGE_S ago."""
    if not previous:
        return {}
    env = facts.as_dict()
    try:
        same = (previous["config_hash"] == config_hash and previous["code"]["commit"] == code.commit
                and previous["code"]["source_digest"] == code.source_digest and previous["gpus"] == env["gpus"]
                and previous["versions"] == {k: env[k] for k in ("python", "torch", "cuda", "triton")})
        gates = [GateResult.from_dict(g) for g in previous["gates"]] if same else []
    except (KeyError, TypeError, ValueError, AttributeError):
        return {}
    return {g.name: g for g in gates if g.verdict == PASS and g.exit_code is not None
            and now_unix - g.started_unix <= policy.GO_RECORD_MAX_AGE_S}


def _reused(old: GateResult) -> GateResult:
    old.detail = f"reused (--reuse-passed) from the run started {utc_iso(old.started_unix)}: {old.detail}"
    return old


def _echo_prefixed(name: str) -> Callable[[str], None]:
    """Echo a gate's output lines prefixed with its name (gates running at the same time interleave)."""
    return lambda line: print(f"[{name}] {line}", end="", flush=True)


def _run_concurrently(gate_commands: list[GateCommand], done: list[GateResult], reusable: dict[str, GateResult],
                      run: Callable[[GateCommand, Path], GateResult],
                      log_path: Callable[[str], Path]) -> list[GateResult]:
    """--parallel-gates: the subprocess gates all at once (results in gate order). If an in-process gate failed
    they are all SKIPped, as in the sequential order; reusable PASS gates are not run again."""
    if any(g.verdict != PASS for g in done):
        return [_skipped(g.name, g.argv) for g in gate_commands]
    to_run = [g for g in gate_commands if g.name not in reusable]
    with ThreadPoolExecutor(max_workers=max(1, len(to_run))) as pool:
        futures = {g.name: pool.submit(run, g, log_path(g.name)) for g in to_run}
        return [_reused(reusable[g.name]) if g.name in reusable else futures[g.name].result()
                for g in gate_commands]


def _in_process(name: str, ok: bool, detail: str, started: float) -> GateResult:
    return GateResult(name, PASS if ok else FAIL, detail, started, time.time())


def _skipped(name: str, command: list[str] | None = None, *, in_process: bool = False) -> GateResult:
    now = time.time()
    hint = " (--keep-going judges the in-process gates anyway)" if in_process else ""
    return GateResult(name, SKIP, f"not run: an earlier gate failed{hint}", now, now, command=command)


def copy_outputs(record_path: Path, gates: list[GateResult], target: Path) -> None:
    """--out: the record, every gate's log, and each subprocess gate's reports (under <target>/<gate>/)."""
    target.mkdir(parents=True, exist_ok=True)
    for item in [record_path] + [Path(g.log) for g in gates if g.log and Path(g.log).is_file()]:
        shutil.copy2(item, target / item.name)
    for gate in gates:
        for report in map(Path, gate.reports):
            if report.is_file():
                (target / gate.name).mkdir(exist_ok=True)
                shutil.copy2(report, target / gate.name / report.name)


def run_preflight(*, cfg: RunConfig, config_path: str, overrides: list[str], resume: bool, code: CodeIdentity,
                  facts: EnvFacts, gate_commands: list[GateCommand], records_dir: Path,
                  cwd: Path | None = None, check_config_kwargs: dict | None = None, reuse_from: dict | None = None,
                  runner: Callable[[GateCommand, Path], GateResult] | None = None,
                  parallel: bool = False, keep_going: bool = False, copy_to: Path | None = None) -> tuple[dict, Path]:
    """Run the gates in order (SKIP after the first failure) and return (record, path). The record is rewritten
    after every gate, so a preflight killed mid-way leaves a NO-GO record of the gates it finished; with
    `reuse_from` (the previous record, --reuse-passed) its still-valid PASS subprocess gates are not run again.
    parallel (--parallel-gates): the subprocess gates (conformance-gpu, sentinels-gpu) run at the same time
    after the in-process ones; the decision rule is unchanged (GO only if every gate passed). keep_going
    (--keep-going): the in-process gates (code, env, config) are all judged even after one failed, to see every
    refusal at once; the subprocess gates still never start after a failure. copy_to (--out): after every gate,
    the record, the gate logs and the gates' reports are also copied there."""
    started = time.time()
    config_hash = cfg.config_hash()
    gates: list[GateResult] = []
    reusable = reusable_gates(reuse_from, config_hash=config_hash, code=code, facts=facts, now_unix=started)

    def save() -> Path:
        record = build_record(cfg=cfg, config_path=config_path, overrides=overrides, resume=resume, code=code,
                              env=facts.as_dict(), gates=gates, started_unix=started, finished_unix=time.time(),
                              host=platform.node())
        path = write_record(record, records_dir)
        if copy_to is not None:
            copy_outputs(path, gates, copy_to)
        return path

    def blocked() -> bool:
        return not keep_going and any(g.verdict != PASS for g in gates)

    t0 = time.time()
    if code.commit is None:
        gates.append(_in_process("code", False, "no git commit: run in a git checkout, or pass --commit SHA for a "
                                                "copied tree", t0))
    else:
        note = "; tracked files are modified, the source digest names the code" if code.dirty else ""
        gates.append(_in_process("code", True, f"commit {code.commit} ({code.commit_source}), source digest "
                                               f"{code.source_digest[:16]}{note}", t0))

    if blocked():
        gates.append(_skipped("env", in_process=True))
    else:
        t0 = time.time()
        env = check_env(facts)
        gates.append(_in_process("env", env.ok, "; ".join(env.reasons) or "supported", t0))

    if blocked():
        gates.append(_skipped("config", in_process=True))
    else:
        t0 = time.time()
        verdict = check_config(cfg, gpu_visible=bool(facts.gpus), resume=resume, cwd=cwd,
                               **(check_config_kwargs or {}))
        gates.append(_in_process("config", verdict.ok, "; ".join(f"[{f.rule}] {f.message}" for f in verdict.findings)
                                 or f"all rules pass ({verdict.parameters:,} parameters)", t0))

    def run_subprocess(gate: GateCommand, log_path: Path) -> GateResult:
        echo = {"echo": _echo_prefixed(gate.name)} if parallel else {}
        return run_gate_command(gate, log_path, cwd=cwd or REPO_ROOT, **echo)

    run = runner or run_subprocess
    if parallel:
        save()
        gates += _run_concurrently(gate_commands, gates, reusable, run,
                                   lambda g: records_dir / f"{config_hash}.{g}.log")
    for gate in [] if parallel else gate_commands:
        save()
        if any(g.verdict != PASS for g in gates):
            gates.append(_skipped(gate.name, gate.argv))
        elif gate.name in reusable:
            gates.append(_reused(reusable[gate.name]))
        else:
            gates.append(run(gate, records_dir / f"{config_hash}.{gate.name}.log"))

    path = save()
    record = json.loads(path.read_text())
    return record, path


def format_record(record: dict, path: Path) -> str:
    lines = [f"{'gate':<16} {'verdict':<7} {'time':>8}  detail", "-" * 100]
    for g in record["gates"]:
        lines.append(f"{g['name']:<16} {g['verdict']:<7} {g['duration_s']:>7.1f}s  {g['detail']}")
        lines += [f"{'':<34}report: {r}" for r in g["reports"]]
    lines.append("-" * 100)
    lines.append(f"{record['decision']}  config {record['config_hash']}  commit {record['code']['commit']}")
    lines.append(f"record: {path}")
    return "\n".join(lines)
