"""The launcher (sentinels/launch/launch.py, `launch` command): the torchrun command line, and every refusal
before it (no/stale/mismatched GO record, environment, nproc, an out_dir filled since the preflight)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from sentinels.config import load_config
from sentinels.launch import cli, policy
from sentinels.launch.code import CodeIdentity
from sentinels.launch.env import EnvFacts, GpuFacts
from sentinels.launch.gonogo import REQUIRED_GATES, PASS, GateResult, build_record, write_record
from sentinels.launch.launch import decide_launch, torchrun_argv

REPO = Path(__file__).resolve().parent.parent
NOW = 1_800_000_000.0
CODE = CodeIdentity(commit="a" * 40, commit_source="git", dirty=False, source_digest="d" * 64)
GPU = GpuFacts(0, "NVIDIA H100 80GB HBM3", (9, 0))
FACTS = EnvFacts(python="3.11.7", torch="2.4.1", cuda="12.4", triton="3.0.0",
                 gpus=(GPU, GpuFacts(1, GPU.name, GPU.capability)))
RULE_FACTS = {"parameter_count": lambda c: 125_000_000, "tokenizer_check": lambda n: None}


@pytest.fixture
def cfg(tmp_path):
    return load_config(REPO / "configs" / "tiny-cpu.yaml").replace(
        **{"train.steps": 50_000, "train.warmup_steps": 100, "train.save_every": 1000, "train.device": "cuda",
           "train.precision": "bf16", "train.out_dir": str(tmp_path / "run")})


def go_record(cfg, records: Path, finished=NOW) -> Path:
    gates = [GateResult(name, PASS, "ok", finished - 10, finished,
                        **({"exit_code": 0, "reports": [f"{name}.json"]} if "gpu" in name else {}))
             for name in REQUIRED_GATES]
    return write_record(build_record(cfg=cfg, config_path="configs/x.yaml", overrides=[], resume=False, code=CODE,
                                     env=FACTS.as_dict(), gates=gates, started_unix=finished - 100,
                                     finished_unix=finished, host="h"), records)


def decide(cfg, tmp_path, *, nproc=2, facts=FACTS, code=CODE, now=NOW + 60, resume=False):
    return decide_launch(cfg=cfg, config_path="configs/x.yaml", overrides=["train.lr=0.001"], nproc=nproc,
                         resume=resume, code=code, facts=facts, records_dir=tmp_path / "records", now_unix=now,
                         check_config_kwargs=RULE_FACTS)


def test_torchrun_command_line():
    assert torchrun_argv(config_path="configs/prod.yaml", overrides=["train.lr=0.001"], nproc=8, resume=True,
                         python="/usr/bin/python3") == [
        "/usr/bin/python3", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "8",
        "-m", "sentinels", "train", "--config", "configs/prod.yaml", "-o", "train.lr=0.001", "--resume"]
    assert torchrun_argv(config_path="c.yaml", overrides=[], nproc=1, resume=False)[0] == sys.executable


def test_go_record_authorizes_the_launch(cfg, tmp_path):
    go_record(cfg, tmp_path / "records")
    decision = decide(cfg, tmp_path)
    assert decision.ok, decision.reasons
    assert decision.argv[decision.argv.index("--nproc_per_node") + 1] == "2"


def test_missing_record_refuses(cfg, tmp_path):
    decision = decide(cfg, tmp_path)
    assert not decision.ok and len(decision.reasons) == 1 and decision.reasons[0].startswith("no GO record")


def test_stale_record_refuses(cfg, tmp_path):
    go_record(cfg, tmp_path / "records")
    decision = decide(cfg, tmp_path, now=NOW + policy.GO_RECORD_MAX_AGE_S + 1)
    assert not decision.ok and "stale" in decision.reasons[0]


def test_record_for_other_commit_refuses(cfg, tmp_path):
    go_record(cfg, tmp_path / "records")
    later = CodeIdentity(commit="b" * 40, commit_source="git", dirty=False, source_digest="d" * 64)
    decision = decide(cfg, tmp_path, code=later)
    assert not decision.ok and "made at commit" in decision.reasons[0]


def test_record_for_other_config_is_not_found(cfg, tmp_path):
    go_record(cfg, tmp_path / "records")
    decision = decide(cfg.replace(**{"train.lr": 1e-3}), tmp_path)
    assert not decision.ok and decision.reasons[0].startswith("no GO record")


def test_more_processes_than_gpus_refuses(cfg, tmp_path):
    go_record(cfg, tmp_path / "records")
    decision = decide(cfg, tmp_path, nproc=3)
    assert decision.reasons == ("--nproc 3 but only 2 GPU(s) are visible",)
    assert decide(cfg, tmp_path, nproc=0).reasons == ("--nproc must be >= 1, got 0",)


def test_record_of_another_gpu_model_refuses(cfg, tmp_path):
    go_record(cfg, tmp_path / "records")
    a100 = EnvFacts(python="3.11.7", torch="2.4.1", cuda="12.4", triton="3.0.0",
                    gpus=(GpuFacts(0, "NVIDIA A100-SXM4-80GB", (8, 0)),))
    decision = decide(cfg, tmp_path, nproc=1, facts=a100)
    reason = decision.reasons[0]
    assert not decision.ok and "does not vouch" in reason and "NVIDIA A100-SXM4-80GB" in reason


def test_environment_is_checked_again_at_launch(cfg, tmp_path):
    go_record(cfg, tmp_path / "records")
    old_gpu = EnvFacts(python="3.11.7", torch="2.4.1", cuda="12.4", triton="3.0.0",
                       gpus=(GpuFacts(0, "Tesla V100", (7, 0)),))
    decision = decide(cfg, tmp_path, nproc=1, facts=old_gpu)
    assert not decision.ok and any(r.startswith("env: GPU 0 (Tesla V100)") for r in decision.reasons)


def test_out_dir_filled_since_the_preflight_refuses_unless_resuming(cfg, tmp_path):
    go_record(cfg, tmp_path / "records")
    ckpt = Path(cfg.train.out_dir) / "checkpoints"
    ckpt.mkdir(parents=True)
    (ckpt / "latest.json").write_text('{"file": "step_00001000.pt", "step": 1000}')
    decision = decide(cfg, tmp_path)
    assert not decision.ok and decision.reasons[0].startswith("config [out_dir]")
    resumed = decide(cfg, tmp_path, resume=True)
    assert resumed.ok and resumed.argv[-1] == "--resume"


def test_launch_command_refuses_without_record_and_never_execs(cfg, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "collect_env_facts", lambda: FACTS)
    monkeypatch.setattr(cli.os, "execv", lambda *a: pytest.fail("execv called on a refused launch"))
    config = tmp_path / "c.yaml"
    config.write_text((REPO / "configs" / "tiny-cpu.yaml").read_text().replace("steps: 20", "steps: 50000"))
    assert cli.main(["launch", "--config", str(config), "--nproc", "1"]) == 1
    err = capsys.readouterr().err
    assert "launch REFUSED" in err and "no GO record" in err
