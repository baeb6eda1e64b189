"""The prefill range-kernel path's select stage and range-attention forward at one T, under other launch shapes
(a GPU diagnostic, like perf.decode_cmp_probe for the decode step).

What it times (triton.testing.do_bench: warm-up, L2 flushed before every run, median), bf16, in one of LAYOUTS
(--layout: the paper's 64 q heads in 4 KV groups at d_k = d_v = 128 (the benchmark sweeps' layout) or at the
paper's own d_k = 192, d_v = 128 (paper-dk192, NSAConfig's defaults), or prod-125m's 12 in 2, d = 64; all l = 32,
d = 16, l' = 64, n = 16, w = 512), --batch sequences of --seq-len tokens:
- `scores`: the group-scores kernel of optimized/kernels/selection.py (Eq. 8 + 10) over the last --score-rows
  query rows (the widest ranges) per tiling, with its TFLOP/s on the useful q.k_cmp dots (every head, every
  visible compressed token);
- `selection`: the whole `selection_indices(range_backend="triton")` as nsa_forward calls it (the compressed
  branch's lse2 given), with the scoring chunks' P budget (selection.KERNEL_CHUNK_P_BYTES) set to each value; every
  budget must give the same indices bitwise (the chunking does not change a row's arithmetic);
- `range`: range_attention_forward (o and lse2) over the compressed branch's ranges and over the window's, per
  tiling, with TFLOP/s on the useful keys and the largest |o - o(default tiling)|;
- `backward`: range_attention_backward over both branches' ranges with FlashAttention-2's D0 = rowsum(dO * O)
  (an earlier half-precision default) or the dq pass's consistent D, other dq tilings and other dk/dv tilings;
- `heads`: the same backward with dk/dv steps, or dq programs, that take several heads of the KV group at once
  (RangeTiling.heads), against the default tilings;
- `rows`: the same backward (default tilings) with the dk/dv rows of each key tile split into the tile's own equal
  parts or into chunks of the query rows every tile shares (range_attention_backward's row_chunks), each at the
  default count and at other counts.
Each tiling is launched as given; one the GPU cannot fit (shared memory or registers) gives a row with its error.

    python -m perf.prefill_probe [--seq-len 65536] [--layout prod-125m --batch 8]   # on a GPU; writes
                                                                                     # prefill_probe.json
"""

from __future__ import annotations

import argparse
import math
from dataclasses import astuple

import torch
import triton

from optimized import masks
from optimized.kernels import selection
from optimized.kernels.common import RangeTiling, packed_heads, padded, range_tiling
from optimized.kernels.range_attention import (CompressedSoftmax, check_range_inputs, compressed_ranges,
                                               range_attention_forward, sequence_ranges, window_ranges)
from optimized.kernels.range_attention_bwd import dkdv_parts, range_attention_backward, rows_shared_in_l2
from optimized.kernels.selection import group_scores
from reference.config import NSAConfig

from .outputs import (add_probe_arguments, check_probe_arguments, launched, printed_rows, probe_timing,
                      write_probe_report)
from .timing import bench_ms
from .flops import ATTENTION_BWD_FACTOR

LAYOUTS = {"paper": NSAConfig.preset("paper", head_dim_qk=128, head_dim_v=128),
           "paper-dk192": NSAConfig.preset("paper"),
           "prod-125m": NSAConfig.preset("paper", n_heads=12, n_kv_heads=2, head_dim_qk=64, head_dim_v=64)}
CFG = LAYOUTS["paper"]  # the layout the probes use (main sets --layout's)
SCORE_TILINGS = ((64, 64, 8, 2), (64, 64, 4, 2), (128, 64, 8, 2), (64, 128, 8, 2), (128, 128, 8, 2), (64, 32, 4, 2))
RANGE_TILINGS = ((64, 32, 4, 2), (128, 64, 8, 2), (128, 64, 4, 2), (64, 64, 4, 2), (128, 32, 8, 2), (128, 64, 8, 3),
                 (128, 128, 8, 2), (64, 128, 4, 2), (64, 32, 4, 2, 16), (128, 64, 8, 2, 16), (128, 32, 8, 2, 16),
                 (64, 64, 4, 2, 16), (128, 128, 8, 2, 16), (64, 64, 4, 3, 16))
BUDGETS_MIB = (24, 64, 128, 256)
ROW_SPLIT_FACTORS = (1, 0.5, 2, 4)  # `rows`: each split's count relative to its default


def _tiling(shape: tuple[int, ...]) -> RangeTiling:
    """(block_m, block_n, warps, stages[, heads]) as a RangeTiling, heads capped at the layout's KV group padded to
    a power of two (so 16 heads means the whole group of either layout); rows record the tiling as launched."""
    if len(shape) == 5:
        shape = (*shape[:4], min(shape[4], triton.next_power_of_2(CFG.n_heads // CFG.n_kv_heads)))
    return RangeTiling(*shape)


def _default_tiling(kind: str, dtype: torch.dtype, max_width: int | None = None) -> RangeTiling:
    """The launch table's tiling of a range kernel (range_tiling's kind) at the probed layout; max_width: the
    longest range of the launch, which the forward's tile follows (a branch's: _inputs' "max_width")."""
    dv = CFG.head_dim_qk if kind == "scores" else CFG.head_dim_v  # the scores kernel reads no values
    return range_tiling(padded(CFG.head_dim_qk), padded(dv), dtype, kind, max_width)


def _inputs(T: int, device: torch.device, dtype: torch.dtype = torch.bfloat16, batch: int = 1) -> dict:
    """Random q and per-branch k/v of `batch` sequences, the compressed and window ranges, and the compressed
    branch's lse2 (what nsa_forward hands the selection), and each branch's longest range (max_width, as the
    branches hand it to their forward: sequence_ranges)."""
    cfg = CFG
    g = torch.Generator(device=device).manual_seed(T)
    n_cmp = masks.compressed_block_count(T, cfg)

    def randn(*shape):
        return torch.randn(shape, generator=g, device=device).to(dtype)

    q = randn(batch, T, cfg.n_heads, cfg.head_dim_qk)
    k_cmp = randn(batch, n_cmp, cfg.n_kv_heads, cfg.head_dim_qk)
    v_cmp = randn(batch, n_cmp, cfg.n_kv_heads, cfg.head_dim_v)
    k_win, v_win = randn(batch, T, cfg.n_kv_heads, cfg.head_dim_qk), randn(batch, T, cfg.n_kv_heads, cfg.head_dim_v)
    positions = torch.arange(T, device=device)
    cmp_lo, cmp_hi = check_range_inputs(q, k_cmp, v_cmp, *compressed_ranges(positions, n_cmp, cfg))
    win_lo, win_hi = check_range_inputs(q, k_win, v_win, *window_ranges(positions, cfg))
    cmp_lse2 = range_attention_forward(q, k_cmp, None, cmp_lo, cmp_hi, 1.0 / math.sqrt(cfg.head_dim_qk))[1]
    max_width = {branch: sequence_ranges(branch, 0, T, n_keys, cfg, device).max_width
                 for branch, n_keys in (("cmp", n_cmp), ("win", T))}
    return {"q": q, "k_cmp": k_cmp, "v_cmp": v_cmp, "k_win": k_win, "v_win": v_win,
            "cmp": (cmp_lo, cmp_hi), "win": (win_lo, win_hi), "cmp_lse2": cmp_lse2, "max_width": max_width}


def _useful_flops(lo: torch.Tensor, hi: torch.Tensor, dims: int, sequences: int = 1) -> float:
    """2 x (visible keys of every row) x heads x dims x sequences (dims = d_k for q.k, d_k + d_v with the P.V
    product)."""
    keys = torch.clamp(hi.long() - lo.long() + 1, min=0).sum().item()
    return 2.0 * keys * CFG.n_heads * dims * sequences


def probe_scores(x: dict, rows: int, scale: float, rep_ms: int) -> list[dict]:
    q, k_cmp = x["q"], x["k_cmp"]
    T = q.shape[1]
    r0 = max(0, T - rows)
    lo, hi = (t[r0:].contiguous() for t in x["cmp"])
    lse2 = x["cmp_lse2"][:, r0:].contiguous()
    qr = q[:, r0:]
    width = int((hi - lo + 1).max())
    flops = _useful_flops(lo, hi, CFG.head_dim_qk, q.shape[0])
    default = _default_tiling("scores", q.dtype)
    reference = group_scores(qr, k_cmp, lo, hi, lse2, width, scale)
    out = []
    for shape in SCORE_TILINGS:
        t = _tiling(shape)
        row = {"probe": "scores", "tiling": list(shape), "default": t == default, "rows": T - r0}

        def run():
            return group_scores(qr, k_cmp, lo, hi, lse2, width, scale, tiling=t)

        p, error = launched(run)
        if error is not None:  # a tile this GPU cannot launch: the row says so
            out.append({**row, "ms": None, "error": error})
            continue
        ms = bench_ms(run, rep_ms)
        out.append({**row, "ms": ms, "tflops": flops / ms / 1e9,
                    "max_abs_diff_vs_default": float((p - reference).abs().max())})
    return out


def probe_selection(x: dict, rep_ms: int) -> list[dict]:
    q, k_cmp = x["q"], x["k_cmp"]
    soft = CompressedSoftmax(*x["cmp"], x["cmp_lse2"])
    saved_budget, kernel_chunks = selection.KERNEL_CHUNK_P_BYTES, selection.kernel_chunks
    positions = torch.arange(q.shape[1], device=q.device)
    n_sel_blocks = masks.sel_block_count(q.shape[1], CFG)
    used: list[int] = []

    def counted_chunks(*args):  # the chunks selection_indices actually ran
        chunks = kernel_chunks(*args)
        used.append(len(chunks))
        return chunks

    def run():
        return selection.selection_indices_rows(q, k_cmp, CFG, positions, n_sel_blocks, cmp_softmax=soft)

    out, first = [], None
    try:
        selection.kernel_chunks = counted_chunks
        for mib in BUDGETS_MIB:
            selection.KERNEL_CHUNK_P_BYTES = mib * 2**20
            used.clear()
            indices = run()
            first = indices if first is None else first
            out.append({"probe": "selection", "budget_mib": mib, "default": mib * 2**20 == saved_budget,
                        "chunks": used[0], "ms": bench_ms(run, rep_ms),
                        "same_indices": bool(torch.equal(indices, first))})
    finally:
        selection.KERNEL_CHUNK_P_BYTES, selection.kernel_chunks = saved_budget, kernel_chunks
    return out


def probe_range(x: dict, scale: float, rep_ms: int) -> list[dict]:
    q = x["q"]
    out = []
    for branch in ("cmp", "win"):
        k, v = x[f"k_{branch}"], x[f"v_{branch}"]
        lo, hi = x[branch]
        flops = _useful_flops(lo, hi, CFG.head_dim_qk + CFG.head_dim_v, q.shape[0])
        width = x["max_width"][branch]
        default = _default_tiling("forward", q.dtype, width)
        reference = range_attention_forward(q, k, v, lo, hi, scale, max_width=width)[0]  # the default, or what fits
        for shape in RANGE_TILINGS:
            t = _tiling(shape)
            row = {"probe": "range", "branch": branch, "tiling": list(astuple(t)), "default": t == default}

            def run():
                return range_attention_forward(q, k, v, lo, hi, scale, tiling=t)

            result, error = launched(run)
            if error is not None:
                out.append({**row, "ms": None, "error": error})
                continue
            o = result[0]
            ms = bench_ms(run, rep_ms)
            out.append({**row, "ms": ms, "tflops": flops / ms / 1e9,
                        "max_abs_diff_vs_default": float((o.float() - reference.float()).abs().max())})
            del o, result
    return out


# (consistent D, dq tiling, dk/dv tiling), tilings as (query rows, key rows, warps, stages): the dq tiling's rows
# are per program, the dk/dv tiling's query rows are per step of a program that holds the key rows
DQ_TILINGS = ((64, 32, 4, 2), (64, 64, 4, 2), (128, 64, 8, 2), (128, 32, 4, 2))
DKDV_TILINGS = ((64, 32, 8, 2), (32, 64, 8, 2), (32, 64, 8, 3), (32, 128, 8, 2), (16, 64, 4, 2), (64, 64, 4, 2),
                (64, 64, 8, 2), (64, 128, 8, 2), (32, 64, 4, 2), (32, 64, 4, 3), (32, 64, 2, 2), (16, 64, 2, 2),
                (16, 64, 4, 3), (32, 32, 4, 2), (16, 32, 2, 2), (32, 128, 4, 2), (16, 128, 4, 2), (64, 64, 4, 3))
# FlashAttention-2's D0 at the first tilings, then the consistent D: every dk/dv tiling with the first dq tiling,
# every other dq tiling with the first dk/dv tiling
BACKWARD_VARIANTS = ((False, DQ_TILINGS[0], DKDV_TILINGS[0]),
                     *((True, DQ_TILINGS[0], dkdv) for dkdv in DKDV_TILINGS),
                     *((True, dq, DKDV_TILINGS[0]) for dq in DQ_TILINGS[1:]))


# dk/dv tilings whose steps take several heads of the group at once (RangeTiling.heads; block_m then counts (row,
# head) columns), against the default dk/dv tiling, with the default dq tiling and the consistent D
HEADS_DKDV_TILINGS = ((32, 64, 4, 3, 16), (16, 64, 4, 3, 16), (32, 64, 8, 3, 16), (32, 64, 8, 2, 16),
                      (32, 32, 4, 3, 16), (64, 64, 4, 2, 16), (128, 128, 8, 2, 16))
# dq tilings whose programs take several heads of the group (with the default dk/dv tiling)
HEADS_DQ_TILINGS = ((64, 32, 4, 2, 16), (128, 32, 8, 2, 16), (64, 64, 4, 2, 16), (32, 32, 4, 2, 16),
                    (128, 64, 8, 2, 16))


def probe_heads(x: dict, scale: float, rep_ms: int) -> list[dict]:
    dq_default = astuple(_default_tiling("dq", x["q"].dtype))
    dkdv_default = astuple(_default_tiling("dkdv", x["q"].dtype))
    variants = [(True, dq_default, shape) for shape in (dkdv_default, *HEADS_DKDV_TILINGS)]
    variants += [(True, shape, dkdv_default) for shape in HEADS_DQ_TILINGS]
    return probe_backward(x, scale, rep_ms, variants)


def probe_rows(x: dict, scale: float, rep_ms: int) -> list[dict]:
    """range_attention_backward over both branches with the dk/dv rows in each tile's own parts or in shared
    chunks, at the default count of each (dkdv_parts) times each of ROW_SPLIT_FACTORS."""
    q = x["q"]
    g = torch.Generator(device=q.device).manual_seed(1)
    do = torch.randn(q.shape[:3] + (CFG.head_dim_v,), generator=g, device=q.device).to(q.dtype)
    t = _default_tiling("dkdv", q.dtype)
    rows = t.block_m // packed_heads(t, CFG.n_heads // CFG.n_kv_heads)
    out = []
    for branch in ("cmp", "win"):
        k, v = x[f"k_{branch}"], x[f"v_{branch}"]
        lo, hi = x[branch]
        o, lse2 = range_attention_forward(q, k, v, lo, hi, scale, max_width=x["max_width"][branch])
        n_tiles, batch, T = triton.cdiv(k.shape[1], t.block_n), q.shape[0], q.shape[1]
        reference = None
        for chunked in (False, True):
            default = dkdv_parts(chunked, n_tiles, CFG.n_kv_heads, batch, T, k.shape[1], rows,
                                 CFG.head_dim_qk + CFG.head_dim_v)
            for factor in ROW_SPLIT_FACTORS:
                split = max(1, int(default * factor))

                def run():
                    return range_attention_backward(q, k, v, lo, hi, o, lse2, do, scale, split=split,
                                                    row_chunks=chunked)

                grads = run()
                reference = grads if reference is None else reference
                diff = max(float((a.float() - r.float()).abs().max()) for a, r in zip(grads, reference))
                out.append({"probe": "rows", "branch": branch, "rows": "shared chunks" if chunked else "own parts",
                            "split": split, "default_count": factor == 1,
                            "default": factor == 1 and chunked == rows_shared_in_l2(q, CFG.head_dim_v, k.shape[1]),
                            "ms": bench_ms(run, rep_ms), "max_abs_grad_diff_vs_first": diff})
    return out


def probe_backward(x: dict, scale: float, rep_ms: int, variants: tuple | list | None = None) -> list[dict]:
    """range_attention_backward under each (consistent D, dq tiling, dk/dv tiling) of variants (default
    BACKWARD_VARIANTS), both branches."""
    q = x["q"]
    g = torch.Generator(device=q.device).manual_seed(1)
    do = torch.randn(q.shape[:3] + (CFG.head_dim_v,), generator=g, device=q.device).to(q.dtype)
    dq_default = _default_tiling("dq", q.dtype)
    dkdv_default = _default_tiling("dkdv", q.dtype)
    out = []
    for branch in ("cmp", "win"):
        k, v = x[f"k_{branch}"], x[f"v_{branch}"]
        lo, hi = x[branch]
        o, lse2 = range_attention_forward(q, k, v, lo, hi, scale, max_width=x["max_width"][branch])
        flops = ATTENTION_BWD_FACTOR * _useful_flops(lo, hi, CFG.head_dim_qk + CFG.head_dim_v, q.shape[0])
        reference = None
        for consistent, dq_shape, dkdv_shape in variants or BACKWARD_VARIANTS:
            dq_tiling, dkdv_tiling = _tiling(dq_shape), _tiling(dkdv_shape)

            def run():
                return range_attention_backward(q, k, v, lo, hi, o, lse2, do, scale, dq_tiling=dq_tiling,
                                                dkdv_tiling=dkdv_tiling, consistent_d=consistent)

            row = {"probe": "backward", "branch": branch, "consistent_d": consistent,
                   "dq_tiling": list(astuple(dq_tiling)), "dkdv_tiling": list(astuple(dkdv_tiling)),
                   "default": consistent and dq_tiling == dq_default and dkdv_tiling == dkdv_default}
            grads, error = launched(run)
            if error is not None:
                out.append({**row, "ms": None, "error": error})
                continue
            reference = grads if reference is None else reference
            diff = max(float((a.float() - r.float()).abs().max()) for a, r in zip(grads, reference))
            out.append({**row, "ms": (ms := bench_ms(run, rep_ms)), "tflops": flops / ms / 1e9,
                        "max_abs_grad_diff_vs_first": diff})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_probe_arguments(parser, "prefill_probe", LAYOUTS, seq_len=65536, rep_ms=300)
    parser.add_argument("--score-rows", type=int, default=8192, help="the last rows the scores probe reads")
    parser.add_argument("--probes", default="scores,selection,range,backward")
    args = parser.parse_args(argv)
    check_probe_arguments(parser, args)
    global CFG
    CFG = LAYOUTS[args.layout]
    device = torch.device("cuda")
    x = _inputs(args.seq_len, device, batch=args.batch)
    scale = 1.0 / math.sqrt(CFG.head_dim_qk)
    probes = {"scores": lambda: probe_scores(x, args.score_rows, scale, args.rep_ms),
              "selection": lambda: probe_selection(x, args.rep_ms),
              "range": lambda: probe_range(x, scale, args.rep_ms),
              "backward": lambda: probe_backward(x, scale, args.rep_ms),
              "heads": lambda: probe_heads(x, scale, args.rep_ms),
              "rows": lambda: probe_rows(x, scale, args.rep_ms)}
    results = printed_rows(row for name in args.probes.split(",") for row in probes[name]())
    write_probe_report(args.out, "prefill_probe",
                       f"{probe_timing(args.rep_ms, args.layout, args.batch, args.seq_len)}, "
                       f"scores over the last {args.score_rows} rows", results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
