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

from conformance.adapters import load_impl, not_covered
from conformance.helpers import inputs_for, make_inputs
from conformance.precision import close
from conformance.rules import attend_keys, complete_cmp_blocks, selected_keys
from conformance.strategies import configs, lengths, show_reproducer

PROPERTY = "GQA consistency"
EQUATION = "Eq. 10"

RTOL = 1e-12  # float64
REFERENCE = load_impl("reference")


def draw_case(data, envelope, min_group: int = 1):
    cfg = data.draw(configs(envelope), label="cfg")
    if cfg.group_size < min_group:
        group = envelope.caps.group_sizes.pick(min_group)
        if group is None:
            not_covered(f"outside the declared capabilities: the test needs groups of >= {min_group} query heads "
                        f"(declared {envelope.caps.group_sizes.describe()})")
        cfg = cfg.replace(n_heads=cfg.n_kv_heads * group)
    T = data.draw(lengths(cfg, high=40), label="T")
    B = data.draw(st.integers(1, 2), label="B")
    seed = data.draw(st.integers(0, 2**20), label="seed")
    return cfg, T, B, seed


@given(data=st.data())
def test_group_scores_reduce_the_per_head_scores(impl, envelope, device, precision, record_metric, data):
    """selection_scores(q)[g] == reduce_h selection_scores(q_h as a group of one)[g], h over group g's heads."""
    impl.require("selection_scores")
    cfg, T, B, seed = draw_case(data, envelope, min_group=2)
    if not envelope.caps.group_sizes.allows(1):
        not_covered(f"outside the declared capabilities: the test runs each head as a group of one (declared group "
                    f"sizes {envelope.caps.group_sizes.describe()})")
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

    def reference_group_scores(dtype):
        return REFERENCE.selection_scores(x.q.to(dtype).cpu(), k_cmp.to(dtype).cpu(), cfg).double()[finite]

    close(f"group scores vs the {cfg.group_reduce} of the per-head scores", grouped[finite], expected[finite],
          precision=precision, record_metric=record_metric, metric="group_vs_per_head", rtol=RTOL,
          low=lambda: reference_group_scores(torch.float32), oracle=None if precision.float64 else
          reference_group_scores(torch.float64))


@given(data=st.data())
def test_heads_of_a_group_read_the_group_blocks(impl, envelope, device, precision, record_metric, data):
    """o_slc of every head h of group g == attention of q_h over the tokens of indices[b, p, g] (clipped to p)."""
    impl.require("nsa_forward")
    if "slc" not in impl.caps.branches:
        not_covered(f"{impl.name} computes no selected branch (declared branches {sorted(impl.caps.branches)})")
    cfg, T, B, seed = draw_case(data, envelope, min_group=2)
    show_reproducer(impl.spec, cfg, "out = impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)",
                    T=T, B=B, seed=seed, shared_kv=impl.shared_kv)
    x = inputs_for(impl, cfg, T, B=B, seed=seed, device=device)
    out = impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)
    o_slc, indices = out.o_slc.detach().double().cpu(), out.indices.cpu()
    G = cfg.group_size

    def group_attention(dtype):
        """Per (b, p, group): attention of the group's heads over the tokens of its returned blocks, in dtype."""
        q, k, v = (t.detach().to(dtype).cpu() for t in (x.q, *x.kv.slc))
        o = torch.empty(o_slc.shape, dtype=dtype)
        for b in range(B):
            for p in range(T):
                for g in range(cfg.n_kv_heads):
                    keys = selected_keys(p, indices[b, p, g].tolist(), cfg)
                    o[b, p, g * G:(g + 1) * G] = attend_keys(q[b, p, g * G:(g + 1) * G], k[b, :, g], v[b, :, g], keys)
        return o

    want = group_attention(torch.float64)
    where = ""
    if want.numel():
        diff = (o_slc - want).abs().nan_to_num(nan=float("inf")).amax(-1)
        b, p, h = (int(i) for i in torch.nonzero(diff == diff.max())[0])
        where = f" (largest at b={b}, p={p}, head {h}: group blocks {indices[b, p, h // G].tolist()})"
    close(f"o_slc vs attention over each group's selected blocks{where}", o_slc, want, precision=precision,
          record_metric=record_metric, metric="o_slc_vs_group_blocks", rtol=RTOL,
          low=lambda: group_attention(torch.float32))


@given(data=st.data())
def test_permuting_heads_within_a_group(impl, envelope, device, precision, record_metric, data):
    """Permuting the query heads (and their gates) inside each group permutes o and leaves indices unchanged."""
    impl.require("nsa_forward")
    cfg, T, B, seed = draw_case(data, envelope, min_group=2)
    show_reproducer(impl.spec, cfg, "out = impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)",
                    T=T, B=B, seed=seed, shared_kv=impl.shared_kv)
    G = cfg.group_size
    within = torch.randperm(G, generator=torch.Generator().manual_seed(seed))
    if torch.equal(within, torch.arange(G)):
        within = within.roll(1)
    perm = torch.cat([g * G + within for g in range(cfg.n_kv_heads)]).to(device)
    x = inputs_for(impl, cfg, T, B=B, seed=seed, device=device)
    a = impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)
    b = impl.nsa_forward(x.q[:, :, perm], x.kv, x.gates[:, :, perm], cfg, x.phi)
    assert torch.equal(a.indices, b.indices), "permuting the heads of a group changed the selected blocks"

    def reference_o(dtype):
        y = x.to(dtype=dtype, device="cpu")
        return REFERENCE.nsa_forward(y.q, y.kv, y.gates, cfg, y.phi).o

    close("output with the heads of each group permuted vs the permuted output", b.o, a.o[:, :, perm],
          precision=precision, record_metric=record_metric, metric="head_permutation", rtol=RTOL,
          low=lambda: reference_o(torch.float32), oracle=None if precision.float64 else reference_o(torch.float64))
