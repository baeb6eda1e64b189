"""Tile sizes and launch settings of the selected-attention kernels (the paper's Section 3.4 design).

A program holds the query heads of one GQA group as a [BLOCK_H, BLOCK_DK] tile (BLOCK_H >= 16 so tl.dot
has an MMA-sized M dimension) and walks key tiles of BLOCK_N rows inside each selected block (B_k | l' when
l' is a multiple of 16; smaller or odd blocks are covered by a 16-row tile with a mask).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch
import triton
from triton.runtime.errors import OutOfResources

MAX_GROUP = 64  # query heads per KV group the kernels accept (the [h, d_k] tile must fit in registers)
MAX_HEAD_DIM = 256  # largest d_k / d_v
MIN_DOT = 16  # tl.dot needs every dimension >= 16
SMEM_BUDGET = 160 * 1024  # bytes of shared memory a forward program may plan for (H100: 227 KiB per SM)

T = TypeVar("T")


@dataclass(frozen=True)
class Tiling:
    """One launch configuration: key-tile rows, warps and software-pipeline stages."""

    block_n: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        if self.block_n < MIN_DOT or self.block_n & (self.block_n - 1):
            raise ValueError(f"Tiling.block_n must be a power of two >= {MIN_DOT}, got {self.block_n}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"Tiling.num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"Tiling.num_stages must be >= 1, got {self.num_stages}")


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1, set by the root conftest)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def padded(n: int) -> int:
    """Power-of-two tile extent >= max(n, 16)."""
    return max(MIN_DOT, triton.next_power_of_2(n))


def key_tile_rows(sel_block: int, cap: int) -> int:
    """B_k: the largest power of two <= cap dividing l' (>= 16; a masked 16-row tile when 16 does not divide l')."""
    rows = MIN_DOT
    while rows * 2 <= cap and sel_block % (rows * 2) == 0:
        rows *= 2
    return rows


def forward_tiling(block_h: int, block_dk: int, block_dv: int, sel_block: int, dtype: torch.dtype) -> Tiling:
    """Heuristic forward launch: the widest key tile (<= 64) whose pipelined K/V stages fit SMEM_BUDGET."""
    elem = torch.finfo(dtype).bits // 8
    block_n = key_tile_rows(sel_block, 64)
    stages = 3
    while stages > 1 and stages * block_n * (block_dk + block_dv) * elem + block_h * block_dk * elem > SMEM_BUDGET:
        stages -= 1
    while block_n > MIN_DOT and stages * block_n * (block_dk + block_dv) * elem + block_h * block_dk * elem > SMEM_BUDGET:
        block_n //= 2
    warps = 8 if block_h * max(block_dk, block_dv) >= 64 * 128 else 4
    return Tiling(block_n=block_n, num_warps=warps, num_stages=stages)


def backward_tiling(block_h: int, block_dk: int, block_dv: int, sel_block: int, dtype: torch.dtype) -> Tiling:
    """Heuristic backward launch (dq and dk/dv kernels): fp32 accumulators of [BLOCK_N, d] live in registers,
    so key tiles are narrower for wide heads."""
    elem = torch.finfo(dtype).bits // 8
    cap = 64 if max(block_dk, block_dv) <= 128 and elem == 2 else 32
    block_n = key_tile_rows(sel_block, cap)
    warps = 8 if block_h * max(block_dk, block_dv) >= 64 * 128 or block_n * max(block_dk, block_dv) >= 64 * 128 else 4
    return Tiling(block_n=block_n, num_warps=warps, num_stages=2 if elem == 2 else 1)


def smaller_tilings(tiling: Tiling) -> list[Tiling]:
    """The given tiling, then ones with fewer pipeline stages, then narrower key tiles (down to 16 rows)."""
    out = [tiling]
    for stages in range(tiling.num_stages - 1, 0, -1):
        out.append(Tiling(tiling.block_n, tiling.num_warps, stages))
    block_n = tiling.block_n // 2
    while block_n >= MIN_DOT:
        out.append(Tiling(block_n, tiling.num_warps, 1))
        block_n //= 2
    return out


def launch_with_fallback(launch: Callable[[Tiling], T], tiling: Tiling) -> T:
    """launch(tiling); if Triton reports the program needs more shared memory or registers than the GPU has
    (OutOfResources, raised when the kernel is compiled), retry with smaller_tilings(tiling) in order."""
    candidates = smaller_tilings(tiling)
    for candidate in candidates[:-1]:
        try:
            return launch(candidate)
        except OutOfResources:
            continue
    return launch(candidates[-1])
