"""GPU run of the fused Eq. 9-11 top-n kernel (optimized/kernels/selection.py; skipped without CUDA): compiled,
at the paper's sizes, its indices must be IDENTICAL (bitwise) to the torch code's on the same group scores.

Run (H100):  python -m pytest tests/gpu/test_kernel_select_top_n_gpu.py -q [--gpu-report-dir DIR]
Results go to select_top_n_gpu.json and .md in --gpu-report-dir (default reports/parity; tables are printed either
way).

What compiling adds to the interpreter tests (tests/kernels/test_kernel_select_top_n.py): fp fusion must stay off
(an FMA would round Eq. 9's products once instead of twice), the int64 key reductions and the cumsum run as real
warp/CTA reductions, and the tiles are the GPU's (1024-2048 block keys per row at 64k-128k).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import optimized as O
from conformance.helpers import finish_gpu_report, make_inputs, markdown_table
from optimized import masks
from optimized.kernels.range_attention import compressed_ranges
from optimized.kernels.selection import select_top_n
from optimized.scoring import pool_eq9, select_blocks_rows
from reference.config import NSAConfig
from reference.packing import cu_seqlens_of


DEVICE = "cuda"
PAPER_HEADS = NSAConfig.preset("paper", head_dim_qk=128, head_dim_v=128)  # the perf sweep's layer (64 q, 4 KV heads)
PACKED_LENGTHS = [700, 0, 31, 32, 1500, 1, 1833, 3000]  # the last one is cut to fit T
TIE_PALETTE = [0.0, -0.0, 0.25, 0.5, 1.0 / 3.0, 1e-30, 2.0**-24, 0.75, 1.0]

REPORT: dict = {"kernel": [], "selection": []}


@pytest.fixture(scope="module", autouse=True)
def write_report(request: pytest.FixtureRequest, gpu_report_dir: Path):
    yield
    finish_gpu_report(request, REPORT, "select_top_n_gpu", markdown, gpu_report_dir)


def markdown(report: dict) -> str:
    lines = [f"# Fused Eq. 9-11 top-n kernel on {report.get('device')} (torch {report.get('torch')}, triton "
             f"{report.get('triton')})", "",
             "## Kernel vs the torch code on the same P (rows must be identical)", ""]
    lines += markdown_table(("case", "rows x groups", "differing", "kernel ms", "torch code ms"),
                            ((r["case"], r["rows"], r["differing"], f"{r['kernel_ms']:.3f}", f"{r['torch_ms']:.3f}")
                             for r in report["kernel"]))
    lines += ["", "## selection_indices(range_backend='triton'): fused vs the torch code "
              "(select_blocks on the kernel's scores)", ""]
    lines += markdown_table(("case", "differing (row, group)s", "fused ms", "torch code ms", "chunk 777 identical"),
                            ((r["case"], r["differing"], f"{r['fused_ms']:.2f}", f"{r['torch_ms']:.2f}",
                              r["chunked_identical"]) for r in report["selection"]))
    return "\n".join(lines)


def timed(fn) -> tuple[object, float]:
    """(fn(), ms of a second call; the first compiles)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    result = fn()
    end.record()
    torch.cuda.synchronize()
    return result, start.elapsed_time(end)


def torch_code(p, lo, hi, positions, n_blocks, cfg):
    """The scorer's torch code on P: zeros past each row's range, the "mean" division, pool_eq9, -inf after J,
    select_blocks_rows."""
    inside = torch.arange(p.shape[-1], device=p.device)[None, :] < (hi.long() - lo.long() + 1)[:, None]
    p = torch.where(inside[None, :, None, :], p, torch.zeros((), device=p.device))
    if cfg.group_reduce == "mean":
        p = p / cfg.group_size
    scores = pool_eq9(p, n_blocks, cfg)
    after = torch.arange(n_blocks, device=p.device)[None, :] > masks.current_sel_block(positions, cfg)[:, None]
    return select_blocks_rows(scores.masked_fill(after[None, :, None, :], float("-inf")), cfg, positions)


@pytest.mark.parametrize("preset", ["paper", "mean_group_reduce", "logit_scores"])
@pytest.mark.parametrize("T", [8192, 65536, 131072], ids=["8k", "64k", "128k"])
def test_gpu_kernel_equals_the_torch_code_on_given_scores(T: int, preset: str) -> None:
    """4096 rows spread over T (NB = T / 64 blocks: 128, 1024, 2048), 4 groups; half the rows random scores,
    half drawn from a few values (exact ties, signed zeros), NaN past each row's range (must not be read)."""
    cfg = NSAConfig.preset(preset, head_dim_qk=128, head_dim_v=128)
    g = torch.Generator().manual_seed(T + len(preset))
    positions = torch.unique(torch.cat([torch.randint(0, T, (4000,), generator=g), torch.arange(96),
                                        torch.arange(T - 8, T)])).to(DEVICE)
    lo, hi = compressed_ranges(positions, masks.compressed_block_count(T, cfg), cfg)
    lo, hi = lo.to(torch.int32), hi.to(torch.int32)
    n_blocks = -(-T // cfg.sel_block)
    widths = torch.clamp(hi.long() - lo.long() + 1, min=0)
    shape = (1, positions.shape[0], cfg.n_kv_heads, int(widths.max()))
    p = torch.randn(shape, generator=g)
    p = p if cfg.selection_score == "logits" else p.abs()
    palette = torch.tensor(TIE_PALETTE + ([-v for v in TIE_PALETTE] if cfg.selection_score == "logits" else []))
    p[:, 1::2] = palette[torch.randint(len(palette), p[:, 1::2].shape, generator=g)]
    p = p.to(DEVICE)
    inside = torch.arange(shape[-1], device=DEVICE)[None, :] < widths[:, None]
    p = torch.where(inside[None, :, None, :], p, float("nan"))
    current = masks.current_sel_block(positions, cfg)
    got, kernel_ms = timed(lambda: select_top_n(p, lo, hi, current, n_blocks, cfg))
    want, torch_ms = timed(lambda: torch_code(p, lo, hi, positions, n_blocks, cfg))
    differing = int((got != want).any(-1).sum())
    REPORT["kernel"].append({"case": f"{preset} T={T} NB={n_blocks}", "rows": f"{shape[1]} x {shape[2]}",
                             "differing": differing, "kernel_ms": kernel_ms, "torch_ms": torch_ms})
    assert differing == 0, f"{differing} (row, group)s differ"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("packed", [False, True], ids=["single", "packed"])
def test_gpu_selection_indices_fused_equal_the_torch_code(packed: bool, dtype: torch.dtype) -> None:
    """Paper heads (64 q heads, 4 KV groups, d 128) at T = 8192: selection_indices(range_backend="triton") on the
    two kernels equals the same call running the torch code for Eq. 9-11, and does not depend on the chunks."""
    cfg = PAPER_HEADS
    T = 8192
    x = make_inputs(cfg, T, seed=11, dtype=dtype, device=DEVICE, phi_hidden=64)
    cu = None
    if packed:
        cu = cu_seqlens_of(PACKED_LENGTHS[:-1] + [T - sum(PACKED_LENGTHS[:-1])], DEVICE)
    with torch.no_grad():
        k_cmp = O.compress(x.kv.cmp.k, x.kv.cmp.v, cfg, x.phi, cu_seqlens=cu)[0]

        def select(**kwargs):
            return O.selection_indices(x.q, k_cmp, cfg, cu_seqlens=cu, range_backend="triton", **kwargs)

        fused, fused_ms = timed(select)
        chunked = select(chunk_size=777)
        reference, torch_ms = timed(lambda: O.select_blocks(
            O.selection_scores(x.q, k_cmp, cfg, cu_seqlens=cu, range_backend="triton"), cfg, cu_seqlens=cu))
    differing = int((fused != reference).any(-1).sum())
    REPORT["selection"].append({"case": f"paper heads T={T} {'packed' if packed else 'single'} {dtype}",
                                "differing": differing, "fused_ms": fused_ms, "torch_ms": torch_ms,
                                "chunked_identical": bool(torch.equal(fused, chunked))})
    assert differing == 0, f"{differing} (row, group)s differ"
    assert torch.equal(fused, chunked), "the fused selection depends on the chunks"


def test_gpu_width_segments_equal_the_torch_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """Paper heads at T = 32768 (512 selection blocks): the top-n kernel runs in segments of rows by width (128,
    256 and 512 block keys), and the indices still equal the torch code's on the same call's scores."""
    from optimized.kernels import selection as selection_module

    cfg = PAPER_HEADS
    T = 32768
    x = make_inputs(cfg, T, seed=13, dtype=torch.bfloat16, device=DEVICE, phi_hidden=64)
    widths = []
    real = selection_module.select_top_n
    monkeypatch.setattr(selection_module, "select_top_n",
                        lambda p, lo, hi, cur, nb, *a, **k: widths.append(nb) or real(p, lo, hi, cur, nb, *a, **k))
    with torch.no_grad():
        k_cmp = O.compress(x.kv.cmp.k, x.kv.cmp.v, cfg, x.phi)[0]
        fused, fused_ms = timed(lambda: O.selection_indices(x.q, k_cmp, cfg, range_backend="triton"))
        reference, torch_ms = timed(lambda: O.select_blocks(
            O.selection_scores(x.q, k_cmp, cfg, range_backend="triton"), cfg))
    assert {128, 256, 512} <= set(widths), sorted(set(widths))
    differing = int((fused != reference).any(-1).sum())
    REPORT["selection"].append({"case": f"paper heads T={T} single {torch.bfloat16}, top-n in width segments",
                                "differing": differing, "fused_ms": fused_ms, "torch_ms": torch_ms,
                                "chunked_identical": "-"})
    assert differing == 0, f"{differing} (row, group)s differ"
