"""GO/NO-GO records (sentinels/launch/gonogo.py): the decision, the launch check (missing, NO-GO, stale,
mismatched commit / config / source digest / GPU, inconsistent, edited, unreadable), and the trainer's
authorization (the record and the long-run rules, whatever launched it)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from sentinels.config import load_config
from sentinels.launch import policy
from sentinels.launch.code import CodeIdentity
from sentinels.launch.env import EnvFacts, GpuFacts
from sentinels.launch.gonogo import (FAIL, GO, NO_GO, PASS, REQUIRED_GATES, SKIP, GateResult, authorize_training,
                                     build_record, check_go_record, decide, record_path, write_record)

REPO = Path(__file__).resolve().parent.parent
NOW = 1_800_000_000.0
CODE = CodeIdentity(commit="a" * 40, commit_source="git", dirty=False, source_digest="d" * 64)
ENV = {"python": "3.11.7", "torch": "2.4.1", "cuda": "12.4", "triton": "3.0.0",
       "gpus": [{"index": 0, "name": "NVIDIA H100", "capability": "9.0"}]}
H100 = (GpuFacts(0, "NVIDIA H100", (9, 0)),)
HOST = EnvFacts(python="3.11.7", torch="2.4.1", cuda="12.4", triton="3.0.0", gpus=H100)
RULES_PASS = {"parameter_count": lambda c: 125_000_000, "tokenizer_check": lambda n: None}


@pytest.fixture(scope="module")
def cfg():
    return load_config(REPO / "configs" / "tiny-cpu.yaml").replace(
        **{"train.steps": 6000, "train.save_every": 600, "train.device": "cuda", "train.precision": "bf16"})


PREFLIGHT_S = 600  # the preflight in these records starts PREFLIGHT_S before it finishes


def gates(finished=NOW, **verdicts) -> list[GateResult]:
    return [GateResult(name, verdicts.get(name.replace("-", "_"), PASS), "detail", finished - 100, finished - 50,
                       **({"exit_code": 0, "command": ["nox"], "reports": [f"{name}.json"]} if "gpu" in name else {}))
            for name in REQUIRED_GATES]


def make_record(cfg, tmp_path, *, gate_results=None, code=CODE, finished=NOW) -> Path:
    record = build_record(cfg=cfg, config_path="configs/x.yaml", overrides=[], resume=False, code=code, env=ENV,
                          gates=gate_results if gate_results is not None else gates(finished),
                          started_unix=finished - PREFLIGHT_S, finished_unix=finished, host="gpu-host")
    return write_record(record, tmp_path)


def go_check(cfg, path, *, code=CODE, now=NOW, gpus=H100):
    return check_go_record(path, config_hash=cfg.config_hash(), code=code, gpus=gpus, now_unix=now)


def edit(path: Path, change) -> Path:
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(record))
    return path


# -- decision -------------------------------------------------------------------------------------------------
def test_go_only_when_every_required_gate_passed():
    assert decide(gates()) == (GO, [])
    decision, reasons = decide(gates(sentinels_gpu=FAIL))
    assert decision == NO_GO and reasons == ["gate sentinels-gpu: FAIL: detail"]
    decision, reasons = decide(gates(env=FAIL, conformance_gpu=SKIP, sentinels_gpu=SKIP))
    assert decision == NO_GO and len(reasons) == 3


def test_a_missing_gate_is_no_go():
    decision, reasons = decide([g for g in gates() if g.name != "conformance-gpu"])
    assert decision == NO_GO and reasons == ["gate conformance-gpu did not run"]


def test_record_fields(cfg, tmp_path):
    path = make_record(cfg, tmp_path)
    assert path == tmp_path / f"{cfg.config_hash()}.json" == record_path(cfg.config_hash(), tmp_path)
    record = json.loads(path.read_text())
    assert record["decision"] == GO and record["config_hash"] == cfg.config_hash()
    assert record["code"]["commit"] == CODE.commit and record["code"]["source_digest"] == CODE.source_digest
    assert record["gpus"][0]["name"] == "NVIDIA H100" and record["versions"]["torch"] == "2.4.1"
    assert [g["name"] for g in record["gates"]] == list(REQUIRED_GATES)
    assert all({"verdict", "exit_code", "reports", "started_at", "finished_at", "duration_s"} <= set(g)
               for g in record["gates"])
    assert record["gates"][0]["duration_s"] == 50.0 and record["finished_unix"] == NOW
    assert record["evidence_since_unix"] == NOW - PREFLIGHT_S
    assert not list(tmp_path.glob("*.tmp"))


# -- the launch check ------------------------------------------------------------------------------------------
def test_fresh_go_record_authorizes(cfg, tmp_path):
    check = go_check(cfg, make_record(cfg, tmp_path), now=NOW + 3600)
    assert check.ok, check.reason


def test_missing_record_refuses(cfg, tmp_path):
    check = go_check(cfg, record_path(cfg.config_hash(), tmp_path))
    assert not check.ok and check.reason.startswith("no GO record at") and "nox -s preflight" in check.reason


def test_no_go_record_refuses_with_its_reasons(cfg, tmp_path):
    path = make_record(cfg, tmp_path, gate_results=gates(conformance_gpu=FAIL, sentinels_gpu=SKIP))
    check = go_check(cfg, path)
    assert not check.ok and "is NO-GO" in check.reason and "gate conformance-gpu: FAIL" in check.reason


@pytest.mark.parametrize("age_s,ok", [(policy.GO_RECORD_MAX_AGE_S, True), (policy.GO_RECORD_MAX_AGE_S + 1, False),
                                      (3 * 24 * 3600, False)])
def test_stale_record_refuses(cfg, tmp_path, age_s, ok):
    """The age counts from the start of the evidence (the preflight's start), not from its end."""
    check = go_check(cfg, make_record(cfg, tmp_path), now=NOW - PREFLIGHT_S + age_s)
    assert check.ok is ok
    if not ok:
        assert "is stale" in check.reason


def test_future_dated_record_refuses(cfg, tmp_path):
    path = make_record(cfg, tmp_path, finished=NOW + PREFLIGHT_S + policy.GO_RECORD_MAX_CLOCK_SKEW_S + 60)
    check = go_check(cfg, path)
    assert not check.ok and "in the future" in check.reason
    small_skew = NOW + policy.GO_RECORD_MAX_CLOCK_SKEW_S - 10  # the record finished just "after" now
    assert go_check(cfg, make_record(cfg, tmp_path, finished=small_skew)).ok


def test_age_counts_from_the_oldest_gate(cfg, tmp_path):
    """A gate reused from an earlier preflight (--reuse-passed) keeps its start time, and the record ages with it."""
    results = gates(NOW)
    results[3] = GateResult("conformance-gpu", PASS, "reused", NOW - 20 * 3600, NOW - 19.9 * 3600, exit_code=0,
                            reports=["reports/conformance/optimized-cuda.json"])
    path = make_record(cfg, tmp_path, gate_results=results)
    assert go_check(cfg, path, now=NOW + 3 * 3600).ok
    check = go_check(cfg, path, now=NOW + 4.1 * 3600)
    assert not check.ok and "oldest gate started 24.1 h ago" in check.reason


def test_mismatched_commit_refuses(cfg, tmp_path):
    path = make_record(cfg, tmp_path)
    other = CodeIdentity(commit="b" * 40, commit_source="git", dirty=False, source_digest=CODE.source_digest)
    check = go_check(cfg, path, code=other)
    assert not check.ok and f"made at commit {'a' * 40}, this checkout is at {'b' * 40}" in check.reason


def test_mismatched_source_digest_refuses(cfg, tmp_path):
    path = make_record(cfg, tmp_path)
    edited = CodeIdentity(commit=CODE.commit, commit_source="git", dirty=True, source_digest="e" * 64)
    check = go_check(cfg, path, code=edited)
    assert not check.ok and "other source files" in check.reason


def test_mismatched_config_refuses(cfg, tmp_path):
    """A record made for another config, placed where this config's record would be, does not authorize it."""
    other = cfg.replace(**{"train.lr": 1e-3})
    made = make_record(other, tmp_path)
    target = record_path(cfg.config_hash(), tmp_path)
    made.rename(target)
    check = go_check(cfg, target)
    assert not check.ok and f"is for config hash {other.config_hash()}" in check.reason
    assert not go_check(other, record_path(other.config_hash(), tmp_path)).ok  # and is not found for its own


def test_go_record_with_a_failed_gate_is_inconsistent(cfg, tmp_path):
    path = make_record(cfg, tmp_path)
    record = json.loads(path.read_text())
    record["gates"][3]["verdict"] = FAIL  # hand-edited: decision still says GO
    path.write_text(json.dumps(record))
    check = go_check(cfg, path)
    assert not check.ok and "inconsistent" in check.reason and "conformance-gpu" in check.reason


def test_go_record_missing_a_gate_is_inconsistent(cfg, tmp_path):
    path = make_record(cfg, tmp_path)
    record = json.loads(path.read_text())
    record["gates"] = [g for g in record["gates"] if g["name"] != "sentinels-gpu"]
    path.write_text(json.dumps(record))
    assert "inconsistent" in go_check(cfg, path).reason


@pytest.mark.parametrize("content", ["{not json", "[]", json.dumps({"decision": "GO"}),
                                     json.dumps({"decision": "GO", "gates": "x", "config_hash": "h", "code": {},
                                                 "finished_unix": 0, "schema": 1})])
def test_unreadable_record_refuses(cfg, tmp_path, content):
    path = record_path(cfg.config_hash(), tmp_path)
    path.write_text(content)
    check = go_check(cfg, path)
    assert not check.ok and "not a readable GO record" in check.reason


def test_other_schema_refuses(cfg, tmp_path):
    path = make_record(cfg, tmp_path)
    record = json.loads(path.read_text())
    record["schema"] = policy.RECORD_SCHEMA + 1
    path.write_text(json.dumps(record))
    assert "schema" in go_check(cfg, path).reason


def test_copied_tree_without_git_is_matched_by_source_digest(cfg, tmp_path):
    given = CodeIdentity(commit="a" * 40, commit_source="given", dirty=None, source_digest=CODE.source_digest)
    path = make_record(cfg, tmp_path, code=given)
    no_git = CodeIdentity(commit=None, commit_source="unknown", dirty=None, source_digest=CODE.source_digest)
    assert go_check(cfg, path, code=no_git).ok
    changed = CodeIdentity(commit=None, commit_source="unknown", dirty=None, source_digest="f" * 64)
    assert not go_check(cfg, path, code=changed).ok


def test_a_later_no_go_replaces_an_earlier_go(cfg, tmp_path):
    make_record(cfg, tmp_path)
    path = make_record(cfg, tmp_path, gate_results=gates(sentinels_gpu=FAIL))
    assert not go_check(cfg, path).ok


# -- a record edited or written by hand -----------------------------------------------------------------------
def test_nan_evidence_time_is_refused(cfg, tmp_path):
    """NaN compares false both ways, so an age check on it would pass: every number must be finite."""
    path = edit(make_record(cfg, tmp_path), lambda r: r.update(evidence_since_unix=float("nan")))
    check = go_check(cfg, path, now=NOW + 60)
    assert not check.ok and "evidence_since_unix" in check.reason and "finite" in check.reason


def test_age_is_recomputed_from_the_gates_not_read_from_the_record(cfg, tmp_path):
    """Gates 25 h old with evidence_since_unix edited to now: the age comes from the gates' own start times."""
    path = make_record(cfg, tmp_path, finished=NOW - 25 * 3600)
    edit(path, lambda r: r.update(evidence_since_unix=NOW - 60, finished_unix=NOW - 60))
    check = go_check(cfg, path)
    assert not check.ok and ("stale" in check.reason or "evidence_since_unix" in check.reason), check.reason
    edit(path, lambda r: r.update(evidence_since_unix=min(g["started_unix"] for g in r["gates"])))
    check = go_check(cfg, path)
    assert not check.ok and "is stale: its oldest gate started 25.0 h ago" in check.reason


@pytest.mark.parametrize("field,value", [("started_unix", float("nan")), ("started_unix", float("inf")),
                                         ("finished_unix", float("-inf")), ("started_unix", "yesterday"),
                                         ("started_unix", None), ("finished_unix", NOW - 500)])
def test_gate_times_must_be_finite_and_in_order(cfg, tmp_path, field, value):
    def change(record):
        record["gates"][2][field] = value

    check = go_check(cfg, edit(make_record(cfg, tmp_path), change), now=NOW + 60)
    assert not check.ok and "gate config" in check.reason and field in check.reason, check.reason


def test_a_gate_dated_in_the_future_is_refused(cfg, tmp_path):
    def change(record):
        record["gates"][4]["started_unix"] = NOW + 3600
        record["gates"][4]["finished_unix"] = NOW + 3700

    check = go_check(cfg, edit(make_record(cfg, tmp_path), change), now=NOW + 60)
    assert not check.ok and "in the future" in check.reason


@pytest.mark.parametrize("change,rule", [
    (lambda g: g.update(exit_code=None), "exit code"),
    (lambda g: g.update(exit_code=1), "exit code"),
    (lambda g: g.update(reports=[]), "no report"),
])
def test_a_gpu_gate_without_its_evidence_is_refused(cfg, tmp_path, change, rule):
    """A hand-written GO record in which no GPU suite ran (no exit code, no report) does not authorize."""
    path = edit(make_record(cfg, tmp_path), lambda r: change(r["gates"][3]))
    check = go_check(cfg, path, now=NOW + 60)
    assert not check.ok and "gate conformance-gpu" in check.reason and rule in check.reason, check.reason


def test_a_gate_listed_twice_is_refused(cfg, tmp_path):
    path = edit(make_record(cfg, tmp_path), lambda r: r["gates"].append(dict(r["gates"][0], verdict=FAIL)))
    check = go_check(cfg, path, now=NOW + 60)
    assert not check.ok and "more than once" in check.reason


@pytest.mark.parametrize("gpus,why", [
    ((), "no GPU is visible"),
    ((GpuFacts(0, "NVIDIA A100-SXM4-80GB", (8, 0)),), "NVIDIA A100-SXM4-80GB"),
    ((H100[0], GpuFacts(1, "NVIDIA A10", (8, 6))), "NVIDIA A10"),
])
def test_a_record_of_other_gpus_does_not_authorize_this_host(cfg, tmp_path, gpus, why):
    check = go_check(cfg, make_record(cfg, tmp_path), now=NOW + 60, gpus=gpus)
    assert not check.ok and why in check.reason, check.reason
    assert go_check(cfg, make_record(cfg, tmp_path), now=NOW + 60, gpus=H100 + H100).ok  # more of the same GPU


# -- the trainer's authorization ------------------------------------------------------------------------------
def test_short_run_needs_no_record(cfg, tmp_path):
    short = cfg.replace(**{"train.steps": policy.LONG_RUN_STEPS - 1})
    auth = authorize_training(short, i_know_what_im_doing=False, records_dir=tmp_path, code=CODE, now_unix=NOW,
                              facts=HOST, check_config_kwargs=RULES_PASS)
    assert auth.allowed and auth.metadata == {"long_run": False, "steps": policy.LONG_RUN_STEPS - 1}


def test_long_run_without_record_is_refused(cfg, tmp_path):
    auth = authorize_training(cfg, i_know_what_im_doing=False, records_dir=tmp_path, code=CODE, now_unix=NOW,
                              facts=HOST, check_config_kwargs=RULES_PASS)
    assert not auth.allowed
    assert "refusing a 6000-step run" in auth.reason and "--i-know-what-im-doing" in auth.reason


def test_long_run_override_is_allowed_and_logged(cfg, tmp_path, caplog):
    auth = authorize_training(cfg, i_know_what_im_doing=True, records_dir=tmp_path, code=CODE, now_unix=NOW,
                              facts=HOST, check_config_kwargs=RULES_PASS)
    assert auth.allowed and auth.metadata["override"] is True and auth.metadata["go_record_valid"] is False
    assert "no GO record" in auth.metadata["go_check"]
    assert any("OVERRIDDEN" in r.getMessage() for r in caplog.records)


def test_long_run_with_valid_record_is_allowed_without_override(cfg, tmp_path):
    make_record(cfg, tmp_path)
    auth = authorize_training(cfg, i_know_what_im_doing=True, records_dir=tmp_path, code=CODE, now_unix=NOW + 60,
                              facts=HOST, check_config_kwargs=RULES_PASS)
    assert auth.allowed and auth.metadata["go_record_valid"] is True and auth.metadata["override"] is False


def test_long_run_with_stale_record_is_refused(cfg, tmp_path):
    make_record(cfg, tmp_path)
    auth = authorize_training(cfg, i_know_what_im_doing=False, records_dir=tmp_path, code=CODE,
                              now_unix=NOW - PREFLIGHT_S + policy.GO_RECORD_MAX_AGE_S + 1, facts=HOST,
                              check_config_kwargs=RULES_PASS)
    assert not auth.allowed and "stale" in auth.reason


def test_default_clock_is_now(cfg, tmp_path):
    make_record(cfg, tmp_path, finished=time.time() - 10)
    assert authorize_training(cfg, i_know_what_im_doing=False, records_dir=tmp_path, code=CODE, facts=HOST,
                              check_config_kwargs=RULES_PASS).allowed


def test_trainer_reapplies_the_long_run_rules_even_with_a_valid_record(cfg, tmp_path):
    """A GO record (forged, or for a config the rules would refuse on this host) never lets a toy model train
    on the CPU without checkpoints: the trainer applies the preflight's rules itself."""
    toy = cfg.replace(**{"train.device": "cpu", "train.save_every": 0})
    make_record(toy, tmp_path)
    auth = authorize_training(toy, i_know_what_im_doing=False, records_dir=tmp_path, code=CODE, now_unix=NOW + 60,
                              facts=HOST, check_config_kwargs={"tokenizer_check": lambda n: None})
    assert not auth.allowed and auth.metadata["go_record_valid"] is True
    for rule in ("[device]", "[save_every]", "[model_size]"):
        assert rule in auth.reason
    assert [f.split("]")[0] + "]" for f in auth.metadata["rule_findings"]] == ["[device]", "[save_every]",
                                                                               "[model_size]"]


def test_trainer_refuses_a_long_run_that_saves_no_checkpoints(cfg, tmp_path):
    make_record(cfg, tmp_path)
    auth = authorize_training(cfg, i_know_what_im_doing=False, records_dir=tmp_path, code=CODE, now_unix=NOW + 60,
                              facts=HOST, check_config_kwargs=RULES_PASS, save_checkpoints=False)
    assert not auth.allowed and "[checkpoints]" in auth.reason


def test_trainer_reapplies_the_environment_guard(cfg, tmp_path):
    make_record(cfg, tmp_path)
    no_triton = EnvFacts(python="3.11.7", torch="2.4.1", cuda="12.4", triton=None, gpus=H100)
    auth = authorize_training(cfg, i_know_what_im_doing=False, records_dir=tmp_path, code=CODE, now_unix=NOW + 60,
                              facts=no_triton, check_config_kwargs=RULES_PASS)
    assert not auth.allowed and "[env] triton does not import" in auth.reason


def test_override_covers_the_rules_and_logs_each(cfg, tmp_path, caplog):
    toy = cfg.replace(**{"train.device": "cpu"})
    auth = authorize_training(toy, i_know_what_im_doing=True, records_dir=tmp_path, code=CODE, now_unix=NOW,
                              facts=HOST, check_config_kwargs={"tokenizer_check": lambda n: None})
    assert auth.allowed and auth.metadata["override"] is True
    assert any("[device]" in f for f in auth.metadata["rule_findings"])
    assert "OVERRIDDEN" in caplog.text and "[model_size]" in caplog.text
