"""The files of optimized/ a prefill call on the kernel path crosses: the list in optimized/__init__.py's docstring
is checked against a trace of the call (the kernels run in Triton's interpreter on a tiny shape; on a CUDA machine
they run compiled and only the Python side is traced, which is what the list is about).

- every listed file runs and no other file of optimized/ does (documents.py only for a packed batch);
- forward.py hands the data to each file once and in the listed order: the files forward.py calls into directly,
  consecutive calls into one file counted once, never repeat and follow the list.
"""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path

import pytest
import torch

import optimized
from conformance.helpers import make_inputs
from reference.config import NSAConfig
from reference.packing import cu_seqlens_of

ROOT = Path(optimized.__file__).resolve().parent
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on CPU the kernels run in Triton's interpreter
CFG = NSAConfig(cmp_block=4, cmp_stride=2, sel_block=8, n_sel=3, window=5, n_heads=4, n_kv_heads=2, head_dim_qk=8,
                head_dim_v=8, phi="avg")


def listed_files() -> list[str]:
    """The numbered list of optimized/__init__.py's docstring, as paths relative to optimized/."""
    lines = re.findall(r"^\s*\d+\.\s+optimized/(\S+)", optimized.__doc__, flags=re.MULTILINE)
    assert lines, "optimized/__init__.py's docstring lists no files"
    return lines


@functools.cache
def relative(filename: str) -> str | None:
    """The path of a code object's file relative to optimized/ (None outside it)."""
    path = Path(filename).resolve()
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else None


def trace(call) -> tuple[list[str], list[str]]:
    """(the optimized/ files whose code runs, in order of first entry; the files forward.py calls into directly,
    one entry per call). Frames outside optimized/ (torch, Triton's interpreter) are transparent: a call's caller
    is the nearest optimized/ frame below it."""
    executed: list[str] = []
    from_forward: list[str] = []

    def profile(frame, event, arg):
        if event != "call":
            return
        name = relative(frame.f_code.co_filename)
        if name is None:
            return
        if name not in executed:
            executed.append(name)
        caller = frame.f_back
        while caller is not None and relative(caller.f_code.co_filename) is None:
            caller = caller.f_back
        if caller is not None and relative(caller.f_code.co_filename) == "forward.py" and name != "forward.py":
            from_forward.append(name)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return executed, from_forward


def path_problems(listed: list[str], executed: list[str], from_forward: list[str], packed: bool) -> list[str]:
    """What is wrong with a traced call against the list (empty: nothing)."""
    problems = []
    expected = [f for f in listed if packed or f != "documents.py"]
    if sorted(executed) != sorted(expected):
        problems.append(f"ran {executed}, the docstring lists {expected}")
    visits = [f for i, f in enumerate(from_forward) if i == 0 or f != from_forward[i - 1]]
    if len(visits) != len(set(visits)):
        problems.append(f"forward.py comes back to a file: {visits}")
    order = [listed.index(f) if f in listed else -1 for f in visits]
    if order != sorted(order):
        problems.append(f"forward.py visits {visits}, not in the listed order")
    return problems


@pytest.mark.parametrize("packed", [False, True], ids=["single", "packed"])
def test_prefill_on_the_kernel_path_crosses_the_listed_files_once(packed: bool) -> None:
    listed = listed_files()
    assert len(listed) <= 10 and len(set(listed)) == len(listed) and listed[0] == "forward.py"
    x = make_inputs(CFG, 24, dtype=torch.float32, device=DEVICE)
    cu = cu_seqlens_of([10, 14], DEVICE) if packed else None

    def call():
        return optimized.nsa_forward(x.q, x.kv, x.gates, CFG, backend="triton", range_backend="triton",
                                     cu_seqlens=cu)

    call()  # imports, and the interpreter's first-call work, out of the trace
    executed, from_forward = trace(call)
    assert path_problems(listed, executed, from_forward, packed) == []
    assert from_forward[-1] == "kernels/gated_sum.py" and "kernels/selection.py" in from_forward


def test_the_check_catches_extra_files_returns_and_disorder() -> None:
    listed = ["forward.py", "dispatch.py", "masks.py", "kernels/a.py", "kernels/b.py"]
    executed = ["forward.py", "dispatch.py", "masks.py", "kernels/a.py", "kernels/b.py"]
    assert path_problems(listed, executed, ["dispatch.py", "kernels/a.py", "kernels/a.py", "kernels/b.py"],
                         False) == []
    assert len(path_problems(listed, executed + ["scoring.py"], ["dispatch.py"], False)) == 1
    assert len(path_problems(listed, executed[:-1], ["dispatch.py"], False)) == 1
    returns = path_problems(listed, executed, ["kernels/a.py", "kernels/b.py", "kernels/a.py"], False)
    assert any("comes back" in p for p in returns)
    assert len(path_problems(listed, executed, ["kernels/b.py", "kernels/a.py"], False)) == 1
