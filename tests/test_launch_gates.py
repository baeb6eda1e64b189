"""The preflight pipeline (sentinels/launch/gates.py) end to end with stand-in subprocess gates: GO when all
pass; NO-GO with the later gates SKIPped (never started) after a failure; a gate that exits 0 without the
report that proves it is a FAIL; and the code identity it records (sentinels/launch/code.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from sentinels.config import load_config
from sentinels.launch.code import CodeIdentity, code_identity, source_digest, source_files
from sentinels.launch.env import EnvFacts, GpuFacts
from sentinels.launch.gates import (GateCommand, conformance_evidence, run_preflight, sentinels_evidence)
from sentinels.launch.gonogo import GO, NO_GO, check_go_record

REPO = Path(__file__).resolve().parent.parent
CODE = CodeIdentity(commit="a" * 40, commit_source="git", dirty=False, source_digest="d" * 64)
FACTS = EnvFacts(python="3.11.7", torch="2.4.1", cuda="12.4", triton="3.0.0",
                 gpus=(GpuFacts(0, "NVIDIA H100 80GB HBM3", (9, 0)),))


@pytest.fixture
def cfg(tmp_path):
    return load_config(REPO / "configs" / "tiny-cpu.yaml").replace(
        **{"train.device": "cuda", "train.precision": "bf16", "train.out_dir": str(tmp_path / "run")})


def fake_gate(name: str, report_dir: Path, *, exit_code: int = 0, report: dict | None = None,
              evidence=lambda reports: None if reports else "no report", marker: Path | None = None) -> GateCommand:
    """A subprocess that prints a line, may write a JSON report and a marker file, and exits with exit_code."""
    script = (f"import json, pathlib, sys\nprint('running {name}')\n"
              f"pathlib.Path({str(report_dir)!r}).mkdir(parents=True, exist_ok=True)\n")
    if report is not None:
        script += f"pathlib.Path({str(report_dir / (name + '.json'))!r}).write_text(json.dumps({report!r}))\n"
    if marker is not None:
        script += f"pathlib.Path({str(marker)!r}).write_text('ran')\n"
    script += f"print('last words of {name}')\nsys.exit({exit_code})\n"
    return GateCommand(name, [sys.executable, "-c", script], (report_dir,), evidence)


def preflight(cfg, tmp_path, gate_commands, *, facts=FACTS, code=CODE, parallel=False, check_config_kwargs=None,
              **kwargs):
    rule_facts = check_config_kwargs or {"parameter_count": lambda c: 10, "tokenizer_check": lambda n: None}
    return run_preflight(cfg=cfg, config_path="configs/x.yaml", overrides=["train.lr=0.001"], resume=False,
                         code=code, facts=facts, gate_commands=gate_commands, records_dir=tmp_path / "records",
                         check_config_kwargs=rule_facts, parallel=parallel, **kwargs)


def test_all_gates_pass_gives_go(cfg, tmp_path):
    gates = [fake_gate("conformance-gpu", tmp_path / "rc", report={"ok": 1}),
             fake_gate("sentinels-gpu", tmp_path / "rs", report={"ok": 1})]
    record, path = preflight(cfg, tmp_path, gates)
    assert record["decision"] == GO, record["reasons"]
    assert path == tmp_path / "records" / f"{cfg.config_hash()}.json"
    assert json.loads(path.read_text()) == json.loads(json.dumps(record))
    names = [g["name"] for g in record["gates"]]
    assert names == ["code", "env", "config", "conformance-gpu", "sentinels-gpu"]
    sub = record["gates"][3]
    assert sub["exit_code"] == 0 and sub["reports"] == [str(tmp_path / "rc" / "conformance-gpu.json")]
    assert "running conformance-gpu" in Path(sub["log"]).read_text()
    assert record["overrides"] == ["train.lr=0.001"]
    assert check_go_record(path, config_hash=cfg.config_hash(), code=CODE, gpus=FACTS.gpus).ok


def test_failing_gate_gives_no_go_and_skips_the_rest(cfg, tmp_path):
    marker = tmp_path / "sentinels-ran"
    gates = [fake_gate("conformance-gpu", tmp_path / "rc", exit_code=1, report={"ok": 1}),
             fake_gate("sentinels-gpu", tmp_path / "rs", report={"ok": 1}, marker=marker)]
    record, _ = preflight(cfg, tmp_path, gates)
    assert record["decision"] == NO_GO
    conf, sent = record["gates"][3], record["gates"][4]
    assert conf["verdict"] == "FAIL" and conf["detail"] == "exit code 1; last line: last words of conformance-gpu"
    assert sent["verdict"] == "SKIP" and sent["exit_code"] is None
    assert not marker.exists()


def overlap_gate(name: str, tmp_path: Path, *, exit_code: int = 0) -> GateCommand:
    """A gate that announces itself in a shared folder, then waits (up to 20 s) until the other gate has done the
    same: it can only finish quickly when both run at the same time."""
    meet = tmp_path / "meet"
    script = (f"import pathlib, sys, time\nmeet = pathlib.Path({str(meet)!r}); meet.mkdir(exist_ok=True)\n"
              f"(meet / {name!r}).write_text('here')\nreport = pathlib.Path({str(tmp_path / name)!r})\n"
              "report.mkdir(exist_ok=True)\nend = time.time() + 20\n"
              "while len(list(meet.iterdir())) < 2 and time.time() < end:\n    time.sleep(0.05)\n"
              "print('met' if len(list(meet.iterdir())) == 2 else 'alone')\n"
              f"(report / 'r.json').write_text('{{}}')\nsys.exit({exit_code})\n")
    return GateCommand(name, [sys.executable, "-c", script], (tmp_path / name,),
                       lambda reports: None if reports else "no report")


def test_parallel_gates_run_at_the_same_time_and_keep_the_gate_order(cfg, tmp_path):
    gates = [overlap_gate("conformance-gpu", tmp_path), overlap_gate("sentinels-gpu", tmp_path)]
    record, _ = preflight(cfg, tmp_path, gates, parallel=True)
    assert record["decision"] == GO, record["reasons"]
    assert [g["name"] for g in record["gates"]] == ["code", "env", "config", "conformance-gpu", "sentinels-gpu"]
    for gate in record["gates"][3:]:
        assert Path(gate["log"]).read_text().strip() == "met", "the gates did not run at the same time"


def test_parallel_gates_no_go_when_one_fails(cfg, tmp_path):
    gates = [overlap_gate("conformance-gpu", tmp_path), overlap_gate("sentinels-gpu", tmp_path, exit_code=3)]
    record, _ = preflight(cfg, tmp_path, gates, parallel=True)
    assert record["decision"] == NO_GO
    assert [g["verdict"] for g in record["gates"][3:]] == ["PASS", "FAIL"]


def test_parallel_gates_are_skipped_after_a_failed_in_process_gate(cfg, tmp_path):
    marker = tmp_path / "ran"
    gates = [fake_gate("conformance-gpu", tmp_path / "rc", report={"ok": 1}, marker=marker)]
    record, _ = preflight(cfg, tmp_path, gates, code=CodeIdentity(None, "unknown", None, "d" * 64), parallel=True)
    assert record["decision"] == NO_GO and record["gates"][3]["verdict"] == "SKIP"
    assert not marker.exists()


def test_exit_zero_without_evidence_fails(cfg, tmp_path):
    gates = [fake_gate("conformance-gpu", tmp_path / "rc", report=None),
             fake_gate("sentinels-gpu", tmp_path / "rs", report={"ok": 1})]
    record, _ = preflight(cfg, tmp_path, gates)
    assert record["decision"] == NO_GO
    assert record["gates"][3]["verdict"] == "FAIL" and record["gates"][3]["detail"] == "exit code 0 but no report"


def test_old_reports_do_not_count_as_evidence(cfg, tmp_path):
    old = tmp_path / "rc" / "old.json"
    old.parent.mkdir()
    old.write_text("{}")
    import os

    os.utime(old, (1_000_000_000, 1_000_000_000))
    gates = [fake_gate("conformance-gpu", tmp_path / "rc", report=None),
             fake_gate("sentinels-gpu", tmp_path / "rs", report={"ok": 1})]
    record, _ = preflight(cfg, tmp_path, gates)
    assert record["gates"][3]["reports"] == [] and record["decision"] == NO_GO


NO_GPU = EnvFacts(python="3.11.7", torch="2.13.0+cpu", cuda=None, triton="3.7.1", gpus=())


def test_preflight_stops_at_the_first_failed_gate(cfg, tmp_path):
    """As the runbook says: after the env gate fails, the config gate is not run (SKIP), nor any GPU gate."""
    marker = tmp_path / "ran"
    gates = [fake_gate("conformance-gpu", tmp_path / "rc", report={"ok": 1}, marker=marker)]
    record, _ = preflight(cfg, tmp_path, gates, facts=NO_GPU, check_config_kwargs={
        "parameter_count": lambda c: pytest.fail("the config gate ran after a failed gate"),
        "tokenizer_check": lambda n: None})
    verdicts = {g["name"]: g["verdict"] for g in record["gates"]}
    assert verdicts == {"code": "PASS", "env": "FAIL", "config": "SKIP", "conformance-gpu": "SKIP"}
    assert "no CUDA device" in record["gates"][1]["detail"] and "--keep-going" in record["gates"][2]["detail"]
    assert not marker.exists()


def test_keep_going_judges_every_in_process_gate_but_never_starts_a_gpu_gate(cfg, tmp_path):
    marker = tmp_path / "ran"
    gates = [fake_gate("conformance-gpu", tmp_path / "rc", report={"ok": 1}, marker=marker)]
    record, _ = preflight(cfg, tmp_path, gates, facts=NO_GPU, keep_going=True)
    verdicts = {g["name"]: g["verdict"] for g in record["gates"]}
    assert verdicts == {"code": "PASS", "env": "FAIL", "config": "FAIL", "conformance-gpu": "SKIP"}
    assert "[device]" in record["gates"][2]["detail"] and not marker.exists()


def test_unknown_commit_is_no_go(cfg, tmp_path):
    unknown = CodeIdentity(commit=None, commit_source="unknown", dirty=None, source_digest="d" * 64)
    record, _ = preflight(cfg, tmp_path, [], code=unknown)
    assert record["gates"][0]["verdict"] == "FAIL" and "--commit" in record["gates"][0]["detail"]
    assert [g["verdict"] for g in record["gates"]] == ["FAIL", "SKIP", "SKIP"]
    assert record["decision"] == NO_GO


def test_copy_to_gets_the_record_the_logs_and_the_reports(cfg, tmp_path):
    gates = [fake_gate("conformance-gpu", tmp_path / "rc", report={"ok": 1})]
    record, path = preflight(cfg, tmp_path, gates, copy_to=tmp_path / "copy")
    copied = tmp_path / "copy"
    assert (copied / path.name).read_text() == path.read_text()
    log = Path(record["gates"][3]["log"])
    assert (copied / log.name).read_text() == log.read_text() and "running conformance-gpu" in log.read_text()
    assert json.loads((copied / "conformance-gpu" / "conformance-gpu.json").read_text()) == {"ok": 1}
    preflight(cfg, tmp_path / "again", gates)
    assert sorted(p.name for p in (tmp_path / "again").iterdir()) == ["records"]  # nothing but the record's folder


# -- evidence ------------------------------------------------------------------------------------------------
def write(path: Path, data) -> Path:
    path.write_text(json.dumps(data))
    return path


def test_conformance_evidence(tmp_path):
    ok = {"device": "cuda", "properties": [{"property": "p", "verdict": "PASS"}]}
    assert conformance_evidence([write(tmp_path / "a.json", ok)]) is None
    assert "not CUDA" in conformance_evidence([write(tmp_path / "b.json", {**ok, "device": "cpu"})])
    failed = {"device": "cuda:0", "properties": [{"property": "eq9", "verdict": "FAIL"}]}
    assert "['eq9']" in conformance_evidence([write(tmp_path / "c.json", failed)])
    assert "no conformance report" in conformance_evidence([write(tmp_path / "d.json", {"x": 1})])


def test_sentinels_evidence_checks_the_tested_config(tmp_path):
    check = sentinels_evidence("h1")
    ok = {"profile": "gpu", "verdict": "PASS", "run_config": {"hash": "h1"}, "sentinels": [], "selftest": True,
          "only": None}
    assert check([write(tmp_path / "a.json", ok)]) is None
    assert "'cpu' profile" in check([write(tmp_path / "e.json", {**ok, "profile": "cpu"})])
    assert "tested run config h2" in check([write(tmp_path / "b.json", {**ok, "run_config": {"hash": "h2"}})])
    assert "verdict 'FAIL'" in check([write(tmp_path / "c.json", {**ok, "verdict": "FAIL"})])
    assert "no sentinel report" in check([])


def test_sentinels_evidence_needs_the_whole_suite(tmp_path):
    """A PASS of a subset (`--only`) or without the planted faults (`--no-selftest`) is not evidence for a launch:
    it proves neither that every sentinel passed nor that the sentinels can trip."""
    check = sentinels_evidence("h1")
    ok = {"profile": "gpu", "verdict": "PASS", "run_config": {"hash": "h1"}, "sentinels": [], "selftest": True,
          "only": None}
    assert "--only" in check([write(tmp_path / "a.json", {**ok, "only": ["random_label"]})])
    assert "self-test" in check([write(tmp_path / "b.json", {**ok, "selftest": False})])
    assert "self-test" in check([write(tmp_path / "c.json", {k: v for k, v in ok.items() if k != "selftest"})])
    assert check([write(tmp_path / "d.json", {**ok, "only": []})]) is None


# -- code identity --------------------------------------------------------------------------------------------
def test_source_digest_follows_the_sources(tmp_path):
    (tmp_path / "sentinels").mkdir()
    (tmp_path / "sentinels" / "a.py").write_text("x = 1\n")
    (tmp_path / "sentinels" / "__pycache__").mkdir()
    (tmp_path / "sentinels" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    (tmp_path / "notes.md").write_text("not source")
    assert [p.name for p in source_files(tmp_path)] == ["a.py"]
    before = source_digest(tmp_path)
    (tmp_path / "sentinels" / "__pycache__" / "b.py").write_text("ignored")
    assert source_digest(tmp_path) == before
    (tmp_path / "sentinels" / "a.py").write_text("x = 2\n")
    assert source_digest(tmp_path) != before
    (tmp_path / "sentinels" / "a.py").write_text("x = 1\n")
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "b.yaml").write_text("")
    assert source_digest(tmp_path) != before


def test_code_identity_without_git_uses_the_given_commit(tmp_path):
    (tmp_path / "configs").mkdir()
    assert code_identity(tmp_path).commit_source == "unknown"
    ident = code_identity(tmp_path, given_commit="c" * 40)
    assert ident.commit == "c" * 40 and ident.commit_source == "given" and ident.dirty is None


def test_given_commit_must_agree_with_git():
    head = code_identity(REPO)
    if head.commit is None:
        pytest.skip("this checkout has no .git")
    assert head.commit_source == "git" and len(head.commit) == 40
    assert code_identity(REPO, given_commit=head.commit[:12]).commit == head.commit
    with pytest.raises(ValueError, match="disagrees"):
        code_identity(REPO, given_commit="0" * 40)


def test_default_gate_commands_call_the_nox_sessions_with_the_config_and_their_own_report_dirs(tmp_path):
    from sentinels.launch.gates import default_gate_commands

    conf, sent = default_gate_commands("configs/prod-125m.yaml", ["train.lr=0.001"], "h1", tmp_path)
    conf_dir, sent_dir = tmp_path / "h1.conformance-gpu.reports", tmp_path / "h1.sentinels-gpu.reports"
    assert conf.name == "conformance-gpu" and conf.argv == [sys.executable, "-m", "nox", "-s", "conformance-gpu",
                                                            "--", "--report-dir", str(conf_dir)]
    assert sent.name == "sentinels-gpu" and sent.argv == [sys.executable, "-m", "nox", "-s", "sentinels-gpu", "--",
                                                          "--config", "configs/prod-125m.yaml", "-o", "train.lr=0.001",
                                                          "--out", str(sent_dir)]
    assert conf.report_dirs == (conf_dir,) and sent.report_dirs == (sent_dir,)


# -- a preflight cut off by a time limit, finished with --reuse-passed -----------------------------------------
def test_killed_preflight_leaves_a_no_go_record_of_the_finished_gates(cfg, tmp_path):
    from sentinels.launch.gates import run_gate_command

    def runner(gate, log_path):
        if gate.name == "sentinels-gpu":
            raise KeyboardInterrupt  # the time limit's SIGINT/SIGTERM arrives during the second GPU gate
        return run_gate_command(gate, log_path)

    gates = [fake_gate("conformance-gpu", tmp_path / "rc", report={"ok": 1}),
             fake_gate("sentinels-gpu", tmp_path / "rs", report={"ok": 1})]
    with pytest.raises(KeyboardInterrupt):
        run_preflight(cfg=cfg, config_path="c.yaml", overrides=[], resume=False, code=CODE, facts=FACTS,
                      gate_commands=gates, records_dir=tmp_path / "records", runner=runner,
                      check_config_kwargs={"parameter_count": lambda c: 10, "tokenizer_check": lambda n: None})
    record = json.loads((tmp_path / "records" / f"{cfg.config_hash()}.json").read_text())
    assert record["decision"] == NO_GO and record["reasons"] == ["gate sentinels-gpu did not run"]
    assert [(g["name"], g["verdict"]) for g in record["gates"]][-1] == ("conformance-gpu", "PASS")


def test_reuse_passed_runs_only_the_gates_that_did_not_pass(cfg, tmp_path):
    marker = tmp_path / "conformance-ran"
    first, _ = preflight(cfg, tmp_path, [fake_gate("conformance-gpu", tmp_path / "rc", report={"ok": 1}),
                                         fake_gate("sentinels-gpu", tmp_path / "rs", exit_code=1)])
    assert first["decision"] == NO_GO
    again = [fake_gate("conformance-gpu", tmp_path / "rc", report={"ok": 1}, marker=marker),
             fake_gate("sentinels-gpu", tmp_path / "rs", report={"ok": 1})]
    second, path = run_preflight(cfg=cfg, config_path="c.yaml", overrides=[], resume=False, code=CODE, facts=FACTS,
                                 gate_commands=again, records_dir=tmp_path / "records", reuse_from=first,
                                 check_config_kwargs={"parameter_count": lambda c: 10,
                                                      "tokenizer_check": lambda n: None})
    assert second["decision"] == GO and not marker.exists()
    conf = second["gates"][3]
    assert conf["detail"].startswith("reused (--reuse-passed)")
    assert conf["started_unix"] == first["gates"][3]["started_unix"]
    assert second["evidence_since_unix"] == conf["started_unix"]
    assert check_go_record(path, config_hash=cfg.config_hash(), code=CODE, gpus=FACTS.gpus).ok


@pytest.mark.parametrize("change", ["commit", "digest", "gpu", "torch", "config"])
def test_reuse_needs_the_same_code_gpus_versions_and_config(cfg, tmp_path, change):
    from sentinels.launch.gates import reusable_gates

    record, _ = preflight(cfg, tmp_path, [fake_gate("conformance-gpu", tmp_path / "rc", report={"ok": 1}),
                                          fake_gate("sentinels-gpu", tmp_path / "rs", exit_code=1)])
    now = record["finished_unix"]
    code, facts, config_hash = CODE, FACTS, cfg.config_hash()
    assert set(reusable_gates(record, config_hash=config_hash, code=code, facts=facts, now_unix=now)) == \
        {"conformance-gpu"}
    if change == "commit":
        code = CodeIdentity("b" * 40, "git", False, CODE.source_digest)
    elif change == "digest":
        code = CodeIdentity(CODE.commit, "git", True, "e" * 64)
    elif change == "gpu":
        facts = EnvFacts(FACTS.python, FACTS.torch, FACTS.cuda, FACTS.triton, (GpuFacts(0, "NVIDIA A100", (8, 0)),))
    elif change == "torch":
        facts = EnvFacts(FACTS.python, "2.5.0", FACTS.cuda, FACTS.triton, FACTS.gpus)
    else:
        config_hash = "0" * 64
    assert reusable_gates(record, config_hash=config_hash, code=code, facts=facts, now_unix=now) == {}


def test_reuse_drops_gates_older_than_the_record_age(cfg, tmp_path):
    from sentinels.launch import policy
    from sentinels.launch.gates import reusable_gates

    record, _ = preflight(cfg, tmp_path, [fake_gate("conformance-gpu", tmp_path / "rc", report={"ok": 1})])
    started = record["gates"][3]["started_unix"]
    kw = {"config_hash": cfg.config_hash(), "code": CODE, "facts": FACTS}
    assert "conformance-gpu" in reusable_gates(record, now_unix=started + policy.GO_RECORD_MAX_AGE_S, **kw)
    assert reusable_gates(record, now_unix=started + policy.GO_RECORD_MAX_AGE_S + 1, **kw) == {}
