"""Ranks of a CPU (gloo) training run for the distributed tests, started as torchrun would start them.

As a script, one rank: `python tests/distributed_ranks.py [fault options] -- <python -m sentinels arguments>`
plants the faults it is given into this process, then runs `python -m sentinels` (the real command line). The
environment says which rank it is (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), as under torchrun.

Imported, `launch(...)` starts every rank of one run on a free port, each with its stdout/stderr in a file, and
`Run.wait(...)` waits for all of them with a deadline (a hung rank is killed, so it cannot hang the tests), and
`one_process_reference(...)` trains one process on the micro-batches of both ranks (the equivalence oracle).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------- one rank
def _plant(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from sentinels import checkpoints, distributed, trainer
    from sentinels.data import sources
    from sentinels.launch.gonogo import Authorization

    rank = int(os.environ.get("RANK", 0))

    if args.same_shard:  # planted bug: every rank reads shard 0
        for_rank = sources.ShardSpec.for_rank.__func__
        sources.ShardSpec.for_rank = classmethod(lambda cls, r, w, *a, **k: for_rank(cls, 0, w, *a, **k))

    if args.skip_allreduce_rank is not None and rank == args.skip_allreduce_rank:
        # planted bug: this rank keeps its own gradient instead of the average. It still joins each all-reduce,
        # so no rank waits for it.
        wrap = distributed.wrap_model

        def keep_local(state, bucket):
            local = bucket.buffer().clone()
            share = bucket.buffer().div_(dist.get_world_size())
            return dist.all_reduce(share, async_op=True).get_future().then(lambda _: local)

        def wrap_with_hook(*a, **k):
            net = wrap(*a, **k)
            net.register_comm_hook(None, keep_local)
            return net

        trainer.wrap_model = wrap_with_hook

    if args.no_replica_check:
        trainer.Trainer._check_replicas = lambda self, step: None

    if args.refuse_on_rank is not None and rank == args.refuse_on_rank:
        trainer.authorize_training = lambda cfg, **k: Authorization(False, f"planted refusal on rank {rank}", {})

    if args.log_writes:  # which rank writes which checkpoint
        def logged(function):
            def write(ckpt_dir, state, *a, **k):
                with open(args.log_writes, "a") as fh:
                    fh.write(f"{rank} {int(state['step'])}\n")
                return function(ckpt_dir, state, *a, **k)
            return write

        checkpoints.write_checkpoint = logged(checkpoints.write_checkpoint)
        checkpoints.finish_sharded_checkpoint = logged(checkpoints.finish_sharded_checkpoint)

    if args.at_step:  # "STEP:RANK:ACTION": before optimizer step STEP, rank RANK halts, gets SIGTERM, or is killed
        step_s, rank_s, action = args.at_step.split(":")
        train_step = trainer.Trainer._train_step

        def step_with_action(self, step):
            if step == int(step_s) and rank == int(rank_s):
                if action == "halt":
                    (self.run_dir / trainer.HALT_FILE).touch()
                else:
                    os.kill(os.getpid(), {"sigterm": signal.SIGTERM, "sigkill": signal.SIGKILL}[action])
            return train_step(self, step)

        trainer.Trainer._train_step = step_with_action

    if args.dump:  # every rank's whole parameters after the run (a sharded one gathered)
        train = trainer.Trainer.train

        def train_and_dump(self):
            result = None
            try:
                result = train(self)
                return result
            finally:  # also when the run fails (its parameters are what the test compares)
                records = None if result is None else [{k: r[k] for k in ("step", "loss", "grad_norm")}
                                                       for r in result.records]
                torch.save({"params": distributed.full_parameters(self.model), "records": records},
                           Path(args.dump) / f"rank{rank}.pt")

        trainer.Trainer.train = train_and_dump


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--same-shard", action="store_true")
    parser.add_argument("--skip-allreduce-rank", type=int)
    parser.add_argument("--no-replica-check", action="store_true")
    parser.add_argument("--refuse-on-rank", type=int)
    parser.add_argument("--log-writes")
    parser.add_argument("--at-step")
    parser.add_argument("--dump")
    parser.add_argument("--threads-after", help="a folder: each rank writes the names of its threads (Linux) there "
                                                "when the command has returned, before the interpreter exits")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    sys.path.insert(0, str(ROOT))
    _plant(args)
    from sentinels.cli import main as sentinels_main

    code = sentinels_main(command)
    if args.threads_after:
        tasks = Path("/proc/self/task")
        names = sorted((tasks / task / "comm").read_text().strip() for task in os.listdir(tasks))
        (Path(args.threads_after) / f"rank{os.environ.get('RANK', 0)}.json").write_text(json.dumps(names))
    sys.exit(code)


def group_threads(folder: Path) -> dict[int, list[str]]:
    """Each rank's threads of the process group (gloo, the TCP store, NCCL) still running when its command had
    returned (written by the rank itself: distributed_ranks.py --threads-after). A group that the trainer's close
    did not free is torn down with the interpreter, where a rank can abort (SIGABRT) while its peer exits."""
    found = {}
    for rank in range(2):
        names = json.loads((folder / f"rank{rank}.json").read_text())
        found[rank] = [n for n in names if any(k in n for k in ("gloo", "tcpstore", "nccl"))]
    return found


# ------------------------------------------------------------------------------------------ the launcher
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankResult:
    rank: int
    returncode: int
    stdout: str
    stderr: str


class Run:
    def __init__(self, procs: list[subprocess.Popen], logs: Path):
        self.procs, self.logs = procs, logs

    def pid(self, rank: int) -> int:
        return self.procs[rank].pid

    def wait(self, timeout: float = 120.0) -> list[RankResult]:
        """Every rank's exit code and output; a rank still running at the deadline is killed and the test fails."""
        deadline = time.monotonic() + timeout
        hung = []
        for rank, proc in enumerate(self.procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                hung.append(rank)
        for rank in hung:
            self.procs[rank].kill()
            self.procs[rank].wait()
        results = [RankResult(rank, proc.returncode, (self.logs / f"rank{rank}.out").read_text(),
                              (self.logs / f"rank{rank}.err").read_text()) for rank, proc in enumerate(self.procs)]
        if hung:
            tails = "\n".join(f"--- rank {r.rank} stderr:\n{r.stderr[-3000:]}" for r in results)
            raise AssertionError(f"ranks {hung} still ran after {timeout:.0f} s and were killed\n{tails}")
        return results


def launch(logs: Path, command: list[str], *, nproc: int = 2, faults: list[str] = ()) -> Run:
    """Start `nproc` ranks of `python -m sentinels <command>` with the planted `faults` (options of this script)."""
    logs.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(nproc):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
               "LOCAL_WORLD_SIZE": str(nproc)}
        procs.append(subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *faults, "--", *command],
                                      cwd=ROOT, env=env, stdout=(logs / f"rank{rank}.out").open("w"),
                                      stderr=(logs / f"rank{rank}.err").open("w")))
    return Run(procs, logs)


# --------------------------------------------------------------------------------- the one-process oracle
def _one_process(config: Path, overrides: list[str], out: Path, *, mode: str) -> dict:

    from sentinels.config import load_config
    from sentinels.distributed import RanksAsOneSource
    from sentinels.trainer import Trainer

    cfg = load_config(config, [*overrides, f"train.out_dir={out}"])
    source = RanksAsOneSource(cfg, 2, mode=mode)
    t = cfg.train
    single = cfg.replace(**({"train.grad_accum": 2 * t.grad_accum} if mode == "interleave" else
                            {"train.micro_batch_size": 2 * t.micro_batch_size}))
    trainer = Trainer(single, batch_source=source, console=False, save_checkpoints=False)
    try:
        result = trainer.train()
    finally:
        trainer.close()
    assert result.status == "completed"
    return {"params": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
            "losses": [r["loss"] for r in result.records]}


@dataclass
class Reference:
    accum2: dict  # one process, grad_accum 2 x micro-batch m, on both ranks' micro-batches: {"params", "losses"}
    micro2m: dict  # one process, one micro-batch of 2m sequences per step
    tolerance: float  # factor x max |p_2m - p_accum2|: the size of an fp32 summation-order effect on this run


def one_process_reference(tmp: Path, config: Path, overrides: list[str], factor: float) -> Reference:
    """One process on the micro-batches the two ranks of `config` + `overrides` read, twice: grad_accum 2 of the
    ranks' micro-batch, and one micro-batch of twice the size (other fp32 summation order, same mathematics)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks (OMP_NUM_THREADS=1): the same kernels, the same sums
    try:
        accum2 = _one_process(config, overrides, tmp / "accum2", mode="interleave")
        micro2m = _one_process(config, overrides, tmp / "2m", mode="concat")
    finally:
        torch.set_num_threads(threads)
    order = max((micro2m["params"][n] - p).abs().max().item() for n, p in accum2["params"].items())
    assert order > 0, "the two summation orders gave identical parameters: the tolerance would be degenerate"
    return Reference(accum2, micro2m, factor * order)


if __name__ == "__main__":
    main()
