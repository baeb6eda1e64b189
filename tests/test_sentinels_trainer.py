"""Trainer: exact resume, atomic checkpoints, clean stops (.HALT, SIGTERM), SIGUSR1 stacks, telemetry, loss-floor
dump, DDP on CPU through torchrun (gloo)."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sentinels.config import load_config
from sentinels.trainer import Trainer, TrainerError, lr_at

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny-cpu.yaml"


pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    lines = []
    for i in range(40):
        text = " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(20 + i % 13))
        lines.append(json.dumps({"text": f"Doc {i}: {text}."}))
    lines.insert(5, "{malformed")
    path.write_text("\n".join(lines) + "\n")
    return path


def _cfg(out_dir, *overrides):
    return load_config(TINY, [f"train.out_dir={out_dir}", "train.seq_len=32", "train.micro_batch_size=2",
                              "train.steps=8", "train.warmup_steps=2", *overrides])


def _text_cfg(out_dir, corpus, *overrides):
    return _cfg(out_dir, "data.source=jsonl", f"data.paths=[{corpus}]", *overrides)


def _train(cfg, **kwargs):
    trainer = Trainer(cfg, console=False, **kwargs)
    try:
        return trainer, trainer.train()
    finally:
        trainer.close()


def _stop_after(step):
    def hook(trainer, at):
        if at == step:
            trainer.request_stop("test interruption")
    return hook


def test_resume_continues_bit_for_bit(tmp_path, corpus):
    overrides = ("train.grad_accum=2", "train.save_every=3")
    _, full = _train(_text_cfg(tmp_path / "a", corpus, *overrides))
    assert full.status == "completed" and full.steps_done == 8
    _, first = _train(_text_cfg(tmp_path / "b", corpus, *overrides), step_hook=_stop_after(4))
    assert first.status == "halted" and first.steps_done == 5
    _, second = _train(_text_cfg(tmp_path / "b", corpus, *overrides), resume=True)
    assert second.status == "completed" and [r["step"] for r in second.records] == [5, 6, 7]
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in second.records] == [r[key] for r in full.records[5:]], key
    # the interrupted-then-resumed telemetry is one history, identical to the uninterrupted one
    rows_a = list(csv.DictReader((tmp_path / "a" / "metrics.csv").open()))
    rows_b = list(csv.DictReader((tmp_path / "b" / "metrics.csv").open()))
    assert [r["loss"] for r in rows_a] == [r["loss"] for r in rows_b]
    assert len((tmp_path / "b" / "heartbeat.jsonl").read_text().splitlines()) == 8


def test_resume_after_a_crash_past_the_checkpoint_drops_the_orphan_rows(tmp_path):
    _, full = _train(_cfg(tmp_path / "a", "train.save_every=4"))
    _, first = _train(_cfg(tmp_path / "b", "train.save_every=4"), step_hook=_stop_after(5))
    assert first.steps_done == 6  # stop writes a checkpoint at 6; simulate a crash after step 4's checkpoint:
    ckpts = tmp_path / "b" / "checkpoints"
    (ckpts / "latest.json").write_text(json.dumps({"file": "step_00000004.pt", "step": 4}))
    _, second = _train(_cfg(tmp_path / "b", "train.save_every=4"), resume=True)
    assert [r["loss"] for r in second.records] == [r["loss"] for r in full.records[4:]]
    steps = [json.loads(l)["step"] for l in (tmp_path / "b" / "heartbeat.jsonl").read_text().splitlines()]
    assert steps == list(range(8))


def test_checkpoints_are_atomic_and_pruned(tmp_path):
    _train(_cfg(tmp_path, "train.save_every=2", "train.keep_checkpoints=2"))
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest.json", "step_00000006.pt", "step_00000008.pt"]
    latest = json.loads((ckpts / "latest.json").read_text())
    assert latest["step"] == 8 and [e["file"] for e in latest["kept"]] == ["step_00000006.pt", "step_00000008.pt"]
    assert latest["sha256"] == hashlib.sha256((ckpts / "step_00000008.pt").read_bytes()).hexdigest()
    assert not list(ckpts.glob("*.tmp"))
    state = torch.load(ckpts / "step_00000008.pt", weights_only=True)  # plain data: nothing in it can run code
    assert {"model", "optimizer", "scheduler", "rng", "data", "step", "config_hash"} <= set(state)
    assert set(state["rng"][0]) >= {"python", "numpy", "torch"}
    assert state["data"][0]["primary"]["counter"] == 8


def test_refuses_to_overwrite_or_resume_nothing(tmp_path):
    _train(_cfg(tmp_path / "a"))
    with pytest.raises(TrainerError, match="holds checkpoints of an earlier run.*--resume.*--fresh"):
        Trainer(_cfg(tmp_path / "a"), console=False)
    with pytest.raises(TrainerError, match="no checkpoint"):
        Trainer(_cfg(tmp_path / "empty"), resume=True, console=False)
    with pytest.raises(TrainerError, match=r"different config; differing keys: \['train.lr'\]"):
        Trainer(_cfg(tmp_path / "a", "train.lr=0.001"), resume=True, console=False)


def test_halt_file_stops_after_a_checkpoint(tmp_path):
    def plant_halt(trainer, step):
        if step == 2:
            (tmp_path / ".HALT").touch()

    _, result = _train(_cfg(tmp_path, "train.save_every=100"), step_hook=plant_halt)
    assert result.status == "halted" and result.steps_done == 3 and ".HALT" in result.halt_reason
    assert json.loads((tmp_path / "checkpoints" / "latest.json").read_text())["step"] == 3
    _, resumed = _train(_cfg(tmp_path, "train.save_every=100"), resume=True)  # the stale .HALT is removed
    assert resumed.status == "completed" and resumed.steps_done == 8 and not (tmp_path / ".HALT").exists()


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
def test_sigterm_and_ctrl_c_stop_after_a_checkpoint(tmp_path, name):
    sig = getattr(signal, name)

    def send(trainer, step):
        if step == 1:
            os.kill(os.getpid(), sig)

    previous = signal.getsignal(sig)
    _, result = _train(_cfg(tmp_path, "train.save_every=100"), step_hook=send)
    assert result.status == "halted" and result.steps_done == 2 and name in result.halt_reason
    assert (tmp_path / "checkpoints" / "step_00000002.pt").exists()
    assert json.loads((tmp_path / "checkpoints" / "latest.json").read_text())["step"] == 2
    assert signal.getsignal(sig) is previous  # the handler is restored


def test_telemetry_and_metadata(tmp_path, corpus):
    _, result = _train(_text_cfg(tmp_path, corpus, "train.steps=4"))
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3]
    for row in rows:
        for branch in ("cmp", "slc", "win"):
            assert 0.0 <= float(row[f"gate_mean_{branch}"]) <= float(row[f"gate_max_{branch}"]) <= 1.0
        assert int(row["reads_total"]) == sum(int(row[f"reads_{b}"]) for b in ("cmp", "slc", "win")) > 0
        assert float(row["sel_distinct_blocks"]) >= 1
        assert float(row["tokens_per_s"]) > 0 and float(row["dt_fetch_s"]) >= 0 and float(row["dt_step_s"]) > 0
        assert int(row["tokens"]) == 2 * 32
        assert row["mem_allocated_mib"] == ""  # CPU: no CUDA memory to report
        assert float(row["lr"]) == pytest.approx(lr_at(int(row["step"]), result_cfg := _text_cfg(tmp_path, corpus,
                                                                                               "train.steps=4")))
    beat = [json.loads(l) for l in (tmp_path / "heartbeat.jsonl").read_text().splitlines()]
    assert len(beat) == 4 and len(beat[0]["gate_mean_per_layer"]) == 2
    meta = json.loads((tmp_path / "metadata.json").read_text())
    assert meta["config_hash"] == result_cfg.config_hash()
    assert meta["tokenizer"]["name"] == "byte" and len(meta["tokenizer"]["fingerprint"]) == 64
    assert "commit" in meta["git"] and meta["versions"]["torch"] == torch.__version__
    assert meta["precision"] == {"configured": "fp32", "effective": "fp32"}
    assert meta["data"]["source"] == "jsonl"
    assert meta["attention_class"] == "optimized.module.NSAAttention"


def test_lr_schedule_warmup_then_cosine():
    cfg = load_config(TINY, ["train.steps=110", "train.warmup_steps=10", "train.lr=1.0", "train.min_lr=0.1"])
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.55)
    assert lr_at(110, cfg) == pytest.approx(0.1)


def test_loss_floor_halts_and_dumps_the_last_batches(tmp_path, corpus):
    # A floor above any real loss makes the monitor trip at the first step: the halt and dump path in isolation.
    _, result = _train(_text_cfg(tmp_path, corpus, "monitors.loss_floor.threshold=100.0",
                                 "monitors.loss_floor.dump_batches=2", "train.grad_accum=2"))
    assert result.status == "halted" and result.steps_done == 1 and "loss_floor" in result.halt_reason
    dump = torch.load(tmp_path / "loss_floor_dump.pt", weights_only=False)
    assert [(d["step"], d["micro"]) for d in dump] == [(0, 0), (0, 1)]
    texts = [json.loads(l)["text"] for l in (tmp_path / "loss_floor_dump.jsonl").read_text().splitlines()]
    assert len(texts) == 4 and any("Doc" in t or "alpha" in t or "beta" in t for t in texts)
    events = [json.loads(l) for l in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert events[0]["kind"] == "loss_floor" and events[0]["halt"]


def test_loss_floor_is_off_for_synthetic_tasks(tmp_path):
    _, result = _train(_cfg(tmp_path, "monitors.loss_floor.threshold=100.0", "train.steps=2"))
    assert result.status == "completed" and not [e for e in result.events if e.kind == "loss_floor"]


def _run_cli(args, **kwargs):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def test_cli_train_sigusr1_dumps_stacks_and_sigterm_stops_cleanly(tmp_path):
    out = tmp_path / "run"
    proc = _run_cli(["-m", "sentinels", "train", "--config", str(TINY), "-o", f"train.out_dir={out}",
                     "-o", "train.steps=100000", "-o", "train.save_every=0", "-o", "train.warmup_steps=1",
                     "--i-know-what-im-doing"])  # a long run without a GO record (docs/runbook.md)
    try:
        deadline = time.monotonic() + 60
        beat = out / "heartbeat.jsonl"
        while time.monotonic() < deadline and not (beat.exists() and len(beat.read_text().splitlines()) >= 2):
            time.sleep(0.1)
        assert beat.exists(), "the trainer did not start"
        proc.send_signal(signal.SIGUSR1)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "Current thread" in stderr or "Thread 0x" in stderr, stderr[-2000:]
    assert "heartbeat-watchdog" in stderr or "monitors.py" in stderr  # every thread's stack
    assert proc.returncode == 3, stderr[-2000:]
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["status"] == "halted" and "SIGTERM" in summary["halt_reason"]
    assert (out / "checkpoints" / "latest.json").exists()


def test_cli_config_error_names_the_key(capsys):
    from sentinels.cli import main

    assert main(["train", "--config", str(TINY), "-o", "train.stepz=3"]) == 2
    assert "train.stepz" in capsys.readouterr().err


def test_ddp_two_ranks_on_cpu_shard_the_data(tmp_path, corpus):
    out = tmp_path / "ddp"
    proc = _run_cli(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "sentinels",
                     "train", "--config", str(TINY), "-o", f"train.out_dir={out}", "-o", "data.source=jsonl",
                     "-o", f"data.paths=[{corpus}]", "-o", "train.steps=3", "-o", "train.warmup_steps=1",
                     "-o", "train.seq_len=32", "-o", "train.micro_batch_size=2"])
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 0, stderr[-3000:]
    state = torch.load(out / "checkpoints" / "step_00000003.pt", weights_only=False)
    assert len(state["data"]) == 2
    assert state["data"][0]["primary"] != state["data"][1]["primary"]  # each rank read its own shard
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["world_size"] == 2 and meta["data"]["shard"] == [0, 2]
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    assert [int(r["tokens"]) for r in rows] == [2 * 2 * 32] * 3  # tokens of both ranks


# -- checkpoints that fail to load, fsync, weights_only ---------------------------------------------------------
def _two_checkpoints(tmp_path):
    """A run stopped after 6 steps with checkpoints at 4 and 6 (keep_checkpoints 2), and the uninterrupted run."""
    _, full = _train(_cfg(tmp_path / "full", "train.save_every=2"))
    _, first = _train(_cfg(tmp_path / "run", "train.save_every=2"), step_hook=_stop_after(5))
    ckpts = tmp_path / "run" / "checkpoints"
    assert first.steps_done == 6 and sorted(p.name for p in ckpts.glob("step_*.pt")) == \
        ["step_00000004.pt", "step_00000006.pt"]
    return full, ckpts


def _resume_records(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="sentinels.train"):
        _, resumed = _train(_cfg(tmp_path / "run", "train.save_every=2"), resume=True)
    return resumed, " ".join(r.getMessage() for r in caplog.records)


def test_truncated_newest_checkpoint_is_reported_and_the_previous_one_used(tmp_path, caplog):
    full, ckpts = _two_checkpoints(tmp_path)
    newest = ckpts / "step_00000006.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    resumed, log = _resume_records(tmp_path, caplog)
    assert "step_00000006.pt" in log and "step_00000004.pt" in log and "sha256" in log
    assert [r["step"] for r in resumed.records] == [4, 5, 6, 7]
    assert [r["loss"] for r in resumed.records] == [r["loss"] for r in full.records[4:]]  # still bit-exact
    events = [json.loads(l) for l in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert any(e["kind"] == "checkpoint_fallback" and "step_00000006.pt" in e["message"] for e in events)


def test_a_checkpoint_failing_its_checksum_is_not_used(tmp_path, caplog):
    full, ckpts = _two_checkpoints(tmp_path)
    newest = ckpts / "step_00000006.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped bit inside the tensors: still loads, but is not what was written
    newest.write_bytes(bytes(data))
    resumed, log = _resume_records(tmp_path, caplog)
    assert "step_00000006.pt" in log and "sha256" in log
    assert [r["loss"] for r in resumed.records] == [r["loss"] for r in full.records[4:]]


@pytest.mark.parametrize("latest", ["{not json", "[]", '{"file": "../../elsewhere.pt", "step": 6}',
                                    '{"file": "step_00000006.pt"}'])
def test_a_bad_latest_json_is_reported_and_the_checkpoints_on_disk_are_used(tmp_path, caplog, latest):
    full, ckpts = _two_checkpoints(tmp_path)
    (ckpts / "latest.json").write_text(latest)
    resumed, log = _resume_records(tmp_path, caplog)
    assert "latest.json" in log
    assert [r["loss"] for r in resumed.records] == [r["loss"] for r in full.records[6:]]


def test_no_usable_checkpoint_names_each_problem(tmp_path):
    _, ckpts = _two_checkpoints(tmp_path)
    for path in ckpts.glob("step_*.pt"):
        path.write_bytes(b"garbage")
    with pytest.raises(TrainerError) as err:
        Trainer(_cfg(tmp_path / "run", "train.save_every=2"), resume=True, console=False)
    message = str(err.value)
    assert "no usable checkpoint" in message and "step_00000006.pt" in message and "step_00000004.pt" in message


class _RunsCode:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_checkpoint_that_would_run_code_is_refused_without_running_it(tmp_path):
    """weights_only loading: a checkpoint from elsewhere cannot execute code, even with a matching checksum."""
    import hashlib

    _, ckpts = _two_checkpoints(tmp_path)
    marker = tmp_path / "code-ran"
    evil = ckpts / "step_00000006.pt"
    torch.save({"step": 6, "model": _RunsCode(marker)}, evil)
    latest = json.loads((ckpts / "latest.json").read_text())
    for entry in latest["kept"]:
        if entry["file"] == evil.name:
            entry["sha256"] = hashlib.sha256(evil.read_bytes()).hexdigest()
    (ckpts / "latest.json").write_text(json.dumps(latest))
    _, resumed = _train(_cfg(tmp_path / "run", "train.save_every=2"), resume=True)
    assert not marker.exists() and resumed.records[0]["step"] == 4


def test_checkpoint_directory_is_fsynced_after_each_rename(tmp_path, monkeypatch):
    import stat

    events = []
    real_replace, real_fsync = os.replace, os.fsync

    def replace(src, dst, *a, **k):
        real_replace(src, dst, *a, **k)
        events.append(("replace", Path(dst).parent.stat().st_ino, Path(dst).name))

    def fsync(fd):
        info = os.fstat(fd)
        events.append(("fsync-dir" if stat.S_ISDIR(info.st_mode) else "fsync-file", info.st_ino, None))
        real_fsync(fd)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "fsync", fsync)
    _train(_cfg(tmp_path, "train.steps=2", "train.save_every=2"))
    for i, (kind, inode, name) in enumerate(events):
        if kind == "replace" and name in ("step_00000002.pt", "latest.json"):
            assert ("fsync-dir", inode, None) in events[i + 1:], f"{name}: directory not fsynced after the rename"


# -- a second Ctrl-C, out_dir ---------------------------------------------------------------------------------
def test_a_second_sigint_aborts_at_once(tmp_path):
    def send_two(trainer, step):
        if step == 1:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)

    previous = signal.getsignal(signal.SIGINT)
    trainer = Trainer(_cfg(tmp_path, "train.save_every=100"), console=False, step_hook=send_two)
    try:
        with pytest.raises(KeyboardInterrupt):
            trainer.train()
    finally:
        trainer.close()
    assert not (tmp_path / "checkpoints").exists()  # aborted: no checkpoint was written for the stop
    assert signal.getsignal(signal.SIGINT) is previous


def test_halt_message_counts_the_steps_done(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="sentinels.train"):
        _, result = _train(_cfg(tmp_path), step_hook=_stop_after(2))
    assert result.steps_done == 3
    assert "run halted after 3 of 8 steps (checkpoint step_00000003.pt written)" in caplog.text


def test_a_new_run_into_a_non_empty_out_dir_is_refused_naming_resume_and_fresh(tmp_path):
    (tmp_path / "metrics.csv").write_text("step,loss\n0,5.0\n")  # a run that stopped before its first checkpoint
    with pytest.raises(TrainerError, match=r"train\.out_dir .* is not empty: .*--resume.*--fresh"):
        Trainer(_cfg(tmp_path), console=False)
    assert (tmp_path / "metrics.csv").read_text() == "step,loss\n0,5.0\n"


def test_fresh_moves_the_old_run_aside_and_starts_over(tmp_path):
    out = tmp_path / "run"
    _train(_cfg(out, "train.steps=2"))
    old_metrics = (out / "metrics.csv").read_text()
    _, result = _train(_cfg(out, "train.steps=2"), fresh=True)
    assert result.status == "completed" and (out / "checkpoints" / "latest.json").exists()
    assert (tmp_path / "run.old-1" / "metrics.csv").read_text() == old_metrics  # nothing was deleted
    _train(_cfg(out, "train.steps=2"), fresh=True)
    assert (tmp_path / "run.old-2" / "checkpoints" / "latest.json").exists()
    with pytest.raises(TrainerError, match="--resume and --fresh"):
        Trainer(_cfg(out), console=False, resume=True, fresh=True)


def test_an_out_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(TrainerError, match=r"train\.out_dir .*file exists and is not a directory"):
        Trainer(_cfg(tmp_path / "file"), console=False)


def test_data_is_checked_before_the_model_is_built(tmp_path, monkeypatch):
    from sentinels import trainer as trainer_module
    from sentinels.data.sources import DataError

    monkeypatch.setattr(trainer_module, "build_model", lambda cfg: pytest.fail("the model was built first"))
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match=r"data\.paths\[0\] .*empty\.jsonl: is empty"):
        Trainer(_text_cfg(tmp_path / "run", empty), console=False)
    assert not (tmp_path / "run").exists()


# -- the train command: Ctrl-C, one-line errors, --debug, --fresh ---------------------------------------------
def _cli_args(out, *extra):
    return ["train", "--config", str(TINY), "-o", f"train.out_dir={out}", "-o", "train.steps=6",
            "-o", "train.warmup_steps=1", "-o", "train.save_every=100", *extra]


def _sigint_at_step_1(monkeypatch, times):
    real = Trainer._train_step

    def step(self, step):
        if step == 1:
            for _ in range(times):
                os.kill(os.getpid(), signal.SIGINT)
        return real(self, step)

    monkeypatch.setattr(Trainer, "_train_step", step)


def test_cli_ctrl_c_checkpoints_and_exits_3_without_a_traceback(tmp_path, monkeypatch, capsys, caplog):
    from sentinels.cli import main

    _sigint_at_step_1(monkeypatch, times=1)
    assert main(_cli_args(tmp_path / "run")) == 3
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "SIGINT received" in caplog.text
    assert json.loads(captured.out.strip().splitlines()[-1])["steps_done"] == 2
    assert json.loads((tmp_path / "run" / "checkpoints" / "latest.json").read_text())["step"] == 2


def test_cli_second_ctrl_c_aborts_with_one_line(tmp_path, monkeypatch, capsys):
    from sentinels.cli import main

    _sigint_at_step_1(monkeypatch, times=2)
    assert main(_cli_args(tmp_path / "run")) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and "a second Ctrl-C: aborted at once, without a checkpoint" in err


def test_cli_refuses_a_non_empty_out_dir_in_one_line_and_fresh_starts_over(tmp_path, capsys):
    from sentinels.cli import main

    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(_cli_args(out)) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "--resume" in lines[0] and "--fresh" in lines[0] and "Traceback" not in err
    assert main(_cli_args(out, "--fresh")) == 0
    assert (tmp_path / "run.old-1" / "notes.txt").read_text() == "mine"


def test_cli_debug_shows_the_traceback(tmp_path, capsys):
    from sentinels.cli import main

    (tmp_path / "file").write_text("x")
    assert main(_cli_args(tmp_path / "file")) == 2
    assert "Traceback" not in capsys.readouterr().err
    assert main(_cli_args(tmp_path / "file", "--debug")) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "TrainerError" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks auto on a machine without CUDA")
def test_cuda_graphs_auto_is_off_without_a_cuda_device(tmp_path):
    trainer = Trainer(_cfg(tmp_path / "run", "train.device=auto"), console=False)
    assert trainer.cfg.train.cuda_graphs == "auto" and trainer.graphed_loss is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_graphs_without_a_cuda_device_is_refused_in_one_line(tmp_path):
    with pytest.raises(TrainerError, match=r"^train\.cuda_graphs needs a CUDA device; this run uses cpu$"):
        Trainer(_cfg(tmp_path / "run", "train.device=auto", "train.cuda_graphs=true"), console=False)
