"""The lean decode step: one token per row in five launches (docs/decode.md, "Lean step").

    compressed splits (+ the append) -> scores (Eq. 8-10) -> select (Eq. 11 lists) -> selected/window splits
           -> gate (split merges, Eq. 5; advances the lengths)

(optimized/kernels/decode_step_cmp.py, decode_step_sparse.py, decode_append.py). Positions, visibility, the window
mask, Eq. 9's weights and Eq. 11's forced blocks are computed inside the kernels from the rows' lengths and the
rules in StepRules, which optimized.decode.lean builds only while every convention seam of optimized.masks is the
module's original function. Reads are counted by the kernels from the keys they admitted. Every launch has a static
grid and no host synchronisation, so a CUDA graph can capture the step (DecodeGraph).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
from torch import Tensor

from ..numerics import LOG2E
from .common import MIN_DOT, interpreting, key_tile_rows, padded
from .decode_append import check_append_buffers
from .decode_splits import Partials, program_budget
from .decode_step_cmp import compressed_split_kernel, score_kernel, select_kernel
from .decode_step_sparse import gate_kernel, sparse_split_kernel
from .top_n import list_width

BLOCK_N = 64  # key-tile rows of the compressed split (16 in the interpreter, so tiny tests span several tiles)
CMP_STAGES = 3  # pipeline stages of the compressed split (the fastest perf.decode_cmp_probe measured; perf/NOTES.md)
SCORE_BLOCK = 64  # selection blocks per score program
SCORE_WARPS = 2  # warps of a score program
RANK_BLOCK = 64  # selection blocks a select program ranks at once (a chunk of score_into_list)
BLOCKS_PER_LIST = 64  # at least this many selection blocks per select program
MAX_LISTS = 16  # select programs per row (the sparse kernel merges n * MAX_LISTS candidates)
SELECT_WARPS = 1  # a select program is one warp (its ranking's comparisons are reductions)
STEP_WARPS = 4  # warps of the other launches' programs
GATE_TILE_DV = 32  # output columns per gate program (its split merges hold [heads, 32] tiles)
MERGE_CHUNK = 8  # split partials a merge loads at once (unrolled)
PDL = True  # programmatic dependent launch where the GPU, Triton and the step's size allow it (uses_pdl)


@dataclass(frozen=True)
class StepRules:
    """The conventions the kernels compute in place of the optimized.masks seams (ints and switches of the
    NSAConfig; eq9_first_offset / eq9_band: the offset and length of masks.eq9_pool_weights's band, whose weights
    the kernel recomputes as overlap / d)."""

    cmp_block: int
    cmp_stride: int
    sel_block: int
    n_sel: int
    n_init: int
    n_local: int
    window_size: int
    strict_visibility: bool
    logit_scores: bool
    mean_reduce: bool
    eq9_first_offset: int
    eq9_band: int


class StepSplits(NamedTuple):
    """Programs per (row, KV group): compressed splits, select lists, selected splits, window splits."""

    cmp: int
    lists: int
    slc: int
    win: int


class StepOutput(NamedTuple):
    o: Tensor  # [B, 1, Hq, dv]
    indices: Tensor  # int64 [B, 1, Hkv, n]
    o_cmp: Tensor
    o_slc: Tensor
    o_win: Tensor
    reads_cmp: Tensor  # int64 [B, 1, Hkv]
    reads_slc: Tensor
    reads_win: Tensor


def uses_pdl(device: torch.device, programs: int) -> bool:
    """Whether the step's launches use programmatic dependent launch (decode_tiles.await_previous_launch: each
    launch may start while the one before it runs, and waits for it before reading anything): PDL is on, the device
    is a CUDA GPU of compute capability 9.0 or later whose Triton CUDA backend has the launch option (not the
    interpreter), and the step's largest launch (`programs`) runs in one wave of program_budget programs. Measured
    (perf/NOTES.md): at 64k x 1 the step took 39.1 against 41.8 us; at 64k x 16, whose score and select launches
    have 1024 programs each, 118.9 against 116.0 us, so larger steps launch without it."""
    if (not PDL or device.type != "cuda" or interpreting() or torch.cuda.get_device_capability(device)[0] < 9
            or programs > program_budget(device)):
        return False
    from triton.backends.nvidia.compiler import CUDAOptions

    return "launch_pdl" in CUDAOptions.__dataclass_fields__


def cmp_tile_rows() -> int:
    """Compressed tokens per key tile: BLOCK_N (MIN_DOT in the interpreter)."""
    return MIN_DOT if interpreting() else BLOCK_N


def step_splits(rows: int, n_cmp_slots: int, n_sel_blocks: int, n_sel: int, sel_block: int, window_slots: int,
                window_tiles: int, key_bytes: int, partial_bytes: int, device: torch.device) -> StepSplits:
    """Programs per (row, KV group). Each launch aims to fill the GPU in one wave (decode_splits.program_budget
    programs, rounded down per row; 1 in the interpreter, where tests replace this function to exercise several),
    but a row's keys are cut into at most about sqrt(keys * key_bytes / partial_bytes) splits: one program merges a
    row's partials, so past that the partials it reads cost more than the keys a split saves the others. The sparse
    launch shares its programs between the selected and window keys in proportion. The select launch's programs are
    one warp each, so it gets STEP_WARPS / SELECT_WARPS times the budget (the same warps per SM)."""
    per_row = max(1, program_budget(device) // max(rows, 1))
    select_per_row = max(1, program_budget(device) * (STEP_WARPS // SELECT_WARPS) // max(rows, 1))

    def splits(keys: int) -> int:
        return max(1, min(per_row, round(math.sqrt(keys * key_bytes / partial_bytes))))

    def clamp(n: int, units: int) -> int:
        return max(1, min(n, units))

    sel_keys = n_sel * sel_block
    sparse = splits(sel_keys + window_slots)
    slc = clamp(round(sparse * sel_keys / (sel_keys + window_slots)), n_sel)
    return StepSplits(cmp=clamp(splits(n_cmp_slots), -(-n_cmp_slots // cmp_tile_rows())),
                      lists=clamp(min(select_per_row, MAX_LISTS), -(-n_sel_blocks // BLOCKS_PER_LIST)),
                      slc=slc, win=clamp(sparse - slc, window_tiles))


def equal_shares(units: int, parts: int) -> tuple[int, int]:
    """(units per part, parts that get any) when `units` are dealt to at most `parts` parts in equal shares of
    ceil(units / parts): a launch's splits, each with work."""
    per_part = -(-units // parts)
    return per_part, -(-units // per_part)


def default_step_splits(q: Tensor, history: tuple[Tensor, Tensor], window: tuple[Tensor, Tensor], rules: StepRules,
                        n_cmp_slots: int, n_sel_blocks: int) -> StepSplits:
    """step_splits for a step of queries q [B, 1, Hq, dk] over these history / window buffers (what
    lean_decode_step uses when no splits are given; perf.decode_profile varies them)."""
    B, _, Hq, dk = q.shape
    Hkv, dv = history[0].shape[1], history[1].shape[3]
    window_slots = window[0].shape[2] - 1
    block_h, block_dv = padded(Hq // Hkv), padded(dv)
    window_tiles = max(1, -(-window_slots // key_tile_rows(rules.sel_block, BLOCK_N)))
    key_bytes = (dk + dv) * q.element_size()
    partial_bytes = (block_h * block_dv + 2 * block_h + 1) * 4
    return step_splits(B * Hkv, max(1, n_cmp_slots), n_sel_blocks, rules.n_sel, rules.sel_block, window_slots,
                       window_tiles, key_bytes, partial_bytes, q.device)


def lean_decode_step(q: Tensor, gates: Tensor, new: tuple[Tensor, ...], lengths: Tensor, n_new: Tensor,
                     compressed: tuple[Tensor, Tensor], raw: tuple[Tensor, Tensor], history: tuple[Tensor, Tensor],
                     window: tuple[Tensor, Tensor], rules: StepRules, n_cmp_slots: int, n_sel_blocks: int,
                     splits: StepSplits | None = None) -> StepOutput:
    """Append one token per row (n_new[b] in {0, 1}: rows with 0 hold a padding query) and compute the step's
    NSA output. q [B, 1, Hq, dk], gates [B, 1, Hq, 3]; new = (k_cmp, v_cmp, k_slc, v_slc, k_win, v_win) [B, 1, Hkv,
    D]; lengths (int64 [B], tokens held before the step, advanced in place); compressed, raw, history, window: the
    cache's (k, v) buffers [B, Hkv, slots + 1, D]. n_cmp_slots / n_sel_blocks: static bounds on the compressed tokens
    and selection blocks any row can see (from the capture horizon); splits: default step_splits."""
    _validate(q, gates, compressed, history, window, rules, n_cmp_slots, n_sel_blocks)
    new = tuple(t.contiguous() for t in new)
    check_append_buffers(lengths, n_new, new, raw, history, window)
    n_cmp_slots = max(1, n_cmp_slots)  # the logits' row width (a slot never emitted is never visible, never read)
    B, _, Hq, dk = q.shape
    Hkv, dv = history[0].shape[1], history[1].shape[3]
    group, rows, dev = Hq // Hkv, B * Hkv, q.device
    window_slots = window[0].shape[2] - 1
    block_h, block_dk, block_dv = padded(group), padded(dk), padded(dv)
    block_n = key_tile_rows(rules.sel_block, BLOCK_N)  # selected and window key tiles: B_k | l'
    tiles_per_block = -(-rules.sel_block // block_n)
    window_tiles = max(1, -(-window_slots // block_n))
    splits = splits or default_step_splits(q, history, window, rules, n_cmp_slots, n_sel_blocks)
    # every split gets work: the shares first, then the splits they need
    cmp_rows = cmp_tile_rows()
    cmp_tiles_per_split, n_cmp = equal_shares(max(1, -(-n_cmp_slots // cmp_rows)), splits.cmp)
    keys_per_split = cmp_tiles_per_split * cmp_rows
    blocks_per_list, n_lists = equal_shares(n_sel_blocks, splits.lists)
    slots_per_split, n_slc = equal_shares(rules.n_sel, splits.slc)
    tiles_per_win_split, n_win = equal_shares(window_tiles, splits.win)
    splits = StepSplits(cmp=n_cmp, lists=n_lists, slc=n_slc, win=n_win)
    n_pad = list_width(rules.n_sel)
    dot_fp32 = q.dtype == torch.float32 or interpreting()
    scale = 1.0 / math.sqrt(dk)
    q = q if q.stride(-1) == 1 else q.contiguous()
    score_programs = -(-n_sel_blocks // SCORE_BLOCK)  # per row
    tile_dv = min(GATE_TILE_DV, block_dv)  # the gate's output columns per program
    largest = rows * max(splits.cmp, score_programs, splits.lists, splits.slc + splits.win, block_dv // tile_dv)
    pdl = {"PDL": True, "launch_pdl": True} if uses_pdl(dev, largest) else {}

    out = StepOutput(o=torch.empty((B, 1, Hq, dv), dtype=q.dtype, device=dev),
                     indices=torch.empty((B, 1, Hkv, rules.n_sel), dtype=torch.int64, device=dev),
                     o_cmp=torch.empty((B, 1, Hq, dv), dtype=q.dtype, device=dev),
                     o_slc=torch.empty((B, 1, Hq, dv), dtype=q.dtype, device=dev),
                     o_win=torch.empty((B, 1, Hq, dv), dtype=q.dtype, device=dev),
                     reads_cmp=torch.empty((B, 1, Hkv), dtype=torch.int64, device=dev),
                     reads_slc=torch.empty((B, 1, Hkv), dtype=torch.int64, device=dev),
                     reads_win=torch.empty((B, 1, Hkv), dtype=torch.int64, device=dev))

    # compressed splits: partials and the Eq. 8 input of every visible compressed token
    cmp_parts = Partials.empty(rows, splits.cmp, block_h, block_dv, dev)
    logits = torch.empty((rows, group, n_cmp_slots), dtype=torch.float32, device=dev)
    k_cmp, v_cmp = compressed
    compressed_split_kernel[(rows, splits.cmp)](
        q, k_cmp, v_cmp, lengths, n_new, logits, cmp_parts.o, cmp_parts.m, cmp_parts.l, cmp_parts.reads,
        *new, raw[0], raw[1], history[0], history[1], window[0], window[1],
        q.stride(0), q.stride(2),
        k_cmp.stride(0), k_cmp.stride(1), k_cmp.stride(2),
        v_cmp.stride(0), v_cmp.stride(1), v_cmp.stride(2),
        n_cmp_slots, keys_per_split, splits.cmp, scale * LOG2E, scale, raw[0].shape[2], history[0].shape[2],
        window[0].shape[2],
        HKV=Hkv, GROUP=group, DK=dk, DV=dv, BLOCK_H=block_h, BLOCK_DK=block_dk, BLOCK_DV=block_dv, BLOCK_N=cmp_rows,
        CMP_BLOCK=rules.cmp_block, CMP_STRIDE=rules.cmp_stride, STRICT=rules.strict_visibility,
        LOGIT_SCORES=rules.logit_scores, DOT_FP32=dot_fp32, num_warps=STEP_WARPS, num_stages=CMP_STAGES, **pdl,
    )

    # Eq. 8-10: every visible selection block's score
    scores = torch.empty((rows, n_sel_blocks), dtype=torch.float32, device=dev)
    score_kernel[(rows, score_programs)](
        lengths, n_new, logits, cmp_parts.m, cmp_parts.l, cmp_parts.reads, scores,
        n_cmp_slots, splits.cmp, n_sel_blocks,
        HKV=Hkv, GROUP=group, BLOCK_H=block_h,
        CMP_BLOCK=rules.cmp_block, CMP_STRIDE=rules.cmp_stride, SEL_BLOCK=rules.sel_block,
        STRICT=rules.strict_visibility, LOGIT_SCORES=rules.logit_scores, MEAN=rules.mean_reduce,
        EQ9_FIRST=rules.eq9_first_offset, EQ9_BAND=rules.eq9_band, SCORE_BLOCK=SCORE_BLOCK,
        CMP_SPLITS=triton.next_power_of_2(splits.cmp), num_warps=SCORE_WARPS, num_stages=1, **pdl,
        enable_fp_fusion=False,  # Eq. 9's products and sums rounded one by one, as in torch
    )

    # Eq. 11: each select program's list of its n best blocks
    lists = torch.empty((rows, splits.lists, n_pad), dtype=torch.int64, device=dev)
    select_kernel[(rows, splits.lists)](
        lengths, n_new, scores, lists, n_sel_blocks, blocks_per_list, splits.lists,
        HKV=Hkv, SEL_BLOCK=rules.sel_block, N_INIT=rules.n_init, N_LOCAL=rules.n_local, N_SEL=rules.n_sel,
        N_PAD=n_pad, RANK_BLOCK=min(RANK_BLOCK, padded(blocks_per_list)), num_warps=SELECT_WARPS, num_stages=1,
        **pdl,
    )

    # selected and window splits
    sparse_parts = Partials.empty(rows, splits.slc + splits.win, block_h, block_dv, dev)
    (hk, hv), (wk, wv) = history, window
    sparse_split_kernel[(rows, splits.slc + splits.win)](
        q, hk, hv, wk, wv, lengths, n_new, lists, out.indices, sparse_parts.o, sparse_parts.m, sparse_parts.l,
        sparse_parts.reads,
        q.stride(0), q.stride(2),
        hk.stride(0), hk.stride(1), hv.stride(0), hv.stride(1), wk.stride(0), wk.stride(1), wv.stride(0),
        wv.stride(1), hk.stride(2), hv.stride(2),
        splits.lists, slots_per_split, splits.slc, tiles_per_win_split, splits.win, window_slots, rules.window_size,
        scale * LOG2E,
        HKV=Hkv, GROUP=group, DK=dk, DV=dv, BLOCK_H=block_h, BLOCK_DK=block_dk, BLOCK_DV=block_dv, BLOCK_N=block_n,
        SEL_BLOCK=rules.sel_block, TILES_PER_BLOCK=tiles_per_block, N_SEL=rules.n_sel,
        N_PAD=n_pad, LISTS_PAD=triton.next_power_of_2(splits.lists), DOT_FP32=dot_fp32, num_warps=STEP_WARPS,
        num_stages=2, **pdl,
    )

    # o_cmp, o_slc, o_win from their splits, and Eq. 5
    gate_kernel[(rows, block_dv // tile_dv)](
        sparse_parts.o, sparse_parts.m, sparse_parts.l, sparse_parts.reads, cmp_parts.o, cmp_parts.m, cmp_parts.l,
        cmp_parts.reads, gates, lengths, n_new, out.o, out.o_cmp, out.o_slc, out.o_win, out.reads_cmp, out.reads_slc,
        out.reads_win,
        out.o.stride(0), out.o.stride(2), gates.stride(0), gates.stride(2), gates.stride(3),
        splits.cmp, splits.slc, splits.win,
        HKV=Hkv, GROUP=group, DV=dv, BLOCK_H=block_h, BLOCK_DV=block_dv, TILE_DV=tile_dv,
        CMP_SPLITS=triton.next_power_of_2(splits.cmp), SPLITS=triton.next_power_of_2(max(splits.slc, splits.win)),
        MERGE_CHUNK=MERGE_CHUNK, num_warps=STEP_WARPS, **pdl,
        enable_fp_fusion=False,  # Eq. 5's products and sums rounded one by one, as gated_sum's
    )
    return out


def _validate(q: Tensor, gates: Tensor, compressed: tuple[Tensor, Tensor], history: tuple[Tensor, Tensor],
              window: tuple[Tensor, Tensor], rules: StepRules, n_cmp_slots: int, n_sel_blocks: int) -> None:
    if q.dim() != 4 or q.shape[1] != 1:
        raise ValueError(f"lean_decode_step: q must be [B, 1, Hq, dk] (one query per row), got {tuple(q.shape)}")
    B, _, Hq, _ = q.shape
    if gates.shape != (B, 1, Hq, 3) or gates.dtype != q.dtype:
        raise ValueError(f"lean_decode_step: gates must be [B={B}, 1, Hq={Hq}, 3] in q's dtype, got {gates.dtype} "
                         f"{tuple(gates.shape)}")
    if not 0 <= n_cmp_slots <= compressed[0].shape[2] - 1:
        raise ValueError(f"lean_decode_step: n_cmp_slots must be in 0..{compressed[0].shape[2] - 1} (the compressed "
                         f"store's slots), got {n_cmp_slots}")
    if history[0].stride(2) != window[0].stride(2) or history[1].stride(2) != window[1].stride(2):
        raise ValueError("lean_decode_step: the history and window buffers must have the same token stride (one "
                         "kernel loop reads both)")
    if n_sel_blocks < 1:
        raise ValueError(f"lean_decode_step: n_sel_blocks must be >= 1, got {n_sel_blocks}")
    if rules.eq9_band < 1 or rules.n_sel < 1:
        raise ValueError(f"lean_decode_step: rules need eq9_band >= 1 and n_sel >= 1, got {rules}")
    if q.device.type != "cuda" and not interpreting():
        raise ValueError("lean_decode_step: tensors must be on CUDA (or set TRITON_INTERPRET=1 before importing the "
                         "kernels)")
