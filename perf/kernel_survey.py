"""Registers and stack (spills) of the lean decode kernels and the prefill range and selected-attention kernels
compiled for an H100 (sm_90) without a GPU, and whether the pipelined launches load their tiles asynchronously.

Triton compiles a kernel for GPUTarget("cuda", 90, 32) with the ptxas it ships, and the cuobjdump it ships reads
the cubin's resource usage. Pointers and the integer arguments a real launch specialises get divisibility-16 hints,
as at a launch. Must run without TRITON_INTERPRET (the interpreter replaces triton.jit functions).

Why: a version of the lean step's gate kernel that unrolled 24-32 [16 x 128] fp32 tiles measured 40-56 us at batch 1
on an H100 (perf/NOTES.md); its sm_90 compile used 5-8 KB of stack per thread. The cases below
are the launches of optimized/kernels/decode_step.py at the paper layout (16 heads per KV group, d_v = 128,
l = 32, d = 16, l' = 64, n = 16) that matter for speed, the prefill range kernels' launches (prefill_cases), the
selected-attention kernels' (selected_cases) and Eq. 7's and the gate MLP's kernels (mlp_cases);
`--require-no-spill` fails if any of them spills beyond what its launch was measured fastest with (the paper
layout's range dk/dv tile: 8 bytes, against a no-spill tile 8% slower; common.RANGE_MEASURED_STACK; the selected
dq and dk/dv launches: SELECTED_MEASURED_STACK).
`--require-pipelined` fails if a launch with num_stages > 1 leaves a tile load inside a loop synchronous: the
selected dq kernel once loaded its key tile in a layout its second dot could not use from shared memory, Triton's
pipeliner left that load synchronous, and the kernel ran 1.3x-1.5x slower (perf/NOTES.md).

    python -m perf.kernel_survey [--require-no-spill] [--require-pipelined]
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@dataclass(frozen=True)
class Case:
    name: str
    kernel: object  # a triton.jit function
    pointers: dict  # argument -> Triton pointer type ("*bf16", ...)
    constexprs: dict
    num_warps: int
    num_stages: int = 1
    measured_stack: int = 0  # bytes of stack per thread a launch was measured fastest with (--require-no-spill's bound)


def compile_sm90(case: Case):
    """triton.compile of case for sm_90: pointer arguments typed as given, other runtime arguments i32 (fp32 when
    named scale*), divisibility-16 hints on pointers and strides."""
    params = list(inspect.signature(case.kernel.fn).parameters)
    signature, attrs = {}, {}
    for i, name in enumerate(params):
        if name in case.constexprs:
            signature[name] = "constexpr"
        elif name in case.pointers:
            signature[name] = case.pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32" if name.startswith("scale") else "i32"
            if name.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    missing = set(case.constexprs) - set(params)
    if missing:
        raise ValueError(f"{case.name}: {sorted(missing)} are not parameters of {case.kernel.fn.__name__}")
    source = ASTSource(fn=case.kernel, signature=signature,
                       constexprs={(params.index(k),): v for k, v in case.constexprs.items()}, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": case.num_warps, "num_stages": case.num_stages})


def resources(compiled) -> dict[str, int]:
    """REG and STACK (bytes per thread) of a compiled kernel's cubin, read by Triton's bundled cuobjdump."""
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        text = subprocess.run([str(cuobjdump), "-res-usage", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    found = dict(re.findall(r"(REG|STACK):(\d+)", text))
    if set(found) != {"REG", "STACK"}:
        raise RuntimeError(f"cuobjdump -res-usage printed no REG/STACK:\n{text}")
    return {"registers": int(found["REG"]), "stack_bytes": int(found["STACK"])}


# Bytes of stack per thread a selected-attention launch (kind, BLOCK_DK + BLOCK_DV) was measured fastest with
# (perf.selected_probe, reports/perf/selected_launch): the paper layout's dq at one warp (255 registers; 2 warps or
# wider key tiles measured slower) and dk/dv at 32 columns (no other setting within 20% at 64k tokens); prod-125m's
# dk/dv at 128 columns (in the prod-125m training step 2-4% faster than the 64-column settings at 2k and 16k; with
# the group's 6 heads unpadded, 21 queries per step, 7-10% faster again and 280 bytes of stack), and its dq with
# the heads as columns at 32 keys, 3 stages (8 bytes under Triton 3.7; 1.05 ms at 16k tokens against 1.12 at 16 keys,
# 2 stages, which spills nothing; perf/NOTES.md); the paper's d_k = 192 / d_v = 128 dk/dv on 4 warps (72 bytes under
# Triton 3.7 with d_k read as 128 + 64, 48 padded to 256, which was as fast at 16k tokens and 2.5% slower at 64k; 8
# warps spill nothing but took 1.2-1.5x as long at 8k-64k tokens).
SELECTED_MEASURED_STACK = {("dq", 256): 32, ("dq", 128): 8, ("dkdv", 256): 96, ("dkdv", 128): 280, ("dkdv", 384): 72}


def lean_cases() -> list[Case]:
    from optimized.kernels import decode_step
    from optimized.kernels.decode_step_cmp import score_kernel, select_kernel
    from optimized.kernels.decode_step_sparse import gate_kernel

    gate_pointers = {name: "*fp32" for name in ("O_PART", "M_PART", "L_PART", "O_CPART", "M_CPART", "L_CPART")}
    gate_pointers.update({name: "*i32" for name in ("R_PART", "R_CPART")})
    gate_pointers.update({name: "*bf16" for name in ("GATES", "O", "O_CMP", "O_SLC", "O_WIN")})
    gate_pointers.update({name: "*i64" for name in ("LENGTHS", "N_NEW", "READS_CMP", "READS_SLC", "READS_WIN")})
    score_pointers = {"LENGTHS": "*i64", "N_NEW": "*i64", "LOGITS": "*fp32", "M_PART": "*fp32", "L_PART": "*fp32",
                      "R_PART": "*i32", "SCORES": "*fp32"}
    select_pointers = {"LENGTHS": "*i64", "N_NEW": "*i64", "SCORES": "*fp32", "LISTS": "*i64"}
    cases = []
    for cmp_splits, splits in ((4, 4), (16, 8), (32, 8)):  # 64k x 16; 64k x 1; 128k x 1 (next powers of two)
        cases.append(Case(f"gate, {cmp_splits} compressed / {splits} sparse splits", gate_kernel, gate_pointers,
                          dict(HKV=4, GROUP=16, DV=128, BLOCK_H=16, BLOCK_DV=128, TILE_DV=decode_step.GATE_TILE_DV,
                               CMP_SPLITS=cmp_splits, SPLITS=splits, MERGE_CHUNK=decode_step.MERGE_CHUNK),
                          decode_step.STEP_WARPS))
    for cmp_splits in (4, 16, 32):
        cases.append(Case(f"score, {cmp_splits} compressed splits", score_kernel, score_pointers,
                          dict(HKV=4, GROUP=16, BLOCK_H=16, CMP_BLOCK=32, CMP_STRIDE=16, SEL_BLOCK=64, STRICT=False,
                               LOGIT_SCORES=False, MEAN=False, EQ9_FIRST=-1, EQ9_BAND=5,
                               SCORE_BLOCK=decode_step.SCORE_BLOCK, CMP_SPLITS=cmp_splits),
                          decode_step.SCORE_WARPS))
    cases.append(Case("select (Eq. 11 lists)", select_kernel, select_pointers,
                      dict(HKV=4, SEL_BLOCK=64, N_INIT=1, N_LOCAL=2, N_SEL=16, N_PAD=16,
                           RANK_BLOCK=decode_step.RANK_BLOCK), decode_step.SELECT_WARPS))
    return cases


# Triton pointer types of the prefill kernels' pointer arguments, by argument name (bf16 launches).
PREFILL_POINTERS = {
    **{name: "*bf16" for name in ("Q", "K", "V", "O", "DO", "DQ", "DKEY", "DVAL", "DK_OUT", "DV_OUT")},
    **{name: "*fp32" for name in ("LSE2", "P", "DELTA", "STATS", "DK_WS", "DV_WS")},
    **{name: "*i32" for name in ("LO", "HI", "QFIRST", "QLAST", "IDX", "DOC_START", "QUERY_ROWS", "ITEM_KEY",
                                 "ITEM_BEGIN", "ITEM_END", "ITEM_SLOT", "BLOCK_BASE", "BLOCK_END")},
}


def pointers(kernel) -> dict:
    """PREFILL_POINTERS for the pointer arguments the kernel takes."""
    params = inspect.signature(kernel.fn).parameters
    return {name: kind for name, kind in PREFILL_POINTERS.items() if name in params}


# (heads per KV group, d_k, d_v) of the prefill launches surveyed: the paper sweep's layout, prod-125m's and the
# paper's own head dims (NSAConfig's defaults)
PREFILL_LAYOUTS = ((16, 128, 128), (6, 64, 64), (16, 192, 128))


def layout_name(group: int, dk: int, dv: int) -> str:
    """How a case names its layout: "G=16 d=128", or "G=16 d_k=192 d_v=128" where the head dims differ."""
    return f"G={group} d={dk}" if dk == dv else f"G={group} d_k={dk} d_v={dv}"


def prefill_cases() -> list[Case]:
    """The range-kernel path's launches with the tiles optimized/kernels/common.py picks (bf16), at the paper layout
    (16 heads per KV group, d_k = d_v = 128, and the paper's own d_k = 192 / d_v = 128) and prod-125m's (6 per
    group, d = 64): the group-scores kernel, the range forward (also on the tiles it takes for short and long ranges
    where they differ), dq (consistent D) and dk/dv."""
    from optimized.kernels.common import (LONG_RANGE, RANGE_MEASURED_STACK, SHORT_RANGE, head_dim_tiles, packed_heads,
                                          padded, range_tiling)
    from optimized.kernels.range_attention import _range_attention_fwd_kernel
    from optimized.kernels.range_attention_bwd import _range_attention_dkdv_kernel, _range_attention_dq_kernel
    from optimized.kernels.selection import _group_scores_kernel

    import torch

    cases = []
    for group, dk, dv in PREFILL_LAYOUTS:
        bdk, bdv = padded(dk), padded(dv)
        first, second = head_dim_tiles(dk)  # as the launches read the head dim
        dims = dict(DK=dk, BLOCK_DK=first, BLOCK_DK2=second, DOT_FP32=False, INPUT_PRECISION="ieee")
        attn = dict(GROUP=group, DV=dv, BLOCK_DV=bdv, **dims)
        layout = layout_name(group, dk, dv)

        def tiles(kind: str, max_width: int | None = None):
            t = range_tiling(bdk, bdk if kind == "scores" else bdv, torch.bfloat16, kind, max_width)
            return t, dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n)

        t, _ = tiles("scores")
        group_pad = triton.next_power_of_2(group)
        rows = max(1, t.block_m // group_pad)  # as selection.group_scores launches it
        cases.append(Case(f"prefill {layout} group_scores {t.block_m}x{t.block_n}", _group_scores_kernel,
                          pointers(_group_scores_kernel),
                          dict(GROUP=group, GROUP_PAD=group_pad, ROWS=rows, BLOCK_M=rows * group_pad,
                               BLOCK_N=t.block_n, LOGITS=False, **dims), t.num_warps, t.num_stages))
        launches = [("forward", None, _range_attention_fwd_kernel, dict(WITH_OUTPUT=True))]
        launches += [("forward", width, _range_attention_fwd_kernel, dict(WITH_OUTPUT=True))
                     for width in (SHORT_RANGE, LONG_RANGE) if tiles("forward", width)[0] != tiles("forward")[0]]
        launches += [("dq", None, _range_attention_dq_kernel, dict(CONSISTENT_D=True)),
                     ("dk/dv", None, _range_attention_dkdv_kernel, dict(COMPENSATED=False))]
        for kind, width, kernel, flags in launches:
            table_kind = kind.replace("/", "")
            t, shape = tiles(table_kind, width)
            heads = packed_heads(t, group)  # as the launches take it
            ranges = "" if width is None else f" ({'short' if width == SHORT_RANGE else 'long'} ranges)"
            cases.append(Case(f"prefill {layout} range {kind}{ranges} {t.block_m}x{t.block_n}, {heads} heads",
                              kernel, pointers(kernel), dict(HEADS=heads, **flags, **shape, **attn), t.num_warps,
                              t.num_stages, measured_stack=RANGE_MEASURED_STACK.get((table_kind, bdk + bdv), 0)))
    return cases


def mlp_cases() -> list[Case]:
    """Eq. 7's MLP kernels (prod-125m and the paper: l = 32, d = 16, d = 64 features, 64 hidden) and the gate MLP's
    backward kernel (768 hidden, 12 heads x 3 gates), bf16, with the launch settings their modules use."""
    from optimized.kernels import compression_mlp as phi
    from optimized.kernels import gate_mlp as gate

    bf16, f32 = "*bf16", "*fp32"
    dims = dict(D=64, HID=64, BLOCK_D=64, BLOCK_HID=64, DOT_FP32=False, INPUT_PRECISION="ieee")
    block_m, block_h, warps = gate.BACKWARD_LAUNCH
    return [
        Case("mlp phi forward", phi._phi_fwd_kernel, dict(X=bf16, W1=bf16, C=f32, W2=bf16, B2=f32, PHI=f32, PRE=f32),
             dict(L=32, STRIDE=16, BLOCK_N=phi.BLOCKS_PER_TILE, **dims), 4),
        Case("mlp phi backward d pre", phi._phi_bwd_hidden_kernel,
             dict(D_OUT=f32, PRE=f32, W2=bf16, D_PRE=f32, DB1_PART=f32, DB2_PART=f32, DW2_PART=f32),
             dict(BLOCK_N=phi.BLOCKS_PER_TILE, **dims), 4),
        Case("mlp phi backward d w1", phi._phi_bwd_w1_kernel, dict(X=bf16, D_PRE=f32, DW1=f32),
             dict(STRIDE=16, BLOCK_N=phi.BLOCKS_PER_TILE, **dims), 4),
        Case("mlp phi backward d x", phi._phi_bwd_x_kernel, dict(D_PRE=f32, W1=bf16, DX=bf16),
             dict(M=2, STRIDE=16, BLOCK_J=phi.ROWS_PER_TILE, **dims), 4),
        Case("mlp gate backward", gate._gate_mlp_bwd_kernel,
             dict(PRE=bf16, D_LOGITS=bf16, W2=bf16, D_PRE=bf16, H=bf16, DB1_PART=f32),
             dict(BLOCK_M=block_m, BLOCK_H=block_h, BLOCK_O=64, DOT_FP32=False, INPUT_PRECISION="ieee"), warps),
    ]


def selected_cases() -> list[Case]:
    """The selected-attention kernels' launches with the tilings optimized/kernels/common.py picks (bf16), at the
    paper layout (d = 128, and the paper's own d_k = 192 / d_v = 128) and prod-125m's (l' = 64): the forward, dq and
    dk/dv."""
    import torch

    from optimized.kernels.common import (dkdv_tiling, dq_head_dim_tiles, dq_head_tile, dq_tiling, forward_head_tile,
                                          forward_tiling, head_dim_tiles, padded)
    from optimized.kernels.selected_attention import _selected_attention_fwd_kernel
    from optimized.kernels.selected_attention_bwd import (_selected_attention_bwd_dkdv_kernel,
                                                          _selected_attention_bwd_dq_kernel)

    cases = []
    sel_block = 64
    for group, dk, dv in PREFILL_LAYOUTS:
        layout = layout_name(group, dk, dv)
        bdk, bdv = padded(dk), padded(dv)
        width = max(bdk, bdv)
        dq_h, dq_axis, head_rows, copies = dq_head_tile(group, True, width)  # as the launches take them
        block_h = {"forward": forward_head_tile(group, width)[0], "dq": dq_h}
        first, second = head_dim_tiles(dk)  # as the launches read the head dim
        dims = dict(GROUP=group, DK=dk, DV=dv, SEL_BLOCK=sel_block, BLOCK_DK=first, BLOCK_DK2=second, BLOCK_DV=bdv,
                    DOT_FP32=False, INPUT_PRECISION="ieee", PACKED=False)
        dq_first, dq_second = dq_head_dim_tiles(dk, copies)
        bf16 = torch.bfloat16
        launches = (("forward", _selected_attention_fwd_kernel, forward_tiling(group, bdk, bdv, sel_block, bf16),
                     dict(KEY_AXIS=forward_head_tile(group, width)[1])),
                    ("dq", _selected_attention_bwd_dq_kernel, dq_tiling(group, bdk, bdv, sel_block, bf16),
                     dict(SPLIT_DS=True, HEAD_ROWS=head_rows, COPIES=copies, KEY_AXIS=dq_axis, BLOCK_DK=dq_first,
                          BLOCK_DK2=dq_second)))
        for kind, kernel, t, flags in launches:
            cases.append(Case(f"selected {layout} {kind} {t.block_n} keys", kernel, pointers(kernel),
                              dict(BLOCK_H=block_h[kind], BLOCK_N=t.block_n, TILES_PER_BLOCK=sel_block // t.block_n,
                                   **{**dims, **flags}), t.num_warps, t.num_stages,
                              measured_stack=SELECTED_MEASURED_STACK.get((kind, bdk + bdv), 0)))
        t = dkdv_tiling(group, bdk, bdv, sel_block, torch.bfloat16)
        cases.append(Case(f"selected {layout} dk/dv {t.block_n} x {t.block_cols}", _selected_attention_bwd_dkdv_kernel,
                          pointers(_selected_attention_bwd_dkdv_kernel),
                          dict(QUERIES_PER_STEP=t.block_cols // group, BLOCK_COLS=t.block_cols,
                               BLOCK_N=t.block_n, COMPENSATED=False, **dims), t.num_warps, t.num_stages,
                          measured_stack=SELECTED_MEASURED_STACK.get(("dkdv", bdk + bdv), 0)))
    return cases


def unpipelined_loads(compiled) -> list[str]:
    """The tile loads (tensors of two or more dimensions) inside a loop of the kernel's TTGIR that Triton's
    pipeliner left synchronous (a plain tt.load rather than an async copy into shared memory): each such load makes
    every iteration wait for its memory round trip."""
    found, loops, depth = [], [], 0
    for line in compiled.asm["ttgir"].splitlines():
        if "scf.for" in line:
            loops.append(depth)
        if loops and re.search(r"= tt\.load .*: tensor<\d+x\d+", line):
            found.append(re.search(r"(%[\w.]+) = tt\.load", line).group(1))
        depth += line.count("{") - line.count("}")
        while loops and depth <= loops[-1]:
            loops.pop()
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--require-no-spill", action="store_true",
                        help="exit 1 if any case spills (uses stack) beyond what its launch was measured with")
    parser.add_argument("--require-pipelined", action="store_true",
                        help="exit 1 if a pipelined launch (num_stages > 1) leaves a tile load in a loop synchronous")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("perf.kernel_survey: unset TRITON_INTERPRET (the interpreter replaces triton.jit functions)",
              file=sys.stderr)
        return 2
    spilled, unpipelined = [], []
    for case in lean_cases() + prefill_cases() + selected_cases() + mlp_cases():
        compiled = compile_sm90(case)
        usage = resources(compiled)
        # Only launches with software pipelining (num_stages > 1) are expected to load their tiles asynchronously.
        sync = unpipelined_loads(compiled) if case.num_stages > 1 else []
        print(f"{case.name:45s} {case.num_warps} warps  {usage['registers']:3d} registers  "
              f"{usage['stack_bytes']:5d} B stack" + (f"  synchronous tile loads in a loop: {sync}" if sync else ""),
              flush=True)
        if usage["stack_bytes"] > case.measured_stack:
            spilled.append(case.name)
        if sync:
            unpipelined.append(case.name)
    failed = False
    if spilled and args.require_no_spill:
        print(f"spills: {spilled}", file=sys.stderr)
        failed = True
    if unpipelined and args.require_pipelined:
        print(f"tile loads not pipelined: {unpipelined}", file=sys.stderr)
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
