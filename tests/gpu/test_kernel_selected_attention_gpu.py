"""GPU run of the Triton selected-attention kernels (skipped without CUDA): parity, T = 65536, timings.

Run (H100):  python -m pytest tests/gpu/test_kernel_selected_attention_gpu.py -q [--gpu-report-dir DIR]
Results go to selected_attention_kernel_gpu.json and .md in --gpu-report-dir (default reports/parity; tables are
printed either way).

Parity rule (FlashAttention's, helpers.error_ratio): max |kernel - float64 naive| <= 2 x max |naive run in the
same dtype - float64 naive| + 1e-6, on sampled query rows. dq of a row depends only on that row's dO, so the
sampled dq is exact; dk/dv are checked with a second backward whose dO is zero outside the sampled rows.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conformance.helpers import error_ratio, finish_gpu_report, markdown_table, rel_error
from tests.kernels.selected_kernel_inputs import Case, random_indices, random_qkv
from optimized.kernels import selected_attention_naive, triton_selected_attention
from optimized.kernels.selected_attention_bwd import (selected_attention_backward, selected_attention_backward_dkdv,
                                                      selected_attention_backward_dq)
from optimized.kernels.selected_attention import selected_attention_forward
from optimized.kernels.selected_attention_index import build_inverted_index
from optimized.kernels.common import DkdvTiling, Tiling


DEVICE = "cuda"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PARITY_CASES = {
    "h1-d64": Case(tk=2048, tq=2048, n_kv_heads=2, group=1, dk=64, dv=64, sel_block=64, n_sel=8),
    "h6-d64-4k": Case(tk=4096, tq=4096, n_kv_heads=2, group=6, dk=64, dv=64, sel_block=64, n_sel=16),
    "h4-dk128-dv64-8k": Case(tk=8192, tq=8192, n_kv_heads=4, group=4, dk=128, dv=64, sel_block=64, n_sel=16),
    "h16-dk192-dv128": Case(tk=4096, tq=4096, n_kv_heads=4, group=16, dk=192, dv=128, sel_block=64, n_sel=16),
    "h64-d128": Case(tk=2048, tq=2048, n_kv_heads=1, group=64, dk=128, dv=128, sel_block=64, n_sel=8),
    "h16-d256": Case(tk=1024, tq=1024, n_kv_heads=1, group=16, dk=256, dv=256, sel_block=64, n_sel=8),
    "h64-d256": Case(tk=1024, tq=1024, n_kv_heads=1, group=64, dk=256, dv=256, sel_block=64, n_sel=4),
    # block 0 (forced for every query) sums 8192 queries x 16 heads: the long dk/dv accumulation of fp32
    "h16-d128-8k": Case(tk=8192, tq=8192, n_kv_heads=1, group=16, dk=128, dv=128, sel_block=64, n_sel=16),
    "decode-h16": Case(tk=1000, tq=7, n_kv_heads=2, group=16, dk=128, dv=128, sel_block=32, n_sel=6, batch=2),
    "h3-dk96-dv160-l48": Case(tk=777, tq=777, n_kv_heads=2, group=3, dk=96, dv=160, sel_block=48, n_sel=5),
}
LONG_CASE = Case(tk=65536, tq=65536, n_kv_heads=4, group=16, dk=128, dv=128, sel_block=64, n_sel=16)
N_SAMPLED_ROWS = 64

REPORT: dict = {"parity": [], "long": [], "timing": [], "forward_sweep": [], "dq_sweep": [], "dkdv_sweep": []}


@pytest.fixture(scope="module", autouse=True)
def write_report(request: pytest.FixtureRequest, gpu_report_dir: Path):
    yield
    finish_gpu_report(request, REPORT, "selected_attention_kernel_gpu", markdown, gpu_report_dir)


def sampled_rows(case: Case, seed: int) -> torch.Tensor:
    """Query rows to check: the first and last rows, rows at block boundaries, and random rows."""
    fixed = [0, 1, case.sel_block - 1, case.sel_block, case.sel_block + 1, case.tq // 2, case.tq - 1]
    g = torch.Generator().manual_seed(seed)
    rand = torch.randperm(case.tq, generator=g)[:N_SAMPLED_ROWS]
    rows = torch.cat([torch.tensor(fixed), rand])
    return torch.unique(rows[rows < case.tq])


def naive_on_rows(case: Case, q, k, v, idx, rows, do_rows, dtype):
    """o, dq, dk, dv of the naive oracle for the sampled query rows only, computed in dtype."""
    leaves = [q[:, rows].to(dtype), k.to(dtype), v.to(dtype)]
    leaves = [x.detach().requires_grad_(True) for x in leaves]
    positions = case.tk - case.tq + rows.to(q.device)
    o = selected_attention_naive(*leaves, idx[:, rows], case.sel_block, positions=positions)
    return [o] + list(torch.autograd.grad(o, leaves, do_rows.to(dtype)))


def check_parity(case: Case, dtype: torch.dtype, seed: int = 0, qkv: tuple | None = None,
                 rows: torch.Tensor | None = None) -> dict:
    """Kernel forward + backward on the whole case, compared with the naive oracle on sampled rows."""
    q, k, v = qkv if qkv is not None else random_qkv(case, dtype=dtype, device=DEVICE, seed=seed)
    idx = random_indices(case, seed=seed + 1, device=DEVICE)
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
    o = triton_selected_attention(*leaves, idx, case.sel_block)
    # dO from its own seed, not the global generator: a case's inputs, and so its ratios, must not depend on which
    # tests the same process ran before (pytest-xdist splits the module differently from run to run)
    generator = torch.Generator(device=o.device).manual_seed(seed + 2)
    do = torch.randn(o.shape, generator=generator, device=o.device, dtype=o.dtype)
    dq, dk, dv = torch.autograd.grad(o, leaves, do, retain_graph=True)
    for name, x in (("o", o), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(x).all(), f"{name} has NaN/inf"

    rows = (rows if rows is not None else sampled_rows(case, seed)).to(DEVICE)
    sparse_do = torch.zeros_like(do)
    sparse_do[:, rows] = do[:, rows]
    dk_rows, dv_rows = torch.autograd.grad(o, leaves[1:], sparse_do)
    got = [o[:, rows], dq[:, rows], dk_rows, dv_rows]
    exact = naive_on_rows(case, q, k, v, idx, rows, do[:, rows], torch.float64)
    low = naive_on_rows(case, q, k, v, idx, rows, do[:, rows], dtype)
    row = {"case": str(case), "dtype": str(dtype).replace("torch.", ""), "rows_checked": int(rows.numel())}
    for name, g_, l_, e_ in zip(("o", "dq", "dk", "dv"), got, low, exact):
        row[f"{name}_ratio"] = error_ratio(g_, l_, e_)
        row[f"{name}_rel"] = rel_error(g_, e_)
        row[f"{name}_naive_rel"] = rel_error(l_, e_)
    return row


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("case_name", list(PARITY_CASES))
def test_gpu_parity_with_naive(case_name: str, dtype_name: str) -> None:
    row = check_parity(PARITY_CASES[case_name], DTYPES[dtype_name])
    REPORT["parity"].append(row)
    worst = {k: v for k, v in row.items() if k.endswith("_ratio")}
    assert max(worst.values()) <= 1.0, worst


def test_gpu_offsets_beyond_int32() -> None:
    """q, o, dq with 2 * 70000 * 64 * 256 = 2.29e9 > 2^31 elements: rows past element 2^31 must be right
    (program ids and strides are multiplied in int64)."""
    case = Case(tk=70000, tq=70000, n_kv_heads=1, group=64, dk=256, dv=256, sel_block=64, n_sel=4, batch=2)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    qkv = tuple(torch.randn(shape, generator=g, device=DEVICE, dtype=torch.bfloat16)
                for shape in ((2, case.tq, case.n_heads, case.dk), (2, case.tk, 1, case.dk), (2, case.tk, 1, case.dv)))
    assert qkv[0].numel() > 2**31
    rows = torch.tensor([0, 1, 63, 64, 35000, 69990, 69998, 69999])
    row = check_parity(case, torch.bfloat16, qkv=qkv, rows=rows)
    REPORT["long"].append(row)
    worst = {k: v for k, v in row.items() if k.endswith("_ratio")}
    assert max(worst.values()) <= 1.0, worst


@pytest.mark.parametrize("dtype_name", ["bf16", "fp32"])
def test_gpu_backward_is_bitwise_deterministic(dtype_name: str) -> None:
    case = PARITY_CASES["h4-dk128-dv64-8k"]
    q, k, v = random_qkv(case, dtype=DTYPES[dtype_name], device=DEVICE, seed=3)
    idx = random_indices(case, seed=4, device=DEVICE)
    scale = 1.0 / math.sqrt(case.dk)
    o, stats = selected_attention_forward(q, k, v, idx, case.sel_block, scale)
    do = torch.randn_like(o)
    first = selected_attention_backward(q, k, v, idx, o, stats, do, case.sel_block, scale)
    for _ in range(3):
        again = selected_attention_backward(q, k, v, idx, o, stats, do, case.sel_block, scale)
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), f"{name} differs between runs"


def test_gpu_64k_forward_backward_completes_and_matches() -> None:
    """Paper-scale shape: T = 65536, 64 q heads in 4 KV groups, d = 128, n = 16, l' = 64, bf16."""
    case = LONG_CASE
    torch.cuda.reset_peak_memory_stats()
    q, k, v = random_qkv(case, dtype=torch.bfloat16, device=DEVICE, seed=0)
    idx = random_indices(case, seed=1, device=DEVICE, dtype=torch.int32)
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    o = triton_selected_attention(*leaves, idx, case.sel_block)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    do = torch.randn_like(o)
    dq, dk, dv = torch.autograd.grad(o, leaves, do, retain_graph=True)
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    for name, x in (("o", o), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(x).all(), f"{name} has NaN/inf at T=65536"

    rows = sampled_rows(case, 0).to(DEVICE)
    sparse_do = torch.zeros_like(do)
    sparse_do[:, rows] = do[:, rows]
    dk_rows, dv_rows = torch.autograd.grad(o, leaves[1:], sparse_do)
    got = [o[:, rows], dq[:, rows], dk_rows, dv_rows]
    exact = naive_on_rows(case, q, k, v, idx, rows, do[:, rows], torch.float64)
    low = naive_on_rows(case, q, k, v, idx, rows, do[:, rows], torch.bfloat16)
    fp32 = naive_on_rows(case, q, k, v, idx, rows, do[:, rows], torch.float32)
    row = {"case": str(case), "dtype": "bfloat16", "first_forward_s": t1 - t0, "first_backward_s": t2 - t1,
           "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30, "rows_checked": int(rows.numel())}
    for name, g_, l_, f_, e_ in zip(("o", "dq", "dk", "dv"), got, low, fp32, exact):
        row[f"{name}_ratio"] = error_ratio(g_, l_, e_)
        row[f"{name}_rel_vs_fp32_naive"] = rel_error(g_, f_)
    REPORT["long"].append(row)
    worst = {k: v for k, v in row.items() if k.endswith("_ratio")}
    assert max(worst.values()) <= 1.0, worst


def bench_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def sdpa_times(q, k, v, group: int, do) -> tuple[float, float, float]:
    """Causal full attention (SDPA, K/V expanded to the query heads): forward, backward, forward+backward ms."""
    qh = q.detach().transpose(1, 2).requires_grad_(True)
    kh = k.detach().repeat_interleave(group, dim=2).transpose(1, 2).requires_grad_(True)
    vh = v.detach().repeat_interleave(group, dim=2).transpose(1, 2).requires_grad_(True)
    doh = do.transpose(1, 2)

    def fwd():
        return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)

    def step():
        torch.autograd.grad(fwd(), (qh, kh, vh), doh)

    out = fwd()
    return (bench_ms(fwd), bench_ms(lambda: torch.autograd.grad(out, (qh, kh, vh), doh, retain_graph=True)),
            bench_ms(step))


@pytest.mark.parametrize("tk", [8192, 32768, 65536])
def test_gpu_timing(tk: int) -> None:
    """Median ms (triton.testing.do_bench) of the kernel forward, backward through autograd (inverted-index
    build included), forward+backward, the dq kernel alone, the dk/dv part alone (index build + dk/dv kernel +
    slot reduction) and the index build alone, next to SDPA causal full attention on the same q/k/v
    (bf16, 64 q heads, 4 KV groups, d = 128)."""
    case = Case(tk=tk, tq=tk, n_kv_heads=4, group=16, dk=128, dv=128, sel_block=64, n_sel=16)
    q, k, v = random_qkv(case, dtype=torch.bfloat16, device=DEVICE, seed=0)
    idx = random_indices(case, seed=1, device=DEVICE, dtype=torch.int32)
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
    do = torch.randn((1, tk, case.n_heads, case.dv), device=DEVICE, dtype=torch.bfloat16)
    scale = 1.0 / math.sqrt(case.dk)

    def fwd():
        return triton_selected_attention(*leaves, idx, case.sel_block)

    def step():
        torch.autograd.grad(fwd(), leaves, do)

    out = fwd()
    o, stats = selected_attention_forward(q, k, v, idx, case.sel_block, scale)
    _, delta = selected_attention_backward_dq(q, k, v, idx, o, stats, do, case.sel_block, scale)
    row = {"tk": tk, "case": str(case), "kernel_fwd_ms": bench_ms(fwd),
           "kernel_bwd_ms": bench_ms(lambda: torch.autograd.grad(out, leaves, do, retain_graph=True)),
           "kernel_fwd_bwd_ms": bench_ms(step),
           "dq_kernel_ms": bench_ms(lambda: selected_attention_backward_dq(q, k, v, idx, o, stats, do,
                                                                          case.sel_block, scale)),
           "dkdv_ms": bench_ms(lambda: selected_attention_backward_dkdv(q, k, v, idx, stats, delta, do,
                                                                       case.sel_block, scale)),
           "index_build_ms": bench_ms(lambda: build_inverted_index(idx, tk, case.sel_block))}
    del out
    (row["sdpa_causal_fwd_ms"], row["sdpa_causal_bwd_ms"],
     row["sdpa_causal_fwd_bwd_ms"]) = sdpa_times(q, k, v, case.group, do)
    REPORT["timing"].append(row)
    assert row["kernel_fwd_ms"] > 0


def sweep(entries: list, settings, default, time_it) -> None:
    """Time each launch setting (a setting the GPU cannot run is recorded, not fatal); mark the heuristic's."""
    for setting in settings:
        entry = {**vars(setting), "heuristic": setting == default}
        try:
            entry["ms"] = bench_ms(lambda: time_it(setting))
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
        entries.append(entry)


def test_gpu_tiling_sweep_at_64k() -> None:
    """Forward, dq-kernel and dk/dv time per launch setting at T = 65536 (the heuristic's pick is marked), so
    the defaults in common.py can be checked against measurements."""
    from optimized.kernels.common import dkdv_tiling, dq_tiling, forward_tiling, padded

    case = LONG_CASE
    q, k, v = random_qkv(case, dtype=torch.bfloat16, device=DEVICE, seed=0)
    idx = random_indices(case, seed=1, device=DEVICE, dtype=torch.int32)
    scale = 1.0 / math.sqrt(case.dk)
    dims = (padded(case.group), padded(case.dk), padded(case.dv), case.sel_block, torch.bfloat16)
    sweep(REPORT["forward_sweep"],
          [Tiling(n, w, st) for n in (32, 64) for w in (1, 2, 4, 8) for st in (1, 2, 3)],
          forward_tiling(case.group, *dims[1:]),
          lambda tiling: selected_attention_forward(q, k, v, idx, case.sel_block, scale, tiling))
    o, stats = selected_attention_forward(q, k, v, idx, case.sel_block, scale)
    do = torch.randn_like(o)
    sweep(REPORT["dq_sweep"],
          [Tiling(n, w, st) for n in (16, 32, 64) for w in (1, 2, 4, 8) for st in (1, 2, 3)],
          dq_tiling(case.group, *dims[1:]),
          lambda tiling: selected_attention_backward_dq(q, k, v, idx, o, stats, do, case.sel_block, scale, tiling))
    _, delta = selected_attention_backward_dq(q, k, v, idx, o, stats, do, case.sel_block, scale)
    shapes = [(64, 32), (64, 64), (64, 128), (32, 64), (32, 128)]
    settings = [DkdvTiling(n, c, w, st) for n, c in shapes for w in (4, 8) for st in (1, 2)]
    settings += [DkdvTiling(n, c, 8, 3) for n, c in shapes[:2] + shapes[3:4]]  # one 8-warp CTA per SM: deeper pipe?
    sweep(REPORT["dkdv_sweep"], settings,
          dkdv_tiling(case.group, padded(case.dk), padded(case.dv), case.sel_block, torch.bfloat16),
          lambda launch: selected_attention_backward_dkdv(q, k, v, idx, stats, delta, do, case.sel_block, scale,
                                                          launch))
    assert any("ms" in e for e in REPORT["forward_sweep"])
    assert any("ms" in e for e in REPORT["dkdv_sweep"])


def markdown(report: dict) -> str:
    lines = [f"# Triton selected attention on {report.get('device')} (torch {report.get('torch')}, "
             f"triton {report.get('triton')})", ""]
    if report["parity"]:
        lines += ["## Parity vs naive (error ratio <= 1 passes; rel = ||x - f64|| / ||f64||)", ""]
        lines += markdown_table(("case", "dtype", "o ratio", "dq ratio", "dk ratio", "dv ratio", "o rel", "dk rel"),
                                ((r["case"], r["dtype"], f"{r['o_ratio']:.3f}", f"{r['dq_ratio']:.3f}",
                                  f"{r['dk_ratio']:.3f}", f"{r['dv_ratio']:.3f}", f"{r['o_rel']:.2e}",
                                  f"{r['dk_rel']:.2e}") for r in report["parity"]))
        lines.append("")
    for r in report["long"]:
        lines += ["## T = 65536 forward + backward", "", "```", json.dumps(r, indent=1), "```", ""]
    if report["timing"]:
        lines += ["## Timing (median ms, bf16, Hq=64, Hkv=4, d=128, n=16, l'=64)", ""]
        times = ("kernel_fwd_ms", "kernel_bwd_ms", "kernel_fwd_bwd_ms", "dq_kernel_ms", "dkdv_ms", "index_build_ms",
                 "sdpa_causal_fwd_ms", "sdpa_causal_bwd_ms", "sdpa_causal_fwd_bwd_ms")
        lines += markdown_table(("T", "kernel fwd", "kernel bwd", "kernel fwd+bwd", "dq kernel", "dk/dv (+index)",
                                 "index build", "SDPA fwd", "SDPA bwd", "SDPA fwd+bwd", "SDPA/kernel fwd",
                                 "SDPA/kernel fwd+bwd"),
                                ((r["tk"], *(f"{r[k]:.2f}" for k in times),
                                  f"{r['sdpa_causal_fwd_ms'] / r['kernel_fwd_ms']:.1f}x",
                                  f"{r['sdpa_causal_fwd_bwd_ms'] / r['kernel_fwd_bwd_ms']:.1f}x")
                                 for r in report["timing"]))
        lines.append("")
    for key in ("forward_sweep", "dq_sweep", "dkdv_sweep"):
        if report[key]:
            fields = [f for f in report[key][0] if f not in ("heuristic", "ms", "error")]
            lines += [f"## {key} at T = 65536 (* = heuristic default)", "", "| " + " | ".join(fields) + " | ms |",
                      "|" + "---|" * (len(fields) + 1)]
            for e in report[key]:
                value = f"{e['ms']:.2f}" if "ms" in e else e.get("error", "?")
                star = " *" if e["heuristic"] else ""
                lines.append("| " + " | ".join(str(e[f]) for f in fields) + f"{star} | {value} |")
            lines.append("")
    return "\n".join(lines)
