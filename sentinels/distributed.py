"""Training over several ranks (torchrun): the process group, the model wrapper that train.parallel names, the
collectives through which the ranks agree, and one process reading what several ranks read.

train.parallel
  ddp   torch.nn.parallel.DistributedDataParallel: every rank holds the whole model; at the last micro-batch of an
        optimizer step the gradients are averaged over the ranks (all-reduce, overlapped with the backward).
        Rank 0 writes each checkpoint, one file (sentinels/checkpoints.py).
  fsdp  FSDP2, torch.distributed.fsdp.fully_shard: each decoder block, then the root (embedding, tied head, final
        norm) is sharded over the ranks, so parameters, gradients and AdamW state live in shards (DTensor). On
        CUDA with train.precision bf16 the parameters are all-gathered in bf16 for compute and the gradients
        reduced in fp32 (MixedPrecisionPolicy); the sharded weights and the optimizer state stay fp32. Gradients
        are reduce-scattered after every micro-batch, so no rank holds a whole model's gradient. Checkpoints are
        sharded (torch.distributed.checkpoint): every rank writes its own shards.
A single process (no torchrun) trains the plain model whatever train.parallel says; the setting still picks the
checkpoint format, so a sharded checkpoint resumes in one process and the other way round.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .config import RunConfig
from .data.batch import Batch
from .data.pipeline import BatchSource
from .data.sources import ShardSpec
from .errors import BAD_INPUT_ERRORS, one_line

T = TypeVar("T")


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    initialized_here: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return dist.is_available() and dist.is_initialized()


def init_distributed(device_type: str) -> DistInfo:
    """torchrun sets RANK/WORLD_SIZE/LOCAL_RANK; then join the process group (nccl on CUDA, gloo on CPU)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return DistInfo()
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    initialized_here = False
    if not dist.is_initialized():
        # torch.distributed.nn's functions take `group=group.WORLD` as a default argument, evaluated when the module
        # is first imported (torch._dynamo imports it, e.g. on the first init of a tensor on the meta device). Imported
        # after the group exists, ten defaults hold the default group for good: destroy_process_group cannot free it,
        # and its backend's threads are only stopped in interpreter teardown, where a rank can abort (SIGABRT).
        import torch.distributed.nn  # noqa: F401

        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
        initialized_here = True
    return DistInfo(rank, world, local, initialized_here)


# ----------------------------------------------------------------------------------------------------
# The model wrapper


def require_fsdp() -> None:
    """ImportError naming the setting unless this torch has FSDP2 (torch.distributed.fsdp.fully_shard, torch >= 2.6)
    and torch.distributed.checkpoint's state-dict API."""
    try:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict  # noqa: F401
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"train.parallel fsdp needs FSDP2 (torch.distributed.fsdp.fully_shard, torch >= 2.6); "
                          f"torch {torch.__version__} has not: {exc}") from None


def wrap_model(model: nn.Module, *, parallel: str, device: torch.device, info: DistInfo,
               bf16: bool) -> nn.Module:
    """The module the training step calls: DDP around `model`, or `model` itself sharded in place by FSDP2 (its
    parameters become DTensors, so build the optimizer after this), or `model` alone in a single process."""
    if not info.active:
        return model
    if parallel == "ddp":
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if parallel != "fsdp":
        raise ValueError(f"train.parallel must be 'ddp' or 'fsdp', got {parallel!r}")
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
              else MixedPrecisionPolicy())
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def clear_dtensor_caches() -> None:
    """Empty torch's caches that keep DTensor device meshes alive, and with them the meshes' process groups: the
    sharding propagation caches (C++ and Python), the redistribution plans and the mesh topologies. A sharded model
    whose references are dropped still leaves its group running (its gloo or NCCL threads) until these let go.
    Each cache is looked up by name, so a torch that lacks one skips it."""
    import importlib

    for module, clear in (("torch.distributed.tensor.debug", "_clear_sharding_prop_cache"),
                          ("torch.distributed.tensor._redistribute", "clear_redistribute_planner_cache"),
                          ("torch.distributed.tensor._redistribute", "_gen_transform_infos.cache_clear"),
                          ("torch.distributed.tensor._collective_utils", "MeshTopoInfo.build_from_mesh.cache_clear")):
        try:
            target = importlib.import_module(module)
            for name in clear.split("."):
                target = getattr(target, name)
        except (ImportError, AttributeError):
            continue
        target()


def gradient_sync(net: nn.Module, sync: bool):
    """DDP: skip the all-reduce (no_sync) on all but the last micro-batch of a step. FSDP2 reduce-scatters after
    every micro-batch (its gradients stay sharded), one process has nothing to sync."""
    if isinstance(net, DistributedDataParallel) and not sync:
        return net.no_sync()
    return contextlib.nullcontext()


def clip_grad_norm(parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over every rank's shards: the total 2-norm of all gradients (a sharded one's
    norm is reduced over the ranks), and every gradient scaled by max_norm / norm when it is larger."""
    from torch.distributed.tensor import DTensor

    with_grad = [p for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in with_grad], norm_type=2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(with_grad, max_norm, total)
    return total


# ----------------------------------------------------------------------------------------------------
# Agreement between ranks


def gather_objects(info: DistInfo, obj: Any) -> list[Any]:
    """obj of every rank, in rank order (every rank must call it)."""
    if not info.active:
        return [obj]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def _failure_message(what: str, failures: list[tuple[int, str]], world_size: int) -> str:
    messages = sorted({m for _, m in failures})
    if len(messages) == 1:
        ranks = [r for r, _ in failures]
        where = "" if len(ranks) == world_size else f" (on rank{'s' if len(ranks) > 1 else ''} " \
                                                      f"{', '.join(map(str, ranks))} of {world_size})"
        return f"{messages[0]}{where}"
    return f"{what}: " + "; ".join(f"rank {r}: {m}" for r, m in failures)


def on_every_rank(info: DistInfo, what: str, fn: Callable[[], T], error: type[Exception],
                  quiet_error: type[Exception]) -> T:
    """fn() on every rank, and the ranks agree on the outcome: when it fails on any rank, every rank stops.

    Rank 0 raises one error naming the ranks that failed and why (its own exception unchanged when it failed
    alone or for the same reason as every other rank); the other ranks raise `quiet_error`, which the command line
    turns into an exit code without a message, so a refusal is said once. A failure that is not bad input (a bug)
    is re-raised with its traceback on the rank where it happened. One process runs fn() as it is."""
    if not info.active:
        return fn()
    result, caught = None, None
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - every rank must learn of any failure, or they wait forever
        caught = exc
    mine = None
    if caught is not None:
        mine = one_line(caught) if isinstance(caught, BAD_INPUT_ERRORS) else \
            f"{type(caught).__name__}: {one_line(caught)}"
    everyone = gather_objects(info, mine)
    failures = [(rank, message) for rank, message in enumerate(everyone) if message is not None]
    if not failures:
        return result
    if caught is not None and not isinstance(caught, BAD_INPUT_ERRORS):
        raise caught
    message = _failure_message(what, failures, info.world_size)
    if info.is_main:
        if caught is not None and {m for _, m in failures} == {mine}:
            raise caught
        raise error(message)
    raise quiet_error(message)


@torch.no_grad()
def parameter_fingerprint(model: nn.Module, chunk: int = 1 << 24) -> torch.Tensor:
    """[n_parameters, 2] int64 per parameter: the sum of its elements' bit patterns and of their squares (wrapping),
    so one flipped bit of any element changes it. Equal on every rank when the replicas hold the same weights."""
    rows = []
    for _, p in sorted(model.named_parameters(), key=lambda item: item[0]):
        flat = p.detach().reshape(-1)
        bits = flat.view(torch.int32) if flat.dtype == torch.float32 else flat.double().view(torch.int64)
        total = torch.zeros(2, dtype=torch.int64, device=flat.device)
        for start in range(0, bits.numel(), chunk):
            part = bits[start:start + chunk].to(torch.int64)
            total += torch.stack([part.sum(), (part * part).sum()])
        rows.append(total)
    return torch.stack(rows) if rows else torch.zeros(0, 2, dtype=torch.int64)


def diverged_parameters(info: DistInfo, model: nn.Module) -> list[str]:
    """Names of the parameters whose replicas differ between ranks (DDP keeps them bit-identical; a rank that
    misses a gradient all-reduce does not). Every rank must call it; one process returns []."""
    if not info.active:
        return []
    fingerprint = parameter_fingerprint(model)
    low, high = fingerprint.clone(), fingerprint.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    names = sorted(name for name, _ in model.named_parameters())
    return [names[i] for i in (low != high).any(dim=1).nonzero().flatten().tolist()]


# ----------------------------------------------------------------------------------------------------
# Sharded checkpoint tensors (FSDP2); the files, checksums and fallback are sentinels/checkpoints.py's


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor],
                                                                                dict[str, Any]]:
    """(tensors: the model's and the optimizer's tensors under "model.<fqn>" and "optimizer.state.<fqn>.<key>",
    sharded as this run holds them; plain: the optimizer's hyperparameters per parameter, numbers only). An
    optimizer without state yet gets it first (a step of zero gradients and learning rate 0), so the tensors are
    also the template a checkpoint is loaded into."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    tensors = {f"model.{k}": v for k, v in get_model_state_dict(model).items()}
    flat = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
    plain = {}
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            tensors[f"optimizer.{key}"] = value
        else:
            plain[key] = value
    return tensors, plain


def load_sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer, tensors_dir: str,
                       optimizer_plain: dict[str, Any]) -> None:
    """Load the tensors torch.distributed.checkpoint wrote to tensors_dir into this run's model and optimizer,
    resharded to this run's ranks (any world size, one process included); every rank must call it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    tensors, _ = sharded_state(model, optimizer)
    with _one_process_is_intended():
        dcp.load(tensors, storage_reader=dcp.FileSystemReader(tensors_dir), no_dist=not _initialized())
    set_model_state_dict(model, {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")})
    flat = {k[len("optimizer."):]: v for k, v in tensors.items() if k.startswith("optimizer.")}
    set_optimizer_state_dict(model, optimizer, {**flat, **optimizer_plain},
                             options=StateDictOptions(flatten_optimizer_state_dict=True))


def save_sharded_tensors(tensors: dict[str, torch.Tensor], tensors_dir: str) -> None:
    """Every rank writes its shards of `tensors` into tensors_dir (fsynced); rank 0 also writes the index."""
    import torch.distributed.checkpoint as dcp

    with _one_process_is_intended():
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tensors_dir, sync_files=True),
                 no_dist=not _initialized())


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _one_process_is_intended():
    """torch.distributed.checkpoint warns when it runs without a process group; here that is what one process does."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is .*single process")
        yield


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, on the CPU (a sharded one gathered from all ranks: every rank must call it)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        value = p.detach()
        if isinstance(value, DTensor):
            value = value.full_tensor()
        out[name] = value.cpu().clone()
    return out


# ----------------------------------------------------------------------------------------------------
# One process reading what several ranks read


class RanksAsOneSource:
    """The micro-batches that `world_size` ranks of `cfg` read (each its own shard, as the trainer builds it), read
    by one process, so that a one-process run can be checked against a multi-rank run on the same data.

    interleave (default): per optimizer step, rank 0's cfg.train.grad_accum micro-batches, then rank 1's, ...:
        train it with grad_accum = world_size x cfg.train.grad_accum and the same micro_batch_size.
    concat: each call returns the next micro-batch of every rank, concatenated along the batch (contiguous
        windows only): train it with micro_batch_size = world_size x cfg's and the same grad_accum.
    """

    def __init__(self, cfg: RunConfig, world_size: int, *, mode: str = "interleave"):
        if mode not in ("interleave", "concat"):
            raise ValueError(f"mode must be 'interleave' or 'concat', got {mode!r}")
        if mode == "concat" and cfg.data.packing != "contiguous":
            raise ValueError("mode 'concat' joins contiguous windows; data.packing varlen rows hold one packed row")
        self.cfg, self.world_size, self.mode = cfg, world_size, mode
        self.sources = [BatchSource(cfg, ShardSpec.for_rank(rank, world_size), synthetic_on_fail=False)
                        for rank in range(world_size)]
        self.calls = 0

    def next_batch(self) -> Batch:
        if self.mode == "concat":
            batches = [source.next_batch() for source in self.sources]
            masks = [b.loss_mask for b in batches]
            mask = None if all(m is None for m in masks) else torch.cat(
                [torch.ones_like(b.inputs, dtype=torch.float32) if m is None else m for b, m in zip(batches, masks)])
            return Batch(torch.cat([b.inputs for b in batches]), torch.cat([b.labels for b in batches]), mask)
        accum = self.cfg.train.grad_accum
        rank = (self.calls // accum) % self.world_size
        self.calls += 1
        return self.sources[rank].next_batch()

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "ranks": [source.state_dict() for source in self.sources]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls = int(state["calls"])
        for source, rank_state in zip(self.sources, state["ranks"], strict=True):
            source.load_state_dict(rank_state)

    def describe(self) -> dict[str, Any]:
        return {"ranks_as_one": {"world_size": self.world_size, "mode": self.mode},
                "shards": [source.describe() for source in self.sources]}
