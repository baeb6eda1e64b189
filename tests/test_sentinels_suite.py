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
from sentinels.profiles import PROFILES, SENTINELS
from sentinels.model import packs_documents
from sentinels.plants import PLANTS
from sentinels.suite import (FAIL, NOT_APPLICABLE, PASS, WARN, SentinelRunner, cross_boundary_batch,
                             misaligned_batch, overall_verdict, plant_nan_at, worst_position_class)

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


# The packed-document sentinels run the optimized module when its seams take cu_seqlens, else the reference.
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
    clean, trained = runner.random_label()
    assert clean.verdict == PASS, clean.summary
    assert abs(clean.metrics["eval_loss"] - math.log(64)) <= 0.1
    assert [ev["step"] for ev in clean.metrics["evals"]] == [25, 50, 60]
    assert trained.name == "causal_isolation_trained" and trained.verdict == PASS, trained.summary
    leak, leak_trained = runner.random_label(PLANTS["kv_next_token"], planted="kv_next_token")
    assert leak.verdict == FAIL, leak.summary
    assert leak.metrics["first_trip_step"] == 25 and leak.metrics["steps"] == 26  # stopped once tripped
    assert leak_trained.verdict == FAIL and leak_trained.metrics["stopped_early"]


def test_worst_position_class_finds_a_leak_at_one_offset():
    """A leak at one block offset (1 position in l = 8) moves the mean over all positions by an eighth only."""
    nsa = load_config(TINY).model.nsa_config()  # d = 4, l = l' = 8
    ln_v = math.log(64)
    loss = [ln_v] * 64
    for p in range(7, 64, 8):
        loss[p] = ln_v - 0.4
    worst = worst_position_class(loss, ln_v, nsa)
    assert worst["class"] == "p % 8 == 7" and worst["class_gap"] == pytest.approx(-0.4)
    assert sum(loss) / 64 - ln_v == pytest.approx(-0.05)  # above the trip line; the class is below it
    assert worst_position_class([ln_v] * 64, ln_v, nsa)["class_gap"] == pytest.approx(0.0)


@pytest.mark.slow
def test_random_label_trips_on_a_leak_at_one_position_in_d(tmp_path):
    """The CPU profile's random-label run trips on the compressed branch leaking one token at 1 position in 4 (the
    query i*d + l - 1 reads a block one token early), at T = 128 where selection selects."""
    runner = _runner(tmp_path, eval_batches=8)
    leak = runner.random_label(PLANTS["cmp_one_early"], planted="cmp_one_early", trained_isolation=False)[0]
    assert leak.verdict == FAIL and leak.metrics["class_gap"] < -0.1, leak.summary


def test_causal_isolation_passes_clean_and_trips_on_every_plant(tmp_path):
    runner = _runner(tmp_path)
    clean = runner.causal_isolation()
    assert clean.verdict == PASS and clean.metrics["probes_run"] == 63 * 4, clean.summary
    for name in PROFILES["cpu"].isolation_plants:
        row = runner.causal_isolation(PLANTS[name], planted=name)
        assert row.verdict == FAIL and row.metrics["first"]["p"] < row.metrics["first"]["t"], (name, row.summary)


def test_a_seam_plant_that_changes_nothing_is_not_applicable(tmp_path):
    """A path that calls a replaced seam but computes the rule itself (as a kernel may) shows no leak and no change:
    the row is "not applicable", never a silent pass of the sentinel."""
    from sentinels.plants import Plant

    unchanged = Plant("same_rule", "the original window rule, through the seam", "none",
                      seams={"window_key_visible": lambda original: lambda *args: original(*args)})
    row = _runner(tmp_path).causal_isolation(unchanged, planted="same_rule")
    assert row.verdict == NOT_APPLICABLE and row.metrics["seam_calls"] > 0, row.summary
    assert "logits are those of the unplanted model" in row.summary


def _path_aware_plant(monkeypatch, broken_factory):
    """A window-seam plant applied only once the model is on the torch path, as on CUDA where the kernels compute
    the window rule themselves and ignore the replaced seam; all_on_torch_path answers for that stand-in."""
    import sentinels.suite as suite_module
    from sentinels.plants import Plant

    state = {"torch_path": False}
    real_on_torch_path = suite_module.on_torch_path

    def on_torch_path(model):
        state["torch_path"] = True
        real_on_torch_path(model)

    monkeypatch.setattr(suite_module, "on_torch_path", on_torch_path)
    monkeypatch.setattr(suite_module, "all_on_torch_path", lambda model: state["torch_path"])

    def factory(original):
        broken = broken_factory(original)
        return lambda *args, **kwargs: (broken if state["torch_path"] else original)(*args, **kwargs)

    return Plant("kernel_window", "the window rule, replaced where the torch path reads it", "none",
                 seams={"window_key_visible": factory})


def test_a_seam_plant_the_default_path_ignores_trips_on_the_torch_path(tmp_path, monkeypatch):
    """A seam plant the default path does not apply is run again with the layers on the torch path, and trips
    there: the row says which path tripped."""
    plant = _path_aware_plant(monkeypatch, PLANTS["window_next_key"].seams["window_key_visible"])
    row = _runner(tmp_path).causal_isolation(plant, planted=plant.name)
    assert row.verdict == FAIL and row.metrics["first"]["p"] < row.metrics["first"]["t"], row.summary
    assert row.summary.startswith("on the torch path") and "does not apply the plant" in row.summary


def test_a_seam_plant_both_paths_ignore_stays_not_applicable(tmp_path, monkeypatch):
    plant = _path_aware_plant(monkeypatch, lambda original: original)
    row = _runner(tmp_path).causal_isolation(plant, planted=plant.name)
    assert row.verdict == NOT_APPLICABLE and row.summary.startswith("on the torch path"), row.summary


def test_on_torch_path_sets_every_attention_layer():
    from sentinels.model import all_on_torch_path, build_model, on_torch_path

    cfg = load_config(TINY)
    model = build_model(cfg)
    assert all_on_torch_path(model)  # "auto" off CUDA is the torch path
    layers = [m for m in model.modules() if hasattr(m, "range_backend")]
    assert layers, "the tiny config's model has no routed attention layers"
    layers[-1].range_backend = "triton"
    assert not all_on_torch_path(model)
    on_torch_path(model)
    assert all_on_torch_path(model) and all(m.backend == m.range_backend == "torch" for m in layers)


def test_seed_reseeds_every_run(tmp_path):
    runner = _runner(tmp_path)
    runner.seed = 7
    cfg = runner._config(runner.probe_config, {})
    assert cfg.train.seed == 7 and cfg.data.shuffle_seed == 7
    unseeded = _runner(tmp_path)._config(load_config(TINY), {})
    assert unseeded.train.seed == load_config(TINY).train.seed


def test_only_runs_the_named_sentinels_and_their_selftest_rows(tmp_path):
    runner = _runner(tmp_path)
    runner.profile = dataclasses.replace(runner.profile, isolation_plants=("window_next_key", "sel_next_block"))
    results, planted = runner.run_all(only={"causal_isolation"})
    assert [r.name for r in results] == ["causal_isolation"]
    assert [(r.planted, r.name, r.tripped) for r in planted] == [
        ("leak: window_next_key", "causal_isolation", True), ("leak: sel_next_block", "causal_isolation", True)]
    assert overall_verdict(results, planted) == PASS
    with pytest.raises(ValueError, match="unknown sentinel"):
        runner.run_all(only={"random_labels"})


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


def test_real_text_can_run_the_first_steps_of_the_run_schedule(tmp_path, corpus):
    """real_text_first_steps: the run config's own train.steps and warmup (longer than the sentinel run) stay, and
    the run stops after its first steps without a 'cut' note. A launch-length config needs no GO record for it:
    the launch gate judges the steps the process runs."""
    runner = _runner(tmp_path, corpus, real_text={"train.micro_batch_size": 2, "train.seq_len": 32},
                     real_text_first_steps={"contiguous": 6})
    runner.run_config = runner.run_config.replace(**{"train.steps": 50000, "train.warmup_steps": 2000})
    floor, gate, _ = runner.real_text()
    assert floor.metrics["steps"] == 6 and floor.verdict == PASS, floor.summary
    assert "cut at step" not in floor.summary and "cut at step" not in gate.summary


def test_the_launch_gate_still_refuses_the_whole_schedule(tmp_path):
    from sentinels.trainer import Trainer, TrainerError

    cfg = load_config(TINY).replace(**{"train.steps": 50000, "train.out_dir": str(tmp_path / "run")})
    with pytest.raises(TrainerError, match="refusing a 50000-step run"):
        Trainer(cfg, console=False, save_checkpoints=False)
    with pytest.raises(TrainerError, match="refusing a 10000-step run"):
        Trainer(cfg, console=False, save_checkpoints=False, stop_after=10000)  # 10000 steps: still long


def test_overall_verdict_rules():
    from sentinels.suite import SKIP, SentinelResult

    ok = SentinelResult("a", PASS, "", "")
    warn = SentinelResult("a", WARN, "", "")
    bad = SentinelResult("a", FAIL, "", "")
    tripped = SentinelResult("a", FAIL, "", "", planted="x")
    missed = SentinelResult("a", PASS, "", "", planted="x")
    skipped = SentinelResult("a", SKIP, "", "")
    short = SentinelResult("a", PASS, "", "", incomplete="judged over 22 steps")
    not_applicable = SentinelResult("a", NOT_APPLICABLE, "", "", planted="x")
    assert overall_verdict([ok, warn], [tripped]) == PASS
    assert overall_verdict([ok, bad], [tripped]) == FAIL
    assert overall_verdict([ok], [missed]) == FAIL  # a planted fault that does not trip fails the suite
    assert overall_verdict([ok, skipped], [tripped]) == "INCOMPLETE"
    assert overall_verdict([ok, short], [tripped]) == "INCOMPLETE"  # a run shorter than the profile asks
    assert overall_verdict([ok], [tripped, not_applicable]) == PASS


@pytest.mark.slow
def test_cpu_profile_end_to_end(tmp_path):
    """The whole CPU profile (under 5 minutes on 2 cores): every sentinel PASS, every planted fault trips."""
    proc = subprocess.run([sys.executable, "-m", "sentinels", "run", "--profile", "cpu", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "cpu-cpu.json").read_text())
    assert report["verdict"] == PASS
    assert [s["name"] for s in report["sentinels"]] == list(SENTINELS)
    assert all(p["tripped"] and p["state"] == "tripped (expected)" for p in report["planted"])
    planted = {(p["planted"], p["name"]) for p in report["planted"]}
    assert {(f"leak: {name}", "causal_isolation") for name in PLANTS} <= planted
    assert ("leak: cmp_one_early", "random_label") in planted
    assert all((tmp_path / s["plot"]).exists() for s in report["sentinels"] if s["plot"])
    assert "tripped (expected)" in (tmp_path / "cpu-cpu.md").read_text()


@pytest.mark.slow
def test_gpu_profile_plumbing_on_cpu(tmp_path, corpus, monkeypatch):
    """Every run of the GPU profile (its probe and run configs, overrides and planted faults) for two steps on
    the CPU, the isolation checks on short rows and a few positions: catches config/plumbing errors before the GPU
    run. Verdicts at two steps mean nothing."""
    try:
        from sentinels.data.tokenizers import get_tokenizer

        get_tokenizer("gpt2")
    except Exception as exc:
        pytest.skip(f"GPT-2 tokenizer unavailable: {exc}")
    import sentinels.suite as suite

    # the run config's model at 2048 tokens costs minutes per forward on a CPU: check short rows, few positions
    monkeypatch.setattr(suite, "isolation_length", lambda nsa, seq_len: 2 * nsa.sel_block)
    monkeypatch.setattr(suite, "probe_positions", lambda nsa, T, **kw: [1, nsa.cmp_block - 1, T - 1])
    gpu = PROFILES["gpu"]

    def two_steps(overrides, **extra):
        return {**overrides, "train.steps": 2, "train.warmup_steps": 1, "train.micro_batch_size": 1, **extra}

    profile = dataclasses.replace(
        gpu, device="cpu", precision="fp32", random_label=two_steps(gpu.random_label),
        long_range=two_steps(gpu.long_range), real_text=two_steps(gpu.real_text, **{"train.seq_len": 256}),
        real_text_varlen=two_steps(gpu.real_text_varlen, **{"train.seq_len": 256}), plant_run=two_steps(gpu.plant_run),
        loss_floor_plant=two_steps(gpu.loss_floor_plant), gate_collapse_plant_steps=2, watchdog_plant_steps=2,
        eval_batches=1, label_shift_batches=1, cpu_threads=1, isolation_plants=("kv_next_token", "window_next_key"),
        random_label_plants=("kv_next_token",), trained_isolation_plants=("kv_next_token",))
    runner = SentinelRunner(profile, run_config=load_config(gpu.run_config), probe_config=load_config(gpu.probe_config),
                            work_dir=tmp_path / "work", corpus=corpus, budget_s=1800, log=lambda msg: None)
    results, planted = runner.run_all()
    assert [r.name for r in results] == list(SENTINELS)
    assert [(r.planted, r.name) for r in planted][:4] == [
        ("leak: kv_next_token", "causal_isolation"), ("leak: window_next_key", "causal_isolation"),
        ("leak: kv_next_token", "random_label"), ("leak: kv_next_token", "causal_isolation_trained")]
    assert len(planted) == 11 and all(r.verdict != "SKIP" for r in results + planted)
