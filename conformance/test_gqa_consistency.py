"""GQA consistency, Eq. 10: p_slc'_t = sum_{h=1}^{H} p_slc^{(h)}_t over the H query heads of a KV group
(mean with group_reduce="mean"), and one block selection per (query, group) shared by all its heads
(Section 3.4: "they share the same sparse KV blocks").

Tests: the group scores equal the reduction of the implementation's own per-head scores (each head run
as a group of one); every head's selected-branch output is attention over exactly the tokens of its
group's selected blocks; permuting the heads inside a group permutes the outputs and changes no index.
"""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from conformance.helpers import make_inputs
from conformance.rules import attend_keys, complete_cmp_blocks, selected_keys
from conformance.strategies import configs, lengths, show_reproducer

PROPERTY = "GQA consistency"
EQUATION = "Eq. 10"

RTOL = 1e-12  # float64


def draw_case(data, preset, min_group: int = 1):
    cfg = data.draw(configs(preset), label="cfg")
    if cfg.group_size < min_group:
        cfg = cfg.replace(n_heads=cfg.n_kv_heads * min_group)
    T = data.draw(lengths(cfg, high=40), label="T")
    B = data.draw(st.integers(1, 2), label="B")
    seed = data.draw(st.integers(0, 2**20), label="seed")
    return cfg, T, B, seed


@given(data=st.data())
def test_group_scores_reduce_the_per_head_scores(impl, preset, device, record_metric, data):
    """selection_scores(q)[g] == reduce_h selection_scores(q_h as a group of one)[g], h over group g's heads."""
    impl.require("selection_scores")
    cfg, T, B, seed = draw_case(data, preset, min_group=2)
    show_reproducer(impl.spec, cfg, "scores = impl.selection_scores(x.q, k_cmp, cfg)  # k_cmp: random "
                    "[B, N, Hkv, dk]", T=T, B=B, seed=seed)
    x = make_inputs(cfg, T, B=B, seed=seed, device=device)
    k_cmp = torch.randn(B, complete_cmp_blocks(T, cfg), cfg.n_kv_heads, cfg.head_dim_qk,
                        generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(device)
    grouped = impl.selection_scores(x.q, k_cmp, cfg).double().cpu()
    one_head = cfg.replace(n_heads=cfg.n_kv_heads)
    G = cfg.group_size
    per_head = [impl.selection_scores(x.q[:, :, h::G].contiguous(), k_cmp, one_head).double().cpu()
                for h in range(G)]
    expected = torch.stack(per_head).sum(0)
    if cfg.group_reduce == "mean":
        expected = expected / G
    finite = torch.isfinite(expected)
    assert torch.equal(finite, torch.isfinite(grouped)), "group and per-head scores disagree on which blocks exist"
    err = (grouped[finite] - expected[finite]).abs()
    tol = RTOL * (1 + expected[finite].abs())
    record_metric("group_vs_per_head", float((err / tol).max()) if err.numel() else 0.0)
    assert bool((err <= tol).all()), (f"group scores are not the {cfg.group_reduce} of the per-head scores: "
                                      f"max error {float(err.max())}")


@given(data=st.data())
def test_heads_of_a_group_read_the_group_blocks(impl, preset, device, record_metric, data):
    """o_slc of every head h of group g == attention of q_h over the tokens of indices[b, p, g] (clipped to p)."""
    impl.require("nsa_forward")
    cfg, T, B, seed = draw_case(data, preset, min_group=2)
    show_reproducer(impl.spec, cfg, "out = impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)",
                    T=T, B=B, seed=seed, shared_kv=impl.shared_kv)
    x = make_inputs(cfg, T, B=B, seed=seed, device=device, shared_kv=impl.shared_kv)
    out = impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)
    q, k, v = (t.detach().double().cpu() for t in (x.q, *x.kv.slc))
    o_slc, indices = out.o_slc.detach().double().cpu(), out.indices.cpu()
    G = cfg.group_size
    worst = 0.0
    for b in range(B):
        for p in range(T):
            for g in range(cfg.n_kv_heads):
                keys = selected_keys(p, indices[b, p, g].tolist(), cfg)
                expected = attend_keys(q[b, p, g * G:(g + 1) * G], k[b, :, g], v[b, :, g], keys)
                got = o_slc[b, p, g * G:(g + 1) * G]
                err = float((got - expected).abs().max())
                tol = RTOL * (1 + float(expected.abs().max()))
                worst = max(worst, err / tol)
                assert err <= tol, (f"o_slc[b={b}, p={p}, heads {g * G}..{(g + 1) * G - 1}] is not attention over the "
                                    f"group's selected blocks {indices[b, p, g].tolist()} (max error {err:.3g})")
    record_metric("o_slc_vs_group_blocks", worst)


@given(data=st.data())
def test_permuting_heads_within_a_group(impl, preset, device, record_metric, data):
    """Permuting the query heads (and their gates) inside each group permutes o and leaves indices unchanged."""
    impl.require("nsa_forward")
    cfg, T, B, seed = draw_case(data, preset, min_group=2)
    show_reproducer(impl.spec, cfg, "out = impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)",
                    T=T, B=B, seed=seed, shared_kv=impl.shared_kv)
    G = cfg.group_size
    within = torch.randperm(G, generator=torch.Generator().manual_seed(seed))
    if torch.equal(within, torch.arange(G)):
        within = within.roll(1)
    perm = torch.cat([g * G + within for g in range(cfg.n_kv_heads)]).to(device)
    x = make_inputs(cfg, T, B=B, seed=seed, device=device, shared_kv=impl.shared_kv)
    a = impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)
    b = impl.nsa_forward(x.q[:, :, perm], x.kv, x.gates[:, :, perm], cfg, x.phi)
    assert torch.equal(a.indices, b.indices), "permuting the heads of a group changed the selected blocks"
    err = float((a.o[:, :, perm] - b.o).abs().max())
    tol = RTOL * (1 + float(a.o.abs().max()))
    record_metric("head_permutation", err / tol)
    assert err <= tol, f"permuting the heads of a group did not permute the output (max error {err:.3g})"
