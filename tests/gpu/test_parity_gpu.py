"""GPU parity of the optimized path with the compiled Triton kernels (skipped without CUDA).

Run (H100):  python -m pytest tests/gpu/test_parity_gpu.py -q [--gpu-report-dir DIR]
The float64 oracles run on the CPU, so the suite's wall time follows the host's CPU; in parts, each part writing
its own report directory: `-k "small or presets"`, `-k "up_to_8k or invariance"`, `-k 65536`.
Summary (JSON + markdown: GPU name, dtypes, shapes, oracles, worst error ratios, peak memory, times) goes to
--gpu-report-dir (default reports/parity; tests/gpu/conftest.py).

Oracles, per check (every comparison uses FlashAttention's error-ratio rule, helpers.error_ratio, with all runs
getting the same low-precision inputs and the float64 oracle their exact values):
- small configs (T <= 128, hypothesis + presets): oracle the loop reference in float64 on CPU, baseline the loop
  reference in the tested dtype on CPU (tests/kernels/parity.low_precision_example, as in the CPU suite);
- T = 1061 and 8192 with the paper's head layout (64 q heads, 4 KV groups, d_k = 192, d_v = 128): the full
  forward and backward on the kernels (backend "triton"); oracle and baseline are the loop reference (float64 /
  the tested dtype) on 24 sampled rows, the loss weighting only those rows, so dq/d(gates) of the rows and every
  dk, dv, d(phi) are comparable. The selection of all rows is the vectorized float64 path's, checked equal to the
  loop reference's on the sampled rows;
- T = 1061 with the paper's head layout, bf16 and fp16, nsa_forward with its defaults and its own selection: rows
  0..1023 select every block up to their own and the selected branch attends to their key runs on the range
  kernels (the rest gathered); oracle and baseline as above, teacher-forced on the call's own indices;
- T = 65536, paper config (64 q heads, 4 KV groups, d_k = d_v = 128), bf16: one full forward + backward on the
  kernels must complete with finite results; on 24 sampled rows o, dq and d(gates) (which depend only on the row)
  are compared with the loop reference on those rows (float64 oracle, bf16 baseline) and with the vectorized
  float32 path on those rows (nsa_forward_rows) as a second oracle.
Outputs are teacher-forced on one selection; free selections are compared tie-aware
(tests/kernels/parity.selection_mismatches) with SELECTION_RTOL. Chunk-size/batch invariance of the selection is
checked bitwise on CUDA.
Every check also runs with range_backend="triton" (the compressed and window branches and Eq. 8 + 10 on
the range-attention and group-scores kernels; `-k range` selects those runs), reported with "range kernels" in
the case name.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

import optimized as O
import reference
from conformance.helpers import Inputs, error_ratio, finish_gpu_report, make_inputs, markdown_table
from tests.kernels.parity import (cotangent, grads_of, low_precision_example, reference_teacher_forced,
                                  score_tolerance, selection_mismatches, small_configs, tensor_names)
from reference import selection as ref_selection
from optimized.scoring import selection_scores_rows
from reference.config import NSAConfig


DEVICE = "cuda"
GPU_DTYPES = (torch.bfloat16, torch.float32, torch.float16)
# Free-selection tolerance at 1k-64k, relative to a row's largest float64 score: the selection is scored in
# float32 from inputs (and compressed keys) rounded to the dtype, so near-ties within about the dtype's relative
# logit error may order either way.
SELECTION_RTOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 6e-2}
LONG_T = 65536
PAPER_HEADS = NSAConfig.preset("paper")  # l=32, d=16, l'=64, n=16, w=512, 64 q heads, 4 KV groups, dk=192, dv=128

REPORT: dict = {"small_vs_loop_reference": [], "kernels_up_to_8k": [], "chunk_invariance": [], "long_65536": []}
ROWS_PER_CHECK = 24


@pytest.fixture(scope="module", autouse=True)
def write_report(request: pytest.FixtureRequest, gpu_report_dir: Path):
    yield
    finish_gpu_report(request, REPORT, "parity_gpu", markdown, gpu_report_dir)


def markdown(report: dict) -> str:
    lines = [f"# GPU parity of the optimized path: {report.get('device')}",
             f"torch {report.get('torch')}, triton {report.get('triton')}", ""]
    for section, rows in report.items():
        if not isinstance(rows, list) or not rows:
            continue
        lines += [f"## {section}", ""]
        lines += markdown_table(("case", "dtype", "shape", "oracle", "worst ratio", "detail"),
                                ((r["case"], r["dtype"], r["shape"], r["oracle"], worst_text(r.get("worst_ratio")),
                                  r.get("detail", "")) for r in rows))
        lines.append("")
    return "\n".join(lines)


def worst_text(worst: tuple[str, float] | None) -> str:
    return f"{worst[1]:.3f} ({worst[0]})" if worst else "-"


def worst(ratios: dict[str, float]) -> tuple[str, float]:
    name = max(ratios, key=ratios.get)
    return name, ratios[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# Small configs vs the loop reference (same suite as on CPU, kernels on the GPU) ---------------------------------
RANGE_BACKENDS = ("torch", "triton")


def backend_label(range_backend: str) -> str:
    return "" if range_backend == "torch" else " (range kernels)"


def check_small(cfg: NSAConfig, T: int, dtype: torch.dtype, case: str, range_backend: str = "torch") -> None:
    result = low_precision_example(cfg, T, dtype, seed=T + 7, device=DEVICE, backend="auto",
                                   range_backend=range_backend)
    case += backend_label(range_backend)
    name, ratio = worst(result.ratios)
    REPORT["small_vs_loop_reference"].append({
        "case": case, "dtype": dtype_name(dtype), "shape": f"B=1 T={T} Hq={cfg.n_heads} Hkv={cfg.n_kv_heads} "
        f"dk={cfg.head_dim_qk} dv={cfg.head_dim_v}", "config": cfg.to_dict(),
        "oracle": "loop reference float64 (CPU); baseline: loop reference in dtype", "worst_ratio": (name, ratio),
        "ratios": result.ratios, "score_ratio": result.score_ratio,
        "detail": f"scores ratio {result.score_ratio:.3f}; selection rows outside tolerance {len(result.selection)}"})
    assert ratio <= 1.0, f"{case} {dtype}: {name} error ratio {ratio:.3f} > 1"
    assert result.neg_inf_pattern_equal
    assert result.score_ratio <= 1.0, f"{case} {dtype}: selection_scores error ratio {result.score_ratio:.3f}"
    assert not result.selection, result.selection[:5]


@pytest.mark.parametrize("range_backend", RANGE_BACKENDS, ids=["torch", "range"])
@given(data=st.data())
def test_small_configs_vs_loop_reference(range_backend, data):
    cfg = data.draw(small_configs(), label="cfg")
    T = data.draw(st.integers(1, 96), label="T")
    dtype = data.draw(st.sampled_from(GPU_DTYPES), label="dtype")
    note(f"cfg={cfg} T={T} dtype={dtype} range_backend={range_backend}")
    check_small(cfg, T, dtype, "hypothesis", range_backend)


@pytest.mark.parametrize("range_backend", RANGE_BACKENDS, ids=["torch", "range"])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=dtype_name)
@pytest.mark.parametrize("preset", ["paper", "equal_blocks", "window_w_plus_1", "strict_cmp_visibility",
                                    "logit_scores", "mean_group_reduce"])
def test_presets_vs_loop_reference(preset, dtype, range_backend):
    cfg = NSAConfig.preset(preset, n_heads=8, n_kv_heads=2, head_dim_qk=16, head_dim_v=8, window=40, n_sel=4)
    if preset != "equal_blocks":
        cfg = cfg.replace(cmp_block=8, cmp_stride=4, sel_block=16)
    else:
        cfg = cfg.replace(cmp_block=16, cmp_stride=16, sel_block=16)
    check_small(cfg, 96, dtype, preset, range_backend)


# 1k-8k with the paper's head layout: the full run on the kernels vs the loop reference on sampled rows ----------
def sample_positions(T: int, cfg: NSAConfig, count: int) -> torch.Tensor:
    """Block, window and selection edges plus random positions, ascending, within 0..T-1."""
    edges = {0, 1, cfg.cmp_block - 2, cfg.cmp_block - 1, cfg.sel_block - 1, cfg.sel_block, cfg.window - 1,
             cfg.window, cfg.n_sel * cfg.sel_block - 1, cfg.n_sel * cfg.sel_block, T // 2, T - 2, T - 1}
    edges = {p for p in edges if 0 <= p < T}
    g = torch.Generator().manual_seed(T)
    random = torch.randint(0, T, (max(0, count - len(edges)),), generator=g).tolist()
    return torch.tensor(sorted(edges | set(random)))


def reference_rows_with_grads(inputs, cfg: NSAConfig, rows: torch.Tensor, indices: torch.Tensor,
                              weight: torch.Tensor, kv_grads: bool) -> dict[str, torch.Tensor]:
    """The loop reference (CPU) for the sampled rows only, teacher-forced on `indices` [B, S, Hkv, n]: o and the
    gradients of sum(o * weight) for the rows' q and gates (and, with kv_grads, every k, v and phi tensor)."""
    x = inputs.to(requires_grad=kv_grads)
    row_inputs = Inputs(x.q[:, rows].detach().requires_grad_(), x.kv, x.gates[:, rows].detach().requires_grad_(),
                        x.phi)
    out = reference_teacher_forced(row_inputs, cfg, indices, positions=rows)
    leaves = row_inputs.tensors() if kv_grads else [row_inputs.q, row_inputs.gates]
    names = tensor_names(row_inputs) if kv_grads else ["q", "gates"]
    grads = torch.autograd.grad((out["o"] * weight.to(out["o"].dtype)).sum(), leaves, allow_unused=True)
    result = {"o": out["o"].detach()}
    result.update({f"d{n}": (g if g is not None else torch.zeros_like(t)) for n, t, g in zip(names, leaves, grads)})
    return result


@pytest.mark.parametrize("range_backend", RANGE_BACKENDS, ids=["torch", "range"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=dtype_name)
@pytest.mark.parametrize("T", [1061, 8192])
def test_kernels_vs_loop_reference_up_to_8k(T, dtype, range_backend):
    cfg = PAPER_HEADS
    low = make_inputs(cfg, T, seed=T, dtype=dtype, phi_hidden=64)  # on CPU; the GPU run gets a copy
    exact = low.to(dtype=torch.float64)
    rows = sample_positions(T, cfg, ROWS_PER_CHECK)

    # Selection for every row: the vectorized float64 path; on the sampled rows it must be the loop reference's.
    gpu_exact = exact.to(device=DEVICE)
    with torch.no_grad():
        k_cmp64 = O.compress(gpu_exact.kv.cmp.k, gpu_exact.kv.cmp.v, cfg, gpu_exact.phi)[0]
        indices64 = O.selection_indices(gpu_exact.q, k_cmp64, cfg)
        scores64 = O.selection_scores(gpu_exact.q, k_cmp64, cfg).cpu()
        free = O.selection_indices(gpu_exact.q.to(dtype), k_cmp64.to(dtype), cfg, range_backend=range_backend).cpu()
        ref_k_cmp = reference.compress(exact.kv.cmp.k, exact.kv.cmp.v, cfg, exact.phi)[0]
        ref_scores = ref_selection.selection_scores_rows(exact.q[:, rows], ref_k_cmp, cfg, rows.tolist(),
                                                         scores64.shape[-1])
        ref_indices = ref_selection.select_blocks_rows(ref_scores, cfg, rows.tolist())
    del gpu_exact, k_cmp64
    assert not selection_mismatches(indices64.cpu()[:, rows], ref_indices, ref_scores,
                                    score_tolerance(ref_scores, None), cfg, positions=rows)

    weight = torch.zeros(1, T, cfg.n_heads, cfg.head_dim_v, dtype=torch.float64)
    weight[:, rows] = cotangent((1, len(rows), cfg.n_heads, cfg.head_dim_v)).to(dtype).to(torch.float64)
    rows_indices = indices64.cpu()[:, rows]
    oracle = reference_rows_with_grads(exact, cfg, rows, rows_indices, weight[:, rows], kv_grads=True)
    baseline = reference_rows_with_grads(low, cfg, rows, rows_indices, weight[:, rows], kv_grads=True)

    run_in = low.to(device=DEVICE, requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    out = O.nsa_forward(run_in.q, run_in.kv, run_in.gates, cfg, run_in.phi, backend="triton", indices=indices64,
                        range_backend=range_backend)
    grads = grads_of(out.o, run_in, weight.to(device=DEVICE))
    torch.cuda.synchronize()
    seconds, peak = time.perf_counter() - start, torch.cuda.max_memory_allocated()
    candidate = {"o": out.o[:, rows.to(DEVICE)]}
    candidate.update({f"d{n}": (g[:, rows.to(DEVICE)] if n in ("q", "gates") else g) for n, g in grads.items()})
    ratios = {n: error_ratio(candidate[n], baseline[n], oracle[n]) for n in oracle}

    tol = score_tolerance(scores64, None, rel_slack=SELECTION_RTOL[dtype])
    bad = selection_mismatches(free, indices64.cpu(), scores64, tol, cfg)
    differing = int((free != indices64.cpu()).any(-1).sum())
    name, ratio = worst(ratios)
    REPORT["kernels_up_to_8k"].append({
        "case": f"paper heads T={T}{backend_label(range_backend)}", "dtype": dtype_name(dtype),
        "shape": f"B=1 T={T} Hq=64 Hkv=4 dk=192 dv=128 l=32 d=16 l'=64 n=16 w=512, phi mlp",
        "oracle": f"loop reference float64 on {len(rows)} sampled rows (CPU); baseline: loop reference in dtype",
        "worst_ratio": (name, ratio), "ratios": ratios, "seconds_fwd_bwd": seconds, "peak_bytes": peak,
        "detail": f"full fwd+bwd on the kernels {seconds:.2f}s, peak {peak / 2**30:.2f} GiB; free selection in dtype: "
                  f"{differing} (row, group)s differ from float64, {len(bad)} outside the tie tolerance"})
    assert ratio <= 1.0, f"T={T} {dtype}: {name} error ratio {ratio:.3f} > 1 ({ratios})"
    assert not bad, bad[:5]


# Own selection at 1061 tokens: rows 0..1023 (J + 1 <= n) select every block up to their own, so the selected branch
# attends to their key runs on the range kernels; rows 1024.. are gathered ----------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_name)
def test_own_selection_with_full_rows_vs_loop_reference(dtype):
    cfg = PAPER_HEADS
    T = 1061
    low = make_inputs(cfg, T, seed=T + 1, dtype=dtype, phi_hidden=64)
    exact = low.to(dtype=torch.float64)
    rows = sample_positions(T, cfg, ROWS_PER_CHECK)
    weight = torch.zeros(1, T, cfg.n_heads, cfg.head_dim_v, dtype=torch.float64)
    weight[:, rows] = cotangent((1, len(rows), cfg.n_heads, cfg.head_dim_v)).to(dtype).to(torch.float64)

    run_in = low.to(device=DEVICE, requires_grad=True)
    out = O.nsa_forward(run_in.q, run_in.kv, run_in.gates, cfg, run_in.phi)  # the default path, its own selection
    grads = grads_of(out.o, run_in, weight.to(device=DEVICE))
    indices = out.indices.cpu()
    full = cfg.n_sel * cfg.sel_block
    blocks = torch.arange(cfg.n_sel)
    expected_full = torch.where(blocks <= torch.arange(full)[:, None] // cfg.sel_block, blocks, -1)
    assert torch.equal(indices[0, :full], expected_full[:, None, :].expand(full, cfg.n_kv_heads, cfg.n_sel))

    rows_indices = indices[:, rows]
    oracle = reference_rows_with_grads(exact, cfg, rows, rows_indices, weight[:, rows], kv_grads=True)
    baseline = reference_rows_with_grads(low, cfg, rows, rows_indices, weight[:, rows], kv_grads=True)
    candidate = {"o": out.o[:, rows.to(DEVICE)]}
    candidate.update({f"d{n}": (g[:, rows.to(DEVICE)] if n in ("q", "gates") else g) for n, g in grads.items()})
    ratios = {n: error_ratio(candidate[n], baseline[n], oracle[n]) for n in oracle}
    name, ratio = worst(ratios)
    REPORT["kernels_up_to_8k"].append({
        "case": f"paper heads T={T}, own selection (rows < {full} on the range kernels)", "dtype": dtype_name(dtype),
        "shape": f"B=1 T={T} Hq=64 Hkv=4 dk=192 dv=128 l=32 d=16 l'=64 n=16 w=512, phi mlp",
        "oracle": f"loop reference float64 on {len(rows)} sampled rows (CPU), on the call's own selection; "
                  "baseline: loop reference in dtype",
        "worst_ratio": (name, ratio), "ratios": ratios, "seconds_fwd_bwd": None, "peak_bytes": None,
        "detail": "nsa_forward with its defaults: the selection kernels' indices, rows whose selection is every "
                  "block up to their own attended on the range kernels, the others gathered"})
    assert ratio <= 1.0, f"T={T} {dtype}: {name} error ratio {ratio:.3f} > 1 ({ratios})"


# Chunk size and batch composition on CUDA (bitwise indices) ------------------------------------------------------
@pytest.mark.parametrize("range_backend", RANGE_BACKENDS, ids=["torch", "range"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=dtype_name)
def test_selection_chunk_and_batch_invariance_on_gpu(dtype, range_backend):
    cfg = PAPER_HEADS
    T = 4096
    x = make_inputs(cfg, T, B=2, seed=3, dtype=dtype, device=DEVICE, phi_hidden=64)
    k_cmp = O.compress(x.kv.cmp.k, x.kv.cmp.v, cfg, x.phi)[0]

    def indices(q, k, chunk):
        return O.selection_indices(q, k, cfg, chunk_size=chunk, range_backend=range_backend)

    whole = indices(x.q, k_cmp, T)
    mismatches = {}
    for chunk in (1, 97, 512, 1500):
        mismatches[f"chunk {chunk}"] = int((indices(x.q, k_cmp, chunk) != whole).sum())
    for b in range(2):
        alone = indices(x.q[b:b + 1], k_cmp[b:b + 1], 333)
        mismatches[f"batch element {b} alone"] = int((alone != whole[b:b + 1]).sum())
    REPORT["chunk_invariance"].append({
        "case": f"selection_indices{backend_label(range_backend)}", "dtype": dtype_name(dtype),
        "shape": f"B=2 T={T} paper heads",
        "oracle": "itself with chunk_size=T (bitwise)", "detail": json.dumps(mismatches)})
    assert not any(mismatches.values()), mismatches


# T = 65536, paper config, bf16 -------------------------------------------------------------------------------
@pytest.mark.parametrize("range_backend", RANGE_BACKENDS, ids=["torch", "range"])
def test_65536_tokens_paper_config(range_backend):
    T = LONG_T
    cfg = PAPER_HEADS.replace(head_dim_qk=128, head_dim_v=128)
    dtype = torch.bfloat16
    low = make_inputs(cfg, T, seed=5, dtype=dtype, phi_hidden=128)  # on CPU; the GPU run gets a copy
    run_in = low.to(device=DEVICE, requires_grad=True)
    weight = cotangent((1, T, cfg.n_heads, cfg.head_dim_v)).to(dtype)

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    # auto: the Triton selected branch; range_backend "triton": the compressed and window branches and Eq. 8 + 10 too
    out = O.nsa_forward(run_in.q, run_in.kv, run_in.gates, cfg, run_in.phi, range_backend=range_backend)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    grads = grads_of(out.o, run_in, weight.to(DEVICE))
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    peak = torch.cuda.max_memory_allocated()
    assert torch.isfinite(out.o).all(), "non-finite output at 64k"
    nonfinite = [n for n, g in grads.items() if not torch.isfinite(g).all()]
    assert not nonfinite, f"non-finite gradients at 64k: {nonfinite}"

    # dq and d(gates) of a row depend only on that row's output: compare the sampled rows with row-only runs.
    rows = sample_positions(T, cfg, ROWS_PER_CHECK)
    gpu_rows = rows.to(DEVICE)
    rows_indices = out.indices[:, gpu_rows].cpu()
    candidate = {"o": out.o[:, gpu_rows], "dq": grads["q"][:, gpu_rows], "dgates": grads["gates"][:, gpu_rows]}
    del grads, run_in, out
    oracle = reference_rows_with_grads(low.to(dtype=torch.float64), cfg, rows, rows_indices, weight[:, rows],
                                       kv_grads=False)
    baseline = reference_rows_with_grads(low, cfg, rows, rows_indices, weight[:, rows], kv_grads=False)
    ratios = {n: error_ratio(candidate[n], baseline[n], oracle[n]) for n in candidate}

    x = low.to(dtype=torch.float32, device=DEVICE)  # the vectorized float32 path on the same rows
    q_rows, gates_rows = x.q[:, gpu_rows].requires_grad_(), x.gates[:, gpu_rows].requires_grad_()
    vec = O.nsa_forward_rows(q_rows, x.kv, gates_rows, cfg, x.phi, gpu_rows, indices=rows_indices.to(DEVICE),
                             backend="torch", range_backend="torch")
    dq, dgates = torch.autograd.grad((vec.o * weight[:, rows].to(DEVICE, torch.float32)).sum(), (q_rows, gates_rows))
    vectorized = {"o": vec.o, "dq": dq, "dgates": dgates}
    ratios_vs_fp32 = {n: error_ratio(candidate[n], baseline[n], vectorized[n]) for n in candidate}
    with torch.no_grad():  # the free float32 selection of the sampled rows vs the kernel run's (bf16) selection
        free32 = O.nsa_forward_rows(q_rows.detach(), x.kv, gates_rows.detach(), cfg, x.phi, gpu_rows, backend="torch",
                                    range_backend="torch").indices.cpu()
        exact = low.to(dtype=torch.float64, device=DEVICE)
        k_cmp64 = O.compress(exact.kv.cmp.k, exact.kv.cmp.v, cfg, exact.phi)[0]
        scores64 = selection_scores_rows(exact.q[:, gpu_rows], k_cmp64, cfg, gpu_rows, -(-T // cfg.sel_block)).cpu()
    tol = score_tolerance(scores64, None, rel_slack=SELECTION_RTOL[dtype])
    bad = selection_mismatches(rows_indices, free32, scores64, tol, cfg, positions=rows)

    name, ratio = worst(ratios)
    REPORT["long_65536"].append({
        "case": f"paper config, 64k{backend_label(range_backend)}", "dtype": "bfloat16",
        "shape": f"B=1 T={T} Hq=64 Hkv=4 dk=dv=128 l=32 d=16 l'=64 n=16 w=512, phi mlp",
        "oracle": f"loop reference float64 on {len(rows)} sampled rows (CPU); baseline: loop reference bf16",
        "worst_ratio": (name, ratio), "ratios": ratios, "ratios_with_vectorized_fp32_oracle": ratios_vs_fp32,
        "forward_seconds": t1 - t0, "backward_seconds": t2 - t1, "peak_bytes": peak,
        "detail": f"fwd {t1 - t0:.2f}s bwd {t2 - t1:.2f}s peak {peak / 2**30:.1f} GiB; worst ratio with the "
                  f"vectorized fp32 path as oracle {max(ratios_vs_fp32.values()):.3f}; selection rows outside the tie "
                  f"tolerance {len(bad)}"})
    assert ratio <= 1.0, f"64k: {name} error ratio {ratio:.3f} > 1 ({ratios})"
    assert max(ratios_vs_fp32.values()) <= 1.0, f"64k vs the vectorized fp32 path: {ratios_vs_fp32}"
    assert not bad, bad[:5]
