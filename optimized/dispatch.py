"""Where a call's device, dtype and backend are decided, once.

Every entry point (nsa_forward and decode_step in optimized.forward, the stage functions of optimized.stages,
NSAAttention, NSADecodeCache) asks this module once and then runs the path it names; nothing further down checks
the backend again.

Two keywords choose the backend, each "auto" (the default), "torch" or "triton":
- range_backend: the compressed and window branches (range attention), the selection (Eq. 8-11) and Eq. 5;
- backend: the selected branch (Eq. 12).
"auto" runs the Triton kernels for CUDA tensors of fp32, bf16 or fp16 when Triton imports (else a warning says
so, once), and the vectorized torch path everywhere else (CPU tensors, float64). A shape the kernels cannot take
(more than MAX_KERNEL_GROUP query heads per KV group for Eq. 12, head dims above MAX_KERNEL_HEAD_DIM) runs on the
torch path under "auto", with a warning naming the shape (once per shape). "triton" forces the kernels (CPU
tensors only under TRITON_INTERPRET=1, Triton's interpreter, set before the kernels are imported) and "torch" the
torch path; both are for tests and comparisons.

compute_dtype is the other decision made here: the dtype the torch path computes in, and the kernel path's Eq. 7
and Eq. 5.
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

BACKENDS = ("auto", "torch", "triton")
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the kernels take (they accumulate in fp32)
HALF_DTYPES = (torch.bfloat16, torch.float16)
MAX_KERNEL_GROUP = 64  # query heads per KV group of the selected-attention kernel's [h, d_k] tile
MAX_KERNEL_HEAD_DIM = 256  # largest d_k / d_v of every kernel (other head dims are padded to a power of two)

_warned: set[tuple] = set()  # what dispatch has warned about (once each)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype arithmetic runs in: float32 for half/bfloat16 inputs, float64 for float32 and float64 inputs."""
    return torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32


def in_autocast_dtype(x: Tensor) -> bool:
    """Whether autocast is on for x's device and casts to x's own dtype: a matmul under it takes x as it is, so
    widening x first would only be narrowed straight back (a copy each way, and their gradients)."""
    return torch.is_autocast_enabled(x.device.type) and torch.get_autocast_dtype(x.device.type) == x.dtype


def check_backend(name: str, value: str) -> None:
    """ValueError naming the keyword unless value is one of BACKENDS."""
    if value not in BACKENDS:
        raise ValueError(f"{name} must be one of {BACKENDS}, got {value!r}")


def interpreting() -> bool:
    """Whether Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1, set by the root conftest)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def triton_imports() -> bool:
    """Whether the triton package imports (looked up once per process)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def auto_picks_kernels(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether "auto" runs the kernels for tensors of this device and dtype: CUDA, a kernel dtype, Triton
    importable. (Tests that check what "auto" chooses on a GPU replace this function.)"""
    return device.type == "cuda" and dtype in KERNEL_DTYPES and triton_imports()


def check_kernels_run_on(name: str, device: torch.device) -> None:
    """ValueError naming the keyword unless a "triton" backend can run on this device."""
    if device.type != "cuda" and not interpreting():
        raise ValueError(f"{name}='triton' on {device.type} tensors needs TRITON_INTERPRET=1 set before the kernels "
                         f"are imported (Triton's interpreter)")


def _warn_once(key: tuple, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"optimized NSA: {message}", stacklevel=5)


def _torch_only(what: str, shape: dict[str, int], limit: str) -> bool:
    """Warn once per shape that `what` runs on the torch path; returns False (the kernels do not run)."""
    named = ", ".join(f"{k}={v}" for k, v in shape.items())
    _warn_once((what, tuple(shape.items())), f"{what} runs on the torch path for {named}: the kernels take {limit}")
    return False


def forced_range_kernels(device: torch.device, dtype: torch.dtype, range_backend: str, kernels: str) -> bool:
    """Whether range_backend forces the kernels ("triton"), after checking that they run on this device and take
    this dtype (ValueError: "range_backend='triton' runs <kernels> fp32/bf16/fp16 inputs, got <dtype>")."""
    if range_backend != "triton":
        return False
    check_kernels_run_on("range_backend", device)
    if dtype not in KERNEL_DTYPES:
        raise ValueError(f"range_backend='triton' runs {kernels} fp32/bf16/fp16 inputs, got {dtype}")
    return True


@dataclass(frozen=True)
class Route:
    """Where one call runs. ranges: the compressed and window branches, the selection (Eq. 8-11) and Eq. 5 on the
    kernels (else the torch path); selected: Eq. 12 on the selected-attention kernel; compute: compute_dtype of
    the inputs."""

    ranges: bool
    selected: bool
    compute: torch.dtype


def route(q: Tensor, k: Tensor, v: Tensor, *, backend: str = "auto", range_backend: str = "auto",
          queries_are_suffix: bool = True) -> Route:
    """The one decision of a call on queries q [B, TQ, Hq, dk] over keys k [B, TK, Hkv, dk] and values
    v [B, TK, Hkv, dv] (decide() for their device, dtype and shape). queries_are_suffix: the queries sit at the last
    TQ key positions (prefill, decode), which the selected-attention kernel needs."""
    return decide(q.device, q.dtype, q.shape[2] // max(k.shape[2], 1), q.shape[3], v.shape[3], backend=backend,
                  range_backend=range_backend, queries_are_suffix=queries_are_suffix)


def decide(device: torch.device, dtype: torch.dtype, group: int, head_dim_qk: int, head_dim_v: int, *,
           backend: str = "auto", range_backend: str = "auto", queries_are_suffix: bool = True) -> Route:
    """Where a call on tensors of this device and dtype runs, for `group` query heads per KV group and these head
    dims (module docstring)."""
    check_backend("backend", backend)
    check_backend("range_backend", range_backend)
    dims = {"head_dim_qk": head_dim_qk, "head_dim_v": head_dim_v}
    kernels = auto_picks_kernels(device, dtype)
    if not kernels and device.type == "cuda" and dtype in KERNEL_DTYPES and "auto" in (backend, range_backend):
        _warn_once(("no triton",), "Triton does not import, so CUDA tensors run on the torch path (the kernels need "
                                   "the triton package)")
    dims_fit = max(head_dim_qk, head_dim_v) <= MAX_KERNEL_HEAD_DIM
    limit = f"head dims up to {MAX_KERNEL_HEAD_DIM}"

    if forced_range_kernels(device, dtype, range_backend, "the Triton range kernels, which take"):
        ranges = True
    elif range_backend == "auto" and kernels:
        ranges = dims_fit or _torch_only("the compressed and window branches and the selection", dims, limit)
    else:
        ranges = False

    if backend == "triton":
        check_kernels_run_on("backend", device)
        if not queries_are_suffix:
            raise ValueError("backend='triton' needs the queries to be the last TQ key positions")
        selected = True
    elif backend == "auto" and kernels and queries_are_suffix:
        selected = (dims_fit and group <= MAX_KERNEL_GROUP) or _torch_only(
            "the selected branch (Eq. 12)", {"group_size": group, **dims},
            f"group sizes 1-{MAX_KERNEL_GROUP} and {limit}")
    else:
        selected = False
    return Route(ranges=ranges, selected=selected, compute=compute_dtype(dtype))


def rope_on_kernels(device: torch.device, dtype: torch.dtype, range_backend: str = "auto") -> bool:
    """Whether NSAAttention.project rotates q and k (RoPE) with its Triton kernel (optimized/kernels/rope.py):
    under range_backend's rule for every other stage ("auto": CUDA tensors of a kernel dtype; "triton": forced;
    "torch": never). RoPE takes every head dim, so no shape limit applies."""
    check_backend("range_backend", range_backend)
    if forced_range_kernels(device, dtype, range_backend, "the Triton RoPE kernel, which takes"):
        return True
    return range_backend == "auto" and auto_picks_kernels(device, dtype)


def gate_mlp_on_kernels(device: torch.device, dtype: torch.dtype, range_backend: str = "auto") -> bool:
    """Whether NSAAttention.project runs the gate MLP on its Triton kernels (optimized/kernels/gate_mlp.py): for
    bf16/fp16 inputs (under autocast, the autocast dtype's) under range_backend's rule ("auto": CUDA tensors;
    "triton": forced; "torch": never). fp32 inputs keep the torch expression (cuBLAS's fp32 matmuls) on every
    backend; half precision follows the rule RoPE's kernel follows (rope_on_kernels)."""
    check_backend("range_backend", range_backend)
    return dtype in HALF_DTYPES and rope_on_kernels(device, dtype, range_backend)
