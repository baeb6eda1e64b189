"""The trainer's own refusal (issue 7 item 5): `python -m sentinels train` of >= 5000 steps refuses without a valid
GO record, before it touches train.out_dir; --i-know-what-im-doing overrides it and lands in metadata.json."""

from __future__ import annotations

import json
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
