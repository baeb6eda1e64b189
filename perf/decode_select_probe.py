"""Where the lean decode step's selection (Eq. 8-11) spends its time (a GPU diagnostic).

The lean step scores the selection blocks in one launch (optimized/kernels/decode_step_cmp.score_kernel, Eq. 8-10
into an fp32 [rows, blocks] buffer) and ranks them in another (select_kernel, Eq. 11 lists). Before, one
one-warp kernel did both; perf.decode_profile measured it at 25-30 us at 64k x 16, latency-bound. This probe times
on synthetic inputs of the paper layout (16 heads per KV group, l = 32, d = 16, l' = 64, n = 16):

- step: the two launches as the lean step runs them; score only / select only: each launch alone;
- select only, W warps: the select launch with W warps per program (Eq. 11 by top_n.top_n_by_rank's comparison
  matrices instead of the bitonic top-k measured 12.0 against 7.3 us at 64k x 16: perf/NOTES.md);
- scores B / W: the two launches with B selection blocks per score program and W warps;
- one launch: the previous single kernel (1 warp: scoring and ranking in one program).
Every variant's lists are compared with the step's (equal unless the compiler fuses a multiply-add differently).

    python -m perf.decode_select_probe [--out DIR]  # on a GPU; prints a table, writes decode_select_probe.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import triton
import triton.language as tl

from optimized.kernels import decode_step
from optimized.kernels.decode_step_cmp import chunk_scores, score_kernel, select_kernel
from optimized.kernels.decode_tiles import merge_stats, step_position, visible_cmp_count
from optimized.kernels.top_n import EMPTY, rank_key, top_n_by_rank

from .outputs import DECODE_OUT, write_probe_report

GROUP, HKV, N_SEL = 16, 4, 16
CMP_BLOCK, CMP_STRIDE, SEL_BLOCK = tl.constexpr(32), tl.constexpr(16), tl.constexpr(64)  # l, d, l' (read by kernels)
N_INIT, N_LOCAL = tl.constexpr(1), tl.constexpr(2)
EQ9_FIRST, EQ9_BAND = -1, 5  # masks.eq9_pool_weights for l = 32, d = 16, l' = 64: offsets -1..3


@triton.jit
def _one_launch_kernel(
    LENGTHS, N_NEW, LOGITS, M_PART, L_PART, R_PART, LISTS,
    n_slots, n_cmp_split, blocks_per_list, n_lists,
    HKV: tl.constexpr, GROUP: tl.constexpr, N_SEL: tl.constexpr, N_PAD: tl.constexpr,
    EQ9_FIRST: tl.constexpr, EQ9_BAND: tl.constexpr, SCORE_BLOCK: tl.constexpr, CMP_SPLITS: tl.constexpr,
):
    """The lean step's selection as one kernel (before the score / select split), paper layout: each program
    scores its share of the blocks in chunks (Eq. 8-10 head by head) and ranks each
    chunk into its list (Eq. 11)."""
    row = tl.program_id(0).to(tl.int64)
    b = row // HKV
    p, held = step_position(LENGTHS, N_NEW, b)
    m_i, l_i, _ = merge_stats(M_PART, L_PART, R_PART, row * n_cmp_split, n_cmp_split, GROUP, CMP_SPLITS)
    lse2 = m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0))
    n_visible = tl.minimum(visible_cmp_count(p, held, CMP_BLOCK, CMP_STRIDE, False), n_slots)
    logits = LOGITS + row * GROUP * n_slots
    J = tl.where(p >= 0, p // SEL_BLOCK, -1)
    first = tl.program_id(1) * blocks_per_list
    stop = tl.minimum(first + blocks_per_list, J + 1).to(tl.int32)
    best = tl.full([N_PAD], EMPTY, dtype=tl.int64)
    for start in range(first, stop, SCORE_BLOCK):
        j = start + tl.arange(0, SCORE_BLOCK)
        ok = j < stop
        total = chunk_scores(logits, j, ok, lse2, n_visible, n_slots, GROUP, GROUP, SCORE_BLOCK, EQ9_FIRST,
                              EQ9_BAND, CMP_BLOCK, CMP_STRIDE, SEL_BLOCK, False)
        best = top_n_by_rank(tl.where(ok, rank_key(total, j, J, N_INIT, N_LOCAL), EMPTY), best, N_SEL, N_PAD)
    tl.store(LISTS + (row * n_lists + tl.program_id(1)) * N_PAD + tl.arange(0, N_PAD), best)


# name: (what runs, (blocks per score program, score warps), select warps); "launches": score + select as the step
# runs them, "score" / "select": one of them alone, "one launch": the previous single kernel
STEP_SCORE = (decode_step.SCORE_BLOCK, decode_step.SCORE_WARPS)
VARIANTS = {
    "step": ("launches", STEP_SCORE, decode_step.SELECT_WARPS),
    "score only": ("score", STEP_SCORE, decode_step.SELECT_WARPS),
    "select only": ("select", STEP_SCORE, decode_step.SELECT_WARPS),
    "select only, 2 warps": ("select", STEP_SCORE, 2),
    "select only, 4 warps": ("select", STEP_SCORE, 4),
    "scores 64 / 4 warps": ("launches", (64, 4), decode_step.SELECT_WARPS),
    "scores 128 / 4 warps": ("launches", (128, 4), decode_step.SELECT_WARPS),
    "one launch": ("one launch", STEP_SCORE, decode_step.SELECT_WARPS),  # the tilings do not apply
}


def inputs(batch: int, context: int, splits: int, device: torch.device) -> dict:
    rows = batch * HKV
    n_slots = int((context - CMP_BLOCK) // CMP_STRIDE + 1)
    g = torch.Generator(device=device).manual_seed(batch * 7 + context)
    logits = torch.randn((rows, GROUP, n_slots), generator=g, device=device) * 4.0
    m = torch.randn((rows, splits, GROUP), generator=g, device=device) + 6.0
    l = torch.rand((rows, splits, GROUP), generator=g, device=device) * 50.0 + 1.0
    reads = torch.full((rows, splits), 1, dtype=torch.int32, device=device)
    lengths = torch.full((batch,), context, dtype=torch.int64, device=device)
    return {"rows": rows, "n_slots": n_slots, "logits": logits, "m": m, "l": l, "reads": reads, "lengths": lengths,
            "n_new": torch.ones(batch, dtype=torch.int64, device=device), "n_blocks": int(context // SEL_BLOCK)}


def launcher(x: dict, lists: int, splits: int, variant: str):
    """(run, lists): a callable that launches the variant and the [rows, lists, N_PAD] lists it writes."""
    kind, (score_block, score_warps), select_warps = VARIANTS[variant]
    device = x["logits"].device
    n_blocks = x["n_blocks"]
    blocks_per_list = -(-n_blocks // lists)
    rank_block = min(decode_step.RANK_BLOCK, triton.next_power_of_2(blocks_per_list))
    out = torch.empty((x["rows"], lists, 16), dtype=torch.int64, device=device)
    scores = torch.empty((x["rows"], n_blocks), dtype=torch.float32, device=device)
    stats = (x["lengths"], x["n_new"], x["logits"], x["m"], x["l"], x["reads"])
    if kind == "one launch":
        def run():
            _one_launch_kernel[(x["rows"], lists)](
                *stats, out, x["n_slots"], splits, blocks_per_list, lists, HKV=HKV, GROUP=GROUP, N_SEL=N_SEL,
                N_PAD=16, EQ9_FIRST=EQ9_FIRST, EQ9_BAND=EQ9_BAND, SCORE_BLOCK=rank_block,
                CMP_SPLITS=triton.next_power_of_2(splits), num_warps=1, num_stages=1,
                enable_fp_fusion=False)
        return run, out

    def score():
        score_kernel[(x["rows"], -(-n_blocks // score_block))](
            *stats, scores, x["n_slots"], splits, n_blocks,
            HKV=HKV, GROUP=GROUP, BLOCK_H=16, CMP_BLOCK=CMP_BLOCK, CMP_STRIDE=CMP_STRIDE, SEL_BLOCK=SEL_BLOCK,
            STRICT=False, LOGIT_SCORES=False, MEAN=False, EQ9_FIRST=EQ9_FIRST, EQ9_BAND=EQ9_BAND,
            SCORE_BLOCK=score_block, CMP_SPLITS=triton.next_power_of_2(splits), num_warps=score_warps, num_stages=1,
            enable_fp_fusion=False)

    def select():
        select_kernel[(x["rows"], lists)](
            x["lengths"], x["n_new"], scores, out, n_blocks, blocks_per_list, lists,
            HKV=HKV, SEL_BLOCK=SEL_BLOCK, N_INIT=N_INIT, N_LOCAL=N_LOCAL, N_SEL=N_SEL, N_PAD=16,
            RANK_BLOCK=rank_block, num_warps=select_warps, num_stages=1)

    if kind in ("score", "select"):  # one launch timed; both run once first, so the lists come out either way
        score()
        select()
        return (score if kind == "score" else select), out

    def run():
        score()
        select()
    return run, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="1x65536x16x16,16x65536x16x4,16x131072x16x4",
                        help="batch x context x lists x compressed splits, comma-separated")
    parser.add_argument("--out", type=Path, default=DECODE_OUT,
                        help="writes decode_select_probe.json here (default reports/decode)")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    results = []
    for case in args.cases.split(","):
        batch, context, lists, splits = (int(v) for v in case.split("x"))
        x = inputs(batch, context, splits, device)
        reference = None
        for variant in VARIANTS:
            run, out = launcher(x, lists, splits, variant)
            us = triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median") * 1e3
            if reference is None:
                reference = out.clone()  # "step" comes first
            same = bool(torch.equal(out, reference))
            results.append({"batch": batch, "context": context, "lists": lists, "cmp_splits": splits,
                            "variant": variant, "median_us": round(us, 2), "lists_equal_step": same})
            print(f"{batch:3d} x {context:6d} lists {lists:2d} splits {splits:2d}  {variant:22s} {us:8.2f} us"
                  f"  lists equal to step: {same}", flush=True)
    write_probe_report(args.out, "decode_select_probe",
                       "triton.testing.do_bench median (warmup 25 ms, rep 200 ms), L2 not flushed", results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
