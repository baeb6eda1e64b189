"""DDP on CPU (gloo, 2 ranks started as torchrun starts them): a 2-rank run computes what one process computes,
planted bugs make that check fail, stops (.HALT, SIGTERM to one rank, kill -9 of one rank) stop every rank with one
checkpoint written by rank 0 only, --resume continues bit for bit, and the launch gate's refusal on any rank stops
every rank with one message.

Equivalence and its tolerance. Each rank trains on its own shard with micro-batch m and grad_accum 1; DDP averages
the two gradients, (g0 + g1) / 2. One process reading the same micro-batches (RanksAsOneSource) with grad_accum 2
accumulates 0.5 g0 + 0.5 g1: the backward is linear in the loss's seed and a scale by 0.5 (a power of two)
commutes with every fp32 rounding, so its gradients are exactly half of each rank's, and a sum of two terms rounds
the same in either order. Clipping, AdamW and the logged loss then see bit-identical inputs, so the parameters after
k steps must be EQUAL (tolerance 0).

One process with one micro-batch of 2m sequences computes the same gradients with its fp32 sums in another order
(one product over 2m*T rows instead of two over m*T), so it differs from the grad_accum-2 process by rounding
only. That difference after the same k steps, D = max |p_2m - p_accum2|, is the size of an fp32 summation-order
effect on this training; a rank may differ from the 2m process by at most TOLERANCE_FACTOR x D. A planted bug
moves the parameters by about the learning rate per step, orders of magnitude above D.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from distributed_ranks import Reference, group_threads, launch, one_process_reference

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny-cpu.yaml"
STEPS = 6
SAVE_EVERY = 3
TOLERANCE_FACTOR = 4.0
OVERRIDES = ["train.seq_len=32", "train.micro_batch_size=2", f"train.steps={STEPS}", "train.warmup_steps=2",
             f"train.save_every={SAVE_EVERY}"]


def _train_args(out: Path, *extra: str) -> list[str]:
    args = ["train", "--config", str(TINY), "-o", f"train.out_dir={out}"]
    for item in [*OVERRIDES, *extra]:
        args += ["-o", item]
    return args


def _run(tmp: Path, name: str, faults: list[str] = (), *, resume: bool = False, extra: tuple[str, ...] = (),
         timeout: float = 120.0):
    """One 2-rank run of `name` under tmp (run directory, logs, per-rank dumps, the checkpoint-write log)."""
    out, dumps = tmp / name, tmp / f"{name}.dumps"
    dumps.mkdir(parents=True, exist_ok=True)
    command = _train_args(out, *extra) + (["--resume"] if resume else [])
    threads = tmp / f"{name}.threads"
    threads.mkdir(exist_ok=True)
    run = launch(tmp / f"{name}.logs" / ("resume" if resume else "first"), command,
                 faults=[*faults, "--dump", str(dumps), "--log-writes", str(tmp / f"{name}.writes"),
                         "--threads-after", str(threads)])
    return out, dumps, run.wait(timeout)


def _dumps(path: Path) -> list[dict]:
    return [torch.load(path / f"rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Reference:
    return one_process_reference(tmp_path_factory.mktemp("one-process"), TINY, OVERRIDES, TOLERANCE_FACTOR)


def equivalence_problems(dumps: list[dict], ref: Reference) -> list[str]:
    """What separates each rank's parameters from one process on the same data (empty: equivalent)."""
    problems = []
    for rank, dump in enumerate(dumps):
        params = dump["params"]
        unequal = [n for n, p in ref.accum2["params"].items() if not torch.equal(params[n], p)]
        if unequal:
            problems.append(f"rank {rank}: {len(unequal)} parameters differ from one process with grad_accum 2 "
                            f"(first {unequal[0]})")
        gap = max((params[n] - p).abs().max().item() for n, p in ref.micro2m["params"].items())
        if gap > ref.tolerance:
            problems.append(f"rank {rank}: max |p - p_2m| = {gap:.3g} > tolerance {ref.tolerance:.3g}")
    return problems


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The 2-rank run every check compares with: STEPS steps, checkpoints every SAVE_EVERY."""
    tmp = tmp_path_factory.mktemp("ddp")
    out, dumps, results = _run(tmp, "full")
    assert [r.returncode for r in results] == [0, 0], results[0].stderr[-3000:] + results[1].stderr[-3000:]
    return tmp, out, _dumps(dumps)


def test_every_rank_has_freed_its_process_group_when_a_run_ends(uninterrupted):
    tmp, _, _ = uninterrupted
    assert group_threads(tmp / "full.threads") == {0: [], 1: []}


# -- equivalence ------------------------------------------------------------------------------------------------
def test_two_ranks_equal_one_process_on_the_same_data(uninterrupted, reference):
    tmp, out, dumps = uninterrupted
    assert equivalence_problems(dumps, reference) == []
    assert [r["loss"] for r in dumps[0]["records"]] == reference.accum2["losses"]  # the logged loss is the average
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["world_size"] == 2 and meta["config"]["train"]["parallel"] == "ddp"


def test_a_planted_bug_fails_the_equivalence_check(tmp_path, reference):
    """Both ranks reading shard 0: the check fails on both ranks, beyond the tolerance, not only bit for bit."""
    _, dumps, results = _run(tmp_path, "planted", ["--same-shard"])
    assert [r.returncode for r in results] == [0, 0], results[0].stderr[-3000:]
    problems = equivalence_problems(_dumps(dumps), reference)
    for rank in (0, 1):
        assert any(p.startswith(f"rank {rank}: max |p - p_2m|") for p in problems), problems


def test_a_rank_that_skips_its_all_reduce_fails_the_check_and_the_trainer_saves_nothing(tmp_path, reference):
    """Rank 1 keeps its own gradient (it joins the all-reduce but drops the average). The comparison with one
    process catches it on rank 1, beyond the tolerance (rank 0 is off too: its average got rank 1's gradient
    unscaled); independently the trainer's replica check (before its only
    checkpoint, at the end: save_every 0) stops every rank and writes no checkpoint of that state."""
    out, dumps, results = _run(tmp_path, "planted", ["--skip-allreduce-rank=1"], extra=("train.save_every=0",))
    assert all(r.returncode not in (0, 3) for r in results), [r.returncode for r in results]
    assert f"RanksDivergedError: the ranks hold different parameters after step {STEPS}" in results[0].stderr
    assert _error_lines(results[1].stderr) == []  # rank 0 reports
    assert not list((out / "checkpoints").glob("step_*")) if (out / "checkpoints").exists() else True
    problems = equivalence_problems(_dumps(dumps), reference)
    assert any(p.startswith("rank 1: max |p - p_2m|") for p in problems), problems


# -- stops and resume -------------------------------------------------------------------------------------------
def _metric_rows(out: Path) -> list[tuple[str, str, str]]:
    with (out / "metrics.csv").open() as fh:
        return [(r["step"], r["loss"], r["grad_norm"]) for r in csv.DictReader(fh)]


def _writes(tmp: Path, name: str) -> list[tuple[int, int]]:
    path = tmp / f"{name}.writes"
    return [tuple(map(int, line.split())) for line in path.read_text().splitlines()] if path.exists() else []


def _summary(result) -> dict:
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_stops_stop_every_rank_and_resume_continues_bit_for_bit(tmp_path, uninterrupted):
    """One run stopped three ways, resumed on 2 ranks after each stop: .HALT created before step 1 (rank 0 sees it),
    SIGTERM to rank 1 alone before step 2, kill -9 of rank 1 before step 4. Every rank stops each time; a clean
    stop writes one checkpoint, by rank 0 only; a kill leaves the last one (step 3) and no partial file; the last
    resume ends where the uninterrupted run ended, bit for bit (parameters of both ranks, optimizer, data and RNG
    state, and the logged history)."""
    _, full_out, full_dumps = uninterrupted
    out, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"

    def both(results):
        return results[0].stderr[-3000:] + results[1].stderr[-3000:]

    # .HALT: both ranks stop after step 1 (exit 3); rank 0 writes step 2
    _, _, results = _run(tmp_path, "run", ["--at-step=1:0:halt"])
    assert [r.returncode for r in results] == [3, 3], both(results)
    summary = _summary(results[0])
    assert summary["steps_done"] == 2 and ".HALT file found" in summary["halt_reason"]
    assert results[1].stdout.strip() == ""  # rank 0 reports
    assert _writes(tmp_path, "run") == [(0, 2)]

    # SIGTERM to rank 1 only: both stop after step 2; rank 0 writes step 3 (the stop and the periodic one at once)
    _, _, results = _run(tmp_path, "run", ["--at-step=2:1:sigterm"], resume=True)
    assert [r.returncode for r in results] == [3, 3], both(results)
    summary = _summary(results[0])
    assert summary["steps_done"] == 3 and "SIGTERM received (rank 1)" in summary["halt_reason"]
    assert _writes(tmp_path, "run") == [(0, 2), (0, 3)]

    # kill -9 of rank 1 before step 4: rank 0 fails at its next collective instead of waiting; nothing is written
    _, _, results = _run(tmp_path, "run", ["--at-step=4:1:sigkill"], resume=True)
    assert results[1].returncode == -9 and results[0].returncode not in (0, 3), [r.returncode for r in results]
    assert _writes(tmp_path, "run") == [(0, 2), (0, 3)]
    assert json.loads((ckpts / "latest.json").read_text())["step"] == 3
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest.json", "step_00000002.pt", "step_00000003.pt"]

    _, dumps, results = _run(tmp_path, "run", resume=True)
    assert [r.returncode for r in results] == [0, 0], both(results)
    for rank_dump, full_dump in zip(_dumps(dumps), full_dumps):
        assert rank_dump["params"].keys() == full_dump["params"].keys()
        assert all(torch.equal(p, full_dump["params"][n]) for n, p in rank_dump["params"].items())
        assert rank_dump["records"] == full_dump["records"][3:]
    assert _metric_rows(out) == _metric_rows(full_out)  # one history, identical to the uninterrupted one
    final, full_final = (torch.load(o / "checkpoints" / f"step_{STEPS:08d}.pt", weights_only=True)
                         for o in (out, full_out))
    for key in ("model", "optimizer", "data", "rng", "scheduler"):
        assert _equal(final[key], full_final[key]), key


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_train_parallel_is_a_validated_config_field():
    from sentinels.config import ConfigError, load_config

    assert load_config(TINY).train.parallel == "ddp"
    assert load_config(TINY, ["train.parallel=fsdp"]).train.parallel == "fsdp"
    with pytest.raises(ConfigError, match=r"train\.parallel: must be one of \['ddp', 'fsdp'\], got 'zero'"):
        load_config(TINY, ["train.parallel=zero"])


# -- the launch gate on every rank -------------------------------------------------------------------------------
def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def test_a_refusal_of_the_launch_gate_stops_every_rank_with_one_message(tmp_path):
    """A long run without a GO record: every rank checks the record, every rank stops, rank 0 says why once."""
    out, threads = tmp_path / "long", tmp_path / "threads"
    threads.mkdir()
    results = launch(tmp_path / "logs", _train_args(out, "train.steps=5000", "train.save_every=500"),
                     faults=["--threads-after", str(threads)]).wait(120)
    assert [r.returncode for r in results] == [2, 2]
    assert group_threads(threads) == {0: [], 1: []}  # the gate builds a model on the meta device (torch._dynamo)
    lines = _error_lines(results[0].stderr)
    assert len(lines) == 1 and "refusing a 5000-step run" in lines[0] and "no GO record" in lines[0], lines
    assert _error_lines(results[1].stderr) == [] and "Traceback" not in results[1].stderr
    assert not out.exists()


def test_a_refusal_on_one_rank_only_stops_every_rank(tmp_path):
    """The record is checked on every rank, not only on rank 0: a refusal on rank 1 alone stops rank 0 too, and rank 0
    names the rank and its reason."""
    out = tmp_path / "run"
    results = launch(tmp_path / "logs", _train_args(out), faults=["--refuse-on-rank=1"]).wait(120)
    assert [r.returncode for r in results] == [2, 2]
    assert _error_lines(results[0].stderr) == ["error: planted refusal on rank 1 (on rank 1 of 2)"]
    assert _error_lines(results[1].stderr) == []
    assert not out.exists()
