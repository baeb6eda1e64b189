"""train.parallel fsdp (FSDP2, fully_shard) on CPU (gloo, 2 ranks): it trains what one process trains on the same
data, within the summation-order tolerance; its checkpoints are sharded directories (torch.distributed.checkpoint)
written atomically, checked file by file, resumed bit for bit on 2 ranks and loaded by one process; a damaged or
code-carrying checkpoint is refused and the previous one used.

The tolerance (as in test_distributed_ddp.py): one process with grad_accum 2 and one process with a single
micro-batch of twice the size differ only in the order of their fp32 sums; their largest parameter difference after
the same steps, D, sizes an fp32 summation-order effect on this training. FSDP differs from the grad_accum-2
process in such orders only (the gradient norm summed shard by shard, then over the ranks; a reduce-scatter of two
ranks is one addition), so every parameter must lie within TOLERANCE_FACTOR x D of both one-process runs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from distributed_ranks import Reference, group_threads, launch, one_process_reference
from sentinels.config import load_config
from sentinels.trainer import Trainer, TrainerError

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny-cpu.yaml"
STEPS = 6
TOLERANCE_FACTOR = 4.0
OVERRIDES = ["train.seq_len=32", "train.micro_batch_size=2", f"train.steps={STEPS}", "train.warmup_steps=2",
             "train.save_every=3", "train.parallel=fsdp"]

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def _train_args(out: Path, *extra: str) -> list[str]:
    args = ["train", "--config", str(TINY), "-o", f"train.out_dir={out}"]
    for item in [*OVERRIDES, *extra]:
        args += ["-o", item]
    return args


def _run(tmp: Path, name: str, faults: list[str] = (), *, resume: bool = False):
    out, dumps = tmp / name, tmp / f"{name}.dumps"
    dumps.mkdir(parents=True, exist_ok=True)
    command = _train_args(out) + (["--resume"] if resume else [])
    threads = tmp / f"{name}.threads"
    threads.mkdir(exist_ok=True)
    results = launch(tmp / f"{name}.logs" / ("resume" if resume else "first"), command,
                     faults=[*faults, "--dump", str(dumps), "--log-writes", str(tmp / f"{name}.writes"),
                             "--threads-after", str(threads)]).wait(120)
    dumps = [torch.load(dumps / f"rank{r}.pt", weights_only=True) for r in range(2)] \
        if all((dumps / f"rank{r}.pt").exists() for r in range(2)) else None
    return out, dumps, results


def _both(results) -> str:
    return results[0].stderr[-3000:] + results[1].stderr[-3000:]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Reference:
    return one_process_reference(tmp_path_factory.mktemp("one-process"), TINY, OVERRIDES, TOLERANCE_FACTOR)


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    """The uninterrupted 2-rank FSDP run, and the same run stopped by .HALT before step 1 (snapshot kept)."""
    tmp = tmp_path_factory.mktemp("fsdp")
    full_out, full_dumps, results = _run(tmp, "full")
    assert [r.returncode for r in results] == [0, 0], _both(results)
    out, halted_dumps, results = _run(tmp, "run", ["--at-step=1:0:halt"])
    assert [r.returncode for r in results] == [3, 3], _both(results)
    snapshot = tmp / "run.halted"
    shutil.copytree(out, snapshot)
    return {"tmp": tmp, "full_out": full_out, "full": full_dumps, "out": out, "halted": halted_dumps,
            "snapshot": snapshot}


def test_every_rank_has_freed_its_process_group_when_a_run_ends(fsdp_runs):
    """A completed and a halted run: each rank's gloo threads are gone when its command returns (the trainer's close
    released the sharded model and torch's DTensor caches that hold its mesh), so none is torn down with the
    interpreter, where a rank can abort while its peer exits."""
    for name in ("full", "run"):
        assert group_threads(fsdp_runs["tmp"] / f"{name}.threads") == {0: [], 1: []}, name


def _max_gap(params: dict, other: dict) -> float:
    return max((params[n] - p).abs().max().item() for n, p in other.items())


def test_fsdp_on_two_ranks_trains_what_one_process_trains(fsdp_runs, reference):
    full = fsdp_runs["full"]
    assert all(torch.equal(p, full[1]["params"][n]) for n, p in full[0]["params"].items())  # gathered: one model
    gaps = [_max_gap(full[0]["params"], ref["params"]) for ref in (reference.accum2, reference.micro2m)]
    assert max(gaps) <= reference.tolerance, (gaps, reference.tolerance)
    losses = [r["loss"] for r in full[0]["records"]]
    assert losses == pytest.approx(reference.accum2["losses"], rel=1e-5)
    meta = json.loads((fsdp_runs["full_out"] / "metadata.json").read_text())
    assert meta["world_size"] == 2 and meta["config"]["train"]["parallel"] == "fsdp"


def test_a_sharded_checkpoint_is_one_directory_finished_by_rank_0(fsdp_runs):
    tmp, snapshot = fsdp_runs["tmp"], fsdp_runs["snapshot"]
    ckpts = snapshot / "checkpoints"
    latest = json.loads((ckpts / "latest.json").read_text())
    assert latest["file"] == "step_00000002.dcp" and latest["step"] == 2
    root = ckpts / "step_00000002.dcp"
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) == \
        ["manifest.json", "state.pt", "tensors/.metadata", "tensors/__0_0.distcp", "tensors/__1_0.distcp"]
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest.json", "step_00000002.dcp"]  # no .tmp left
    assert (tmp / "run.writes").read_text().splitlines()[0] == "0 2"  # rank 0 alone finished the directory
    import hashlib

    assert latest["sha256"] == hashlib.sha256((root / "manifest.json").read_bytes()).hexdigest()
    state = torch.load(root / "state.pt", weights_only=True)
    assert "model" not in state and len(state["data"]) == 2 and state["optimizer_plain"]


def test_the_halted_fsdp_run_resumes_bit_for_bit_on_two_ranks(fsdp_runs):
    tmp = fsdp_runs["tmp"]
    _restore_halted(fsdp_runs)
    out, dumps, results = _run(tmp, "run", resume=True)
    assert [r.returncode for r in results] == [0, 0], _both(results)
    full = fsdp_runs["full"]
    for rank in range(2):
        assert all(torch.equal(p, full[rank]["params"][n]) for n, p in dumps[rank]["params"].items())
        assert dumps[rank]["records"] == full[rank]["records"][2:]
    rows = [json.loads(line)["loss"] for line in (out / "heartbeat.jsonl").read_text().splitlines()]
    assert rows == [r["loss"] for r in full[0]["records"]]


def _one_process_cfg(out: Path, *extra: str):
    return load_config(TINY, [*OVERRIDES, f"train.out_dir={out}", *extra])


def _restore_halted(runs) -> Path:
    """The run directory as the .HALT left it (train.out_dir is part of the config, so it is resumed in place)."""
    shutil.rmtree(runs["out"], ignore_errors=True)
    shutil.copytree(runs["snapshot"], runs["out"])
    return runs["out"]


def test_a_two_rank_sharded_checkpoint_resumes_in_one_process(fsdp_runs, caplog):
    """World size 2 -> 1 with grad_accum 2 (the same global batch): the parameters load exactly (gathered from the
    shards), the run continues to its end and says that the data readers start over. grad_accum 1 (half the
    global batch) is refused, naming the fix."""
    out = _restore_halted(fsdp_runs)
    with pytest.raises(TrainerError, match=r"2 rank\(s\) x micro_batch_size 2 x grad_accum 1 = 4 sequences per "
                                           r"optimizer step; this run has 1 x 2 x 1 = 2: set train.grad_accum=2"):
        Trainer(_one_process_cfg(out), resume=True, console=False)
    with caplog.at_level("WARNING", logger="sentinels.train"):
        trainer = Trainer(_one_process_cfg(out, "train.grad_accum=2"), resume=True, console=False)
    try:
        halted = fsdp_runs["halted"][0]["params"]
        assert all(torch.equal(p.detach(), halted[n]) for n, p in trainer.model.named_parameters())
        assert trainer.start_step == 2
        result = trainer.train()
    finally:
        trainer.close()
    assert result.status == "completed" and [r["step"] for r in result.records] == [2, 3, 4, 5]
    assert [e.kind for e in result.events] == ["resume_layout_change"]
    assert "2 rank(s) x micro_batch_size 2 x grad_accum 1 -> 1 x 2 x 2" in caplog.text
    assert "the data readers start over" in caplog.text


def test_sharded_format_in_one_process_and_its_checks(tmp_path, caplog):
    """One process with train.parallel fsdp writes the same sharded directories; resume is bit for bit; a shard that
    changed on disk, an unfinished directory and an index that would run code are each refused, and the previous
    kept checkpoint used."""
    full = _train(_one_process_cfg(tmp_path / "full", "train.save_every=2"))
    cfg = _one_process_cfg(tmp_path / "run", "train.save_every=2")
    first = _train(cfg, stop_after=3)
    assert first.steps_done == 4
    ckpts = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest.json", "step_00000002.dcp", "step_00000004.dcp"]
    snapshot = tmp_path / "snapshot"
    shutil.copytree(ckpts, snapshot)

    resumed = _train(cfg, resume=True)
    assert [r["loss"] for r in resumed.records] == [r["loss"] for r in full.records[4:]]

    def damaged(change) -> str:
        shutil.rmtree(ckpts)
        shutil.copytree(snapshot, ckpts)
        change(ckpts / "step_00000004.dcp")
        with caplog.at_level("WARNING", logger="sentinels.train"):
            caplog.clear()
            result = _train(cfg, resume=True)
        assert result.records[0]["step"] == 2  # the previous kept checkpoint
        assert [r["loss"] for r in result.records] == [r["loss"] for r in full.records[2:]]
        assert any(e.kind == "checkpoint_fallback" for e in result.events)
        return caplog.text

    def flip_a_byte(root: Path) -> None:
        shard = root / "tensors" / "__0_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))

    assert "__0_0.distcp does not match its sha256 in manifest.json" in damaged(flip_a_byte)
    assert "has no manifest.json" in damaged(lambda root: (root / "manifest.json").unlink())

    marker = tmp_path / "code-ran"

    def code_in_the_index(root: Path) -> None:
        """An attacker who controls the whole directory: an index that calls a function, with the manifest and
        latest.json rewritten to match it."""
        import hashlib
        import pickle

        class RunsCode:
            def __reduce__(self):
                return (open, (str(marker), "w"))

        index = root / "tensors" / ".metadata"
        index.write_bytes(pickle.dumps(RunsCode()))
        manifest = json.loads((root / "manifest.json").read_text())
        manifest["files"]["tensors/.metadata"] = {"bytes": index.stat().st_size,
                                                  "sha256": hashlib.sha256(index.read_bytes()).hexdigest()}
        raw = json.dumps(manifest).encode()
        (root / "manifest.json").write_bytes(raw)
        latest = json.loads((root.parent / "latest.json").read_text())
        for entry in [latest, *latest["kept"]]:
            if entry["file"] == root.name:
                entry["sha256"] = hashlib.sha256(raw).hexdigest()
        (root.parent / "latest.json").write_text(json.dumps(latest))

    assert "open has no place in a checkpoint index" in damaged(code_in_the_index)
    assert not marker.exists()


def _train(cfg, *, resume: bool = False, stop_after: int | None = None):
    def hook(trainer, step):
        if step == stop_after:
            trainer.request_stop("test interruption")

    trainer = Trainer(cfg, resume=resume, console=False, step_hook=hook if stop_after is not None else None)
    try:
        return trainer.train()
    finally:
        trainer.close()
