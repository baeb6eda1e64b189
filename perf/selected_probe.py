"""The selected-attention kernels (Eq. 12) at one T under other launch settings, beside the time it takes only to
load the key and value tiles they gather (a GPU diagnostic, like perf.prefill_probe for the range kernels).

What it times (triton.testing.do_bench: warm-up, L2 flushed before every run, median), bf16, in one of
perf.prefill_probe's LAYOUTS (--layout), --batch sequences of --seq-len tokens, n = 16 blocks of l' = 64 per
(query, KV group):
- `gather`: a kernel with the forward's grid, key tiles, launch settings and index reads that loads the same K and
  V tiles and only sums them: the bytes the query-centric kernels must move, T x Hkv x n x l' x (d_k + d_v) x 2 B
  (clipped at the causal edge), at the fastest the GPU moves them that way. Its sums are returned so a test can
  check it loads exactly the forward's keys;
- `forward`, `dq`, `dkdv`: selected_attention_forward, selected_attention_backward_dq and
  selected_attention_backward_dkdv under each launch setting of FORWARD_TILINGS, DQ_TILINGS and DKDV_TILINGS
  (the default, what optimized/kernels/common.py picks, is marked), with the largest difference from the default's
  result; a setting the GPU cannot launch (shared memory at wide heads) gives a row with its error instead.
Selections (--selections): `random`, every query's n blocks drawn at random among the visible ones with the
paper's forced blocks (block 0 and the query's own and previous block) included; or `same`, every query selecting
blocks 0..n-1 (the same tiles for every program, all L2 hits).

    python -m perf.selected_probe [--layout prod-125m] [--seq-len 16384] [--selections random]   # on a GPU
"""

from __future__ import annotations

import argparse
import functools
import math
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from optimized.kernels.common import (DkdvTiling, Tiling, dkdv_tiling, dq_tiling, forward_tiling, heads_per_query,
                                      key_tile_rows, padded, selected_block_keys)
from optimized.kernels.selected_attention import selected_attention_forward
from optimized.kernels.selected_attention_bwd import selected_attention_backward_dkdv, selected_attention_backward_dq

from .outputs import (add_probe_arguments, check_probe_arguments, launched, printed_rows, probe_timing,
                      write_probe_report)
from .prefill_probe import LAYOUTS
from .timing import bench_ms

SEL_BLOCK = 64
N_SEL = 16
# (key rows, warps, stages)
FORWARD_TILINGS = ((32, 1, 2), (32, 1, 3), (32, 2, 2), (64, 2, 2), (64, 2, 3), (64, 4, 2), (64, 4, 3), (64, 8, 2))
DQ_TILINGS = ((16, 1, 2), (16, 1, 3), (16, 2, 2), *FORWARD_TILINGS)  # 16-key tiles: fewer registers per warp
# (key rows, (query, head) columns, warps, stages)
DKDV_TILINGS = ((64, 128, 4, 2), (64, 64, 4, 2), (64, 32, 4, 2), (64, 64, 8, 2), (32, 64, 4, 2), (64, 64, 4, 3))


@triton.jit
def _gather_kernel(K, V, IDX, SUMS,
                   stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                   stride_ib, stride_it, stride_ih, stride_in, stride_sb, stride_st, stride_sh,
                   n_sel, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
                   SEL_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, TILES_PER_BLOCK: tl.constexpr):
    """The forward's loads without its arithmetic: program (query t, KV group g, batch b) walks the same
    (slot, key tile) loop over the same index entries and masks, and stores the column sums of what it loaded."""
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    dk_mask = offs_dk < DK
    dv_mask = offs_dv < DV
    k_base = K + b * stride_kb + g * stride_kh
    v_base = V + b * stride_vb + g * stride_vh
    idx_base = IDX + b * stride_ib + t * stride_it + g * stride_ih
    sum_k = tl.zeros([BLOCK_DK], dtype=tl.float32)
    sum_v = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for it in range(0, n_sel * TILES_PER_BLOCK):
        slot = it // TILES_PER_BLOCK
        tile = it % TILES_PER_BLOCK
        block = tl.load(idx_base + slot * stride_in).to(tl.int64)
        pos, key_mask = selected_block_keys(block, tile, 0, t, offs_n, SEL_BLOCK, BLOCK_N)
        kT = tl.load(k_base + pos[None, :] * stride_kt + offs_dk[:, None],
                     mask=key_mask[None, :] & dk_mask[:, None], other=0.0)
        v = tl.load(v_base + pos[:, None] * stride_vt + offs_dv[None, :],
                    mask=key_mask[:, None] & dv_mask[None, :], other=0.0)
        sum_k += tl.sum(kT.to(tl.float32), 1)
        sum_v += tl.sum(v.to(tl.float32), 0)
    sums = SUMS + b * stride_sb + t * stride_st + g * stride_sh
    tl.store(sums + offs_dk, sum_k, mask=dk_mask)
    tl.store(sums + DK + offs_dv, sum_v, mask=dv_mask)


def gather_only(k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, sel_block: int,
                tiling: Tiling) -> torch.Tensor:
    """Run _gather_kernel with the forward's grid and launch settings; fp32 [B, T, Hkv, d_k + d_v]: per (query,
    group), the sums of the key and value rows it loaded."""
    B, T, Hkv, n_sel = indices.shape
    dk, dv = k.shape[-1], v.shape[-1]
    sums = torch.empty((B, T, Hkv, dk + dv), device=k.device, dtype=torch.float32)
    _gather_kernel[(T, Hkv, B)](
        k, v, indices, sums, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        *indices.stride(), sums.stride(0), sums.stride(1), sums.stride(2), n_sel,
        DK=dk, DV=dv, BLOCK_DK=padded(dk), BLOCK_DV=padded(dv), SEL_BLOCK=sel_block, BLOCK_N=tiling.block_n,
        TILES_PER_BLOCK=math.ceil(sel_block / tiling.block_n), num_warps=tiling.num_warps,
        num_stages=tiling.num_stages)
    return sums


def selections(batch: int, T: int, n_kv_heads: int, n_sel: int, sel_block: int, kind: str,
               generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """int32 [batch, T, Hkv, n_sel], each row's blocks ascending and -1 padded. random: n_sel of the row's visible
    blocks 0..J (J = t // sel_block), block 0, J and J - 1 always among them; same: blocks 0..n_sel-1 (those
    visible)."""
    J = torch.arange(T, device=device) // sel_block
    n_blocks = int(J.max()) + 1 if T else 1
    blocks = torch.arange(n_blocks, device=device)
    visible = blocks[None, :] <= J[:, None]  # [T, n_blocks]
    if kind == "same":
        idx = torch.arange(n_sel, device=device).expand(batch, T, n_kv_heads, n_sel)
        return torch.where(idx <= J[None, :, None, None], idx, -1).to(torch.int32).contiguous()
    if kind != "random":
        raise ValueError(f"selections kind must be 'random' or 'same', got {kind!r}")
    rank = torch.rand((batch, T, n_kv_heads, n_blocks), generator=generator, device=device)
    forced = (blocks[None, :] == 0) | (blocks[None, :] == J[:, None]) | (blocks[None, :] == J[:, None] - 1)
    rank = torch.where(forced[None, :, None], 2.0, rank)
    rank = torch.where(visible[None, :, None], rank, -1.0)
    top = rank.topk(min(n_sel, n_blocks), dim=-1)
    idx = torch.where(top.values >= 0, top.indices, n_blocks)  # not visible -> sorts last
    idx = idx.sort(dim=-1).values
    idx = torch.where(idx >= n_blocks, -1, idx)
    if idx.shape[-1] < n_sel:
        idx = torch.cat([idx, idx.new_full(idx.shape[:-1] + (n_sel - idx.shape[-1],), -1)], dim=-1)
    return idx.to(torch.int32).contiguous()


def gathered_bytes(indices: torch.Tensor, sel_block: int, dk: int, dv: int, element_size: int) -> int:
    """Bytes of the key and value rows the query-centric kernels load: every selected block's keys up to the
    query (the causal edge clips the query's own block)."""
    T = indices.shape[1]
    t = torch.arange(T, device=indices.device)[None, :, None, None]
    keys = torch.where(indices >= 0, (t - indices.long() * sel_block + 1).clamp(0, sel_block), 0).sum()
    return int(keys) * (dk + dv) * element_size


def _inputs(cfg, T: int, batch: int, kind: str, device: torch.device, dtype: torch.dtype) -> dict:
    g = torch.Generator(device=device).manual_seed(T)

    def randn(*shape):
        return torch.randn(shape, generator=g, device=device).to(dtype)

    q = randn(batch, T, cfg.n_heads, cfg.head_dim_qk)
    k = randn(batch, T, cfg.n_kv_heads, cfg.head_dim_qk)
    v = randn(batch, T, cfg.n_kv_heads, cfg.head_dim_v)
    indices = selections(batch, T, cfg.n_kv_heads, N_SEL, SEL_BLOCK, kind, g, device)
    scale = 1.0 / math.sqrt(cfg.head_dim_qk)
    o, stats = selected_attention_forward(q, k, v, indices, SEL_BLOCK, scale)
    do = randn(*o.shape)
    delta = selected_attention_backward_dq(q, k, v, indices, o, stats, do, SEL_BLOCK, scale)[1]
    return {"q": q, "k": k, "v": v, "indices": indices, "scale": scale, "o": o, "stats": stats, "do": do,
            "delta": delta}


def _diff(a, b) -> float:
    pairs = zip(a, b) if isinstance(a, tuple) else ((a, b),)
    return max(float((x.float() - y.float()).abs().max()) for x, y in pairs)


def probe(x: dict, rep_ms: int) -> Iterator[dict]:
    """The rows of every kernel and launch setting, each yielded as soon as it is timed."""
    q, k, v, idx, scale = x["q"], x["k"], x["v"], x["indices"], x["scale"]
    o, stats, do, delta = x["o"], x["stats"], x["do"], x["delta"]
    group, dk, dv = q.shape[2] // k.shape[2], q.shape[-1], v.shape[-1]
    gb = gathered_bytes(idx, SEL_BLOCK, dk, dv, q.element_size()) / 1e9
    defaults = {"forward": forward_tiling(group, padded(dk), padded(dv), SEL_BLOCK, q.dtype),
                "dq": dq_tiling(group, padded(dk), padded(dv), SEL_BLOCK, q.dtype)}
    dkdv_default = dkdv_tiling(group, padded(dk), padded(dv), SEL_BLOCK, q.dtype)
    runs = {
        "gather": lambda t: gather_only(k, v, idx, SEL_BLOCK, t),
        "forward": lambda t: selected_attention_forward(q, k, v, idx, SEL_BLOCK, scale, tiling=t),
        "dq": lambda t: selected_attention_backward_dq(q, k, v, idx, o, stats, do, SEL_BLOCK, scale, t)[0],
    }
    for kernel, shapes in (("gather", FORWARD_TILINGS), ("forward", FORWARD_TILINGS), ("dq", DQ_TILINGS)):
        default = defaults["forward" if kernel == "gather" else kernel]
        tilings = [default] + [t for t in (Tiling(key_tile_rows(SEL_BLOCK, n), w, st) for n, w, st in shapes)
                               if t != default]
        reference = None
        for t in dict.fromkeys(tilings):  # the default first: the others are compared with its result
            row = {"probe": "selected", "kernel": kernel, "tiling": [t.block_n, t.num_warps, t.num_stages],
                   "default": t == default}
            run = functools.partial(runs[kernel], t)
            result, error = launched(run)
            if error is not None:  # a launch setting this GPU cannot run: a row that says so
                yield {**row, "ms": None, "error": error}
                continue
            reference = result if reference is None else reference
            ms = bench_ms(run, rep_ms)
            yield {**row, "ms": ms, "gathered_gb": gb, "gb_per_s": gb / ms * 1e3,
                   "max_abs_diff_vs_default": None if kernel == "gather" else _diff(result, reference)}
    reference = None
    tilings = [dkdv_default] + [DkdvTiling(key_tile_rows(SEL_BLOCK, n), cols, w, st) for n, cols, w, st in DKDV_TILINGS
                                if cols >= heads_per_query(group)]
    for t in dict.fromkeys(tilings):
        row = {"probe": "selected", "kernel": "dkdv", "tiling": [t.block_n, t.block_cols, t.num_warps, t.num_stages],
               "default": t == dkdv_default}

        def run():
            return selected_attention_backward_dkdv(q, k, v, idx, stats, delta, do, SEL_BLOCK, scale, t)

        result, error = launched(run)
        if error is not None:
            yield {**row, "ms": None, "error": error}
            continue
        reference = result if reference is None else reference
        ms = bench_ms(run, rep_ms)
        yield {**row, "ms": ms, "gathered_gb": gb, "gb_per_s": gb / ms * 1e3,
               "max_abs_diff_vs_default": _diff(result, reference)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_probe_arguments(parser, "selected_probe", LAYOUTS, seq_len=16384, rep_ms=200)
    parser.add_argument("--selections", choices=("random", "same"), default="random")
    args = parser.parse_args(argv)
    check_probe_arguments(parser, args)
    x = _inputs(LAYOUTS[args.layout], args.seq_len, args.batch, args.selections, torch.device("cuda"),
                torch.bfloat16)
    results = printed_rows(probe(x, args.rep_ms))
    write_probe_report(args.out, "selected_probe",
                       f"{probe_timing(args.rep_ms, args.layout, args.batch, args.seq_len)}, n = {N_SEL}, "
                       f"l' = {SEL_BLOCK}, {args.selections} selections", results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
