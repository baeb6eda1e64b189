"""The two measured ceilings every floor is computed from: dense matmul throughput and copy bandwidth.

- matmul: C = A @ B with A, B [size, size] random in the sweep dtype: 2 * size^3 FLOPs per run.
- copy: dst.copy_(src) of `copy_bytes` device-to-device: 2 * copy_bytes bytes moved per run (read + write).
Both are timed like every case (warm-up, L2 flush, median of the timed runs).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .timing import Timer


@dataclass(frozen=True)
class Ceilings:
    matmul_tflops: float
    matmul_median_ms: float
    matmul_size: int
    copy_gbps: float  # GB/s = 1e9 bytes per second, bytes read + written
    copy_median_ms: float
    copy_bytes: int
    dtype: str

    def to_dict(self) -> dict:
        return asdict(self)


def measure_ceilings(timer: Timer, dtype: torch.dtype, dtype_name: str, matmul_size: int, copy_bytes: int,
                     repeats: int, warmup: int) -> Ceilings:
    device = timer.device
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(matmul_size, matmul_size, device=device, dtype=dtype, generator=gen)
    b = torch.randn(matmul_size, matmul_size, device=device, dtype=dtype, generator=gen)
    matmul = lambda: torch.matmul(a, b)  # noqa: E731
    for _ in range(warmup):
        timer.wall_once(matmul)
    matmul_ms = timer.measure(matmul, repeats).median
    del a, b

    n = copy_bytes // 4
    src = torch.randint(0, 2**30, (n,), device=device, dtype=torch.int32, generator=gen)
    dst = torch.empty_like(src)
    copy = lambda: dst.copy_(src)  # noqa: E731
    for _ in range(warmup):
        timer.wall_once(copy)
    copy_ms = timer.measure(copy, repeats).median
    del src, dst

    return Ceilings(
        matmul_tflops=2.0 * matmul_size**3 / (matmul_ms * 1e-3) / 1e12,
        matmul_median_ms=matmul_ms,
        matmul_size=matmul_size,
        copy_gbps=2.0 * n * 4 / (copy_ms * 1e-3) / 1e9,
        copy_median_ms=copy_ms,
        copy_bytes=n * 4,
        dtype=dtype_name,
    )
