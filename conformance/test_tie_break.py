"""Tie-break determinism, Eq. 11: I_t = {i | rank(p_slc'_t[i]) <= n}, with the forced blocks (0..n_init-1
and J-n_local+1..J) always in, every block when J + 1 <= n, and exact ties ranked by the lower block
index (docs/spec.md; the paper leaves ties unspecified, so the contract fixes them).

Tests: constructed exact ties select the lower block index (stage select_blocks, and end to end with
queries whose Eq. 9 scores tie exactly); the forced blocks survive when a free block's score saturates (one
probability 1.0, the rest 0) and when every score ties exactly; top-n returns exactly min(n, J + 1) distinct
valid blocks whatever the scores (zeros, tiny, equal, huge) - end to end also with the selected branch reading
exactly those blocks; indices are bitwise identical across repeated runs, across chunk sizes (when the
implementation takes chunk_size), across batch composition, and CPU vs GPU when --device cuda. Outputs are
bitwise identical across repeated runs; across chunk sizes and batch composition they may differ by rounding
only (a BLAS kernel may sum in a shape-dependent order; that is not a selection difference), checked at 1e-12
relative in float64 (at the implementation's own precision by the error-ratio rule if it computes in float32).
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conformance.adapters import load_impl, not_covered
from conformance.helpers import error_ratio, first_difference, inputs_for, select_rows
from conformance.precision import close
from conformance.rules import (attend_keys, current_sel_block, expected_selection, forced_sel_blocks, selected_keys,
                               token_overlap, visible_cmp_blocks)
from conformance.strategies import configs, lengths, show_reproducer

PROPERTY = "Tie-break determinism"
EQUATION = "Eq. 11"

RTOL = 1e-12  # float64 rounding between differently shaped computations
REFERENCE = load_impl("reference")


def assert_same_up_to_rounding(what: str, a: torch.Tensor, b: torch.Tensor, record_metric, precision, x, cfg) -> None:
    """a == b up to float64 rounding; for an implementation computing in float32, within the error-ratio budget of
    the reference run in float32 on x rounded to float32 (against the float64 reference)."""

    def reference_o(dtype):
        y = x.to(dtype=dtype, device="cpu")
        return REFERENCE.nsa_forward(y.q, y.kv, y.gates, cfg, y.phi).o

    close(what, a, b, precision=precision, record_metric=record_metric, metric="output_rounding", rtol=RTOL,
          low=lambda: reference_o(torch.float32)[: a.shape[0]], oracle=None if precision.float64 else
          reference_o(torch.float64)[: a.shape[0]])


@given(data=st.data())
def test_exact_ties_select_the_lower_block(impl, envelope, device, data):
    """select_blocks on scores drawn from {0, 1, 2} (many exact ties) == forced blocks + top by (-score, index)."""
    impl.require("select_blocks")
    cfg = data.draw(configs(envelope), label="cfg")
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
def test_end_to_end_ties_select_the_lower_block(impl, envelope, device, data):
    """nsa_forward with q = 0 (all logits 0: Eq. 9 scores tie exactly) selects the lower-index blocks."""
    impl.require("nsa_forward")
    cfg = data.draw(configs(envelope, phi="avg"), label="cfg")
    T = data.draw(lengths(cfg, low=1, high=48), label="T")
    seed = data.draw(st.integers(0, 2**20), label="seed")
    show_reproducer(impl.spec, cfg, "x.q.zero_()\nout = impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)",
                    T=T, seed=seed, shared_kv=impl.shared_kv)
    x = inputs_for(impl, cfg, T, seed=seed, device=device)
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


def tie_heavy_inputs(impl, cfg, T: int, B: int, seed: int, device):
    """Random inputs whose query rows are zero at every third position (exact score ties there)."""
    x = inputs_for(impl, cfg, T, B=B, seed=seed, device=device)
    x.q[:, ::3] = 0
    return x


def draw_case(data, envelope, high: int = 48):
    cfg = data.draw(configs(envelope), label="cfg")
    T = data.draw(lengths(cfg, low=2, high=high), label="T")
    seed = data.draw(st.integers(0, 2**20), label="seed")
    return cfg, T, seed


@given(data=st.data())
def test_repeated_runs_are_identical(impl, envelope, device, data):
    """Three runs on the same inputs: bitwise identical indices and outputs."""
    impl.require("nsa_forward")
    cfg, T, seed = draw_case(data, envelope)
    show_reproducer(impl.spec, cfg, "x.q[:, ::3] = 0\nouts = [impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi) "
                    "for _ in range(3)]", T=T, B=2, seed=seed, shared_kv=impl.shared_kv)
    x = tie_heavy_inputs(impl, cfg, T, 2, seed, device)
    runs = [impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi) for _ in range(3)]
    for i, run in enumerate(runs[1:], 2):
        for field in ("indices", "o"):
            diff = first_difference(getattr(runs[0], field), getattr(run, field))
            assert not diff, f"run {i} {field} differs from run 1: {diff}"


@given(data=st.data())
def test_chunk_size_does_not_change_the_result(impl, envelope, device, precision, record_metric, data):
    """nsa_forward(..., chunk_size=c) for several c: identical indices, outputs equal up to float64 rounding
    (if the implementation takes chunk_size)."""
    impl.require("nsa_forward")
    if not impl.takes("nsa_forward", "chunk_size"):
        pytest.skip(f"not applicable: {impl.name}.nsa_forward takes no chunk_size")
    cfg, T, seed = draw_case(data, envelope, high=32)
    sizes = sorted({1, data.draw(st.integers(2, max(2, T)), label="chunk"), T})
    show_reproducer(impl.spec, cfg, f"x.q[:, ::3] = 0\nouts = {{c: impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi, "
                    f"chunk_size=c) for c in {sizes}}}", T=T, B=2, seed=seed, shared_kv=impl.shared_kv)
    x = tie_heavy_inputs(impl, cfg, T, 2, seed, device)
    runs = {c: impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi, chunk_size=c) for c in sizes}
    first = runs[sizes[0]]
    for c, run in runs.items():
        diff = first_difference(first.indices, run.indices)
        assert not diff, f"chunk_size={c} indices differ from chunk_size={sizes[0]}: {diff}"
        assert_same_up_to_rounding(f"chunk_size={c} vs {sizes[0]} output", run.o, first.o, record_metric,
                                   precision, x, cfg)


@given(data=st.data())
def test_batch_composition_does_not_change_a_row(impl, envelope, device, precision, record_metric, data):
    """Row 0 alone and row 0 inside a batch of three: identical indices, outputs up to rounding."""
    impl.require("nsa_forward")
    cfg, T, seed = draw_case(data, envelope)
    show_reproducer(impl.spec, cfg, "x.q[:, ::3] = 0\nbatch = impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)\n"
                    "alone = impl.nsa_forward(x.q[:1], ..., x.gates[:1], cfg, x.phi)  # row 0 of every kv tensor",
                    T=T, B=3, seed=seed, shared_kv=impl.shared_kv)
    x = tie_heavy_inputs(impl, cfg, T, 3, seed, device)
    batch = impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)
    row = select_rows(x, batch=slice(0, 1))
    alone = impl.nsa_forward(row.q, row.kv, row.gates, cfg, row.phi)
    diff = first_difference(alone.indices, batch.indices[:1])
    assert not diff, f"row 0 indices computed alone differ from row 0 in a batch of 3: {diff}"
    assert_same_up_to_rounding("row 0 output alone vs in a batch of 3", alone.o, batch.o[:1], record_metric,
                               precision, x, cfg)


@given(data=st.data())
def test_cpu_and_gpu_agree(impl, envelope, device, low_dtype, record_metric, data):
    """--device cuda only: the same inputs on CPU and GPU give identical indices (float64) and, in the low
    precision, outputs within the error-ratio rule (float64 reference on the same rounded inputs)."""
    if device.type != "cuda":
        pytest.skip("not applicable: CPU vs GPU needs --device cuda")
    impl.require("nsa_forward")
    cfg, T, seed = draw_case(data, envelope)
    show_reproducer(impl.spec, cfg, "x.q[:, ::3] = 0\ncpu = impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)",
                    T=T, B=2, seed=seed, shared_kv=impl.shared_kv)
    x = tie_heavy_inputs(impl, cfg, T, 2, seed, "cpu")
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


# ------------------------------------------------------------------ forced blocks and the size of the selection
SCORE_KINDS = ("zeros", "tiny", "equal", "huge", "saturated")


def crafted_scores(kind: str, cfg, B: int, T: int, seed: int) -> torch.Tensor:
    """Group scores [B, T, Hkv, NB] of one kind, -inf after each query's J: zeros; tiny (|s| ~ 1e-30); all equal
    to 1.0; huge (|s| ~ 1e30, both signs); saturated (one free block 1.0 - a probability that rounded to one -
    the rest 0, forced blocks included)."""
    NB = -(-T // cfg.sel_block)
    g = torch.Generator().manual_seed(seed)
    if kind == "zeros":
        s = torch.zeros(B, T, cfg.n_kv_heads, NB, dtype=torch.float64)
    elif kind == "tiny":
        s = torch.rand(B, T, cfg.n_kv_heads, NB, generator=g, dtype=torch.float64) * 1e-30
    elif kind == "equal":
        s = torch.ones(B, T, cfg.n_kv_heads, NB, dtype=torch.float64)
    elif kind == "huge":
        s = torch.randn(B, T, cfg.n_kv_heads, NB, generator=g, dtype=torch.float64) * 1e30
    else:
        s = torch.zeros(B, T, cfg.n_kv_heads, NB, dtype=torch.float64)
        for p in range(T):
            J = current_sel_block(p, cfg)
            free = [j for j in range(J + 1) if j not in forced_sel_blocks(J, cfg)]
            if free:
                s[:, p, :, free[int(torch.randint(len(free), (1,), generator=g))]] = 1.0
    for p in range(T):
        s[:, p, :, current_sel_block(p, cfg) + 1:] = float("-inf")
    return s


def check_selection_rows(indices: torch.Tensor, cfg, T: int, what: str, scores: torch.Tensor | None = None) -> None:
    """Every row of indices [B, T, Hkv, n]: exactly min(n, J + 1) distinct valid blocks in 0..J, ascending and
    -1-padded, the forced blocks among them; with scores, also the Eq. 11 selection (ties -> lower index)."""
    assert indices.shape[1:] == (T, cfg.n_kv_heads, cfg.n_sel), f"indices shape {tuple(indices.shape)}"
    for b in range(indices.shape[0]):
        for p in range(T):
            J = current_sel_block(p, cfg)
            for h in range(cfg.n_kv_heads):
                row = indices[b, p, h].tolist()
                valid = [j for j in row if j >= 0]
                where = f"{what}: indices[b={b}, p={p}, h={h}] = {row} (J = {J}, n = {cfg.n_sel})"
                assert len(valid) == min(cfg.n_sel, J + 1), (
                    f"{where}: {len(valid)} valid blocks, expected exactly min(n, J + 1) = {min(cfg.n_sel, J + 1)}")
                assert valid == sorted(set(valid)) and all(0 <= j <= J for j in valid), (
                    f"{where}: blocks must be distinct, ascending and in 0..J")
                assert row[len(valid):] == [-1] * (cfg.n_sel - len(valid)), f"{where}: padding must be -1, last"
                missing = forced_sel_blocks(J, cfg) - set(valid)
                assert not missing, f"{where}: forced blocks {sorted(missing)} were dropped"
                if scores is not None:
                    want = expected_selection(scores[b, p, h].tolist(), J, cfg)
                    assert valid == want, f"{where}: expected {want} (forced, then descending score, ties -> lower)"


@pytest.mark.parametrize("kind", SCORE_KINDS)
@given(data=st.data())
def test_forced_blocks_and_selection_size_whatever_the_scores(impl, envelope, device, kind, data):
    """select_blocks on zero, tiny, equal, huge and saturated scores: exactly min(n, J + 1) distinct valid blocks,
    the forced blocks always in (a forced block given a finite score loses to a saturated free block or to a tie),
    and the Eq. 11 selection (ties -> lower index)."""
    impl.require("select_blocks")
    cfg = data.draw(configs(envelope), label="cfg")
    T = data.draw(st.integers(1, 8 * cfg.sel_block), label="T")
    seed = data.draw(st.integers(0, 2**20), label="seed")
    show_reproducer(impl.spec, cfg, f"scores = crafted_scores({kind!r}, cfg, 2, {T}, {seed})  # "
                    "conformance/test_tie_break.py\nindices = impl.select_blocks(scores, cfg)", T=T, seed=seed)
    scores = crafted_scores(kind, cfg, 2, T, seed)
    got = impl.select_blocks(scores.to(device), cfg).cpu()
    check_selection_rows(got, cfg, T, f"{kind} scores", scores)


def crafted_inputs(kind: str, impl, cfg, T: int, seed: int, device):
    """nsa_forward inputs (phi = mean pooling) whose selection scores are of one kind: "zeros" (q = 0: every score
    ties), "tiny" (q ~ 1e-8), "huge" (q and k ~ 30: logits spread over hundreds, probabilities underflow to 0), and
    "saturated" (every key of free selection block n_init, and q, along one direction with logits ~ 1e3: that
    block's compressed probability is 1.0, every other 0)."""
    x = inputs_for(impl, cfg, T, B=2, seed=seed, device=device)
    with torch.no_grad():
        if kind == "zeros":
            x.q.zero_()
        elif kind == "tiny":
            x.q.mul_(1e-8)
        elif kind == "huge":
            x.q.mul_(30)
            for k in {id(x.kv.branch(b).k): x.kv.branch(b).k for b in ("cmp", "slc", "win")}.values():
                k.mul_(30)
        else:
            g = torch.Generator().manual_seed(seed + 3)
            u = torch.nn.functional.normalize(torch.randn(cfg.head_dim_qk, generator=g, dtype=torch.float64), dim=0)
            a = (1e3 * cfg.head_dim_qk ** 0.5) ** 0.5
            j = cfg.n_init
            keys = slice(j * cfg.sel_block, (j + 1) * cfg.sel_block)
            x.q.copy_((a * u).to(x.q).expand_as(x.q))
            for k in {id(x.kv.branch(b).k): x.kv.branch(b).k for b in ("cmp", "slc", "win")}.values():
                k.mul_(1e-3)
                k[:, keys] = (a * u).to(k)
    return x


@pytest.mark.parametrize("kind", ("zeros", "tiny", "huge", "saturated"))
@given(data=st.data())
def test_end_to_end_selection_size_and_forced_blocks(impl, envelope, device, precision, record_metric, kind, data):
    """nsa_forward on inputs whose scores are all tied, tiny, huge or saturated: exactly min(n, J + 1) distinct
    valid blocks with the forced ones, and o_slc is attention over exactly those blocks (a library that returns n
    blocks but reads fewer fails here). With logits in the hundreds or more ("huge", "saturated") float32 cannot
    resolve o_slc to the error-ratio rule, so for an implementation computing in float32 only the indices are
    checked there."""
    impl.require("nsa_forward")
    cfg = data.draw(configs(envelope, phi="avg"), label="cfg")
    T = data.draw(lengths(cfg, low=1, high=40), label="T")
    seed = data.draw(st.integers(0, 2**20), label="seed")
    show_reproducer(impl.spec, cfg, f"x = crafted_inputs({kind!r}, impl, cfg, {T}, {seed}, 'cpu')  # "
                    "conformance/test_tie_break.py\nout = impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)",
                    T=T, B=2, seed=seed, shared_kv=impl.shared_kv)
    x = crafted_inputs(kind, impl, cfg, T, seed, device)
    out = impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)
    indices = out.indices.cpu()
    check_selection_rows(indices, cfg, T, f"end to end, {kind} scores")
    if "slc" not in impl.caps.branches:
        not_covered(f"{impl.name} computes no selected branch (declared branches {sorted(impl.caps.branches)})")
    if not precision.float64 and kind in ("huge", "saturated"):
        return
    xc = x.to(device="cpu")
    G = cfg.group_size

    def attended(y):
        q, k, v = (t.detach().cpu() for t in (y.q, *y.kv.slc))
        o = torch.empty(q.shape[:3] + (v.shape[-1],), dtype=q.dtype)
        for b in range(q.shape[0]):
            for p in range(T):
                for g in range(cfg.n_kv_heads):
                    keys = selected_keys(p, indices[b, p, g].tolist(), cfg)
                    o[b, p, g * G:(g + 1) * G] = attend_keys(q[b, p, g * G:(g + 1) * G], k[b, :, g], v[b, :, g], keys)
        return o

    close(f"o_slc vs attention over the returned blocks ({kind} scores)", out.o_slc, attended(xc),
          precision=precision, record_metric=record_metric, metric="o_slc_vs_returned_blocks", rtol=1e-10,
          low=lambda: attended(xc.to(dtype=torch.float32)))
