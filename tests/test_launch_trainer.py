"""The trainer's own refusal: `python -m sentinels train` of >= 5000 steps refuses without a valid GO record, or
when the long-run rules fail on this host (whatever launched it, a forged record included), before it touches
train.out_dir; --i-know-what-im-doing overrides it and lands in metadata.json."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from sentinels import cli
from sentinels.config import load_config
from sentinels.launch import policy
from sentinels.launch.gonogo import RECORDS_DIR, record_path
from sentinels.trainer import Trainer, TrainerError

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def long_cfg(tmp_path):
    cfg = load_config(REPO / "configs" / "tiny-cpu.yaml").replace(
        **{"train.steps": policy.LONG_RUN_STEPS, "train.out_dir": str(tmp_path / "run")})
    assert not record_path(cfg.config_hash(), RECORDS_DIR).exists()
    return cfg


def test_long_run_without_go_record_is_refused_before_touching_out_dir(long_cfg):
    with pytest.raises(TrainerError, match="refusing a 5000-step run .* no GO record"):
        Trainer(long_cfg, console=False)
    assert not Path(long_cfg.train.out_dir).exists()


def test_train_command_refuses_with_exit_2(long_cfg, tmp_path, capsys):
    config = tmp_path / "long.yaml"
    config.write_text((REPO / "configs" / "tiny-cpu.yaml").read_text())
    assert cli.main(["train", "--config", str(config), "-o", f"train.steps={policy.LONG_RUN_STEPS}",
                     "-o", f"train.out_dir={tmp_path / 'run2'}"]) == 2
    assert "--i-know-what-im-doing" in capsys.readouterr().err


def test_override_is_written_into_the_run_metadata(long_cfg):
    trainer = Trainer(long_cfg, console=False, i_know_what_im_doing=True)
    try:
        meta = json.loads((Path(long_cfg.train.out_dir) / "metadata.json").read_text())
    finally:
        trainer.close()
    auth = meta["launch_authorization"]
    assert auth["override"] is True and auth["go_record_valid"] is False and auth["long_run"] is True
    assert auth["go_record"] == str(record_path(long_cfg.config_hash(), RECORDS_DIR))


def test_short_run_records_that_no_gate_applied(long_cfg):
    short = long_cfg.replace(**{"train.steps": policy.LONG_RUN_STEPS - 1})
    trainer = Trainer(short, console=False)
    try:
        meta = json.loads((Path(short.train.out_dir) / "metadata.json").read_text())
    finally:
        trainer.close()
    assert meta["launch_authorization"] == {"long_run": False, "steps": policy.LONG_RUN_STEPS - 1}


def test_a_hand_written_go_record_does_not_let_a_toy_model_train_on_the_cpu(long_cfg, tmp_path, monkeypatch):
    """A GO record written by hand for this exact code and config (no gate ever ran, host "forged") is refused,
    and even if it were not, the trainer's own long-run rules refuse a toy model on the CPU."""
    from sentinels.launch import gonogo
    from sentinels.launch.code import code_identity

    records = tmp_path / "records"
    monkeypatch.setattr(gonogo, "RECORDS_DIR", records)
    code = code_identity()
    now = time.time()
    forged = {"schema": policy.RECORD_SCHEMA, "decision": "GO", "reasons": [], "config_hash": long_cfg.config_hash(),
              "code": code.as_dict(), "host": "forged",
              "gpus": [{"index": 0, "name": "NVIDIA H100", "capability": "9.0"}],
              "gates": [{"name": name, "verdict": "PASS", "started_unix": now - 60, "finished_unix": now - 30,
                         "exit_code": 0, "reports": ["r.json"]} for name in gonogo.REQUIRED_GATES],
              "finished_unix": now - 30, "evidence_since_unix": now - 60}
    records.mkdir()
    record_path(long_cfg.config_hash(), records).write_text(json.dumps(forged))
    with pytest.raises(TrainerError) as err:
        Trainer(long_cfg, console=False)
    message = str(err.value)
    assert "does not vouch for this host: no GPU is visible" in message
    for rule in ("[device]", "[model_size]", "[env]"):
        assert rule in message
    assert not Path(long_cfg.train.out_dir).exists()
