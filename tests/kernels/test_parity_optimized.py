"""Parity of the vectorized optimized path with the float64 loop reference, on CPU.

Oracle: `reference` in float64. Rules:
- float64: every output and gradient within 1e-10 (relative to the largest reference value, at least 1);
- float32/bfloat16/float16 (FlashAttention's rule, helpers.error_ratio): error(optimized vs float64 reference)
  <= 2 x error(reference in the same dtype vs float64) + 1e-6, NaN never passes; o, o_cmp, o_slc, o_win and the
  gradients of q, gates, every branch's k and v, and every phi weight. As in FlashAttention's tests, all three
  runs get the same inputs: the low-precision tensors (the float64 oracle gets their exact values), so the rule
  compares arithmetic error, not the rounding of the inputs (which is common to both and, on tiny tensors, lets
  the reference's rounding noise cancel it by luck). Outputs are compared teacher-forced: both sides attend to the
  float64 reference's selection, so a near-tie flipped by rounding cannot hide an error;
- selection is compared tie-aware (parity.selection_mismatches): forced blocks present, the same number of
  blocks, and a free block picked instead of the reference's must have a float64 score within
  2 x (the reference's own score error in that dtype) + 1e-12 x the row's largest score;
- free-running end to end (the optimized path picks its own blocks) in float64 and float32.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

import optimized as O
import reference as R
from conformance.helpers import error_ratio, make_inputs, max_abs_error
from tests.kernels.parity import (LOW_PRECISION, cotangent, grads_of, low_precision_example, score_tolerance,
                                selection_mismatches, sequence_lengths, small_configs)
from optimized import masks

FP64_TOL = 1e-10


def assert_close64(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    scale = max(1.0, want.detach().abs().max().item() if want.numel() else 0.0)
    err = max_abs_error(got, want)
    assert err <= FP64_TOL * scale, f"{what}: max abs error {err:.3e} > {FP64_TOL:.0e} x {scale:.3g}"


def assert_reads_equal(got: R.Reads, want: R.Reads, rows: torch.Tensor | None = None) -> None:
    for branch in ("cmp", "slc", "win"):
        g, w = getattr(got, branch), getattr(want, branch)
        assert g.dtype == torch.int64 and g.shape == w.shape, f"reads.{branch}: {g.dtype} {tuple(g.shape)}"
        if rows is not None:
            g, w = g[rows], w[rows]
        assert torch.equal(g, w), f"reads.{branch} differ from the reference"


# Float64: every stage, free-running end to end, teacher-forced gradients ----------------------------------------
@given(data=st.data())
def test_float64_parity(data):
    cfg = data.draw(small_configs(), label="cfg")
    T = data.draw(sequence_lengths(cfg, 120), label="T")
    B = data.draw(st.integers(1, 2), label="B")
    shared_kv = data.draw(st.booleans(), label="shared_kv")
    base = make_inputs(cfg, T, B=B, seed=T, shared_kv=shared_kv, phi_hidden=3)

    # Reference (oracle): free-running forward with gradients.
    ref_in = base.to(requires_grad=True)
    ref = R.nsa_forward(ref_in.q, ref_in.kv, ref_in.gates, cfg, ref_in.phi)
    weight = cotangent(tuple(ref.o.shape))
    ref_grads = grads_of(ref.o, ref_in, weight)
    with torch.no_grad():
        k_cmp_ref, v_cmp_ref = R.compress(base.kv.cmp.k, base.kv.cmp.v, cfg, base.phi)
        scores_ref = R.selection_scores(base.q, k_cmp_ref, cfg)

    # Stages.
    k_cmp, v_cmp = O.compress(base.kv.cmp.k, base.kv.cmp.v, cfg, base.phi)
    assert_close64(k_cmp, k_cmp_ref, "compress k")
    assert_close64(v_cmp, v_cmp_ref, "compress v")
    assert_close64(O.compressed_attention(base.q, k_cmp_ref, v_cmp_ref, cfg), ref.o_cmp, "compressed_attention")
    scores = O.selection_scores(base.q, k_cmp_ref, cfg)
    assert scores.shape == scores_ref.shape
    assert torch.equal(torch.isneginf(scores), torch.isneginf(scores_ref)), "-inf pattern (blocks after J)"
    finite = torch.isfinite(scores_ref)
    assert_close64(scores[finite], scores_ref[finite], "selection_scores")
    assert torch.equal(O.select_blocks(scores_ref, cfg), ref.indices), "select_blocks on the reference's scores"
    assert_close64(O.selected_attention(base.q, base.kv.slc.k, base.kv.slc.v, ref.indices, cfg), ref.o_slc,
                   "selected_attention (reference indices)")
    assert_close64(O.window_attention(base.q, base.kv.win.k, base.kv.win.v, cfg), ref.o_win, "window_attention")

    # Free-running end to end: selection tie-aware; outputs and reads on the rows that selected alike.
    free = O.nsa_forward(base.q, base.kv, base.gates, cfg, base.phi, backend="torch")
    bad = selection_mismatches(free.indices, ref.indices, scores_ref, score_tolerance(scores_ref, None), cfg)
    assert not bad, bad[:5]
    same_rows = (free.indices == ref.indices).all(dim=-1).all(dim=-1)  # [B, T]
    note(f"rows selecting differently (near-ties): {int((~same_rows).sum())}")
    for name in ("o", "o_cmp", "o_slc", "o_win"):
        assert_close64(getattr(free, name)[same_rows], getattr(ref, name)[same_rows], f"free-running {name}")
    assert_close64(free.o_cmp, ref.o_cmp, "free-running o_cmp")
    assert_close64(free.o_win, ref.o_win, "free-running o_win")
    assert_reads_equal(free.reads, ref.reads, same_rows)

    # Teacher-forced gradients through every branch, the gates and phi.
    opt_in = base.to(requires_grad=True)
    forced = O.nsa_forward(opt_in.q, opt_in.kv, opt_in.gates, cfg, opt_in.phi, backend="torch",
                           indices=ref.indices)
    assert_close64(forced.o, ref.o, "teacher-forced o")
    assert_reads_equal(forced.reads, ref.reads)
    for name, g in grads_of(forced.o, opt_in, weight).items():
        assert_close64(g, ref_grads[name], f"d{name}")


# Low precision: FlashAttention's error-ratio rule --------------------------------------------------------------
@given(data=st.data())
def test_low_precision_parity(data):
    cfg = data.draw(small_configs(), label="cfg")
    T = data.draw(sequence_lengths(cfg, 80), label="T")
    dtype = data.draw(st.sampled_from(LOW_PRECISION), label="dtype")
    shared_kv = data.draw(st.booleans(), label="shared_kv")
    result = low_precision_example(cfg, T, dtype, seed=T + 7, shared_kv=shared_kv)
    note(f"error ratios: {result.ratios}")
    worst = max(result.ratios, key=result.ratios.get)
    assert result.ratios[worst] <= 1.0, f"{dtype}: {worst} error ratio {result.ratios[worst]:.3f} > 1"
    assert result.neg_inf_pattern_equal, "selection_scores: -inf exactly for the blocks after J"
    assert result.score_ratio <= 1.0, f"{dtype}: selection_scores error ratio {result.score_ratio:.3f}"
    assert not result.selection, result.selection[:5]


@pytest.mark.parametrize("preset", ["paper", "strict_cmp_visibility", "logit_scores", "window_w_plus_1"])
def test_float32_free_running(preset):
    """Free-running float32 (each side selects its own blocks): o within the error-ratio rule on the rows where
    the float32 optimized, float32 reference and float64 reference selections agree; other rows are near-ties."""
    cfg = R.NSAConfig.preset(preset, cmp_block=4, cmp_stride=2, sel_block=4, n_sel=4, window=6, n_heads=4,
                             n_kv_heads=2, head_dim_qk=8, head_dim_v=4)
    base = make_inputs(cfg, 70, seed=11, phi_hidden=4, dtype=torch.float32).to(dtype=torch.float64)
    oracle = R.nsa_forward(base.q, base.kv, base.gates, cfg, base.phi)
    low_in = base.to(dtype=torch.float32)
    low = R.nsa_forward(low_in.q, low_in.kv, low_in.gates, cfg, low_in.phi)
    opt = O.nsa_forward(low_in.q, low_in.kv, low_in.gates, cfg, low_in.phi)
    k_cmp64, _ = R.compress(base.kv.cmp.k, base.kv.cmp.v, cfg, base.phi)
    scores64 = R.selection_scores(base.q, k_cmp64, cfg)
    scores_low = R.selection_scores(low_in.q, R.compress(low_in.kv.cmp.k, low_in.kv.cmp.v, cfg, low_in.phi)[0], cfg)
    bad = selection_mismatches(opt.indices, oracle.indices, scores64, score_tolerance(scores64, scores_low), cfg)
    assert not bad, bad[:5]
    rows = ((opt.indices == oracle.indices) & (low.indices == oracle.indices)).all(-1).all(-1)
    assert rows.float().mean() > 0.9
    for name in ("o", "o_cmp", "o_slc", "o_win"):
        ratio = error_ratio(getattr(opt, name)[rows], getattr(low, name)[rows], getattr(oracle, name)[rows])
        assert ratio <= 1.0, f"{name}: error ratio {ratio:.3f}"


# Eq. 11: the exact tie-break ----------------------------------------------------------------------------------
@pytest.mark.parametrize("n_init,n_local,n_sel", [(1, 2, 4), (0, 0, 3), (2, 0, 3), (0, 2, 2), (1, 1, 5)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_select_blocks_exact_ties(n_init, n_local, n_sel, dtype):
    """Scores drawn from a few values (many exact ties, +0.0 and -0.0): the optimized Eq. 11 must pick exactly
    the reference's blocks (equal scores -> lower block index)."""
    cfg = R.NSAConfig(cmp_block=2, cmp_stride=1, sel_block=2, n_sel=n_sel, n_init=n_init, n_local=n_local,
                      window=2, n_heads=2, n_kv_heads=2, head_dim_qk=2, head_dim_v=2, phi="avg")
    T = 37
    g = torch.Generator().manual_seed(n_init * 31 + n_local * 7 + n_sel)
    values = torch.tensor([0.0, -0.0, 0.25, 0.5, 1.0 / 3.0, 1e-300 if dtype == torch.float64 else 1e-30])
    pick = torch.randint(len(values), (2, T, 2, -(-T // 2)), generator=g)
    scores = values[pick].to(dtype)
    J = torch.arange(T) // cfg.sel_block
    scores = scores.masked_fill(torch.arange(scores.shape[-1]) > J[None, :, None, None], float("-inf"))
    assert torch.equal(O.select_blocks(scores, cfg), R.select_blocks(scores.to(torch.float64), cfg))


def test_top_n_prefers_lower_index_among_nearly_equal_scores():
    """No epsilon bias: scores that differ in the last bit rank by value, exact ties by index."""
    cfg = R.NSAConfig(cmp_block=1, cmp_stride=1, sel_block=1, n_sel=2, n_init=0, n_local=0, window=1,
                      n_heads=1, n_kv_heads=1, head_dim_qk=1, head_dim_v=1, phi="avg")
    a = 0.5
    b = math.nextafter(a, 1.0)
    scores = torch.tensor([a, a, b, a], dtype=torch.float64)[None, None, None, :]
    got = masks.top_n_blocks(scores, torch.tensor([[[3]]]), cfg)
    assert got.tolist() == [[[[0, 2]]]]


# Chunk size and batch composition do not change the selection (bitwise) ----------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_selection_indices_chunk_and_batch_invariant(dtype):
    cfg = R.NSAConfig(cmp_block=4, cmp_stride=2, sel_block=4, n_sel=4, n_init=1, n_local=1, window=8,
                      n_heads=6, n_kv_heads=2, head_dim_qk=16, head_dim_v=8, phi="avg")
    T = 157
    x = make_inputs(cfg, T, B=3, seed=2, dtype=dtype)
    k_cmp = O.compress(x.kv.cmp.k, x.kv.cmp.v, cfg)[0]
    whole = O.selection_indices(x.q, k_cmp, cfg, chunk_size=T)
    for chunk in (1, 5, 16, 64, 156):
        assert torch.equal(O.selection_indices(x.q, k_cmp, cfg, chunk_size=chunk), whole), f"chunk {chunk}"
    for b in range(3):
        alone = O.selection_indices(x.q[b:b + 1], k_cmp[b:b + 1], cfg, chunk_size=7)
        assert torch.equal(alone, whole[b:b + 1]), f"batch element {b} alone"
    tail = torch.arange(T - 9, T)
    rows = O.selection_indices(x.q[:, T - 9:], k_cmp, cfg, positions=tail, n_keys=T, chunk_size=4)
    assert torch.equal(rows, whole[:, T - 9:]), "the last 9 rows alone (decode)"
    assert torch.equal(O.select_blocks(O.selection_scores(x.q, k_cmp, cfg, chunk_size=10), cfg), whole)


def test_outputs_do_not_depend_on_chunk_size():
    cfg = R.NSAConfig(cmp_block=4, cmp_stride=2, sel_block=8, n_sel=3, window=5, n_heads=4, n_kv_heads=2,
                      head_dim_qk=4, head_dim_v=3, phi="mlp")
    x = make_inputs(cfg, 90, B=2, seed=4, phi_hidden=3)
    whole = O.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi, chunk_size=90)
    for chunk in (1, 7, 32):
        part = O.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi, chunk_size=chunk)
        assert torch.equal(part.indices, whole.indices)
        assert_close64(part.o, whole.o, f"o with chunk {chunk}")
        assert_reads_equal(part.reads, whole.reads)


def test_no_tensor_grows_with_all_queries(monkeypatch):
    """Memory: with chunk_size C every logits tensor (selection and all three branches) has at most C query rows;
    nothing is T x T or T x N for all queries at once."""
    import optimized.masked_attention as MA

    cfg = R.NSAConfig(cmp_block=4, cmp_stride=2, sel_block=8, n_sel=3, window=16, n_heads=2, n_kv_heads=1,
                      head_dim_qk=4, head_dim_v=4, phi="avg")
    T, C = 256, 16
    seen = []
    logits, importance = MA._logits, masks.cmp_importance
    monkeypatch.setattr(MA, "_logits", lambda qc, keys, shared: seen.append(qc.shape[1]) or logits(qc, keys, shared))
    monkeypatch.setattr(masks, "cmp_importance", lambda lg, vis, c: seen.append(lg.shape[1]) or importance(lg, vis, c))
    x = make_inputs(cfg, T, seed=1).to(requires_grad=True)
    out = O.nsa_forward(x.q, x.kv, x.gates, cfg, chunk_size=C)
    out.o.sum().backward()
    assert seen and max(seen) <= C, f"a logits tensor had {max(seen)} query rows > chunk {C}"


# The convention seams: one patch changes the behaviour everywhere (forward, selection, decode) ------------------
def _strict_visibility(block_idx, pos, cfg):
    return block_idx * cfg.cmp_stride + cfg.cmp_block - 1 < pos


def _window_w_plus_1(pos, cfg):
    return pos - cfg.window


def _logit_importance(logits, visible, cfg):
    return torch.where(visible, logits, torch.zeros_like(logits))


def _mean_reduce(per_head, cfg):
    return per_head.sum(dim=-2) / per_head.shape[-2]


@pytest.mark.parametrize("seam,replacement,switch", [
    ("compressed_block_visible", _strict_visibility, {"cmp_visibility": "strict"}),
    ("window_start", _window_w_plus_1, {"window_keys": "w+1"}),
    ("cmp_importance", _logit_importance, {"selection_score": "logits"}),
    ("group_reduce", _mean_reduce, {"group_reduce": "mean"}),
])
def test_patching_a_seam_switches_the_convention_everywhere(monkeypatch, seam, replacement, switch):
    cfg = R.NSAConfig(cmp_block=4, cmp_stride=2, sel_block=4, n_sel=3, n_init=1, n_local=1, window=5,
                      n_heads=4, n_kv_heads=2, head_dim_qk=4, head_dim_v=3, phi="avg")
    x = make_inputs(cfg, 41, seed=9, scale=2.0)
    want = R.nsa_forward(x.q, x.kv, x.gates, cfg.replace(**switch))
    want_decode = R.decode_step(x.q[:, -3:], x.kv, x.gates[:, -3:], cfg.replace(**switch))
    k_cmp = R.compress(x.kv.cmp.k, x.kv.cmp.v, cfg)[0]
    want_scores = R.selection_scores(x.q, k_cmp, cfg.replace(**switch))
    unpatched = O.nsa_forward(x.q, x.kv, x.gates, cfg)
    unpatched_scores = O.selection_scores(x.q, k_cmp, cfg)
    monkeypatch.setattr(masks, seam, replacement)
    got = O.nsa_forward(x.q, x.kv, x.gates, cfg)
    got_decode = O.decode_step(x.q[:, -3:], x.kv, x.gates[:, -3:], cfg)
    got_scores = O.selection_scores(x.q, k_cmp, cfg)
    assert not (torch.allclose(unpatched.o, want.o) and torch.equal(unpatched_scores, want_scores)), \
        "the switch must matter for this input"
    finite = torch.isfinite(want_scores)
    assert torch.equal(finite, torch.isfinite(got_scores))
    assert_close64(got_scores[finite], want_scores[finite], f"patched {seam}: selection_scores")
    assert torch.equal(got.indices, want.indices)
    assert_close64(got.o, want.o, f"patched {seam}: o")
    assert_reads_equal(got.reads, want.reads)
    assert torch.equal(got_decode.indices, want_decode.indices)
    assert_close64(got_decode.o, want_decode.o, f"patched {seam}: decode o")


def test_eq9_band_is_the_token_overlap():
    """Paper config l=32, d=16, l'=64: weights 1,2,2,2,1 over compressed blocks 4j-1..4j+3 (docs/spec.md)."""
    band = masks.eq9_pool_weights(R.NSAConfig())
    assert band.first_offset == -1 and band.weights == (1.0, 2.0, 2.0, 2.0, 1.0)
    band = masks.eq9_pool_weights(R.NSAConfig(cmp_block=64, cmp_stride=64, sel_block=64))
    assert band.first_offset == 0 and band.weights == (1.0,)


@given(cfg=small_configs(), n_cmp=st.integers(0, 30), n_sel=st.integers(1, 12))
def test_eq9_pool_matches_the_reference_double_sum(cfg, n_cmp, n_sel):
    from optimized.scoring import pool_eq9
    from reference.selection import pool_to_selection_blocks

    p_cmp = torch.rand(n_cmp, generator=torch.Generator().manual_seed(n_cmp), dtype=torch.float64)
    want = torch.tensor(pool_to_selection_blocks(p_cmp.tolist(), n_sel, cfg), dtype=torch.float64)
    assert_close64(pool_eq9(p_cmp, n_sel, cfg), want, "Eq. 9 pooling")


# Decode, module, backends, edges, input errors ----------------------------------------------------------------
@pytest.mark.parametrize("TQ", [1, 3])
@pytest.mark.parametrize("T", [5, 33, 64])
def test_decode_step_matches_reference(T, TQ):
    cfg = R.NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, n_sel=3, window=9, n_heads=4, n_kv_heads=2,
                      head_dim_qk=4, head_dim_v=3, phi="mlp")
    x = make_inputs(cfg, T, seed=T, phi_hidden=3)
    args = (x.q[:, -TQ:], x.kv, x.gates[:, -TQ:], cfg, x.phi)
    want, got = R.decode_step(*args), O.decode_step(*args)
    assert torch.equal(got.indices, want.indices)
    for name in ("o", "o_cmp", "o_slc", "o_win"):
        assert_close64(getattr(got, name), getattr(want, name), f"decode {name}")
    assert_reads_equal(got.reads, want.reads)


def test_module_state_dict_loads_into_either():
    cfg = R.NSAConfig(cmp_block=4, cmp_stride=2, sel_block=4, n_sel=3, window=5, n_heads=4, n_kv_heads=2,
                      head_dim_qk=4, head_dim_v=6, phi="mlp")
    torch.manual_seed(0)
    ref = R.NSAAttention(16, cfg, gate_hidden=8, phi_hidden=5).double()
    opt = O.NSAAttention(16, cfg, gate_hidden=8, phi_hidden=5).double()
    assert list(opt.state_dict()) == list(ref.state_dict())
    opt.load_state_dict(ref.state_dict())
    with torch.no_grad():
        ref.gate[-1].weight.normal_()  # leave the zero-initialised gate so the three branches weigh differently
    opt.load_state_dict(ref.state_dict())
    x = torch.randn(2, 23, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert_close64(opt(x, position_offset=3), ref(x, position_offset=3), "module forward")
    R.NSAAttention(16, cfg, gate_hidden=8, phi_hidden=5).double().load_state_dict(opt.state_dict())


def test_no_visible_block_is_exact_zero_without_nan():
    cfg = R.NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, n_sel=3, window=3, n_heads=2, n_kv_heads=1,
                      head_dim_qk=4, head_dim_v=3, phi="mlp")
    x = make_inputs(cfg, 10, seed=3, phi_hidden=3, dtype=torch.float32).to(requires_grad=True)
    out = O.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)
    assert torch.equal(out.o_cmp[:, :7], torch.zeros_like(out.o_cmp[:, :7]))  # block 0 ends at key 7
    assert torch.equal(out.reads.cmp[:, :7], torch.zeros_like(out.reads.cmp[:, :7]))
    grads = grads_of(out.o, x, cotangent(tuple(out.o.shape)))
    assert all(torch.isfinite(g).all() for g in grads.values())
    short = make_inputs(cfg, 5, seed=3, phi_hidden=3).to(requires_grad=True)  # T < l: no block at all
    out = O.nsa_forward(short.q, short.kv, short.gates, cfg, short.phi)
    assert torch.equal(out.o_cmp, torch.zeros_like(out.o_cmp))
    grads = grads_of(out.o, short, cotangent(tuple(out.o.shape)))
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert torch.equal(grads["phi_k.w1"], torch.zeros_like(grads["phi_k.w1"]))


def test_triton_backend_interpreted_matches_torch():
    """backend="triton" on CPU runs the kernels in Triton's interpreter (tiny fp32); "auto" on CPU is torch."""
    pytest.importorskip("triton")
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET is not set (a CUDA machine): see test_parity_gpu.py")
    cfg = R.NSAConfig(cmp_block=4, cmp_stride=2, sel_block=8, n_sel=3, window=4, n_heads=2, n_kv_heads=1,
                      head_dim_qk=4, head_dim_v=8, phi="avg")
    x = make_inputs(cfg, 24, seed=5, dtype=torch.float32).to(requires_grad=True)
    torch_out = O.nsa_forward(x.q, x.kv, x.gates, cfg, backend="torch")
    triton_out = O.nsa_forward(x.q, x.kv, x.gates, cfg, backend="triton")
    auto_out = O.nsa_forward(x.q, x.kv, x.gates, cfg, backend="auto")
    assert torch.equal(auto_out.o, torch_out.o)
    assert torch.equal(triton_out.indices, torch_out.indices)
    assert max_abs_error(triton_out.o_slc, torch_out.o_slc) < 1e-5
    assert_reads_equal(triton_out.reads, torch_out.reads)
    weight = cotangent(tuple(torch_out.o.shape))
    g_torch, g_triton = grads_of(torch_out.o, x, weight), grads_of(triton_out.o, x, weight)
    for name in g_torch:
        assert max_abs_error(g_triton[name], g_torch[name]) < 1e-5, f"d{name}"


def test_bad_inputs_raise_value_errors():
    cfg = R.NSAConfig(cmp_block=4, cmp_stride=2, sel_block=4, n_sel=3, window=3, n_heads=2, n_kv_heads=1,
                      head_dim_qk=4, head_dim_v=3, phi="mlp")
    x = make_inputs(cfg, 9, seed=1, phi_hidden=3)
    with pytest.raises(ValueError, match="phi"):
        O.compress(x.kv.cmp.k, x.kv.cmp.v, cfg, None)
    with pytest.raises(ValueError, match="backend"):
        O.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi, backend="cuda")
    with pytest.raises(ValueError, match="chunk_size"):
        O.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi, chunk_size=0)
    with pytest.raises(ValueError, match="gates"):
        O.nsa_forward(x.q, x.kv, x.gates[..., :2], cfg, x.phi)
    with pytest.raises(ValueError, match="indices"):
        O.selected_attention(x.q, x.kv.slc.k, x.kv.slc.v, torch.zeros(1, 9, 2, 2, dtype=torch.int64), cfg)
    with pytest.raises(ValueError, match="k must be"):
        O.window_attention(x.q, x.kv.win.k[..., :3], x.kv.win.v, cfg)
    with pytest.raises(ValueError, match="T >= 1"):
        O.nsa_forward(x.q[:, :0], R.BranchKV.shared(x.kv.cmp.k[:, :0], x.kv.cmp.v[:, :0]), x.gates[:, :0], cfg,
                      x.phi)
    with pytest.raises(ValueError, match="TQ"):
        O.decode_step(x.q[:, :0], x.kv, x.gates[:, :0], cfg, x.phi)
