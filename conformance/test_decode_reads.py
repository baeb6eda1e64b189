"""Counted reads (Eq. 6: N_t = sum_c size[K~^c_t]) against Table 4, and decode = prefill.

Table 4 of the paper gives the decode memory access per attention op with the paper config: 2048, 2560,
3584, 5632 tokens at contexts 8192, 16384, 32768, 65536 (= s/d + n*l' + w). The implementation's
counted reads for one decode step at those contexts must match within 2 tokens (Eq. 7 counts
floor((s-l)/d) + 1 = s/d - 1 compressed tokens; docs/spec.md). Reads must be counts of what was
gathered: at every position they equal the sizes of the index sets - the visible compressed blocks, the
tokens of the returned selected blocks clipped to <= p, the window keys - counted here from the
returned indices (a formula such as n*l' is wrong for a partial current block or few blocks).
A decode step for the last TQ positions must equal the prefill at those positions.

An implementation with a stateful decoder (the optional stage NSADecodeCache, conformance/adapters) is
checked the same way: prefill a prompt, then single-token steps and chunks; every call's outputs,
indices and counted reads must equal the prefill's at those positions (compressed tokens must appear
exactly at the step that completes their block), and Table 4 holds for one cached step.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conformance.adapters import not_covered
from conformance.helpers import make_inputs, select_rows
from conformance.rules import selected_keys, visible_cmp_blocks, window_keys
from conformance.strategies import configs, lengths, show_reproducer
from reference.config import NSAConfig
from reference.contract import BranchKV

PROPERTY = "Counted reads and decode = prefill"
EQUATION = "Eq. 6, Table 4"

TABLE_4 = {8192: 2048, 16384: 2560, 32768: 3584, 65536: 5632}
TABLE_4_SLACK = 2
RTOL = 1e-12  # float64


def table4_config(preset: NSAConfig) -> NSAConfig:
    """Table 4's setting: the paper's sizes (l=32, d=16, l'=64, n=16, w=512) with the preset's convention
    switches, one head of a tiny dimension (reads do not depend on it), phi = mean pooling."""
    return NSAConfig.preset("paper", n_heads=1, n_kv_heads=1, head_dim_qk=2, head_dim_v=2, phi="avg",
                            window_keys=preset.window_keys, cmp_visibility=preset.cmp_visibility,
                            selection_score=preset.selection_score, group_reduce=preset.group_reduce)


@pytest.mark.parametrize("context", sorted(TABLE_4))
def test_table_4_decode_reads(impl, preset, device, record_metric, context):
    """One decode step at context s (the query at position s-1): counted reads total = Table 4 +- 2."""
    impl.require("decode_step")
    cfg = table4_config(preset)
    g = torch.Generator().manual_seed(context)
    k = torch.randn(1, context, 1, 2, generator=g, dtype=torch.float64).to(device)
    v = torch.randn(1, context, 1, 2, generator=g, dtype=torch.float64).to(device)
    q = torch.randn(1, 1, 1, 2, generator=g, dtype=torch.float64).to(device)
    gates = torch.full((1, 1, 1, 3), 0.5, dtype=torch.float64, device=device)
    out = impl.decode_step(q, BranchKV.shared(k, v), gates, cfg)
    if out.reads is None:
        not_covered(f"{impl.name}.decode_step reports no reads")
    reads = {b: int(getattr(out.reads, b)[0, 0, 0]) for b in ("cmp", "slc", "win")}
    total = sum(reads.values())
    for branch, count in reads.items():
        record_metric(f"decode_reads@{context}.{branch}", count, kind="count")
    assert abs(total - TABLE_4[context]) <= TABLE_4_SLACK, (
        f"counted decode reads at context {context}: {reads} (total {total}), Table 4 says {TABLE_4[context]}")
    chosen = [int(j) for j in out.indices[0, 0, 0] if j >= 0]
    assert_reads_are_counts(out.reads, out.indices, [context - 1], cfg, 0, 0, 0)
    assert len(chosen) == cfg.n_sel


def assert_reads_are_counts(reads, indices, positions, cfg, b: int, row: int, g: int) -> None:
    p = positions[row]
    want = {
        "cmp": visible_cmp_blocks(p, cfg),
        "slc": len(selected_keys(p, indices[b, row, g].tolist(), cfg)),
        "win": len(window_keys(p, cfg)),
    }
    got = {branch: int(getattr(reads, branch)[b, row, g]) for branch in want}
    assert got == want, (f"reads at position {p} (batch {b}, group {g}) = {got}, but the index sets hold {want} "
                         f"(selected blocks {indices[b, row, g].tolist()})")


def check_all_reads(out, positions, cfg) -> None:
    if out.reads is None:
        not_covered("the implementation reports no reads")
    reads = type(out.reads)(*(t.cpu() for t in (out.reads.cmp, out.reads.slc, out.reads.win)))
    indices = out.indices.cpu()
    for b in range(indices.shape[0]):
        for row in range(len(positions)):
            for g in range(cfg.n_kv_heads):
                assert_reads_are_counts(reads, indices, positions, cfg, b, row, g)


@pytest.mark.parametrize("context", sorted(TABLE_4))
def test_table_4_cached_decode_reads(impl, preset, device, record_metric, context):
    """The cache filled with s-1 prompt tokens, one step: counted reads total = Table 4 +- 2."""
    cache = cache_or_skip(impl)
    cfg = table4_config(preset)
    g = torch.Generator().manual_seed(context)
    k = torch.randn(1, context, 1, 2, generator=g, dtype=torch.float64).to(device)
    v = torch.randn(1, context, 1, 2, generator=g, dtype=torch.float64).to(device)
    q = torch.randn(1, 1, 1, 2, generator=g, dtype=torch.float64).to(device)
    gates = torch.full((1, 1, 1, 3), 0.5, dtype=torch.float64, device=device)
    decoder = cache(cfg, 1, context, dtype=torch.float64, device=device, phi=None)
    if not hasattr(decoder, "fill"):
        pytest.skip(f"not applicable: {impl.name}'s NSADecodeCache has no fill() (a {context}-token prefill on "
                    "CPU would be slow)")
    decoder.fill(BranchKV.shared(k[:, :-1], v[:, :-1]))
    out = decoder.step(q, BranchKV.shared(k[:, -1:], v[:, -1:]), gates)
    reads = {b: int(getattr(out.reads, b)[0, 0, 0]) for b in ("cmp", "slc", "win")}
    for branch, count in reads.items():
        record_metric(f"cached_decode_reads@{context}.{branch}", count, kind="count")
    assert abs(sum(reads.values()) - TABLE_4[context]) <= TABLE_4_SLACK, (
        f"cached decode reads at context {context}: {reads}, Table 4 says {TABLE_4[context]}")
    assert_reads_are_counts(out.reads, out.indices, [context - 1], cfg, 0, 0, 0)


def cache_or_skip(impl):
    if not impl.has("NSADecodeCache"):
        pytest.skip(f"not applicable: {impl.name} has no NSADecodeCache (an optional stage)")
    return impl.NSADecodeCache


@given(data=st.data())
def test_cached_decode_equals_prefill(impl, preset, device, record_metric, data):
    """prefill(P tokens), then step (1 token) / extend (chunks): every call == the prefill of all T tokens at its
    positions (outputs within float64 rounding; indices and counted reads identical)."""
    cache = cache_or_skip(impl)
    impl.require("nsa_forward")
    cfg = data.draw(configs(preset), label="cfg")
    T = data.draw(lengths(cfg, low=2, high=40), label="T")
    P = data.draw(st.integers(1, T - 1), label="prompt")
    chunks, left = [], T - P
    while left:
        chunks.append(min(left, data.draw(st.sampled_from([1, 1, 2, 3, 5]), label="chunk")))
        left -= chunks[-1]
    seed = data.draw(st.integers(0, 2**20), label="seed")
    show_reproducer(impl.spec, cfg, f"# prompt {P}, then chunks {chunks}; see test_cached_decode_equals_prefill\n"
                    f"dec = impl.NSADecodeCache(cfg, 2, {T}, dtype=torch.float64, device='cpu', phi=x.phi)",
                    T=T, B=2, seed=seed, shared_kv=impl.shared_kv)
    x = make_inputs(cfg, T, B=2, seed=seed, device=device, shared_kv=impl.shared_kv)
    pre = impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)
    decoder = cache(cfg, 2, T, dtype=torch.float64, device=device, phi=x.phi)

    def part(a: int, b: int):
        y = select_rows(x, time=slice(a, b))
        return y.q, y.kv, y.gates

    calls = [("prefill", 0, P)]
    for c in chunks:
        calls.append(("step" if c == 1 else "extend", calls[-1][2], calls[-1][2] + c))
    worst = 0.0
    for how, a, b in calls:
        out = getattr(decoder, how)(*part(a, b))
        where = f"{how} of positions {a}..{b - 1} (prompt {P}, chunks {chunks})"
        assert torch.equal(out.indices, pre.indices[:, a:b]), (
            f"{where}: indices {out.indices.tolist()} != prefill {pre.indices[:, a:b].tolist()}")
        for field in ("o", "o_cmp", "o_slc", "o_win"):
            got, want = getattr(out, field).double(), getattr(pre, field)[:, a:b].double()
            err = float((got - want).abs().max())
            tol = RTOL * (1 + float(want.abs().max()))
            worst = max(worst, err / tol)
            assert err <= tol, f"{where}: {field} differs from prefill by {err:.3g}"
        if out.reads is not None:
            for branch in ("cmp", "slc", "win"):
                assert torch.equal(getattr(out.reads, branch), getattr(pre.reads, branch)[:, a:b]), (
                    f"{where}: reads.{branch} {getattr(out.reads, branch).tolist()} != prefill "
                    f"{getattr(pre.reads, branch)[:, a:b].tolist()}")
            check_all_reads(out, list(range(a, b)), cfg)
    record_metric("cached_decode_vs_prefill", worst)


@given(data=st.data())
def test_prefill_reads_count_the_index_sets(impl, preset, device, data):
    """nsa_forward's reads at every position equal the sizes of the index sets it used."""
    impl.require("nsa_forward")
    cfg = data.draw(configs(preset), label="cfg")
    T = data.draw(lengths(cfg, high=48), label="T")
    seed = data.draw(st.integers(0, 2**20), label="seed")
    show_reproducer(impl.spec, cfg, "out = impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)",
                    T=T, B=2, seed=seed, shared_kv=impl.shared_kv)
    x = make_inputs(cfg, T, B=2, seed=seed, device=device, shared_kv=impl.shared_kv)
    check_all_reads(impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi), list(range(T)), cfg)


def draw_decode_case(data, preset):
    cfg = data.draw(configs(preset), label="cfg")
    TK = data.draw(lengths(cfg, low=1, high=48), label="TK")
    TQ = data.draw(st.sampled_from(sorted({1, min(2, TK), min(3, TK), TK})), label="TQ")
    seed = data.draw(st.integers(0, 2**20), label="seed")
    return cfg, TK, TQ, seed


@given(data=st.data())
def test_decode_reads_count_the_index_sets(impl, preset, device, data):
    """decode_step's reads for each new query equal the sizes of the index sets it used."""
    impl.require("decode_step")
    cfg, TK, TQ, seed = draw_decode_case(data, preset)
    show_reproducer(impl.spec, cfg, f"out = impl.decode_step(x.q[:, -{TQ}:], x.kv, x.gates[:, -{TQ}:], cfg, x.phi)",
                    T=TK, B=2, seed=seed, shared_kv=impl.shared_kv)
    x = make_inputs(cfg, TK, B=2, seed=seed, device=device, shared_kv=impl.shared_kv)
    out = impl.decode_step(x.q[:, TK - TQ:], x.kv, x.gates[:, TK - TQ:], cfg, x.phi)
    check_all_reads(out, list(range(TK - TQ, TK)), cfg)


@given(data=st.data())
def test_decode_equals_prefill(impl, preset, device, record_metric, data):
    """decode_step for the last TQ of TK positions == nsa_forward over TK at those positions (outputs within
    float64 rounding, indices and reads identical)."""
    impl.require("decode_step", "nsa_forward")
    cfg, TK, TQ, seed = draw_decode_case(data, preset)
    show_reproducer(impl.spec, cfg, f"dec = impl.decode_step(x.q[:, -{TQ}:], x.kv, x.gates[:, -{TQ}:], cfg, x.phi)\n"
                    "pre = impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)",
                    T=TK, B=2, seed=seed, shared_kv=impl.shared_kv)
    x = make_inputs(cfg, TK, B=2, seed=seed, device=device, shared_kv=impl.shared_kv)
    pre = impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)
    dec = impl.decode_step(x.q[:, TK - TQ:], x.kv, x.gates[:, TK - TQ:], cfg, x.phi)
    assert torch.equal(dec.indices, pre.indices[:, TK - TQ:]), (
        f"decode indices {dec.indices.tolist()} != prefill indices {pre.indices[:, TK - TQ:].tolist()}")
    worst = 0.0
    for field in ("o", "o_cmp", "o_slc", "o_win"):
        a, b = getattr(dec, field).double(), getattr(pre, field)[:, TK - TQ:].double()
        err = float((a - b).abs().max())
        tol = RTOL * (1 + float(b.abs().max()))
        worst = max(worst, err / tol)
        assert err <= tol, f"decode {field} differs from prefill at positions {TK - TQ}..{TK - 1}: max error {err:.3g}"
    record_metric("decode_vs_prefill", worst)
    if dec.reads is not None and pre.reads is not None:
        for branch in ("cmp", "slc", "win"):
            assert torch.equal(getattr(dec.reads, branch), getattr(pre.reads, branch)[:, TK - TQ:]), (
                f"decode reads.{branch} differ from prefill")

