"""Tie-break determinism, Eq. 11: I_t = {i | rank(p_slc'_t[i]) <= n}, with the forced blocks (0..n_init-1
and J-n_local+1..J) always in, every block when J + 1 <= n, and exact ties ranked by the lower block
index (docs/spec.md; the paper leaves ties unspecified, so the contract fixes them).

Tests: constructed exact ties select the lower block index (stage select_blocks, and end to end with
queries whose Eq. 9 scores tie exactly); indices are bitwise identical across repeated runs, across chunk
sizes (when the implementation takes chunk_size), across batch composition, and CPU vs GPU when
--device cuda. Outputs are bitwise identical across repeated runs; across chunk sizes and batch
composition they may differ by float64 rounding only (a BLAS kernel may sum in a shape-dependent order;
that is not a selection difference), checked at 1e-12 relative.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conformance.adapters import load_impl
from conformance.helpers import error_ratio, first_difference, make_inputs, select_rows
from conformance.rules import current_sel_block, expected_selection, token_overlap, visible_cmp_blocks
from conformance.strategies import configs, lengths, show_reproducer

PROPERTY = "Tie-break determinism"
EQUATION = "Eq. 11"

RTOL = 1e-12  # float64 rounding between differently shaped computations


def assert_same_up_to_rounding(what: str, a: torch.Tensor, b: torch.Tensor, record_metric) -> None:
    err = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
    tol = RTOL * (1 + float(b.double().abs().max())) if b.numel() else RTOL
    record_metric("output_rounding", err / tol)
    assert err <= tol, f"{what}: max error {err:.3g} > float64 rounding ({tol:.3g})"


@given(data=st.data())
def test_exact_ties_select_the_lower_block(impl, preset, device, data):
    """select_blocks on scores drawn from {0, 1, 2} (many exact ties) == forced blocks + top by (-score, index)."""
    impl.require("select_blocks")
    cfg = data.draw(configs(preset), label="cfg")
    T = data.draw(st.integers(1, 8 * cfg.sel_block), label="T")
    seed = data.draw(st.integers(0, 2**20), label="seed")
    NB = -(-T // cfg.sel_block)
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 3, (2, T, cfg.n_kv_heads, NB), generator=g).double()
    for p in range(T):
        scores[:, p, :, current_sel_block(p, cfg) + 1:] = float("-inf")
    show_reproducer(impl.spec, cfg, f"g = torch.Generator().manual_seed({seed})\n"
                    f"scores = torch.randint(0, 3, (2, {T}, cfg.n_kv_heads, {NB}), generator=g).double()\n"
                    f"for p in range({T}): scores[:, p, :, p // cfg.sel_block + 1:] = float('-inf')\n"
                    "indices = impl.select_blocks(scores, cfg)", T=T, seed=seed)
    got = impl.select_blocks(scores.to(device), cfg).cpu()
    assert got.shape == (2, T, cfg.n_kv_heads, cfg.n_sel), f"indices shape {tuple(got.shape)}"
    for b in range(2):
        for p in range(T):
            J = current_sel_block(p, cfg)
            for h in range(cfg.n_kv_heads):
                want = expected_selection(scores[b, p, h].tolist(), J, cfg)
                want = want + [-1] * (cfg.n_sel - len(want))
                assert got[b, p, h].tolist() == want, (
                    f"indices[b={b}, p={p}, h={h}] = {got[b, p, h].tolist()}, expected {want} for scores "
                    f"{scores[b, p, h, :J + 1].tolist()} (forced blocks, then descending score, ties -> lower index)")


def exact_tie_scores(p: int, cfg) -> list[Fraction]:
    """Eq. 8-10 scores of query p when q = 0, as exact fractions: every visible compressed block gets
    p_cmp = 1/V ("probs") or 0 ("logits"); Eq. 9 weights by token overlap / d; Eq. 10 over H heads."""
    V = visible_cmp_blocks(p, cfg)
    p_cmp = Fraction(0) if cfg.selection_score == "logits" or V == 0 else Fraction(1, V)
    heads = 1 if cfg.group_reduce == "mean" else cfg.group_size
    return [heads * p_cmp * sum(Fraction(token_overlap(i, j, cfg), cfg.cmp_stride) for i in range(V))
            for j in range(current_sel_block(p, cfg) + 1)]


def exactly_representable(p: int, cfg) -> bool:
    """1/V is a power of two (or there is no softmax), so every Eq. 9-10 sum of it is exact in floating point
    and tied fractions are tied floats whatever the order of additions."""
    V = visible_cmp_blocks(p, cfg)
    return cfg.selection_score == "logits" or V == 0 or (V & (V - 1)) == 0


@given(data=st.data())
def test_end_to_end_ties_select_the_lower_block(impl, preset, device, data):
    """nsa_forward with q = 0 (all logits 0: Eq. 9 scores tie exactly) selects the lower-index blocks."""
    impl.require("nsa_forward")
    cfg = data.draw(configs(preset, phi="avg"), label="cfg")
    T = data.draw(lengths(cfg, low=1, high=48), label="T")
    seed = data.draw(st.integers(0, 2**20), label="seed")
    show_reproducer(impl.spec, cfg, "x.q.zero_()\nout = impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)",
                    T=T, seed=seed, shared_kv=impl.shared_kv)
    x = make_inputs(cfg, T, seed=seed, device=device, shared_kv=impl.shared_kv)
    x.q.zero_()
    got = impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi).indices.cpu()
    checked = 0
    for p in range(T):
        if not exactly_representable(p, cfg):
            continue
        checked += 1
        scores = exact_tie_scores(p, cfg)
        want = expected_selection(scores, current_sel_block(p, cfg), cfg)
        want = want + [-1] * (cfg.n_sel - len(want))
        for h in range(cfg.n_kv_heads):
            assert got[0, p, h].tolist() == want, (
                f"q = 0, p={p}, group {h}: indices {got[0, p, h].tolist()}, expected {want} "
                f"(exact scores {[str(s) for s in scores]}; ties -> lower index)")
    assert checked > 0


def tie_heavy_inputs(cfg, T: int, B: int, seed: int, device, shared_kv: bool):
    """Random inputs whose query rows are zero at every third position (exact score ties there)."""
    x = make_inputs(cfg, T, B=B, seed=seed, device=device, shared_kv=shared_kv)
    x.q[:, ::3] = 0
    return x


def draw_case(data, preset, high: int = 48):
    cfg = data.draw(configs(preset), label="cfg")
    T = data.draw(lengths(cfg, low=2, high=high), label="T")
    seed = data.draw(st.integers(0, 2**20), label="seed")
    return cfg, T, seed


@given(data=st.data())
def test_repeated_runs_are_identical(impl, preset, device, data):
    """Three runs on the same inputs: bitwise identical indices and outputs."""
    impl.require("nsa_forward")
    cfg, T, seed = draw_case(data, preset)
    show_reproducer(impl.spec, cfg, "x.q[:, ::3] = 0\nouts = [impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi) "
                    "for _ in range(3)]", T=T, B=2, seed=seed, shared_kv=impl.shared_kv)
    x = tie_heavy_inputs(cfg, T, 2, seed, device, impl.shared_kv)
    runs = [impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi) for _ in range(3)]
    for i, run in enumerate(runs[1:], 2):
        for field in ("indices", "o"):
            diff = first_difference(getattr(runs[0], field), getattr(run, field))
            assert not diff, f"run {i} {field} differs from run 1: {diff}"


@given(data=st.data())
def test_chunk_size_does_not_change_the_result(impl, preset, device, record_metric, data):
    """nsa_forward(..., chunk_size=c) for several c: identical indices, outputs equal up to float64 rounding
    (if the implementation takes chunk_size)."""
    impl.require("nsa_forward")
    if not impl.takes("nsa_forward", "chunk_size"):
        pytest.skip(f"not applicable: {impl.name}.nsa_forward takes no chunk_size")
    cfg, T, seed = draw_case(data, preset, high=32)
    sizes = sorted({1, data.draw(st.integers(2, max(2, T)), label="chunk"), T})
    show_reproducer(impl.spec, cfg, f"x.q[:, ::3] = 0\nouts = {{c: impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi, "
                    f"chunk_size=c) for c in {sizes}}}", T=T, B=2, seed=seed, shared_kv=impl.shared_kv)
    x = tie_heavy_inputs(cfg, T, 2, seed, device, impl.shared_kv)
    runs = {c: impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi, chunk_size=c) for c in sizes}
    first = runs[sizes[0]]
    for c, run in runs.items():
        diff = first_difference(first.indices, run.indices)
        assert not diff, f"chunk_size={c} indices differ from chunk_size={sizes[0]}: {diff}"
        assert_same_up_to_rounding(f"chunk_size={c} vs {sizes[0]} output", run.o, first.o, record_metric)


@given(data=st.data())
def test_batch_composition_does_not_change_a_row(impl, preset, device, record_metric, data):
    """Row 0 alone and row 0 inside a batch of three: identical indices, outputs up to float64 rounding."""
    impl.require("nsa_forward")
    cfg, T, seed = draw_case(data, preset)
    show_reproducer(impl.spec, cfg, "x.q[:, ::3] = 0\nbatch = impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)\n"
                    "alone = impl.nsa_forward(x.q[:1], ..., x.gates[:1], cfg, x.phi)  # row 0 of every kv tensor",
                    T=T, B=3, seed=seed, shared_kv=impl.shared_kv)
    x = tie_heavy_inputs(cfg, T, 3, seed, device, impl.shared_kv)
    batch = impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)
    row = select_rows(x, batch=slice(0, 1))
    alone = impl.nsa_forward(row.q, row.kv, row.gates, cfg, row.phi)
    diff = first_difference(alone.indices, batch.indices[:1])
    assert not diff, f"row 0 indices computed alone differ from row 0 in a batch of 3: {diff}"
    assert_same_up_to_rounding("row 0 output alone vs in a batch of 3", alone.o, batch.o[:1], record_metric)


@given(data=st.data())
def test_cpu_and_gpu_agree(impl, preset, device, low_dtype, record_metric, data):
    """--device cuda only: the same inputs on CPU and GPU give identical indices (float64) and, in the low
    precision, outputs within the error-ratio rule (float64 reference on the same rounded inputs)."""
    if device.type != "cuda":
        pytest.skip("not applicable: CPU vs GPU needs --device cuda")
    impl.require("nsa_forward")
    cfg, T, seed = draw_case(data, preset)
    show_reproducer(impl.spec, cfg, "x.q[:, ::3] = 0\ncpu = impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)",
                    T=T, B=2, seed=seed, shared_kv=impl.shared_kv)
    x = tie_heavy_inputs(cfg, T, 2, seed, "cpu", impl.shared_kv)
    cpu = impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)
    xg = x.to(device=device)
    gpu = impl.nsa_forward(xg.q, xg.kv, xg.gates, cfg, xg.phi)
    diff = first_difference(cpu.indices, gpu.indices.cpu())
    assert not diff, f"float64 indices differ between CPU and GPU: {diff}"
    low = x.to(dtype=low_dtype)
    low_gpu = low.to(device=device)
    cand = impl.nsa_forward(low_gpu.q, low_gpu.kv, low_gpu.gates, cfg, low_gpu.phi)
    reference = load_impl("reference")
    ref_low = reference.nsa_forward(low.q, low.kv, low.gates, cfg, low.phi)
    rounded = low.to(dtype=torch.float64)
    oracle = reference.nsa_forward(rounded.q, rounded.kv, rounded.gates, cfg, rounded.phi)
    if torch.equal(cand.indices.cpu(), oracle.indices):
        ratio = error_ratio(cand.o, ref_low.o, oracle.o)
        record_metric("gpu_low_precision_vs_cpu_float64", ratio)
        assert ratio <= 1, f"GPU {low_dtype} output error ratio {ratio:.3g} > 1 against the float64 reference"
