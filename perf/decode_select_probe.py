"""Where the lean decode step's select kernel spends its time (issue 6; a GPU diagnostic).

perf.decode_profile measured the select launch (optimized/kernels/decode_step_cmp._select_kernel) at 20-55 us, far
above its work. This probe times the kernel alone on synthetic inputs of the paper layout (16 heads per KV group,
l = 32, d = 16, l' = 64, n = 16) next to copies that differ in one place, so the differences say what each part
costs:

- full: the kernel as the lean step launches it (1 warp), and with 4 warps;
- tile: Eq. 8-10 as the kernel first did it, from a [heads, blocks] tile of the logits with one masked reduction
  over the head axis per head (same terms, same order);
- rounds: Eq. 11 as N_SEL rounds of int64 arg-max (top_n.take_top_n) instead of top_n_by_rank;
- no_top_n: the scores summed into one number instead of Eq. 11;
- top_n_only: Eq. 11 on scores made from the block index (no loads, no Eq. 8-10).
The lists of tile and rounds are compared with full's (equal unless the compiler fuses a multiply-add differently).

    python -m perf.decode_select_probe            # on a GPU; prints a table, writes decode_select_probe.json
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from optimized.kernels.decode_step_cmp import _chunk_scores, _eq9_term, _select_kernel
from optimized.kernels.decode_tiles import merge_stats, step_position, visible_cmp_count
from optimized.kernels.top_n import EMPTY, rank_key, take_top_n, top_n_by_rank

from .decode_bench import report_dir, write_probe_report

GROUP, HKV, N_SEL = 16, 4, 16
CMP_BLOCK, CMP_STRIDE, SEL_BLOCK = tl.constexpr(32), tl.constexpr(16), tl.constexpr(64)  # l, d, l' (read by kernels)
N_INIT, N_LOCAL = tl.constexpr(1), tl.constexpr(2)
EQ9_FIRST, EQ9_BAND = -1, 5  # masks.eq9_pool_weights for l = 32, d = 16, l' = 64: offsets -1..3


@triton.jit
def _tile_scores(logits, j, ok, lse2, n_visible, n_slots, offs_h, GROUP: tl.constexpr, SCORE_BLOCK: tl.constexpr,
                 EQ9_FIRST: tl.constexpr, EQ9_BAND: tl.constexpr):
    """Eq. 8-10 from [heads, blocks] tiles: the kernel's Eq. 9 terms over every head's row at once (2-D loads),
    then one masked reduction over the head axis per head."""
    rows = logits + offs_h[:, None] * n_slots  # [GROUP, 1]: each head's row of the logits
    pooled = _eq9_term(rows, j, ok, lse2[:, None], n_visible, EQ9_FIRST, CMP_BLOCK, CMP_STRIDE, SEL_BLOCK, False)
    for k in tl.static_range(1, EQ9_BAND):
        pooled = pooled + _eq9_term(rows, j, ok, lse2[:, None], n_visible, EQ9_FIRST + k, CMP_BLOCK, CMP_STRIDE,
                                    SEL_BLOCK, False)
    total = tl.zeros([SCORE_BLOCK], dtype=tl.float32)
    for h in range(GROUP):
        total = total + tl.sum(tl.where(offs_h[:, None] == h, pooled, 0.0), 0)
    return total


@triton.jit
def _select_variant_kernel(
    LENGTHS, N_NEW, LOGITS, M_PART, L_PART, R_PART, LISTS, SINK,
    n_slots, n_cmp_split, blocks_per_list, n_lists,
    HKV: tl.constexpr, GROUP: tl.constexpr, N_SEL: tl.constexpr, N_PAD: tl.constexpr,
    EQ9_FIRST: tl.constexpr, EQ9_BAND: tl.constexpr, SCORE_BLOCK: tl.constexpr, CMP_SPLITS: tl.constexpr,
    TILE: tl.constexpr, TOP_N: tl.constexpr, SCORES: tl.constexpr,
):
    """_select_kernel for the paper layout with switches: TILE (Eq. 8-10 from 2-D tiles), TOP_N (0: none, 1: by
    rank, 2: rounds), SCORES (False: scores from the block index)."""
    row = tl.program_id(0).to(tl.int64)
    b = row // HKV
    p, held = step_position(LENGTHS, N_NEW, b)
    offs_h = tl.arange(0, GROUP)
    m_i, l_i, _ = merge_stats(M_PART, L_PART, R_PART, row * n_cmp_split, n_cmp_split, GROUP, CMP_SPLITS)
    lse2 = m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0))
    n_visible = tl.minimum(visible_cmp_count(p, held, CMP_BLOCK, CMP_STRIDE, False), n_slots)
    logits = LOGITS + row * GROUP * n_slots
    J = tl.where(p >= 0, p // SEL_BLOCK, -1)
    first = tl.program_id(1) * blocks_per_list
    stop = tl.minimum(first + blocks_per_list, J + 1).to(tl.int32)
    best = tl.full([N_PAD], EMPTY, dtype=tl.int64)
    sink = tl.zeros([SCORE_BLOCK], dtype=tl.float32)
    for start in range(first, stop, SCORE_BLOCK):
        j = start + tl.arange(0, SCORE_BLOCK)
        ok = j < stop
        if not SCORES:
            total = ((j * 7919) % 1009).to(tl.float32)
        elif TILE:
            total = _tile_scores(logits, j, ok, lse2, n_visible, n_slots, offs_h, GROUP, SCORE_BLOCK, EQ9_FIRST,
                                 EQ9_BAND)
        else:
            total = _chunk_scores(logits, j, ok, lse2, n_visible, n_slots, GROUP, GROUP, SCORE_BLOCK, EQ9_FIRST,
                                  EQ9_BAND, CMP_BLOCK, CMP_STRIDE, SEL_BLOCK, False)
        if TOP_N == 0:
            sink += tl.where(ok, total, 0.0)
        else:
            cand = tl.where(ok, rank_key(total, j, J, N_INIT, N_LOCAL), EMPTY)
            if TOP_N == 1:
                best = top_n_by_rank(cand, best, N_SEL, N_PAD)
            else:
                best = take_top_n(cand, best, N_SEL, N_PAD)
    tl.store(LISTS + (row * n_lists + tl.program_id(1)) * N_PAD + tl.arange(0, N_PAD), best)
    tl.store(SINK + (row * n_lists + tl.program_id(1)) * SCORE_BLOCK + tl.arange(0, SCORE_BLOCK), sink)


VARIANTS = {  # name: (kernel switches, warps)
    "full (1 warp)": (None, 1),
    "full (4 warps)": (None, 4),
    "tile": ({"TILE": True}, 1),
    "rounds": ({"TOP_N": 2}, 1),
    "no_top_n": ({"TOP_N": 0}, 1),
    "top_n_only": ({"SCORES": False}, 1),
}
COMPARED = ("tile", "rounds")  # variants whose lists should equal full's


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
    switches, warps = VARIANTS[variant]
    blocks_per_list = -(-x["n_blocks"] // lists)
    score_block = min(64, triton.next_power_of_2(blocks_per_list))
    out = torch.empty((x["rows"], lists, 16), dtype=torch.int64, device=x["logits"].device)
    sink = torch.empty((x["rows"], lists, score_block), dtype=torch.float32, device=x["logits"].device)
    common = (x["lengths"], x["n_new"], x["logits"], x["m"], x["l"], x["reads"], out)
    if switches is None:
        def run():
            _select_kernel[(x["rows"], lists)](
                *common, x["n_slots"], splits, blocks_per_list, lists,
                HKV=HKV, GROUP=GROUP, BLOCK_H=16, CMP_BLOCK=CMP_BLOCK, CMP_STRIDE=CMP_STRIDE, SEL_BLOCK=SEL_BLOCK,
                N_INIT=N_INIT, N_LOCAL=N_LOCAL, N_SEL=N_SEL, N_PAD=16, STRICT=False, LOGIT_SCORES=False, MEAN=False,
                EQ9_FIRST=EQ9_FIRST, EQ9_BAND=EQ9_BAND, SCORE_BLOCK=score_block,
                CMP_SPLITS=triton.next_power_of_2(splits), num_warps=warps, num_stages=1)
    else:
        kw = {"TILE": False, "TOP_N": 1, "SCORES": True, **switches}

        def run():
            _select_variant_kernel[(x["rows"], lists)](
                *common, sink, x["n_slots"], splits, blocks_per_list, lists,
                HKV=HKV, GROUP=GROUP, N_SEL=N_SEL, N_PAD=16, EQ9_FIRST=EQ9_FIRST, EQ9_BAND=EQ9_BAND,
                SCORE_BLOCK=score_block, CMP_SPLITS=triton.next_power_of_2(splits), num_warps=warps, num_stages=1,
                **kw)
    return run, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="1x65536x16x16,16x65536x16x4,16x131072x16x4",
                        help="batch x context x lists x compressed splits, comma-separated")
    parser.add_argument("--out", default=None)
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
            same = None
            if variant.startswith("full"):
                reference = out.clone() if reference is None else reference
            elif variant in COMPARED:
                same = bool(torch.equal(out, reference))
            results.append({"batch": batch, "context": context, "lists": lists, "cmp_splits": splits,
                            "variant": variant, "median_us": round(us, 2), "lists_equal_full": same})
            print(f"{batch:3d} x {context:6d} lists {lists:2d} splits {splits:2d}  {variant:16s} {us:8.2f} us"
                  + ("" if same is None else f"  lists equal to full: {same}"), flush=True)
    write_probe_report(report_dir(args.out), "decode_select_probe",
                       "triton.testing.do_bench median (warmup 25 ms, rep 200 ms), L2 not flushed", results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
