"""No peeking (causality), Eq. 1: o_t = Attn(q_t, k_{:t}, v_{:t}) - every branch of NSA may read only keys
at positions <= p (Eq. 7: a compressed block only once its last key i*d + l - 1 is <= p; Eq. 12: the
current selection block J clipped to <= p; the window [p-w+1, p]).

Test: perturb q, every branch's k and v, and the gates at all positions >= s; outputs (o, o_cmp, o_slc,
o_win), selected indices and counted reads at positions < s, and the gradients that a loss on those
outputs sends to positions < s (and to the phi weights), must not change at all - bitwise, in float64.
The cut s is drawn at the convention edges (the last key of a compressed block, selection block starts,
the window size) and at random; end to end (where an implementation with only `nsa_forward` shows whether its
selection scores read compressed blocks not yet visible: through the indices it returns), per branch stage, for a
chunked decode step, and for a black-box module (any nn.Module with its own projections: forward(x) only).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conformance.helpers import (BLACK_BOX_HIDDEN, Inputs, black_box_module, call_module, first_difference, inputs_for,
                                 make_inputs, named_tensors, perturb_from, select_rows)
from conformance.rules import complete_cmp_blocks, current_sel_block, visible_cmp_blocks
from conformance.strategies import boundaries, configs, lengths, show_reproducer
from reference.contract import BranchKV

PROPERTY = "No peeking"
EQUATION = "Eq. 1, 7, 12, window"


@st.composite
def cuts(draw, cfg, T: int) -> list[int]:
    """Up to three cut positions s in 1..T-1: a compressed block's last key, a convention edge, any."""
    if T < 2:
        return []
    cmp_ends = [i * cfg.cmp_stride + cfg.cmp_block - 1 for i in range(T)]
    cmp_ends = [e for e in cmp_ends if 1 <= e <= T - 1]
    out = {draw(st.integers(1, T - 1))}
    if cmp_ends:
        out.add(draw(st.sampled_from(cmp_ends)))
    edges = boundaries(cfg, T - 1)
    if edges:
        out.add(draw(st.sampled_from(edges)))
    return sorted(out)


def loss_weights(shape, seed: int, upto: int, device) -> torch.Tensor:
    """Random weights for a scalar loss on outputs at positions < upto (zero elsewhere)."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    w[:, upto:] = 0
    return w.to(device)


def grads(loss: torch.Tensor, x: Inputs) -> dict[str, torch.Tensor]:
    named = named_tensors(x)
    if not loss.requires_grad:  # e.g. no compressed block visible anywhere: the output is a constant 0
        return {n: torch.zeros_like(t) for n, t in named.items()}
    got = torch.autograd.grad(loss, list(named.values()), allow_unused=True)
    return {n: (torch.zeros_like(t) if g is None else g) for (n, t), g in zip(named.items(), got)}


def assert_prefix_equal(what: str, a: torch.Tensor, b: torch.Tensor, s: int) -> None:
    diff = first_difference(a[:, :s], b[:, :s])
    assert not diff, f"{what} at positions < {s} changed when positions >= {s} were perturbed: {diff}"


def assert_grads_equal(ga: dict, gb: dict, s: int) -> None:
    for name in ga:
        if name.startswith("phi."):  # weights, not positions: only blocks visible before s may reach them
            diff = first_difference(ga[name], gb[name])
        else:
            diff = first_difference(ga[name][:, :s], gb[name][:, :s])
        assert not diff, (f"gradient of {name} changed when positions >= {s} were perturbed "
                          f"(loss on outputs < {s} only): {diff}")


def branch_run(attention, branch: str, seed: int, device):
    """run(x, s) for one branch stage: its output and the gradients of a loss on rows < s with respect to q and
    that branch's k, v. attention(q, k, v) calls the stage."""

    def run(x: Inputs, s: int):
        xg = x.to(requires_grad=True)
        k, v = xg.kv.branch(branch)
        o = attention(xg.q, k, v)
        loss = (o * loss_weights(o.shape, seed, s, device)).sum()
        return o, dict(zip(("q", "k", "v"), torch.autograd.grad(loss, [xg.q, k, v])))

    return run


def assert_ignores_the_future(what: str, run, x: Inputs, data, cfg, T: int, seed: int) -> None:
    """For every drawn cut s: the output rows < s and the gradients reaching positions < s are identical whether
    or not everything at positions >= s is perturbed."""
    for s in data.draw(cuts(cfg, T), label="cuts"):
        (a, ga), (b, gb) = run(x, s), run(perturb_from(x, s, seed=seed + s), s)
        assert_prefix_equal(what, a, b, s)
        assert_grads_equal(ga, gb, s)


def draw_case(data, envelope, low: int = 2, high: int = 40):
    cfg = data.draw(configs(envelope), label="cfg")
    T = data.draw(lengths(cfg, low=low, high=high), label="T")
    B = data.draw(st.integers(1, 2), label="B")
    seed = data.draw(st.integers(0, 2**20), label="seed")
    return cfg, T, B, seed


@given(data=st.data())
def test_prefill_end_to_end(impl, envelope, device, data):
    """nsa_forward: outputs, per-branch outputs, indices, reads and gradients before the cut are unchanged."""
    impl.require("nsa_forward")
    cfg, T, B, seed = draw_case(data, envelope)
    show_reproducer(impl.spec, cfg, "out = impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)",
                    T=T, B=B, seed=seed, shared_kv=impl.shared_kv)

    def run(x: Inputs, s: int):
        xg = x.to(requires_grad=True)
        out = impl.nsa_forward(xg.q, xg.kv, xg.gates, cfg, xg.phi)
        loss = (out.o * loss_weights(out.o.shape, seed, s, device)).sum()
        return out, grads(loss, xg)

    x = inputs_for(impl, cfg, T, B=B, seed=seed, device=device)
    for s in data.draw(cuts(cfg, T), label="cuts"):
        (a, ga), (b, gb) = run(x, s), run(perturb_from(x, s, seed=seed + s, caps=impl.caps), s)
        for field in ("indices", "o", "o_cmp", "o_slc", "o_win"):
            assert_prefix_equal(field, getattr(a, field), getattr(b, field), s)
        if a.reads is not None:
            for branch in ("cmp", "slc", "win"):
                assert_prefix_equal(f"reads.{branch}", getattr(a.reads, branch), getattr(b.reads, branch), s)
        assert_grads_equal(ga, gb, s)


@given(data=st.data())
def test_compressed_branch(impl, envelope, device, data):
    """compress + compressed_attention: a block must not be visible before its last key."""
    impl.require("compress", "compressed_attention")
    cfg, T, B, seed = draw_case(data, envelope)
    show_reproducer(impl.spec, cfg, "k_cmp, v_cmp = impl.compress(x.kv.cmp.k, x.kv.cmp.v, cfg, x.phi)\n"
                    "o_cmp = impl.compressed_attention(x.q, k_cmp, v_cmp, cfg)", T=T, B=B, seed=seed)

    def run(x: Inputs, s: int):
        xg = x.to(requires_grad=True)
        k_cmp, v_cmp = impl.compress(xg.kv.cmp.k, xg.kv.cmp.v, cfg, xg.phi)
        o = impl.compressed_attention(xg.q, k_cmp, v_cmp, cfg)
        loss = (o * loss_weights(o.shape, seed, s, device)).sum()
        only_cmp = Inputs(xg.q, BranchKV.shared(*xg.kv.cmp), xg.gates, xg.phi)
        g = grads(loss, only_cmp)
        g.pop("gates")
        return o, g

    x = make_inputs(cfg, T, B=B, seed=seed, device=device)
    assert_ignores_the_future("o_cmp", run, x, data, cfg, T, seed)


@given(data=st.data())
def test_selection_scoring(impl, envelope, device, data):
    """selection_scores (+ select_blocks): rows < s ignore q at >= s and compressed keys not yet visible.
    (An implementation with only nsa_forward is checked on the indices it returns, test_prefill_end_to_end.)"""
    impl.require("selection_scores")
    cfg, T, B, seed = draw_case(data, envelope)
    show_reproducer(impl.spec, cfg, "k_cmp = torch.randn(x.q.shape[0], max(0, (x.q.shape[1] - cfg.cmp_block) "
                    "// cfg.cmp_stride + 1), cfg.n_kv_heads, cfg.head_dim_qk, dtype=torch.float64)\n"
                    "scores = impl.selection_scores(x.q, k_cmp, cfg)", T=T, B=B, seed=seed)
    g = torch.Generator().manual_seed(seed)
    x = make_inputs(cfg, T, B=B, seed=seed, device=device)
    N = complete_cmp_blocks(T, cfg)
    k_cmp = torch.randn(B, N, cfg.n_kv_heads, cfg.head_dim_qk, generator=g, dtype=torch.float64).to(device)
    for s in data.draw(cuts(cfg, T), label="cuts"):
        k_cmp2 = k_cmp.clone()
        seen = visible_cmp_blocks(s - 1, cfg)
        k_cmp2[:, seen:] = 3 * torch.randn(k_cmp2[:, seen:].shape, generator=g, dtype=torch.float64).to(device)
        q2 = perturb_from(x, s, seed=seed + s).q
        a, b = impl.selection_scores(x.q, k_cmp, cfg), impl.selection_scores(q2, k_cmp2, cfg)
        assert_prefix_equal("selection scores", a, b, s)
        if impl.has("select_blocks"):
            assert_prefix_equal("selected indices", impl.select_blocks(a, cfg), impl.select_blocks(b, cfg), s)


def random_indices(cfg, B: int, T: int, seed: int) -> torch.Tensor:
    """Valid Eq. 11-shaped indices chosen by the test: per (b, p, g) the current block J (partial) plus
    random earlier blocks, n at most, ascending, padded with -1."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((B, T, cfg.n_kv_heads, cfg.n_sel), -1, dtype=torch.int64)
    for b in range(B):
        for p in range(T):
            J = current_sel_block(p, cfg)
            for h in range(cfg.n_kv_heads):
                others = torch.randperm(J, generator=g)[: cfg.n_sel - 1].tolist() if J else []
                chosen = sorted(set(others) | {J})
                out[b, p, h, : len(chosen)] = torch.tensor(chosen)
    return out


@given(data=st.data())
def test_selected_branch_partial_block(impl, envelope, device, data):
    """selected_attention: keys after p inside the (selected) current block J must stay unread."""
    impl.require("selected_attention")
    cfg, T, B, seed = draw_case(data, envelope)
    show_reproducer(impl.spec, cfg, "o = impl.selected_attention(x.q, x.kv.slc.k, x.kv.slc.v, indices, cfg)"
                    "  # indices: see random_indices in conformance/test_no_peeking.py", T=T, B=B, seed=seed)
    indices = random_indices(cfg, B, T, seed).to(device)
    run = branch_run(lambda q, k, v: impl.selected_attention(q, k, v, indices, cfg), "slc", seed, device)
    x = make_inputs(cfg, T, B=B, seed=seed, device=device)
    assert_ignores_the_future("o_slc", run, x, data, cfg, T, seed)


@given(data=st.data())
def test_window_branch(impl, envelope, device, data):
    """window_attention: keys [p-w+1, p] (or [p-w, p]) only."""
    impl.require("window_attention")
    cfg, T, B, seed = draw_case(data, envelope)
    show_reproducer(impl.spec, cfg, "o = impl.window_attention(x.q, x.kv.win.k, x.kv.win.v, cfg)",
                    T=T, B=B, seed=seed)
    run = branch_run(lambda q, k, v: impl.window_attention(q, k, v, cfg), "win", seed, device)
    x = make_inputs(cfg, T, B=B, seed=seed, device=device)
    assert_ignores_the_future("o_win", run, x, data, cfg, T, seed)


@given(data=st.data())
def test_decode_chunk(impl, envelope, device, data):
    """decode_step with TQ new queries (positions TK-TQ..TK-1): a query ignores the later keys of its chunk."""
    impl.require("decode_step")
    cfg, TK, B, seed = draw_case(data, envelope, low=3)
    TQ = data.draw(st.integers(2, min(TK, 8)), label="TQ")
    show_reproducer(impl.spec, cfg, f"out = impl.decode_step(x.q[:, -{TQ}:], x.kv, x.gates[:, -{TQ}:], cfg, x.phi)",
                    T=TK, B=B, seed=seed, shared_kv=impl.shared_kv)
    first = TK - TQ

    def run(x: Inputs, s: int):
        xg = x.to(requires_grad=True)
        out = impl.decode_step(xg.q[:, first:], xg.kv, xg.gates[:, first:], cfg, xg.phi)
        w = loss_weights((B, TK) + tuple(out.o.shape[2:]), seed, s, device)[:, first:]
        return out, grads((out.o * w).sum(), xg)

    x = inputs_for(impl, cfg, TK, B=B, seed=seed, device=device)
    for s in sorted({data.draw(st.integers(first + 1, TK - 1), label="cut")}):
        (a, ga), (b, gb) = run(x, s), run(perturb_from(x, s, seed=seed + s, caps=impl.caps), s)
        for field in ("indices", "o", "o_cmp", "o_slc", "o_win"):
            assert_prefix_equal(f"decode {field} (query rows)", getattr(a, field), getattr(b, field), s - first)
        assert_grads_equal(ga, gb, s)


@given(data=st.data())
def test_cached_decode_chunk(impl, envelope, device, data):
    """NSADecodeCache (optional stage): after a prompt, extend() by a chunk; a query of the chunk ignores the
    chunk's later keys, queries and gates (outputs bitwise)."""
    if not impl.has("NSADecodeCache"):
        pytest.skip(f"not applicable: {impl.name} has no NSADecodeCache (an optional stage)")
    cfg, T, B, seed = draw_case(data, envelope, low=3)
    P = data.draw(st.integers(1, T - 2), label="prompt")
    s = data.draw(st.integers(P + 1, T - 1), label="cut")
    show_reproducer(impl.spec, cfg, f"dec = impl.NSADecodeCache(cfg, {B}, {T}, dtype=torch.float64, device='cpu', "
                    f"phi=x.phi)  # prefill {P} tokens, extend by {T - P}, perturb positions >= {s}",
                    T=T, B=B, seed=seed, shared_kv=impl.shared_kv)

    def run(x: Inputs):
        decoder = impl.NSADecodeCache(cfg, B, T, dtype=torch.float64, device=device, phi=x.phi)
        for a, b, how in ((0, P, "prefill"), (P, T, "extend")):
            y = select_rows(x, time=slice(a, b))
            out = getattr(decoder, how)(y.q, y.kv, y.gates)
        return out

    x = inputs_for(impl, cfg, T, B=B, seed=seed, device=device)
    a, b = run(x), run(perturb_from(x, s, seed=seed + s, caps=impl.caps))
    for field in ("indices", "o", "o_cmp", "o_slc", "o_win"):
        assert_prefix_equal(f"cached extend {field} (chunk rows)", getattr(a, field), getattr(b, field), s - P)



@given(data=st.data())
def test_black_box_module(impl, envelope, device, data):
    """A module with its own projections, through forward(x) only (make_module; NSAAttention counts): output rows
    < s are bitwise unchanged when x at positions >= s changes, and a loss on rows < s sends exactly zero gradient
    to x at positions >= s."""
    impl.require("make_module")
    cfg, T, B, seed = draw_case(data, envelope, high=24)
    show_reproducer(impl.spec, cfg, f"m = impl.make_module(cfg, {BLACK_BOX_HIDDEN}).double()  # torch.manual_seed("
                    f"{seed}) first\ny = m(torch.randn({B}, {T}, {BLACK_BOX_HIDDEN}, dtype=torch.float64))",
                    T=T, B=B, seed=seed)
    module = black_box_module(impl, cfg, device, seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, BLACK_BOX_HIDDEN, generator=g, dtype=torch.float64).to(device)
    for s in data.draw(cuts(cfg, T), label="cuts"):
        y = x.clone()
        y[:, s:] = 3 * torch.randn(y[:, s:].shape, generator=g, dtype=torch.float64).to(device)
        xg = x.clone().requires_grad_(True)
        out = call_module(impl, module, xg)
        with torch.no_grad():
            other = call_module(impl, module, y)
        assert_prefix_equal("module output", out, other, s)
        w = loss_weights(out.shape, seed, s, device)
        (grad,) = torch.autograd.grad((out * w).sum(), [xg], allow_unused=True)
        if grad is not None:
            leak = grad[:, s:].abs().max().item() if s < T else 0.0
            assert leak == 0, (f"a loss on module outputs < {s} has gradient {leak:.3g} with respect to x at "
                               f"positions >= {s}: later tokens reach earlier outputs")

