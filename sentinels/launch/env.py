"""Environment guard (`python -m sentinels env`): which python / torch / CUDA / triton / GPUs this is, and whether
the launch policy (policy.py) supports the combination.

The facts are a plain dataclass so that the verdict is a pure function of them (tests inject facts).
"""

from __future__ import annotations

import platform
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from . import policy


@dataclass(frozen=True)
class GpuFacts:
    index: int
    name: str
    capability: tuple[int, int]  # (major, minor) CUDA compute capability


@dataclass(frozen=True)
class EnvFacts:
    python: str  # e.g. "3.11.7"
    torch: str  # torch.__version__, e.g. "2.4.1+cu124"
    cuda: str | None  # torch.version.cuda: the CUDA torch was built with (None for a CPU build)
    triton: str | None  # triton.__version__, None when triton does not import
    gpus: tuple[GpuFacts, ...] = field(default_factory=tuple)  # the visible CUDA devices

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["gpus"] = [{"index": g.index, "name": g.name, "capability": f"{g.capability[0]}.{g.capability[1]}"}
                       for g in self.gpus]
        return out


@dataclass(frozen=True)
class EnvVerdict:
    facts: EnvFacts
    reasons: tuple[str, ...]  # empty when the environment is supported

    @property
    def ok(self) -> bool:
        return not self.reasons


def leading_version(text: str, what: str) -> tuple[int, int]:
    """(major, minor) of a version string such as '2.4.1+cu124' or '2.6.0a0+git1234'."""
    match = re.match(r"\s*(\d+)\.(\d+)", text)
    if match is None:
        raise ValueError(f"{what} version {text!r} does not start with MAJOR.MINOR")
    return int(match.group(1)), int(match.group(2))


def _dotted(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


def check_env(facts: EnvFacts) -> EnvVerdict:
    """Apply the policy: Python >= 3.11, torch >= 2.4, a visible GPU, every GPU capability >= 8.0, triton."""
    reasons: list[str] = []
    for what, text, minimum in (("python", facts.python, policy.MIN_PYTHON),
                                ("torch", facts.torch, policy.MIN_TORCH)):
        try:
            have = leading_version(text, what)
        except ValueError as exc:
            reasons.append(str(exc))
            continue
        if have < minimum:
            reasons.append(f"{what} {text} is older than the supported minimum {_dotted(minimum)}")
    if not facts.gpus:
        build = f"built with CUDA {facts.cuda}" if facts.cuda else "a CPU-only build"
        reasons.append(f"no CUDA device is visible (torch {facts.torch} is {build}): the Triton kernels and a "
                       f"launch need a GPU of capability >= {_dotted(policy.MIN_GPU_CAPABILITY)}")
    for gpu in facts.gpus:
        if gpu.capability < policy.MIN_GPU_CAPABILITY:
            reasons.append(f"GPU {gpu.index} ({gpu.name}) has compute capability {_dotted(gpu.capability)}; the "
                           f"Triton kernels need >= {_dotted(policy.MIN_GPU_CAPABILITY)}")
    if facts.triton is None:
        reasons.append("triton does not import: the optimized attention's Triton kernels need it")
    return EnvVerdict(facts=facts, reasons=tuple(reasons))


def collect_env_facts() -> EnvFacts:
    """Read the facts of this process's interpreter (read-only queries)."""
    import torch

    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    gpus: tuple[GpuFacts, ...] = ()
    if torch.cuda.is_available():
        gpus = tuple(GpuFacts(i, torch.cuda.get_device_name(i), tuple(torch.cuda.get_device_capability(i)))
                     for i in range(torch.cuda.device_count()))
    return EnvFacts(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
                    triton=triton_version, gpus=gpus)


def format_facts(f: EnvFacts) -> str:
    lines = [f"python  {f.python}", f"torch   {f.torch}", f"cuda    {f.cuda or 'none (CPU build of torch)'}",
             f"triton  {f.triton or 'not importable'}"]
    if not f.gpus:
        lines.append("gpu     none visible")
    for gpu in f.gpus:
        lines.append(f"gpu {gpu.index}   {gpu.name}, capability {_dotted(gpu.capability)}")
    return "\n".join(lines)


def format_verdict(verdict: EnvVerdict) -> str:
    lines = [format_facts(verdict.facts)]
    if verdict.ok:
        lines.append("env: SUPPORTED")
    else:
        lines.append("env: UNSUPPORTED")
        lines += [f"  - {reason}" for reason in verdict.reasons]
    return "\n".join(lines)
