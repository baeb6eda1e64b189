"""Counted reads (Eq. 6: N_t = sum_c size[K~^c_t]) against Table 4, and decode = prefill.

Table 4 of the paper gives the decode memory access per attention op with the paper config: 2048, 2560,
3584, 5632 tokens at contexts 8192, 16384, 32768, 65536 (= s/d + n*l' + w). The implementation's
counted reads for one decode step at those contexts must match within 2 tokens (Eq. 7 counts
floor((s-l)/d) + 1 = s/d - 1 compressed tokens; docs/spec.md). Reads must be counts of what was
gathered: at every position they equal the sizes of the index sets - the visible compressed blocks, the
tokens of the returned selected blocks clipped to <= p, the window keys - counted here from the
returned indices (a formula such as n*l' is wrong for a partial current block or few blocks).
A decode step for the last TQ positions must equal the prefill at those positions, and the reference oracle's
prefill there (a bug shared by an implementation's decode and prefill is invisible to decode = prefill alone).

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

from conformance.adapters import load_impl, not_covered
from conformance.helpers import inputs_for, select_rows
from conformance.precision import close
from conformance.rules import selected_keys, visible_cmp_blocks, window_keys
from conformance.strategies import configs, lengths, show_reproducer
from reference.config import NSAConfig
from reference.contract import BranchKV

PROPERTY = "Counted reads and decode = prefill"
EQUATION = "Eq. 6, Table 4"

TABLE_4 = {8192: 2048, 16384: 2560, 32768: 3584, 65536: 5632}
TABLE_4_SLACK = 2
RTOL = 1e-12  # float64
REFERENCE = load_impl("reference")


def table4_config(envelope) -> NSAConfig:
    """Table 4's setting: the paper's sizes (l=32, d=16, l'=64, n=16 with 1 + 2 forced blocks, w=512) with the
    checked convention switches, phi = mean pooling, the smallest head layout inside the envelope (reads do not
    depend on it). NOT COVERED if the implementation does not declare those sizes."""
    c = envelope.conventions
    caps = envelope.caps
    cfg = NSAConfig.preset("paper", n_heads=1, n_kv_heads=1, head_dim_qk=2, head_dim_v=2, phi="avg",
                           window_keys=c.window_keys, cmp_visibility=c.cmp_visibility,
                           selection_score=c.selection_score, group_reduce=c.group_reduce)
    group, dk = caps.group_sizes.pick(1), caps.head_dims_qk.pick(2)
    dv = dk if caps.equal_head_dims else caps.head_dims_v.pick(2)
    if None not in (group, dk, dv):
        cfg = cfg.replace(n_heads=group, head_dim_qk=dk, head_dim_v=dv)
    why = caps.outside(cfg)
    if why:
        not_covered(f"outside the declared capabilities: Table 4 needs the paper's sizes: {why}")
    return cfg


def table4_inputs(cfg, context: int, device):
    g = torch.Generator().manual_seed(context)
    k = torch.randn(1, context, 1, cfg.head_dim_qk, generator=g, dtype=torch.float64).to(device)
    v = torch.randn(1, context, 1, cfg.head_dim_v, generator=g, dtype=torch.float64).to(device)
    q = torch.randn(1, 1, cfg.n_heads, cfg.head_dim_qk, generator=g, dtype=torch.float64).to(device)
    gates = torch.full((1, 1, cfg.n_heads, 3), 0.5, dtype=torch.float64, device=device)
    return q, k, v, gates


@pytest.mark.parametrize("context", sorted(TABLE_4))
def test_table_4_decode_reads(impl, envelope, device, record_metric, context):
    """One decode step at context s (the query at position s-1): counted reads total = Table 4 +- 2."""
    impl.require("decode_step")
    cfg = table4_config(envelope)
    q, k, v, gates = table4_inputs(cfg, context, device)
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
def test_table_4_cached_decode_reads(impl, envelope, device, record_metric, context):
    """The cache filled with s-1 prompt tokens, one step: counted reads total = Table 4 +- 2."""
    cache = cache_or_skip(impl)
    cfg = table4_config(envelope)
    q, k, v, gates = table4_inputs(cfg, context, device)
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
def test_cached_decode_equals_prefill(impl, envelope, device, precision, record_metric, data):
    """prefill(P tokens), then step (1 token) / extend (chunks): every call == the prefill of all T tokens at its
    positions (outputs within float64 rounding; indices and counted reads identical)."""
    cache = cache_or_skip(impl)
    impl.require("nsa_forward")
    cfg = data.draw(configs(envelope), label="cfg")
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
    x = inputs_for(impl, cfg, T, B=2, seed=seed, device=device)
    pre = impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)
    decoder = cache(cfg, 2, T, dtype=torch.float64, device=device, phi=x.phi)

    def part(a: int, b: int):
        y = select_rows(x, time=slice(a, b))
        return y.q, y.kv, y.gates

    calls = [("prefill", 0, P)]
    for c in chunks:
        calls.append(("step" if c == 1 else "extend", calls[-1][2], calls[-1][2] + c))
    reference = ReferenceOutputs(x, cfg)
    for how, a, b in calls:
        out = getattr(decoder, how)(*part(a, b))
        where = f"{how} of positions {a}..{b - 1} (prompt {P}, chunks {chunks})"
        assert torch.equal(out.indices, pre.indices[:, a:b]), (
            f"{where}: indices {out.indices.tolist()} != prefill {pre.indices[:, a:b].tolist()}")
        if out.reads is not None:
            for branch in ("cmp", "slc", "win"):
                assert torch.equal(getattr(out.reads, branch), getattr(pre.reads, branch)[:, a:b]), (
                    f"{where}: reads.{branch} {getattr(out.reads, branch).tolist()} != prefill "
                    f"{getattr(pre.reads, branch)[:, a:b].tolist()}")
            check_all_reads(out, list(range(a, b)), cfg)
        for field in ("o", "o_cmp", "o_slc", "o_win"):
            close(f"{where}: {field} vs prefill", getattr(out, field), getattr(pre, field)[:, a:b],
                  precision=precision, record_metric=record_metric, metric="cached_decode_vs_prefill", rtol=RTOL,
                  low=lambda f=field: reference.field(f, torch.float32)[:, a:b],
                  oracle=None if precision.float64 else reference.field(field, torch.float64)[:, a:b])


@given(data=st.data())
def test_prefill_reads_count_the_index_sets(impl, envelope, device, data):
    """nsa_forward's reads at every position equal the sizes of the index sets it used."""
    impl.require("nsa_forward")
    cfg = data.draw(configs(envelope), label="cfg")
    T = data.draw(lengths(cfg, high=48), label="T")
    seed = data.draw(st.integers(0, 2**20), label="seed")
    show_reproducer(impl.spec, cfg, "out = impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)",
                    T=T, B=2, seed=seed, shared_kv=impl.shared_kv)
    x = inputs_for(impl, cfg, T, B=2, seed=seed, device=device)
    check_all_reads(impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi), list(range(T)), cfg)


def draw_decode_case(data, envelope):
    cfg = data.draw(configs(envelope), label="cfg")
    TK = data.draw(lengths(cfg, low=1, high=48), label="TK")
    TQ = data.draw(st.sampled_from(sorted({1, min(2, TK), min(3, TK), TK})), label="TQ")
    seed = data.draw(st.integers(0, 2**20), label="seed")
    return cfg, TK, TQ, seed


@given(data=st.data())
def test_decode_reads_count_the_index_sets(impl, envelope, device, data):
    """decode_step's reads for each new query equal the sizes of the index sets it used."""
    impl.require("decode_step")
    cfg, TK, TQ, seed = draw_decode_case(data, envelope)
    show_reproducer(impl.spec, cfg, f"out = impl.decode_step(x.q[:, -{TQ}:], x.kv, x.gates[:, -{TQ}:], cfg, x.phi)",
                    T=TK, B=2, seed=seed, shared_kv=impl.shared_kv)
    x = inputs_for(impl, cfg, TK, B=2, seed=seed, device=device)
    out = impl.decode_step(x.q[:, TK - TQ:], x.kv, x.gates[:, TK - TQ:], cfg, x.phi)
    check_all_reads(out, list(range(TK - TQ, TK)), cfg)


class ReferenceOutputs:
    """The reference's nsa_forward on x (float64, or on x rounded to float32), computed once each."""

    def __init__(self, x, cfg) -> None:
        self.x, self.cfg, self.runs = x, cfg, {}

    def run(self, dtype: torch.dtype):
        if dtype not in self.runs:
            y = self.x.to(dtype=dtype, device="cpu")
            self.runs[dtype] = REFERENCE.nsa_forward(y.q, y.kv, y.gates, self.cfg, y.phi)
        return self.runs[dtype]

    def field(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        return getattr(self.run(dtype), name)


@given(data=st.data())
def test_decode_equals_prefill(impl, envelope, device, precision, record_metric, data):
    """decode_step for the last TQ of TK positions == nsa_forward over TK at those positions (outputs within
    float64 rounding, indices and reads identical)."""
    impl.require("decode_step", "nsa_forward")
    cfg, TK, TQ, seed = draw_decode_case(data, envelope)
    show_reproducer(impl.spec, cfg, f"dec = impl.decode_step(x.q[:, -{TQ}:], x.kv, x.gates[:, -{TQ}:], cfg, x.phi)\n"
                    "pre = impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)",
                    T=TK, B=2, seed=seed, shared_kv=impl.shared_kv)
    x = inputs_for(impl, cfg, TK, B=2, seed=seed, device=device)
    pre = impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)
    dec = impl.decode_step(x.q[:, TK - TQ:], x.kv, x.gates[:, TK - TQ:], cfg, x.phi)
    assert torch.equal(dec.indices, pre.indices[:, TK - TQ:]), (
        f"decode indices {dec.indices.tolist()} != prefill indices {pre.indices[:, TK - TQ:].tolist()}")
    if dec.reads is not None and pre.reads is not None:
        for branch in ("cmp", "slc", "win"):
            assert torch.equal(getattr(dec.reads, branch), getattr(pre.reads, branch)[:, TK - TQ:]), (
                f"decode reads.{branch} differ from prefill")
    reference = ReferenceOutputs(x, cfg)
    for field in ("o", "o_cmp", "o_slc", "o_win"):
        close(f"decode {field} vs prefill at positions {TK - TQ}..{TK - 1}", getattr(dec, field),
              getattr(pre, field)[:, TK - TQ:], precision=precision, record_metric=record_metric,
              metric="decode_vs_prefill", rtol=RTOL, low=lambda f=field: reference.field(f, torch.float32)[:, TK - TQ:],
              oracle=None if precision.float64 else reference.field(field, torch.float64)[:, TK - TQ:])


def assert_equals_the_oracle(what: str, out, reference: ReferenceOutputs, a: int, b: int, cfg, precision,
                             record_metric) -> None:
    """out (the outputs of positions a..b-1) == the reference's prefill there: indices identical (tie-aware for an
    implementation computing in float32 is not needed: its indices come from the same rule), then every output."""
    want = reference.run(torch.float64)
    assert torch.equal(out.indices.cpu(), want.indices[:, a:b]), (
        f"{what}: indices {out.indices.tolist()} != the reference's {want.indices[:, a:b].tolist()}")
    for field in ("o", "o_cmp", "o_slc", "o_win"):
        close(f"{what}: {field} vs the reference's prefill at positions {a}..{b - 1}", getattr(out, field),
              getattr(want, field)[:, a:b], precision=precision, record_metric=record_metric,
              metric="decode_vs_reference", rtol=RTOL, low=lambda f=field: reference.field(f, torch.float32)[:, a:b])


@given(data=st.data())
def test_decode_equals_the_reference(impl, envelope, device, precision, record_metric, data):
    """decode_step for the last TQ of TK positions == the reference oracle's prefill at those positions: indices
    and outputs (decode = prefill alone cannot see a bug the implementation's decode and prefill share)."""
    impl.require("decode_step")
    cfg, TK, TQ, seed = draw_decode_case(data, envelope)
    show_reproducer(impl.spec, cfg, f"dec = impl.decode_step(x.q[:, -{TQ}:], x.kv, x.gates[:, -{TQ}:], cfg, x.phi)\n"
                    "ref = load_impl('reference').nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)",
                    T=TK, B=2, seed=seed, shared_kv=impl.shared_kv)
    x = inputs_for(impl, cfg, TK, B=2, seed=seed, device=device)
    dec = impl.decode_step(x.q[:, TK - TQ:], x.kv, x.gates[:, TK - TQ:], cfg, x.phi)
    assert_equals_the_oracle(f"decode_step of the last {TQ} of {TK} positions", dec, ReferenceOutputs(x, cfg),
                             TK - TQ, TK, cfg, precision, record_metric)


@given(data=st.data())
def test_cached_decode_equals_the_reference(impl, envelope, device, precision, record_metric, data):
    """NSADecodeCache: prefill a prompt, then single-token steps: every step == the reference oracle's prefill at
    its position."""
    cache = cache_or_skip(impl)
    cfg = data.draw(configs(envelope), label="cfg")
    T = data.draw(lengths(cfg, low=2, high=24), label="T")
    P = data.draw(st.integers(1, T - 1), label="prompt")
    seed = data.draw(st.integers(0, 2**20), label="seed")
    show_reproducer(impl.spec, cfg, f"dec = impl.NSADecodeCache(cfg, 2, {T}, dtype=torch.float64, device='cpu', "
                    f"phi=x.phi)  # prefill {P} tokens, then steps", T=T, B=2, seed=seed, shared_kv=impl.shared_kv)
    x = inputs_for(impl, cfg, T, B=2, seed=seed, device=device)
    reference = ReferenceOutputs(x, cfg)
    decoder = cache(cfg, 2, T, dtype=torch.float64, device=device, phi=x.phi)
    y = select_rows(x, time=slice(0, P))
    decoder.prefill(y.q, y.kv, y.gates)
    for p in range(P, T):
        y = select_rows(x, time=slice(p, p + 1))
        out = decoder.step(y.q, y.kv, y.gates)
        assert_equals_the_oracle(f"cached step at position {p} (prompt {P})", out, reference, p, p + 1, cfg,
                                 precision, record_metric)
