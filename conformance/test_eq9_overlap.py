"""CSR overlap scoring, Eq. 8-9 (with the Eq. 10 group reduction applied to compare group scores):

    p_slc_t[j] = sum_{m=0}^{l'/d-1} sum_{n=0}^{l/d-1} p_cmp_t[(l'/d) j - m - n]        (1-based [.], as printed)

The implementation's selection scores must equal that double sum, written here literally with the
paper's 1-based vector indexing over the test's own p_cmp (Eq. 8: softmax of q.k_cmp / sqrt(d_k) over
the visible compressed blocks, or the scaled logits with selection_score="logits"); equivalently
weight(i -> j) = tokens shared by compressed block i and selection block j, divided by d; only the
compressed blocks visible to the query contribute (Eq. 7), and blocks after J = p // l' score -inf.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from conformance.adapters import not_covered
from conformance.helpers import inputs_for, make_inputs
from conformance.precision import close
from conformance.rules import (
    complete_cmp_blocks,
    current_sel_block,
    selection_is_valid_top_n,
    token_overlap,
    visible_cmp_blocks,
)
from conformance.strategies import configs, lengths, show_reproducer

PROPERTY = "CSR overlap scoring"
EQUATION = "Eq. 8-9 (weights = token overlap / d)"

SCORE_RTOL = 1e-12  # float64: the scores are short sums of O(1) terms


def own_p_cmp(q_heads: torch.Tensor, k_rows: torch.Tensor, cfg) -> torch.Tensor:
    """Eq. 8 for the query heads q_heads [H, dk] over the visible compressed keys k_rows [V, dk]: [H, V]."""
    logits = q_heads @ k_rows.T / math.sqrt(q_heads.shape[-1])
    if cfg.selection_score == "logits" or k_rows.shape[0] == 0:
        return logits
    return torch.softmax(logits, dim=-1)


def literal_double_sum(p_cmp: list[float], J: int, cfg) -> list[float]:
    """Eq. 9 exactly as printed, with the paper's 1-based vector indices: p_slc[j1] for j1 = 1..J+1, where
    p_cmp[i1] is compressed block i1-1 and p_slc[j1] is selection block j1-1; missing entries add 0."""

    def p_cmp_1based(i1: int) -> float:
        return p_cmp[i1 - 1] if 1 <= i1 <= len(p_cmp) else 0.0

    p_slc = []
    for j1 in range(1, J + 2):
        total = 0.0
        for m in range(cfg.sel_block // cfg.cmp_stride):
            for n in range(cfg.cmp_block // cfg.cmp_stride):
                total += p_cmp_1based((cfg.sel_block // cfg.cmp_stride) * j1 - m - n)
        p_slc.append(total)
    return p_slc


def overlap_weighted(p_cmp: list[float], J: int, cfg) -> list[float]:
    """Eq. 9 as token overlap / d: p_slc[j] = sum_i p_cmp[i] * |block_i & sel_block_j| / d."""
    return [sum(p * token_overlap(i, j, cfg) / cfg.cmp_stride for i, p in enumerate(p_cmp)) for j in range(J + 1)]


def group_reduce(per_head: list[list[float]], cfg) -> list[float]:
    """Eq. 10: sum (or mean, by switch) over the heads of a group."""
    total = [sum(col) for col in zip(*per_head)]
    return [t / len(per_head) for t in total] if cfg.group_reduce == "mean" else total


def expected_scores(q: torch.Tensor, k_cmp: torch.Tensor, cfg, pool,
                    dtype: torch.dtype = torch.float64) -> dict[tuple[int, int, int], list[float]]:
    """(b, p, g) -> the expected scores of blocks 0..J, from the test's own p_cmp (computed in dtype on q and k_cmp
    rounded to it) and the given Eq. 9 form."""
    B, T = q.shape[:2]
    G = cfg.group_size
    out = {}
    q64, k64 = q.detach().to(dtype).cpu(), k_cmp.detach().to(dtype).cpu()
    for b in range(B):
        for p in range(T):
            V = visible_cmp_blocks(p, cfg)
            J = current_sel_block(p, cfg)
            for g in range(cfg.n_kv_heads):
                p_cmp = own_p_cmp(q64[b, p, g * G:(g + 1) * G], k64[b, :V, g], cfg)
                out[b, p, g] = group_reduce([pool(row.tolist(), J, cfg) for row in p_cmp], cfg)
    return out


def as_tensor(expected: dict, shape) -> torch.Tensor:
    """The expected scores as a [B, T, Hkv, NB] tensor, -inf after each query's J."""
    out = torch.full(shape, float("-inf"), dtype=torch.float64)
    for (b, p, g), exp in expected.items():
        out[b, p, g, : len(exp)] = torch.tensor(exp, dtype=torch.float64)
    return out


def compare_scores(scores: torch.Tensor, q, k_cmp, cfg, pool, what: str, precision, record_metric) -> None:
    """Blocks after J score -inf (exactly); blocks 0..J equal the expected scores within float64 rounding (the
    error-ratio rule against the same computation in float32 for an implementation computing in float32)."""
    scores = scores.detach().double().cpu()
    want = as_tensor(expected_scores(q, k_cmp, cfg, pool), scores.shape)
    finite = torch.isfinite(want)
    assert torch.equal(torch.isneginf(scores), ~finite), (
        f"scores of blocks after J must be -inf and only those: got {scores} (expected -inf at {(~finite).nonzero()})")
    close(f"selection scores vs {what}", scores[finite], want[finite], precision=precision, record_metric=record_metric,
          metric="scores_vs_eq9", rtol=SCORE_RTOL,
          low=lambda: as_tensor(expected_scores(q, k_cmp, cfg, pool, torch.float32), scores.shape)[finite])


def draw_scoring_case(data, envelope, device):
    cfg = data.draw(configs(envelope), label="cfg")
    T = data.draw(lengths(cfg, high=48), label="T")
    B = data.draw(st.integers(1, 2), label="B")
    seed = data.draw(st.integers(0, 2**20), label="seed")
    x = make_inputs(cfg, T, B=B, seed=seed, device=device)
    g = torch.Generator().manual_seed(seed + 1)
    k_cmp = torch.randn(B, complete_cmp_blocks(T, cfg), cfg.n_kv_heads, cfg.head_dim_qk, generator=g,
                        dtype=torch.float64).to(device)
    return cfg, T, B, seed, x, k_cmp


REPRO_K_CMP = ("g = torch.Generator().manual_seed(seed + 1)  # seed as in make_inputs\n"
               "k_cmp = torch.randn(x.q.shape[0], max(0, (x.q.shape[1] - cfg.cmp_block) // cfg.cmp_stride + 1), "
               "cfg.n_kv_heads, cfg.head_dim_qk, generator=g, dtype=torch.float64)\n"
               "scores = impl.selection_scores(x.q, k_cmp, cfg)")


@given(data=st.data())
def test_scores_equal_the_printed_double_sum(impl, envelope, device, precision, record_metric, data):
    """selection_scores == Eq. 9's double sum (1-based, as printed) of the test's p_cmp, group-reduced."""
    impl.require("selection_scores")
    cfg, T, B, seed, x, k_cmp = draw_scoring_case(data, envelope, device)
    show_reproducer(impl.spec, cfg, f"seed = {seed}\n" + REPRO_K_CMP, T=T, B=B, seed=seed)
    scores = impl.selection_scores(x.q, k_cmp, cfg)
    compare_scores(scores, x.q, k_cmp, cfg, literal_double_sum, "the printed double sum", precision, record_metric)


@given(data=st.data())
def test_weights_equal_token_overlap(impl, envelope, device, precision, record_metric, data):
    """selection_scores == sum_i p_cmp[i] * (tokens shared by cmp block i and sel block j) / d."""
    impl.require("selection_scores")
    cfg, T, B, seed, x, k_cmp = draw_scoring_case(data, envelope, device)
    show_reproducer(impl.spec, cfg, f"seed = {seed}\n" + REPRO_K_CMP, T=T, B=B, seed=seed)
    scores = impl.selection_scores(x.q, k_cmp, cfg)
    compare_scores(scores, x.q, k_cmp, cfg, overlap_weighted, "token overlap / d", precision, record_metric)


@given(data=st.data())
def test_only_visible_blocks_contribute(impl, envelope, device, data):
    """Changing compressed keys a query cannot see yet (Eq. 7) leaves its scores bitwise unchanged."""
    impl.require("selection_scores")
    cfg, T, B, seed, x, k_cmp = draw_scoring_case(data, envelope, device)
    p = data.draw(st.integers(0, T - 1), label="p")
    show_reproducer(impl.spec, cfg, f"seed = {seed}\n" + REPRO_K_CMP, T=T, B=B, seed=seed)
    V = visible_cmp_blocks(p, cfg)
    other = k_cmp.clone()
    other[:, V:] = 5 * torch.randn(other[:, V:].shape, generator=torch.Generator().manual_seed(seed + 2),
                                   dtype=torch.float64).to(device)
    a, b = impl.selection_scores(x.q, k_cmp, cfg), impl.selection_scores(x.q, other, cfg)
    assert torch.equal(a[:, p], b[:, p]), (f"scores of query {p} changed when compressed blocks >= {V} (not visible "
                                           f"to it) changed: {a[:, p]} vs {b[:, p]}")


def own_compressed_keys(x, cfg) -> torch.Tensor:
    """Eq. 7 with phi = mean pooling, computed by the test: block i = mean of keys i*d .. i*d + l - 1."""
    k = x.kv.cmp.k.detach().double()
    N = complete_cmp_blocks(k.shape[1], cfg)
    if N == 0:
        return k.new_zeros(k.shape[0], 0, k.shape[2], k.shape[3])
    return torch.stack([k[:, i * cfg.cmp_stride:i * cfg.cmp_stride + cfg.cmp_block].mean(dim=1) for i in range(N)], 1)


@given(data=st.data())
def test_forward_selection_ranks_by_eq9(impl, envelope, device, precision, data):
    """nsa_forward's indices are a top-n selection (Eq. 11, ties within 1e-9 relative, or within twice the float32
    error of the scores for an implementation computing in float32) of the Eq. 9 scores the test computes from the
    implementation's inputs (covers implementations without a selection_scores stage)."""
    impl.require("nsa_forward")
    cfg = data.draw(configs(envelope), label="cfg")
    T = data.draw(lengths(cfg, high=48), label="T")
    B = data.draw(st.integers(1, 2), label="B")
    seed = data.draw(st.integers(0, 2**20), label="seed")
    show_reproducer(impl.spec, cfg, "out = impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)",
                    T=T, B=B, seed=seed, shared_kv=impl.shared_kv)
    x = inputs_for(impl, cfg, T, B=B, seed=seed, device=device)
    if cfg.phi == "avg":
        k_cmp = own_compressed_keys(x, cfg)
    elif impl.has("compress"):
        k_cmp = impl.compress(x.kv.cmp.k, x.kv.cmp.v, cfg, x.phi)[0]
    else:
        not_covered(f"phi='mlp' compressed keys need a compress stage, which {impl.name} lacks")
    out = impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)
    expected = expected_scores(x.q, k_cmp, cfg, overlap_weighted)
    in_float32 = None if precision.float64 else expected_scores(x.q, k_cmp, cfg, overlap_weighted, torch.float32)
    indices = out.indices.cpu()
    for (b, p, g), scores in expected.items():
        chosen = [int(j) for j in indices[b, p, g] if j >= 0]
        tol = 1e-9 * (1 + max(map(abs, scores)))
        if in_float32 is not None:
            tol += 2 * max(abs(a - c) for a, c in zip(scores, in_float32[b, p, g]))
        why = selection_is_valid_top_n(chosen, scores, current_sel_block(p, cfg), cfg, tol=tol)
        assert why is None, f"indices[b={b}, p={p}, g={g}] = {chosen} do not follow Eq. 9-11 scores {scores}: {why}"
