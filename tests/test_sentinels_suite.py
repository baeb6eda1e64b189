"""The sentinel suite at CI size: verdicts on the clean model, and planted faults that must trip them.

The full CPU profile (every sentinel and the whole self-test) is the slow test at the end; CI runs a shortened
random-label sentinel, the label-shift sentinel and the real-text/planted-fault paths on a few steps.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from sentinels.config import load_config
from sentinels.profiles import PROFILES
from sentinels.model import packs_documents
from sentinels.suite import (FAIL, PASS, WARN, SentinelRunner, cross_boundary_batch, misaligned_batch,
                             overall_verdict, plant_nan_at)

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny-cpu.yaml"


pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.jsonl"
    sentences = ["The river flows past the old mill and into the valley.",
                 "Students of history read the letters of the merchants.",
                 "A quiet wind moved through the tall grass near the station."]
    path.write_text("\n".join(json.dumps({"text": " ".join(sentences[(i + j) % 3] for j in range(6))})
                              for i in range(30)) + "\n")
    return path


def _runner(tmp_path, corpus=None, **profile_changes):
    profile = dataclasses.replace(PROFILES["cpu"], **profile_changes)
    cfg = load_config(TINY)
    return SentinelRunner(profile, run_config=cfg, probe_config=cfg, work_dir=tmp_path / "work", corpus=corpus,
                          budget_s=600, log=lambda msg: None)


CI_RANDOM_LABEL = {"train.steps": 60, "train.micro_batch_size": 8, "train.seq_len": 32, "train.lr": 3e-3,
                   "train.warmup_steps": 5, "data.synthetic.vocab_size": 64}


def test_label_shift_passes_clean_and_trips_on_misaligned_labels(tmp_path, corpus):
    runner = _runner(tmp_path, corpus)
    clean = runner.label_shift()
    # 3 contiguous sources (uniform, needle recall, real text) and 2 packed ones (uniform, real text)
    assert clean.verdict == PASS and clean.metrics["batches_checked"] == 5 * 8
    assert clean.metrics["misaligned_refused"] == 3
    planted = runner.label_shift(make_batch=misaligned_batch, planted="labels == inputs")
    assert planted.verdict == FAIL and "label misalignment" in planted.summary
    across = runner.label_shift(make_packed=cross_boundary_batch, planted="packed labels over the whole row")
    assert across.verdict == FAIL and "crosses a document boundary" in across.summary


# The packed-document sentinels run the optimized module once its seams take cu_seqlens (issue 9), else the
# reference.
PACKED_TINY = TINY if packs_documents("optimized") else None


def _packed_runner(tmp_path, corpus=None, **profile_changes):
    runner = _runner(tmp_path, corpus, **profile_changes)
    if PACKED_TINY is None:
        runner.run_config = runner.run_config.replace(**{"model.attention": "reference"})
    return runner


def test_doc_isolation_passes_clean_and_trips_on_a_cross_document_leak(tmp_path):
    runner = _packed_runner(tmp_path)
    clean = runner.doc_isolation()
    assert clean.verdict == PASS, clean.summary
    assert clean.metrics["perturb_max_rel"] == 0.0 and clean.metrics["own_change_min_rel"] > 0
    leak = runner.doc_isolation(leak="cross_document", planted="cross_document")
    assert leak.verdict == FAIL and "attention crosses a boundary" in leak.summary


def test_real_text_runs_packed_too(tmp_path, corpus):
    runner = _packed_runner(tmp_path, corpus, real_text={"train.steps": 4, "train.micro_batch_size": 2,
                                                         "train.seq_len": 32, "train.warmup_steps": 1})
    floor, gate, watchdog = runner.real_text(packing="varlen")
    assert (floor.name, gate.name, watchdog.name) == ("loss_floor_varlen", "gate_collapse_varlen", "watchdog_varlen")
    assert floor.verdict == PASS and gate.verdict == PASS and watchdog.verdict in (PASS, WARN)
    run_dir = Path(runner.work_dir) / "run01"
    assert json.loads((run_dir / "metadata.json").read_text())["packing"] == "varlen"


def test_random_label_clean_passes_and_next_token_leak_trips(tmp_path):
    runner = _runner(tmp_path, random_label=CI_RANDOM_LABEL, eval_batches=4)
    clean = runner.random_label()
    assert clean.verdict == PASS, clean.summary
    assert abs(clean.metrics["eval_loss"] - math.log(64)) <= 0.1
    leak = runner.random_label(leak="kv_next_token")
    assert leak.verdict == FAIL, leak.summary
    assert leak.metrics["gap"] < -0.1


def test_random_label_trips_on_an_early_compressed_block(tmp_path):
    """The subtler leak (one future token mixed into a compressed block) needs the CPU profile's 150 steps."""
    runner = _runner(tmp_path, random_label=PROFILES["cpu"].random_label, eval_batches=4)
    leak = runner.random_label(leak="cmp_block_early")
    assert leak.verdict == FAIL and leak.metrics["gap"] < -0.1, leak.summary


def test_real_text_verdicts_and_planted_faults(tmp_path, corpus):
    runner = _runner(tmp_path, corpus, real_text={"train.steps": 12, "train.micro_batch_size": 2,
                                                  "train.seq_len": 32, "train.warmup_steps": 2},
                     random_label=CI_RANDOM_LABEL)
    floor, gate, watchdog = runner.real_text()
    assert (floor.name, gate.name, watchdog.name) == ("loss_floor", "gate_collapse", "watchdog")
    assert floor.verdict == PASS and gate.verdict == PASS and watchdog.verdict in (PASS, WARN)
    assert floor.metrics["data_quality"]["ok"] > 0

    # planted-fault runs train the probe model on synthetic tokens, whatever data its config names
    runner.probe_config = runner.probe_config.replace(**{"data.source": "jsonl",
                                                         "data.paths": [str(tmp_path / "missing.jsonl")]})
    _, nan_watchdog_gate, nan_watchdog = runner.real_text(steps=8, synthetic=True, step_hook=plant_nan_at(4))
    assert nan_watchdog.verdict == FAIL and "non-finite" in nan_watchdog.summary

    runner.probe_config = runner.probe_config.replace(**{"monitors.gate_collapse.steps": 5})
    _, saturated, _ = runner.real_text(gate_override="saturated", steps=8, synthetic=True)
    assert saturated.verdict == FAIL and "consecutive steps" in saturated.summary


def test_overall_verdict_rules():
    from sentinels.suite import SKIP, SentinelResult

    ok = SentinelResult("a", PASS, "", "")
    warn = SentinelResult("a", WARN, "", "")
    bad = SentinelResult("a", FAIL, "", "")
    tripped = SentinelResult("a", FAIL, "", "", planted="x")
    missed = SentinelResult("a", PASS, "", "", planted="x")
    skipped = SentinelResult("a", SKIP, "", "")
    assert overall_verdict([ok, warn], [tripped]) == PASS
    assert overall_verdict([ok, bad], [tripped]) == FAIL
    assert overall_verdict([ok], [missed]) == FAIL  # a planted fault that does not trip fails the suite
    assert overall_verdict([ok, skipped], [tripped]) == "INCOMPLETE"


@pytest.mark.slow
def test_cpu_profile_end_to_end(tmp_path):
    """The whole CPU profile (about 2 minutes on 2 idle cores): every sentinel PASS, every planted fault trips."""
    proc = subprocess.run([sys.executable, "-m", "sentinels", "run", "--profile", "cpu", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "cpu-cpu.json").read_text())
    assert report["verdict"] == PASS
    assert {s["name"] for s in report["sentinels"]} == {"label_shift", "doc_isolation", "random_label", "long_range",
                                                        "loss_floor", "gate_collapse", "watchdog", "loss_floor_varlen",
                                                        "gate_collapse_varlen", "watchdog_varlen"}
    assert all(p["tripped"] for p in report["planted"]) and len(report["planted"]) >= 8
    assert all((tmp_path / s["plot"]).exists() for s in report["sentinels"] if s["plot"])


@pytest.mark.slow
def test_gpu_profile_plumbing_on_cpu(tmp_path, corpus):
    """Every run of the GPU profile (its probe and run configs, overrides and planted faults) for two steps on
    the CPU: catches config/plumbing errors before the GPU run. Verdicts at two steps mean nothing."""
    try:
        from sentinels.data.tokenizers import get_tokenizer

        get_tokenizer("gpt2")
    except Exception as exc:
        pytest.skip(f"GPT-2 tokenizer unavailable: {exc}")
    gpu = PROFILES["gpu"]

    def two_steps(overrides, **extra):
        return {**overrides, "train.steps": 2, "train.warmup_steps": 1, "train.micro_batch_size": 1, **extra}

    profile = dataclasses.replace(
        gpu, device="cpu", precision="fp32", random_label=two_steps(gpu.random_label),
        long_range=two_steps(gpu.long_range), real_text=two_steps(gpu.real_text, **{"train.seq_len": 256}),
        loss_floor_plant=two_steps(gpu.loss_floor_plant), gate_collapse_plant_steps=2, watchdog_plant_steps=2,
        eval_batches=1, label_shift_batches=1, cpu_threads=1)
    runner = SentinelRunner(profile, run_config=load_config(gpu.run_config), probe_config=load_config(gpu.probe_config),
                            work_dir=tmp_path / "work", corpus=corpus, budget_s=1800, log=lambda msg: None)
    results, planted = runner.run_all()
    assert [r.name for r in results] == ["label_shift", "doc_isolation", "random_label", "long_range", "loss_floor",
                                         "gate_collapse", "watchdog", "loss_floor_varlen", "gate_collapse_varlen",
                                         "watchdog_varlen"]
    assert len(planted) == 9 and all(r.verdict != "SKIP" for r in results + planted)
