"""What machine and software a sweep ran on: GPU, clocks, host CPU, versions (recorded with every result file;
read-only queries only). Which tree was measured is the commit that adds the result files."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from typing import Any

import torch

NVIDIA_SMI_FIELDS = ("name", "clocks.sm", "clocks.max.sm", "clocks.mem", "clocks.max.mem", "power.draw",
                     "power.limit", "temperature.gpu", "driver_version", "pstate")


def nvidia_smi(index: int) -> dict[str, str] | None:
    """Clocks, power and driver of GPU `index` from `nvidia-smi --query-gpu` (None when it is absent)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, f"--id={index}", f"--query-gpu={','.join(NVIDIA_SMI_FIELDS)}", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout.strip()
    except (subprocess.SubprocessError, OSError) as exc:
        return {"error": str(exc)}
    values = [v.strip() for v in out.splitlines()[0].split(",")] if out else []
    return dict(zip(NVIDIA_SMI_FIELDS, values))


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu {platform.machine()}"


def slug(text: str) -> str:
    """File-name-safe lower-case form of a device name: 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def host_cpu() -> str:
    """The host CPU's model and logical core count, e.g. 'Intel(R) Xeon(R) Platinum 8480+, 16 cores': an eager
    training step launches thousands of kernels from Python, so its time depends on the host as well as the GPU
    (perf/NOTES.md). The model comes from /proc/cpuinfo where there is one, else platform.processor()."""
    model = ""
    try:
        with open("/proc/cpuinfo") as fh:
            model = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), "")
    except OSError:
        pass
    model = model or platform.processor() or platform.machine() or "unknown CPU"
    return f"{model}, {os.cpu_count() or '?'} cores"


def describe(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "device": device_name(device),
        "device_type": device.type,
        "host_cpu": host_cpu(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        info["sm_count"] = props.multi_processor_count
        info["total_memory_bytes"] = props.total_memory
        info["capability"] = f"{props.major}.{props.minor}"
        info["cudnn"] = torch.backends.cudnn.version()
        info["nvidia_smi"] = nvidia_smi(index)
    return info
