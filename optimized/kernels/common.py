"""What the Triton kernels of optimized/kernels share: launch settings (tile sizes, warps,
pipeline stages, and a fallback to smaller tiles when a GPU lacks the resources), the dot settings of each input
dtype, the row view of the row passes, and the @triton.jit helpers several kernels call.

Selected-attention tiles (the paper's Section 3.4 design). Forward and dq: a program holds the query heads of one
GQA group as a [BLOCK_H, BLOCK_DK] tile (BLOCK_H >= 16 so tl.dot has an MMA-sized M dimension; a group of fewer
heads is padded with masked rows) and walks key tiles of BLOCK_N rows inside each selected block (B_k | l' when l'
is a multiple of 16; smaller or odd blocks are covered by a 16-row tile with a mask). dk/dv: a program holds a key
tile [BLOCK_N, d] of one selected block and takes the queries that selected the block BLOCK_COLS (query, head)
columns at a time (queries x next_pow2(h) heads), so every tl.dot is [BLOCK_N, BLOCK_COLS]-sized instead of one
query's [BLOCK_N, h]. Head dims that are not a power of two (e.g. 192) are padded to the next one (256) with masked
columns, in every kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, TypeVar

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from ..dispatch import interpreting

INDEX_DTYPES = (torch.int32, torch.int64)
MIN_DOT = 16  # tiles keep every dot dimension >= 16 (K must be; a smaller M pads to 16 rows, N to 8 columns)
SMEM_BUDGET = 160 * 1024  # bytes of shared memory a forward program may plan for (H100: 227 KiB per SM)

T = TypeVar("T")
L = TypeVar("L")


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


def dot_settings(dtype: torch.dtype) -> tuple[bool, str]:
    """(DOT_FP32, INPUT_PRECISION): fp32 inputs use exact fp32 dots ('ieee', no TF32); the interpreter's
    tl.dot is wrong on bf16, so there every operand is upcast to fp32 (after being rounded to the input dtype
    wherever the GPU path feeds the dot a half-precision operand, so the interpreter keeps its numerics)."""
    dot_fp32 = dtype == torch.float32 or interpreting()
    return dot_fp32, "ieee"


def padded(n: int) -> int:
    """Power-of-two tile extent >= max(n, 16)."""
    return max(MIN_DOT, triton.next_power_of_2(n))


def head_dim_tiles(d: int) -> tuple[int, int]:
    """(BLOCK_DK, BLOCK_DK2): the tiles the range, scores and selected kernels read a q/k head dim in (the selected
    dq: dq_head_dim_tiles). One power-of-two tile (padded(d), 0), or two where d is wider than a power of two
    p >= 16 and p plus the padded rest is narrower than padded(d): 192 = 128 + 64, 96 = 64 + 32, 48 = 32 + 16 are
    read as two exact tiles instead of one padded to 256, 128, 64, so no dot multiplies a quarter of zeros and the
    dq and dk accumulators hold a quarter fewer columns."""
    full = padded(d)
    first = full // 2
    if first >= MIN_DOT and d > first:
        second = padded(d - first)
        if first + second < full:
            return first, second
    return full, 0


MIN_DOT_COLUMNS = 8  # the tensor cores' narrowest N: a dot's columns pad to 8, its rows (M) to 16


def forward_head_tile(group: int, width: int) -> tuple[int, int]:
    """(BLOCK_H, KEY_AXIS) of the selected forward for a KV group of `group` heads and head dims padded to
    `width`. Groups of up to MIN_DOT_COLUMNS heads at width <= 128 are the columns of its tiles (KEY_AXIS 0:
    s^T = K q^T, o^T += V^T P^T), padded to MIN_DOT_COLUMNS: a group of 6 takes 8 columns of the dots where it
    took a 16-row tile as the rows of q K^T, and on an H100 the prod-125m forward (G = 6, d = 64, 16k tokens)
    took 0.80 ms against 0.89 (perf/NOTES.md). Larger groups and wider heads stay rows (KEY_AXIS 1,
    padded(group) rows): as columns the 16-head paper layout gained ~1% in bf16 and lost 42% in fp32, and groups
    of 32-64 heads on 4-8 warps ran up to 1.9x slower."""
    if group <= MIN_DOT_COLUMNS and width <= 128:
        return MIN_DOT_COLUMNS, 0
    return padded(group), 1


ROW_PASS_ELEMENTS = 2048  # (row, column) elements of one row-pass program: 16 per thread with 4 warps


def row_view(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] as a [rows, n] view with a contiguous last dim (a copy only when no such view exists): the layout
    of the row passes (Eq. 5 and its backward, the range backward's D0)."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def row_pass_shape(n: int) -> tuple[int, int]:
    """(BLOCK, rows per program) of a row pass over [rows, n]: BLOCK = next power of two >= n, ROW_PASS_ELEMENTS
    elements per program."""
    block = triton.next_power_of_2(n)
    return block, max(1, ROW_PASS_ELEMENTS // block)


def key_tile_rows(sel_block: int, cap: int) -> int:
    """B_k: the largest power of two <= cap dividing l' (>= 16; a masked 16-row tile when 16 does not divide l')."""
    rows = MIN_DOT
    while rows * 2 <= cap and sel_block % (rows * 2) == 0:
        rows *= 2
    return rows


def measured_small_tiles(group_tile: int, width: int, dtype: torch.dtype) -> bool:
    """The shapes the selected-attention kernels' small-tile launch settings were measured on (few_warps,
    dkdv_tiling): half precision, the group's heads padded to a power of two (group_tile) within 16, head dims up
    to 128."""
    return torch.finfo(dtype).bits == 16 and group_tile <= MIN_DOT and width <= 128


WIDE_HEADS_MAX_GROUP = 32  # the largest KV group the wide-head launch settings were measured on


def measured_wide_heads(group: int, width: int, dtype: torch.dtype) -> bool:
    """The shapes the selected-attention kernels' wide-head launch settings were measured on (forward_tiling,
    dq_tiling, dkdv_tiling): half precision, head dims padded beyond 128 (the paper's own d_k = 192, padded to 256,
    with d_v = 128: NSAConfig's defaults), groups of 1 to WIDE_HEADS_MAX_GROUP heads. There each program's K/V
    stages take 1.5x the shared memory of d = 128, and the general heuristics' 64-key tiles in three stages left one
    or two programs per SM: on an H100 at 16k tokens 21-47% slower forwards, 2.2x slower dq and 18-28% slower
    dk/dv than the settings below (perf/NOTES.md)."""
    return torch.finfo(dtype).bits == 16 and width > 128 and group <= WIDE_HEADS_MAX_GROUP


def few_warps(block_h: int, block_dk: int, block_dv: int, sel_block: int, dtype: torch.dtype,
              kernel: str = "forward", heads_as_columns: bool = False) -> Tiling | None:
    """The query-centric selected-attention launches (kernel "forward" or "dq") for a half-precision group of up to
    16 heads (block_h: its tile extent) at d <= 128: one program per (query, group) is a chain of dependent
    gathers, and on an H100 fewer warps per program (more programs resident) ran faster than 4 or 8 warps
    (perf/NOTES.md): the forward with 32-key tiles, 1 warp, 3 stages at d <= 64 (G = 6, 16k tokens: 1.26 -> 0.90
    ms) and 64-key tiles, 2 warps at d = 128; dq with 16-key tiles, 1 warp, 2 stages (fewer registers per warp than
    32 or 64 keys: G = 6, d = 64, 16k tokens 1.82 -> 1.76 ms; G = 16, d = 128, 64k tokens 35.5 -> 32.3 ms). With
    the heads as the tiles' columns (heads_as_columns: forward_head_tile, dq_head_tile) both take 32-key tiles on
    one warp, 3 stages at d <= 64 (dq, G = 6, 16k tokens: 1.12 ms at 16 keys, 2 stages; 1.05 at 32, 3), and at
    d = 128 the forward 2 stages (G = 8, 16k tokens 2.06 -> 1.83 ms against 64 keys on 2 warps), the dq its 16-key
    tiles. Key tiles no longer than key_tile_rows allows for l'. None: the general heuristics."""
    width = max(block_dk, block_dv)
    if not measured_small_tiles(block_h, width, dtype):
        return None
    if heads_as_columns and width <= 64:
        return Tiling(key_tile_rows(sel_block, 32), num_warps=1, num_stages=3)
    if kernel == "dq":
        return Tiling(key_tile_rows(sel_block, 16), num_warps=1, num_stages=2)
    if width <= 64:
        return Tiling(key_tile_rows(sel_block, 32), num_warps=1, num_stages=3)
    if heads_as_columns:
        return Tiling(key_tile_rows(sel_block, 32), num_warps=1, num_stages=2)
    return Tiling(key_tile_rows(sel_block, 64), num_warps=2, num_stages=2)


def forward_tiling(group: int, block_dk: int, block_dv: int, sel_block: int, dtype: torch.dtype) -> Tiling:
    """Heuristic forward launch for a KV group of `group` heads: few_warps' for small half-precision groups (in
    the layout forward_head_tile picks); 32-key tiles on 2 warps in 2 stages for measured_wide_heads; otherwise the
    widest key tile (<= 64) whose pipelined K/V stages fit SMEM_BUDGET."""
    block_h, key_axis = forward_head_tile(group, max(block_dk, block_dv))
    small = few_warps(block_h, block_dk, block_dv, sel_block, dtype, heads_as_columns=key_axis == 0)
    if small is not None:
        return small
    if measured_wide_heads(group, max(block_dk, block_dv), dtype):  # G = 16, d_k = 192, 64k tokens: 31.0 -> 24.9 ms
        return Tiling(key_tile_rows(sel_block, 32), num_warps=2, num_stages=2)
    elem = torch.finfo(dtype).bits // 8
    block_n = key_tile_rows(sel_block, 64)
    stages = 3

    def smem(stages: int, block_n: int) -> int:
        return stages * block_n * (block_dk + block_dv) * elem + block_h * block_dk * elem

    while stages > 1 and smem(stages, block_n) > SMEM_BUDGET:
        stages -= 1
    while block_n > MIN_DOT and smem(stages, block_n) > SMEM_BUDGET:
        block_n //= 2
    warps = 8 if block_h * max(block_dk, block_dv) >= 64 * 128 else 4
    return Tiling(block_n=block_n, num_warps=warps, num_stages=stages)


def dq_row_copies(group: int, split_ds: bool) -> tuple[int, int]:
    """(HEAD_ROWS, COPIES) of a selected dq launch, whose query tile has padded(group) rows: a group whose heads,
    padded to a power of two, fill at most half of the tile repeats them in the free rows, and the split dS's lo
    half (2 copies), then P as well (3 copies, when 4 fit), share the dS hi dot's rows instead of taking dots of
    their own (selected_attention_bwd). (padded(group), 1): one copy, no split (fp32) or no free rows."""
    block_h = padded(group)
    head_rows = triton.next_power_of_2(group)
    fit = block_h // head_rows
    if not split_ds or fit < 2:
        return block_h, 1
    return head_rows, 3 if fit >= 4 else 2


def dq_head_tile(group: int, split_ds: bool, width: int) -> tuple[int, int, int, int]:
    """(BLOCK_H, KEY_AXIS, HEAD_ROWS, COPIES) of a selected dq launch for a KV group of `group` heads, head dims
    padded to `width`. A half-precision group of 5 to 8 heads at width <= 128 is the columns of the kernel's tiles
    (KEY_AXIS 0, as in the forward: forward_head_tile): its three products with the key tile (dS hi, dS lo, P)
    then take 8 columns each, which on an H100 ran faster than two 16-row products with the heads and their copies
    as rows (prod-125m, G = 6, d = 64: 16k tokens 1.19 -> 1.08 ms, 2k x 8 1.19 -> 1.02; G = 8, d = 128: 2.52 ->
    2.39; perf/NOTES.md). Smaller groups, whose rows also carry P in the one product (three copies), and the rest
    keep the rows (KEY_AXIS 1, dq_row_copies): a group of 1 at d = 128 ran 17% slower as columns."""
    if split_ds and 4 < group <= MIN_DOT_COLUMNS and width <= 128:
        return MIN_DOT_COLUMNS, 0, MIN_DOT_COLUMNS, 1
    return (padded(group), 1) + dq_row_copies(group, split_ds)


def dq_head_dim_tiles(d: int, copies: int) -> tuple[int, int]:
    """head_dim_tiles for a selected dq launch whose tile holds `copies` copies of the group's rows (dq_head_tile):
    one padded tile where there are several (the copies are summed back over that one tile)."""
    return head_dim_tiles(d) if copies == 1 else (padded(d), 0)


def dq_tiling(group: int, block_dk: int, block_dv: int, sel_block: int, dtype: torch.dtype) -> Tiling:
    """Heuristic launch of the dq kernel (query-centric like the forward) for a KV group of `group` heads:
    few_warps' for small half-precision query tiles (few_warps has the layout with the heads as the tiles' columns,
    dq_head_tile), with three stages instead of two where the tile's free rows carry the split dS (dq_row_copies)
    at d <= 64 (fewer registers: G = 6, d = 64 156 -> 135; one H100, 16k tokens 1.350 -> 1.223 ms, 64k 5.48 ->
    4.96; perf/NOTES.md) and for 16-row tiles at d = 128 (the paper's group of 16: 64k tokens 22.43 -> 21.90 ms,
    8k 2.626 -> 2.608; reports/perf/selected_launch/); 64-key tiles on 4 warps in 2 stages for
    measured_wide_heads; otherwise narrower key tiles for wide heads and fp32 inputs (the fp32 [BLOCK_N, d]
    key/value tiles and dq, its compensation and sum(P k) live in registers)."""
    block_h, key_axis, _, copies = dq_head_tile(group, dtype != torch.float32, max(block_dk, block_dv))
    small = few_warps(block_h, block_dk, block_dv, sel_block, dtype, kernel="dq", heads_as_columns=key_axis == 0)
    if small is not None:
        if copies > 1 and max(block_dk, block_dv) <= 64:
            return Tiling(small.block_n, small.num_warps, num_stages=3)
        if block_h == 16 and key_axis == 1 and max(block_dk, block_dv) == 128:
            return Tiling(small.block_n, small.num_warps, num_stages=3)
        return small
    if measured_wide_heads(group, max(block_dk, block_dv), dtype):  # G = 16, d_k = 192, 64k tokens: 108 -> 44 ms
        return Tiling(key_tile_rows(sel_block, 64), num_warps=4, num_stages=2)
    elem = torch.finfo(dtype).bits // 8
    cap = 64 if max(block_dk, block_dv) <= 128 and elem == 2 else 32
    block_n = key_tile_rows(sel_block, cap)
    warps = 8 if block_h * max(block_dk, block_dv) >= 64 * 128 or block_n * max(block_dk, block_dv) >= 64 * 128 else 4
    return Tiling(block_n=block_n, num_warps=warps, num_stages=2 if elem == 2 else 1)


@dataclass(frozen=True)
class DkdvTiling:
    """dk/dv launch: key rows per program (block_n), (query, head) columns per step (block_cols), warps, stages."""

    block_n: int
    block_cols: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        Tiling(self.block_n, self.num_warps, self.num_stages)  # same rules for the shared fields
        if self.block_cols < MIN_DOT or self.block_cols & (self.block_cols - 1):
            raise ValueError(f"DkdvTiling.block_cols must be a power of two >= {MIN_DOT}, got {self.block_cols}")


def heads_per_query(group: int) -> int:
    """The fewest columns a dk/dv step can have: one query's h heads, rounded up to a power of two (a step of
    block_cols columns takes block_cols // h queries, the heads unpadded)."""
    return triton.next_power_of_2(group)


def dkdv_tiling(group: int, block_dk: int, block_dv: int, sel_block: int, dtype: torch.dtype) -> DkdvTiling:
    """Heuristic dk/dv launch. Half precision: 64 columns (e.g. 4 queries x 16 heads) against a key tile of up to
    64 rows (32 for d > 128), so the fp32 dk/dv accumulators [block_n, d] stay in registers with 8 warps; for group
    sizes up to 16 and d <= 128, 4 warps and the column count that measured fastest at 16k tokens on an H100
    (G = 6, d = 64: 128 columns, 1.87 -> 1.07 ms, then 21 queries a step with the heads unpadded, 0.76 -> 0.71 ms;
    G = 16, d = 128: 32 columns, 7.8 -> 5.4 ms; perf/NOTES.md); for measured_wide_heads 32 key rows x 64 columns
    on 4 warps. fp32 (exact fp32 dots on CUDA cores, plus compensation terms): narrower tiles."""
    elem = torch.finfo(dtype).bits // 8
    width = max(block_dk, block_dv)
    heads = heads_per_query(group)
    if measured_small_tiles(heads, width, dtype):
        return DkdvTiling(block_n=key_tile_rows(sel_block, 64), block_cols=max(128 if width <= 64 else 32, heads),
                          num_warps=4, num_stages=2)
    if measured_wide_heads(group, width, dtype):  # G = 16, d_k = 192, 64k tokens: 43.5 -> 29.7 ms (8 -> 4 warps)
        return DkdvTiling(block_n=key_tile_rows(sel_block, 32), block_cols=max(64, heads), num_warps=4, num_stages=2)
    if elem == 2:
        block_n = key_tile_rows(sel_block, 64 if width <= 128 else 32)
        cols = max(64, heads)
        return DkdvTiling(block_n=block_n, block_cols=cols, num_warps=8 if block_n * width >= 64 * 64 else 4,
                          num_stages=2)
    block_n = key_tile_rows(sel_block, 32 if width <= 128 else 16)
    return DkdvTiling(block_n=block_n, block_cols=max(32, heads), num_warps=8 if width >= 128 else 4, num_stages=1)


def smaller_dkdv_tilings(tiling: DkdvTiling, min_cols: int) -> list[DkdvTiling]:
    """The given dk/dv tiling, then fewer stages, then fewer columns (down to min_cols), then fewer key rows."""
    out = [tiling]
    for stages in range(tiling.num_stages - 1, 0, -1):
        out.append(DkdvTiling(tiling.block_n, tiling.block_cols, tiling.num_warps, stages))
    cols = tiling.block_cols // 2
    while cols >= max(MIN_DOT, min_cols):
        out.append(DkdvTiling(tiling.block_n, cols, tiling.num_warps, 1))
        cols //= 2
    block_n = tiling.block_n // 2
    while block_n >= MIN_DOT:
        out.append(DkdvTiling(block_n, max(MIN_DOT, min_cols), tiling.num_warps, 1))
        block_n //= 2
    return out


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


def launch_with_fallback(launch: Callable[[L], T], tiling: L, candidates: list[L] | None = None) -> T:
    """launch(tiling); if Triton reports the program needs more shared memory or registers than the GPU has
    (OutOfResources, raised when the kernel is compiled), retry with the next of `candidates` (default:
    smaller_tilings(tiling)) in order."""
    candidates = candidates or smaller_tilings(tiling)
    for candidate in candidates[:-1]:
        try:
            return launch(candidate)
        except OutOfResources:
            continue
    return launch(candidates[-1])


def launch_tiling(launch: Callable[[L], T], tiling: L | None, heuristic: L,
                  smaller: Callable[[L], list[L]] | None = None) -> T:
    """launch(tiling) when a tiling is given: exactly that launch, an OutOfResources error included (a probe timing
    a setting must not time another in its name); otherwise the heuristic one through launch_with_fallback, over
    smaller(heuristic) (default smaller_tilings)."""
    if tiling is not None:
        return launch(tiling)
    return launch_with_fallback(launch, heuristic, None if smaller is None else smaller(heuristic))


# Range attention (optimized/kernels/range_attention_*.py): FlashAttention-2 style tiles ------------------------

@dataclass(frozen=True)
class RangeTiling:
    """Range-attention launch: query rows per tile (block_m), key rows per tile (block_n), warps, stages. For the
    dk/dv kernel, block_m counts the (query row, head) columns of a step and heads says how many of the KV group's
    heads a step takes at once: block_m // heads rows x heads heads, the group's heads padded to a power of two
    and masked past the group. A group that pads to fewer than `heads` heads takes one head per step (the launch
    measured for it). The forward and dq kernels take the same (query row, head) tiles per program: block_m //
    heads rows x heads heads (common.head_packed_rows)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    heads: int = 1

    def __post_init__(self) -> None:
        Tiling(self.block_n, self.num_warps, self.num_stages)  # same rules for the shared fields
        if self.block_m < MIN_DOT or self.block_m & (self.block_m - 1):
            raise ValueError(f"RangeTiling.block_m must be a power of two >= {MIN_DOT}, got {self.block_m}")
        if self.heads < 1 or self.heads & (self.heads - 1) or self.heads > self.block_m:
            raise ValueError(f"RangeTiling.heads must be a power of two from 1 to block_m = {self.block_m}, "
                             f"got {self.heads}")


RANGE_KINDS = ("forward", "lse", "dq", "dkdv", "scores")  # keys of _RANGE_TABLE


# (largest BLOCK_DK + BLOCK_DV, (block_m, block_n, num_warps, num_stages)) per kernel, half precision: the widest
# tiles that compile for sm_90 without spilling, or with the least (cuobjdump -res-usage of triton.compile for
# GPUTarget("cuda", 90, 32); perf.kernel_survey checks them), and among those the fastest measured (perf/NOTES.md).
# dk/dv: block_m = (query row, head) columns per step, block_n = key rows per program; 4 warps with three stages
# measured fastest at d = 64 and d = 128 (perf.prefill_probe's backward).
# Heads (the 5th field, RangeTiling.heads): at d = 128 with the paper's group of 16, tiles of (query row, head) rows
# of the whole group beat one-head tiles in every range kernel at 64k tokens (forward -11%, dq -6%, dk/dv -12%; at
# 8k -2%, -1% and -11%; perf.prefill_probe --probes heads,range; perf/NOTES.md). The dk/dv tile spills 8 bytes and
# is still the fastest measured (the no-spill 16 x 64 one took 8% longer; RANGE_MEASURED_STACK). A group that pads
# to fewer heads keeps one head per program with the same tile sizes. At d = 64 (prod-125m's group of 6, padded to
# 8: a quarter of each tile is padding) no 8-head tile of any of the three kernels beat the one-head ones, so that
# width keeps one head. At that width the forward and dq take three stages (prod-125m's window and compressed
# ranges at 16k x 1 and 2k x 8: forward -3 to -4%, dq -4 to -9% against two; perf/NOTES.md). The d = 128 dq takes
# three stages (whole compressed backward at 64k 39.3 -> 37.3 ms, 1-3% at 8k and 16k; reports/perf/range_entries/).
# At the paper's own d_k = 192 / d_v = 128 (looked up as padded 256 + 128 = 384; the scores kernel reads d_k twice,
# 512), measured with d_k read as 128 + 64 (head_dim_tiles) at 16k and 64k tokens on an H100 (perf/NOTES.md): the
# forward on 3 stages with the group's 16 heads per tile; dq on 128 x 32 tiles of the 16 heads (whole compressed /
# window backward at 64k 84.0 / 23.5 -> 69.1 / 18.9 ms against 64 x 64, 16k 6.20 / 5.88 -> 5.18 / 4.78); dk/dv with
# the 16 heads in 16-column steps on 3 stages (64k 83.4 / 23.4 -> 71.6 / 23.8, 16k 6.20 / 5.88 -> 5.19 / 5.57
# against one head on 2 stages); scores 128 x 64 (64k 2.56 -> 2.29 ms over 8k rows).
# "lse": the forward kernel's lse-only pass (the selection's normaliser where the compressed branch did not run)
# keeps the forward's earlier tiles: with the head-packed tile, the 64k select stage (`python -m perf run`), which
# runs that pass, took 2 ms longer.
_RANGE_TABLE = {
    "forward": ((128, (128, 64, 8, 3)), (256, (64, 64, 4, 3, 16)), (384, (128, 64, 8, 3, 16)), (512, (64, 32, 8, 2))),
    "lse": ((128, (128, 64, 8, 2)), (256, (64, 32, 4, 2)), (384, (128, 64, 8, 2)), (512, (64, 32, 8, 2))),
    "dq": ((128, (64, 32, 4, 3)), (256, (128, 64, 8, 3, 16)), (384, (128, 32, 8, 2, 16)), (512, (32, 32, 8, 2))),
    "dkdv": ((128, (32, 64, 4, 3)), (256, (32, 64, 4, 3, 16)), (384, (16, 64, 4, 3, 16)), (512, (32, 16, 8, 2))),
    "scores": ((128, (64, 64, 4, 2)), (256, (128, 128, 8, 2)), (384, (64, 32, 8, 2)), (512, (128, 64, 8, 2))),
}
# The forward at d = 128 (the table's 256 entry) by the longest range a launch's rows read (range_tiling's
# max_width): ranges of at most SHORT_RANGE keys (the paper's window, w = 512; the compressed branch up to 8k tokens)
# on 64 x 32 tiles (window forward at 8k / 16k / 64k 0.471 / 0.987 / 3.839 -> 0.451 / 0.919 / 3.812 ms), ranges of
# at least LONG_RANGE keys (the compressed branch from 32k tokens) on 128 x 64 tiles on 8 warps (compressed forward
# at 64k 12.68 -> 11.97 ms; it loses at 16k and 8k, 0.940 -> 0.981 and 0.295 -> 0.343); reports/perf/range_entries/.
# In the whole paper layer's forward: 8k 3.440 -> 3.389 ms with the short-range tile, 64k 46.08 -> 45.64 with the
# long-range one (perf/NOTES.md). Other head dims keep one forward tile for every width.
SHORT_RANGE, LONG_RANGE = 512, 2048
_RANGE_FORWARD_BY_WIDTH = {256: ((64, 32, 4, 3, 16), (128, 64, 8, 3, 16))}  # (short, long)
# Bytes of stack per thread a _RANGE_TABLE entry (kind, largest BLOCK_DK + BLOCK_DV) was measured fastest with, where
# it spills; perf.kernel_survey --require-no-spill holds the d = 64, d = 128 and d_k = 192 / d_v = 128 entries to
# this (0 where not listed). The d_k = 192 dq on 128 x 32 tiles spills 48 bytes under Triton 3.7 and its dk/dv 8;
# both were the fastest measured (dq 16-20% faster than the 64 x 64 tile, which spills nothing).
RANGE_MEASURED_STACK = {("dkdv", 256): 8, ("dq", 384): 48, ("dkdv", 384): 8}


def range_tiling(block_dk: int, block_dv: int, dtype: torch.dtype, kind: str,
                 max_width: int | None = None) -> RangeTiling:
    """Heuristic launch of one range-attention kernel (_RANGE_TABLE for half precision; the forward of ranges of at
    most SHORT_RANGE or at least LONG_RANGE keys, max_width, by _RANGE_FORWARD_BY_WIDTH where it has the head
    dims); fp32 (exact fp32 dots on CUDA cores): 64 x 32 tiles, one stage; in Triton's interpreter: 16 x 16 (tests
    keep T small, and several tiles must still be exercised). max_width: the most keys any row of the launch reads
    (None: not known)."""
    if kind not in RANGE_KINDS:
        raise ValueError(f"range_tiling kind must be one of {RANGE_KINDS}, got {kind!r}")
    if interpreting():
        return RangeTiling(block_m=MIN_DOT, block_n=MIN_DOT, num_warps=4, num_stages=1)
    width = max(block_dk, block_dv)
    if torch.finfo(dtype).bits > 16:
        return RangeTiling(block_m=64, block_n=32 if width <= 128 else 16, num_warps=4 if width <= 64 else 8,
                           num_stages=1)
    total = block_dk + block_dv
    if kind == "forward" and max_width is not None and total in _RANGE_FORWARD_BY_WIDTH:
        short, long = _RANGE_FORWARD_BY_WIDTH[total]
        if max_width <= SHORT_RANGE:
            return RangeTiling(*short)
        if max_width >= LONG_RANGE:
            return RangeTiling(*long)
    return RangeTiling(*next(tile for limit, tile in _RANGE_TABLE[kind] if total <= limit))


def smaller_range_tilings(tiling: RangeTiling) -> list[RangeTiling]:
    """The given tiling, then fewer stages, then fewer query rows, then fewer key rows (down to 16 each)."""
    out = [tiling]
    for stages in range(tiling.num_stages - 1, 0, -1):
        out.append(RangeTiling(tiling.block_m, tiling.block_n, tiling.num_warps, stages, tiling.heads))
    block_m = tiling.block_m // 2
    while block_m >= MIN_DOT:
        out.append(RangeTiling(block_m, tiling.block_n, tiling.num_warps, 1, min(tiling.heads, block_m)))
        block_m //= 2
    block_n = tiling.block_n // 2
    while block_n >= MIN_DOT:
        out.append(RangeTiling(MIN_DOT, block_n, tiling.num_warps, 1, min(tiling.heads, MIN_DOT)))
        block_n //= 2
    return out


# @triton.jit helpers called by several kernels ----------------------------------------------------------------

@triton.jit
def head_packed_rows(n_queries, GROUP: tl.constexpr, HEADS: tl.constexpr, BLOCK_M: tl.constexpr):
    """The (query row, head) rows of a query-centric range-attention program on grid (row tile, KV head x head
    part, batch): BLOCK_M // HEADS consecutive query rows x HEADS heads of one KV group (row r of the tile is query
    r // HEADS, head r % HEADS of the part), so one key tile serves every head of the part. Returns (query rows
    int64, query heads int64, valid, KV head int64); with HEADS = 1 a program is BLOCK_M rows of one head."""
    parts = (GROUP + HEADS - 1) // HEADS
    kvh = (tl.program_id(1) // parts).to(tl.int64)
    first_head = (tl.program_id(1) % parts) * HEADS
    offs = tl.arange(0, BLOCK_M)
    rows = tl.program_id(0).to(tl.int64) * (BLOCK_M // HEADS) + offs // HEADS
    in_group = first_head + offs % HEADS
    valid = (rows < n_queries) & (in_group < GROUP)
    return rows, kvh * GROUP + in_group, valid, kvh


def head_packed_grid(tiling: "RangeTiling", n_queries: int, n_heads: int, n_kv_heads: int,
                     batch: int) -> tuple[tuple[int, int, int], int]:
    """(grid, heads) of a query-centric range-attention launch whose programs take head_packed_rows' tiles: heads per
    program (packed_heads), then (row tiles of block_m // heads query rows, KV heads x ceil(group / heads) head
    parts, batch)."""
    group = n_heads // n_kv_heads
    heads = packed_heads(tiling, group)
    return (triton.cdiv(n_queries, tiling.block_m // heads), n_kv_heads * -(-group // heads), batch), heads


def packed_heads(tiling: "RangeTiling", group: int) -> int:
    """The heads per program (or dk/dv step) a range-attention launch takes: the tiling's, where the group pads to
    at least that many heads, else 1 (RangeTiling)."""
    return tiling.heads if tiling.heads <= triton.next_power_of_2(group) else 1


@triton.jit
def key_tile_span(LO, HI, rows, valid, n_keys, BLOCK_N: tl.constexpr):
    """The ranges [lo, hi] of the given rows (int32; an invalid row reads nothing) and the key tiles covering the
    union of the rows that read something: tiles start at `start`, a multiple of BLOCK_N (so a row's arithmetic
    does not depend on the rows it shares a program with), and run while start_n <= last."""
    lo = tl.load(LO + rows, mask=valid, other=0)
    hi = tl.load(HI + rows, mask=valid, other=-1)
    reads = valid & (hi >= lo)
    first = tl.min(tl.where(reads, lo, n_keys), 0)
    last = tl.max(tl.where(reads, hi, -1), 0)
    return lo, hi, (first // BLOCK_N) * BLOCK_N, last


@triton.jit
def selected_block_keys(block, tile, row_start, p, offs_n, SEL_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr):
    """Eq. 12: key tile `tile` (BLOCK_N keys) of selected block `block` of a row whose keys start at row_start:
    the keys' positions and which of them the query at position p reads (a real block, >= 0; inside the block;
    at most p)."""
    in_block = tile * BLOCK_N + offs_n
    pos = row_start + block * SEL_BLOCK + in_block
    return pos, (block >= 0) & (in_block < SEL_BLOCK) & (pos <= p)


@triton.jit
def key_tile_logits(q, k_base, keys, key_ok, stride_kt, offs_dk, dk_mask, acc, DOT_FP32: tl.constexpr,
                    INPUT_PRECISION: tl.constexpr):
    """q [M, BLOCK_DK] times the key tile `keys` of K (rows at k_base + key * stride_kt, columns offs_dk; keys not
    key_ok and columns not dk_mask read as 0): the raw logits [M, BLOCK_N] in fp32 (DOT_FP32, INPUT_PRECISION:
    dot_settings), accumulated onto acc in the dot (None: onto nothing; a head dim read in two tiles,
    head_dim_tiles, passes the first tile's logits with the second tile's q and columns)."""
    kT = tl.load(k_base + keys.to(tl.int64)[None, :] * stride_kt + offs_dk[:, None],
                 mask=key_ok[None, :] & dk_mask[:, None], other=0.0)
    if DOT_FP32:
        s = tl.dot(q, kT.to(tl.float32), acc, input_precision=INPUT_PRECISION)
    else:
        s = tl.dot(q, kT, acc)
    return s


@triton.jit
def second_head_tile(rows, rows_ok, DK: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DK2: tl.constexpr,
                     DOT_FP32: tl.constexpr):
    """The second tile of a head dim read in two (head_dim_tiles): columns BLOCK_DK .. BLOCK_DK + BLOCK_DK2 - 1 of
    the rows at pointers rows [M, 1] (rows not rows_ok and columns past DK read as 0; fp32 with DOT_FP32), with its
    column offsets and their mask."""
    offs = BLOCK_DK + tl.arange(0, BLOCK_DK2)
    cols_ok = offs < DK
    x = tl.load(rows + offs[None, :], mask=rows_ok[:, None] & cols_ok[None, :], other=0.0)
    if DOT_FP32:
        x = x.to(tl.float32)
    return x, offs, cols_ok


@triton.jit
def dot(a, b, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """a @ b accumulated in fp32. DOT_FP32: both operands as fp32 (exact 'ieee' fp32 dots for fp32 inputs; the
    interpreter, whose tl.dot is wrong on bf16, runs every dtype this way)."""
    if DOT_FP32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=INPUT_PRECISION)
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def heads_dot(heads_tile, other, KEY_AXIS: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """The product of a tile over a KV group's heads with a tile over keys or the head dim, for the selected kernels'
    two layouts (forward_head_tile): heads_tile @ other where the heads are rows (KEY_AXIS 1), other @ heads_tile
    where they are columns (KEY_AXIS 0), each operand given in its layout's orientation."""
    if KEY_AXIS == 0:
        out = dot(other, heads_tile, DOT_FP32, INPUT_PRECISION)
    else:
        out = dot(heads_tile, other, DOT_FP32, INPUT_PRECISION)
    return out


@triton.jit
def compensated_add(total, comp, part):
    """One Kahan step: returns (total + part, new compensation); total - comp is the compensated sum."""
    y = part - comp
    new_total = total + y
    return new_total, (new_total - total) - y


@triton.jit
def float_order(x):
    """int32 of fp32 x whose integer order is the float order, -0.0 taken as +0.0 (masks.ranked_blocks's + 0.0):
    the high word of an Eq. 11 rank key (the prefill's top-n kernel and the decode step's lists)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits)  # -0.0 -> +0.0
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
