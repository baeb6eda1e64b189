"""GPU run of the Triton range-attention and group-scores kernels (skipped without CUDA): parity in bf16, fp16 and
fp32 at the shapes the paper config produces, group sizes 1 to 64, head dims up to 256, packed documents.

Run (H100):  python -m pytest tests/gpu/test_kernel_range_attention_gpu.py -q [--gpu-report-dir DIR]
Results go to range_attention_kernel_gpu.json and .md in --gpu-report-dir (default reports/parity; tables are
printed either way).

Parity rule (FlashAttention's, helpers.error_ratio): max |kernel - float64 naive| <= 2 x max |naive run in the
same dtype - float64 naive| + 1e-6, for o, lse, dq, dk, dv (the dense naive oracle holds [Hq, TQ, TK] logits, so
the cases keep Hq * TQ * TK within a few GiB in float64). The group scores are compared with the optimized
torch path's float64 scores under the same rule, with the torch path's dense arithmetic run in the dtype itself as
the baseline (scores_in_dtype).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import optimized as O
from conformance.helpers import error_ratio, finish_gpu_report, make_inputs, markdown_table
from tests.kernels.parity import score_tolerance, selection_mismatches
from optimized import masks
from optimized.documents import documents
from optimized.kernels import range_attention_naive, triton_range_attention
from optimized.kernels.range_attention import compressed_ranges, window_ranges
from reference.config import NSAConfig
from reference.packing import cu_seqlens_of


DEVICE = "cuda"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PAPER = NSAConfig.preset("paper")  # l=32, d=16, l'=64, n=16, w=512

# name: (layout, T, Hq, Hkv, dk, dv); layout window | compressed | window-packed | compressed-packed
CASES = {
    "window-4k-h16-d128": ("window", 4096, 16, 1, 128, 128),
    "compressed-8k-h16-dk192-dv128": ("compressed", 8192, 16, 1, 192, 128),
    "window-2k-h1-d256": ("window", 2048, 4, 4, 256, 256),
    "compressed-4k-h64-d64": ("compressed", 4096, 64, 1, 64, 64),
    "window-packed-4k-h4-d128": ("window-packed", 4096, 8, 2, 128, 128),
    "compressed-packed-4k-h4-d128": ("compressed-packed", 4096, 8, 2, 128, 128),
    "window-1k-h3-dk96-dv160": ("window", 1000, 6, 2, 96, 160),
}
PACKED_LENGTHS = [700, 0, 31, 32, 1500, 1, 1833]  # the last one is cut to fit T
SELECTION_RTOL = {torch.float32: 1e-5, torch.bfloat16: 6e-2}  # as test_parity_gpu: near-ties may order either way

REPORT: dict = {"parity": [], "scores": []}


@pytest.fixture(scope="module", autouse=True)
def write_report(request: pytest.FixtureRequest, gpu_report_dir: Path):
    yield
    finish_gpu_report(request, REPORT, "range_attention_kernel_gpu", markdown, gpu_report_dir)


def markdown(report: dict) -> str:
    lines = [f"# Triton range attention on {report.get('device')} (torch {report.get('torch')}, triton "
             f"{report.get('triton')})", "",
             "## Parity vs the dense naive oracle (error ratio <= 1 passes)", ""]
    grads = ("o", "lse", "dq", "dk", "dv")
    lines += markdown_table(("case", "dtype") + grads,
                            ((r["case"], r["dtype"], *(f"{r['ratios'][k]:.3f}" if k in r["ratios"] else "-"
                                                         for k in grads))
                             for r in report["parity"]))
    lines += ["", "## Group scores (Eq. 8 + 10) vs the torch path in float64", ""]
    lines += markdown_table(("case", "dtype", "score ratio", "(row, group)s differing from float64",
                             "outside the tie tolerance"),
                            ((r["case"], r["dtype"], f"{r['ratio']:.3f}", r["differing"], r["outside"])
                             for r in report["scores"]))
    return "\n".join(lines)


def layout_ranges(layout: str, T: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    positions = torch.arange(T, device=DEVICE)
    docs = None
    if layout.endswith("packed"):
        lengths = PACKED_LENGTHS[:-1] + [T - sum(PACKED_LENGTHS[:-1])]
        bounds = cu_seqlens_of(lengths, DEVICE)
        docs = documents(bounds, T, 1, PAPER, DEVICE)
    if layout.startswith("window"):
        lo, hi = window_ranges(positions, PAPER, docs)
        return lo, hi, T
    n_cmp = masks.compressed_block_count(T, PAPER) if docs is None else docs.n_compressed
    lo, hi = compressed_ranges(positions, n_cmp, PAPER, docs)
    return lo, hi, n_cmp


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_parity_with_naive(case: str, dtype_name: str) -> None:
    layout, T, Hq, Hkv, dk, dv = CASES[case]
    dtype = DTYPES[dtype_name]
    lo, hi, n_keys = layout_ranges(layout, T)
    g = torch.Generator().manual_seed(T + Hq)
    q, k, v = (torch.randn(shape, generator=g).to(DEVICE, dtype) for shape in
               ((1, T, Hq, dk), (1, n_keys, Hkv, dk), (1, n_keys, Hkv, dv)))
    do = torch.randn((1, T, Hq, dv), generator=g).to(DEVICE, dtype)

    def run(fn, leaf_dtype):
        leaves = [x.detach().to(leaf_dtype).requires_grad_(True) for x in (q, k, v)]
        o, lse = fn(*leaves, lo, hi)
        grads = torch.autograd.grad(o, leaves, do.to(leaf_dtype))
        return {"o": o.detach(), "lse": lse.detach(), "dq": grads[0], "dk": grads[1], "dv": grads[2]}

    got = run(triton_range_attention, dtype)
    low = run(range_attention_naive, dtype)
    exact = run(range_attention_naive, torch.float64)
    reading = (hi >= lo)
    ratios = {}
    for name in ("o", "lse", "dq", "dk", "dv"):
        if name == "lse":
            sel = (slice(None), reading)
            ratios[name] = error_ratio(got[name][sel], low[name][sel].float(), exact[name][sel])
        else:
            ratios[name] = error_ratio(got[name], low[name], exact[name])
        assert torch.isfinite(got[name][:, reading] if name in ("o", "lse", "dq") else got[name]).all(), name
    REPORT["parity"].append({"case": case, "dtype": dtype_name, "ratios": ratios})
    assert max(ratios.values()) <= 1.0, ratios


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][0].startswith("compressed")])
def test_gpu_dkdv_in_shared_row_chunks(case: str, dtype_name: str) -> None:
    """The compressed cases' backward with the dk/dv rows split into chunks shared by every key tile (the default
    only past twice the L2 cache, so forced here at these sizes): dk, dv and dq meet the parity rule against the
    naive oracle, and two runs give the same bits."""
    from optimized.kernels.range_attention import range_attention_forward
    from optimized.kernels.range_attention_bwd import range_attention_backward

    layout, T, Hq, Hkv, dk, dv = CASES[case]
    dtype = DTYPES[dtype_name]
    lo, hi, n_keys = layout_ranges(layout, T)
    g = torch.Generator().manual_seed(T + Hq + 1)
    q, k, v = (torch.randn(shape, generator=g).to(DEVICE, dtype) for shape in
               ((1, T, Hq, dk), (1, n_keys, Hkv, dk), (1, n_keys, Hkv, dv)))
    do = torch.randn((1, T, Hq, dv), generator=g).to(DEVICE, dtype)
    scale = dk ** -0.5
    o, lse2 = range_attention_forward(q, k, v, lo, hi, scale)
    runs = [range_attention_backward(q, k, v, lo, hi, o, lse2, do, scale, row_chunks=True) for _ in range(2)]

    def naive_grads(leaf_dtype):
        leaves = [x.detach().to(leaf_dtype).requires_grad_(True) for x in (q, k, v)]
        out, _ = range_attention_naive(*leaves, lo, hi, scale=scale)
        return torch.autograd.grad(out, leaves, do.to(leaf_dtype))

    low, exact = naive_grads(dtype), naive_grads(torch.float64)
    ratios = {}
    for name, got, again, lo_g, ex_g in zip(("dq", "dk", "dv"), *runs, low, exact):
        assert torch.equal(got, again), f"{name} differs between two identical runs"
        assert torch.isfinite(got).all(), name
        ratios[name] = error_ratio(got, lo_g, ex_g)
    REPORT["parity"].append({"case": f"{case}, dk/dv in shared row chunks", "dtype": dtype_name,
                             "ratios": ratios})
    assert max(ratios.values()) <= 1.0, ratios


@pytest.mark.parametrize("dtype_name", ["bf16", "fp16"])
@pytest.mark.parametrize("width", ["short", "long"])
@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][4:] == (128, 128)])
def test_gpu_forward_on_the_tiles_for_short_and_long_ranges(case: str, width: str, dtype_name: str) -> None:
    """The d = 128 forward on the tiles the launch table keeps for ranges of at most SHORT_RANGE and at least
    LONG_RANGE keys (what the branches ask for at the paper's window and at long compressed ranges; the parity
    cases above run the table's entry): o and lse meet the parity rule against the naive oracle whatever the
    case's real widths, since the tile changes only how rows and keys are cut into programs."""
    from optimized.kernels.common import LONG_RANGE, SHORT_RANGE, range_tiling
    from optimized.kernels.range_attention import check_range_inputs, range_attention_forward

    layout, T, Hq, Hkv, dk, dv = CASES[case]
    dtype = DTYPES[dtype_name]
    max_width = SHORT_RANGE if width == "short" else LONG_RANGE
    assert range_tiling(dk, dv, dtype, "forward", max_width) != range_tiling(dk, dv, dtype, "forward")
    lo, hi, n_keys = layout_ranges(layout, T)
    g = torch.Generator().manual_seed(T + Hq + 2)
    q, k, v = (torch.randn(shape, generator=g).to(DEVICE, dtype) for shape in
               ((1, T, Hq, dk), (1, n_keys, Hkv, dk), (1, n_keys, Hkv, dv)))
    scale = dk ** -0.5
    o, lse2 = range_attention_forward(q, k, v, *check_range_inputs(q, k, v, lo, hi), scale, max_width=max_width)
    low = range_attention_naive(q, k, v, lo, hi, scale=scale)
    exact = range_attention_naive(q.double(), k.double(), v.double(), lo, hi, scale=scale)
    reading = hi >= lo
    lse = lse2 * math.log(2.0)
    ratios = {"o": error_ratio(o, low[0], exact[0]),
              "lse": error_ratio(lse[:, reading], low[1][:, reading].float(), exact[1][:, reading])}
    assert torch.isfinite(o[:, reading]).all() and torch.isfinite(lse[:, reading]).all()
    REPORT["parity"].append({"case": f"{case}, forward on the {width}-range tile", "dtype": dtype_name,
                             "ratios": ratios})
    assert max(ratios.values()) <= 1.0, ratios


def scores_in_dtype(q: torch.Tensor, k_cmp: torch.Tensor, cfg: NSAConfig, cu: torch.Tensor | None) -> torch.Tensor:
    """Eq. 8-10 by the optimized torch path's dense per-chunk arithmetic, run in q's own dtype (the public
    functions widen fp32 to fp64 and half to fp32): the low-precision baseline of the error-ratio rule."""
    from optimized.masks import sel_block_count
    from optimized.scoring import packed_scores_of_chunk, scores_of_chunk

    T = q.shape[1]
    positions = torch.arange(T, device=q.device)
    k_low = k_cmp.to(q.dtype)
    docs = None if cu is None else documents(cu, T, 1, cfg, q.device)
    n_sel_blocks = sel_block_count(T, cfg) if docs is None else docs.n_sel_blocks
    parts = []
    for start in range(0, T, 256):
        rows = slice(start, min(T, start + 256))
        if docs is None:
            parts.append(scores_of_chunk(q[:, rows], k_low, positions[rows], n_sel_blocks, cfg))
        else:
            parts.append(packed_scores_of_chunk(q[:, rows], k_low, positions[rows], n_sel_blocks, cfg, docs))
    return torch.cat(parts, dim=1)


@pytest.mark.parametrize("dtype_name", ["bf16", "fp32"])
@pytest.mark.parametrize("packed", [False, True], ids=["single", "packed"])
def test_gpu_group_scores_and_selection(dtype_name: str, packed: bool) -> None:
    """Paper heads (64 q heads, 4 groups, dk 192) at T = 4096: the kernel scores against the torch path's float64
    scores (baseline: scores_in_dtype); the kernel selection agrees with the float64 one up to
    near-ties (tests/kernels/parity.selection_mismatches) and does not depend on the chunk size."""
    cfg = PAPER
    dtype = DTYPES[dtype_name]
    T = 4096
    x = make_inputs(cfg, T, seed=7, dtype=dtype, device=DEVICE, phi_hidden=64)
    cu = None
    if packed:
        lengths = PACKED_LENGTHS[:-1] + [T - sum(PACKED_LENGTHS[:-1])]
        cu = cu_seqlens_of(lengths, DEVICE)
    with torch.no_grad():
        k_cmp = O.compress(x.kv.cmp.k, x.kv.cmp.v, cfg, x.phi, cu_seqlens=cu)[0]
        kernel = O.selection_scores(x.q, k_cmp, cfg, cu_seqlens=cu, range_backend="triton")
        low = scores_in_dtype(x.q, k_cmp, cfg, cu)
        exact = O.selection_scores(x.q.double(), k_cmp.double(), cfg, cu_seqlens=cu)
        finite = torch.isfinite(exact)
        ratio = error_ratio(kernel[finite], low[finite], exact[finite])
        indices = O.selection_indices(x.q, k_cmp, cfg, cu_seqlens=cu, range_backend="triton")
        chunked = O.selection_indices(x.q, k_cmp, cfg, cu_seqlens=cu, range_backend="triton", chunk_size=777)
        exact_indices = O.selection_indices(x.q.double(), k_cmp.double(), cfg, cu_seqlens=cu)
    positions = torch.arange(T)
    if cu is not None:
        positions = documents(cu, T, 1, cfg, DEVICE).relative(positions.to(DEVICE)).cpu()
    tol = score_tolerance(exact.cpu(), None, rel_slack=SELECTION_RTOL[dtype])
    bad = selection_mismatches(indices.cpu(), exact_indices.cpu(), exact.cpu(), tol, cfg, positions=positions)
    differing = int((indices != exact_indices).any(-1).sum())
    REPORT["scores"].append({"case": f"paper heads T={T} {'packed' if packed else 'single'}", "dtype": dtype_name,
                             "ratio": ratio, "differing": differing, "outside": len(bad)})
    assert torch.equal(torch.isneginf(kernel), ~finite)
    assert ratio <= 1.0, ratio
    assert not bad, bad[:5]
    assert torch.equal(indices, chunked), "kernel selection depends on the chunk size"
