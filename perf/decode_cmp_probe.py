"""The lean decode step's compressed split kernel alone, under other launch shapes (a GPU diagnostic).

At 64k x 16 the kernel streams 134 MB of compressed keys/values and writes 17 MB of logits, the largest part of the
step (docs/decode.md, "Measured"). This probe times
optimized/kernels/decode_step_cmp.compressed_split_kernel on synthetic inputs of the paper layout (64 query heads in
4 KV groups, d = 128, l = 32, d = 16, bf16) with the lean step's launch (decode_step's BLOCK_N key-tile rows,
STEP_WARPS warps, CMP_STAGES stages, the policy's splits) and with other key-tile rows, warps, pipeline stages and
split counts, each with its achieved bandwidth (keys/values read + logits written; the step's append, which the
launch's first splits also do, writes a few KB). The logits of every variant must equal the lean launch's bitwise
(the same dot products; only the partials' split boundaries differ), so a variant is a drop-in launch change.

    python -m perf.decode_cmp_probe [--out DIR]   # on a GPU; prints a table, writes decode_cmp_probe.json
"""

from __future__ import annotations

import argparse
import itertools
import math
from pathlib import Path

import torch
import triton

from optimized.kernels.decode_splits import Partials
from optimized.kernels.decode_step import BLOCK_N, CMP_STAGES, STEP_WARPS, equal_shares
from optimized.kernels.decode_step_cmp import compressed_split_kernel
from optimized.numerics import LOG2E

from .outputs import DECODE_OUT, write_probe_report

HQ, HKV, D, CMP_BLOCK, CMP_STRIDE, WINDOW = 64, 4, 128, 32, 16, 512
LEAN = (BLOCK_N, STEP_WARPS, CMP_STAGES)  # the lean step's key-tile rows, warps and stages


def inputs(batch: int, context: int, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> dict:
    n_slots = (context - CMP_BLOCK) // CMP_STRIDE + 1
    g = torch.Generator(device=device).manual_seed(batch + context)
    k = torch.randn((batch, HKV, n_slots + 1, D), generator=g, device=device).to(dtype)
    v = torch.randn((batch, HKV, n_slots + 1, D), generator=g, device=device).to(dtype)
    q = torch.randn((batch, 1, HQ, D), generator=g, device=device).to(dtype)
    new = tuple(torch.randn((batch, 1, HKV, D), generator=g, device=device).to(dtype) for _ in range(6))

    def buffer(slots: int) -> torch.Tensor:  # a cache buffer the launch's append writes the step's token into
        return torch.zeros((batch, HKV, slots + 1, D), dtype=dtype, device=device)

    append = (*new, buffer(CMP_BLOCK), buffer(CMP_BLOCK), buffer(context), buffer(context), buffer(WINDOW),
              buffer(WINDOW))
    return {"q": q, "k": k, "v": v, "n_slots": n_slots, "rows": batch * HKV, "append": append,
            "lengths": torch.full((batch,), context - 1, dtype=torch.int64, device=device),  # before the step
            "n_new": torch.ones(batch, dtype=torch.int64, device=device)}


def launcher(x: dict, splits: int, block_n: int, warps: int, stages: int):
    """The kernel launched as lean_decode_step does, with these splits and launch shape; returns (run, logits)."""
    group, rows, n_slots = HQ // HKV, x["rows"], x["n_slots"]
    tiles_per_split, splits = equal_shares(-(-n_slots // block_n), splits)
    keys_per_split = tiles_per_split * block_n
    parts = Partials.empty(rows, splits, group, D, x["q"].device)
    logits = torch.empty((rows, group, n_slots), dtype=torch.float32, device=x["q"].device)
    q, k, v = x["q"], x["k"], x["v"]
    scale = 1.0 / math.sqrt(D)

    def run():
        compressed_split_kernel[(rows, splits)](
            q, k, v, x["lengths"], x["n_new"], logits, parts.o, parts.m, parts.l, parts.reads, *x["append"],
            q.stride(0), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
            n_slots, keys_per_split, splits, scale * LOG2E, scale,
            *(x["append"][i].shape[2] for i in (6, 8, 10)),  # the raw ring's, history's and window's slots + 1
            HKV=HKV, GROUP=group, DK=D, DV=D, BLOCK_H=group, BLOCK_DK=D, BLOCK_DV=D, BLOCK_N=block_n,
            CMP_BLOCK=CMP_BLOCK, CMP_STRIDE=CMP_STRIDE, STRICT=False, LOGIT_SCORES=False,
            DOT_FP32=q.dtype == torch.float32,
            num_warps=warps, num_stages=stages)
    return run, logits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="16x65536x4,1x65536x16", help="batch x context x the policy's splits")
    parser.add_argument("--block-n", default="32,64,128")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--stages", default="2,3")
    parser.add_argument("--splits-factor", default="1,2", help="splits as multiples of the policy's")
    parser.add_argument("--out", type=Path, default=DECODE_OUT,
                        help="writes decode_cmp_probe.json here (default reports/decode)")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    results = []
    for case in args.cases.split(","):
        batch, context, policy_splits = (int(v) for v in case.split("x"))
        x = inputs(batch, context, device)
        moved = x["rows"] * (x["n_slots"] * 2 * D * 2 + HQ // HKV * x["n_slots"] * 4)  # K/V read + logits written
        lean_run, lean_logits = launcher(x, policy_splits, *LEAN)
        lean_run()
        shapes = itertools.product((int(v) for v in args.block_n.split(",")), (int(v) for v in args.warps.split(",")),
                                   (int(v) for v in args.stages.split(",")),
                                   (int(v) for v in args.splits_factor.split(",")))
        for block_n, warps, stages, factor in shapes:
            splits = policy_splits * factor
            name = f"BLOCK_N {block_n} warps {warps} stages {stages} splits {splits}"
            try:
                run, logits = launcher(x, splits, block_n, warps, stages)
                us = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median") * 1e3
                same = bool(torch.equal(logits, lean_logits))
            except Exception as exc:  # e.g. out of shared memory: recorded, the sweep goes on
                results.append({"batch": batch, "context": context, "variant": name, "error": str(exc)[:160]})
                print(f"{batch:3d} x {context:6d}  {name:42s} {type(exc).__name__}", flush=True)
                continue
            lean = (block_n, warps, stages) == LEAN and factor == 1
            results.append({"batch": batch, "context": context, "block_n": block_n, "warps": warps,
                            "stages": stages, "splits": splits, "lean_launch": lean, "median_us": round(us, 2),
                            "tb_per_s": round(moved / us / 1e6, 3), "logits_equal_lean": same})
            print(f"{batch:3d} x {context:6d}  {name:42s} {us:8.2f} us  {moved / us / 1e6:5.2f} TB/s"
                  f"{'  (lean launch)' if lean else ''}{'' if same else '  LOGITS DIFFER'}", flush=True)
    write_probe_report(args.out, "decode_cmp_probe", "triton.testing.do_bench median (warmup 25 ms, "
                       "rep 100 ms), L2 not flushed (134 MB > 50 MB L2)", results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
