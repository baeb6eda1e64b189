"""Numerical safety of Eq. 2's softmax in every branch: a query with no visible compressed block (p < l-1,
Eq. 7) gets exactly 0 from the compressed branch, with no NaN in any output or gradient; logits of huge
magnitude (either sign) neither overflow nor let masked keys in (a mask filled with a finite value such as
-1e4 leaks once the real logits are below it); long sequences and fully masked rows stay finite, in
float64 and in the low precision (--dtype).
"""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from conformance.adapters import ImplementationError, load_impl, not_covered
from conformance.helpers import (LARGE_LOGIT, Inputs, inputs_for, large_logit_floor, large_logit_inputs,
                                  named_tensors)
from conformance.precision import close
from conformance.rules import visible_cmp_blocks
from conformance.strategies import configs, lengths, show_reproducer

PROPERTY = "Numerical safety"
EQUATION = "Eq. 2 (empty sets, large logits, long T)"

RTOL_LARGE = 1e-8  # float64 with |logits| ~ 1e5: rounding of a logit is ~1e-11


def forward_and_grads(impl, x: Inputs, cfg, seed: int):
    xg = x.to(requires_grad=True)
    out = impl.nsa_forward(xg.q, xg.kv, xg.gates, cfg, xg.phi)
    w = torch.randn(out.o.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    loss = (out.o * w.to(out.o)).sum()
    named = named_tensors(xg)
    grads = torch.autograd.grad(loss, list(named.values()), allow_unused=True) if loss.requires_grad else []
    return out, {n: g for n, g in zip(named, grads) if g is not None}


def assert_finite(out, grads: dict, what: str) -> None:
    for field in ("o", "o_cmp", "o_slc", "o_win"):
        t = getattr(out, field)
        bad = int((~torch.isfinite(t)).sum())
        assert bad == 0, f"{what}: {field} has {bad} non-finite entries"
    for name, g in grads.items():
        assert bool(torch.isfinite(g).all()), f"{what}: gradient of {name} has non-finite entries"


@given(data=st.data())
def test_empty_compressed_set_gives_zero(impl, envelope, device, low_dtype, data):
    """Positions p with no visible compressed block: o_cmp == 0 exactly; outputs and gradients finite."""
    impl.require("nsa_forward")
    cfg = data.draw(configs(envelope), label="cfg")
    T = data.draw(lengths(cfg, low=1, high=3 * cfg.cmp_block), label="T")
    seed = data.draw(st.integers(0, 2**20), label="seed")
    show_reproducer(impl.spec, cfg, "out = impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)",
                    T=T, B=2, seed=seed, shared_kv=impl.shared_kv)
    x = inputs_for(impl, cfg, T, B=2, seed=seed, device=device)
    for dtype in (torch.float64, low_dtype):
        out, grads = forward_and_grads(impl, x.to(dtype=dtype), cfg, seed)
        assert_finite(out, grads, str(dtype))
        for p in range(T):
            if visible_cmp_blocks(p, cfg) == 0:
                assert bool((out.o_cmp[:, p] == 0).all()), (
                    f"{dtype}: o_cmp at position {p} (no compressed block visible) is not 0: {out.o_cmp[:, p]}")


def test_compressed_attention_without_blocks(impl, envelope, device):
    """compressed_attention with N = 0 compressed keys: exactly 0, gradient of q exactly 0."""
    impl.require("compressed_attention")
    cfg = envelope.fit(envelope.conventions.replace(cmp_block=4, cmp_stride=2, sel_block=4, n_sel=3, n_init=1,
                                                    n_local=1, window=4, n_heads=2, n_kv_heads=1, head_dim_qk=4,
                                                    head_dim_v=3, phi="avg"), equal_block=2)
    Hq, Hkv, dk, dv = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim_qk, cfg.head_dim_v
    q = torch.randn(1, 5, Hq, dk, dtype=torch.float64, device=device, requires_grad=True)
    empty_k = torch.zeros(1, 0, Hkv, dk, dtype=torch.float64, device=device)
    empty_v = torch.zeros(1, 0, Hkv, dv, dtype=torch.float64, device=device)
    o = impl.compressed_attention(q, empty_k, empty_v, cfg)
    assert o.shape == (1, 5, Hq, dv) and bool((o == 0).all()), f"o_cmp with no compressed key must be 0, got {o}"
    if o.requires_grad:
        (dq,) = torch.autograd.grad(o.sum(), q)
        assert bool((dq == 0).all()), "gradient of q through an empty compressed set must be 0"


@given(data=st.data())
def test_large_magnitude_logits(impl, envelope, device, precision, record_metric, data):
    """|logits| ~ 1e5 (both signs), every block selected: outputs equal the float64 reference (which
    subtracts the row maximum), no NaN/Inf in outputs or gradients. Masked keys must not leak. An implementation
    judged at float32 gets the error one rounding of such logits causes on top of the error-ratio budget
    (large_logit_floor): about 1e-2 max|v|, where a leaked masked key or a softmax without its maximum moves
    outputs by order max|v|."""
    impl.require("nsa_forward")
    cfg = data.draw(configs(envelope), label="cfg")
    T = data.draw(lengths(cfg, low=2, high=40), label="T")
    every = envelope.caps.n_sel.smallest(1, at_least=max(cfg.n_sel, -(-T // cfg.sel_block)))
    if not every:
        not_covered(f"outside the declared capabilities: selecting every block needs n >= {-(-T // cfg.sel_block)} "
                    f"(declared n {envelope.caps.n_sel.describe()})")
    cfg = cfg.replace(n_sel=every[0])  # selection = every block: no near-ties
    sign = data.draw(st.sampled_from([-1.0, 1.0]), label="sign")
    seed = data.draw(st.integers(0, 2**20), label="seed")
    show_reproducer(impl.spec, cfg, f"x = large_logit_inputs(cfg, {T}, {seed}, {sign}, 'cpu', {impl.shared_kv}, "
                    "impl.caps)  # conformance/test_numerical_safety.py\n"
                    "out = impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)", T=T, seed=seed)
    x = large_logit_inputs(cfg, T, seed, sign, device, impl.shared_kv, impl.caps)
    out, grads = forward_and_grads(impl, x, cfg, seed)
    assert_finite(out, grads, f"logits ~ {sign * LARGE_LOGIT:g}")
    xc = x.to(device="cpu")
    reference = load_impl("reference")
    ref = reference.nsa_forward(xc.q, xc.kv, xc.gates, cfg, xc.phi)
    low = None
    for field in ("o_cmp", "o_slc", "o_win", "o"):
        if field != "o" and field[2:] not in impl.caps.branches:
            continue  # a branch it does not compute (its gate is 0 in o)

        def in_float32(f=field):
            nonlocal low
            if low is None:
                y = xc.to(dtype=torch.float32)
                low = reference.nsa_forward(y.q, y.kv, y.gates, cfg, y.phi)
            return getattr(low, f)

        close(f"{field} with logits ~ {sign * LARGE_LOGIT:g} vs the float64 reference (masked keys leak, or the "
              "softmax lost precision?)", getattr(out, field), getattr(ref, field), precision=precision,
              record_metric=record_metric, metric="large_logits_vs_reference", rtol=RTOL_LARGE, low=in_float32,
              floor=large_logit_floor(xc, field, precision.dtype))


@given(data=st.data())
def test_large_magnitude_selection_scores(impl, envelope, device, data):
    """selection_scores with |logits| ~ 1e5: finite for blocks 0..J, -inf after."""
    impl.require("selection_scores")
    cfg = data.draw(configs(envelope), label="cfg")
    T = data.draw(lengths(cfg, low=1, high=40), label="T")
    sign = data.draw(st.sampled_from([-1.0, 1.0]), label="sign")
    seed = data.draw(st.integers(0, 2**20), label="seed")
    x = large_logit_inputs(cfg, T, seed, sign, device)
    k = x.kv.cmp.k
    N = max(0, (T - cfg.cmp_block) // cfg.cmp_stride + 1)
    k_cmp = torch.stack([k[:, i * cfg.cmp_stride:i * cfg.cmp_stride + cfg.cmp_block].mean(1) for i in range(N)], 1) \
        if N else k.new_zeros(k.shape[0], 0, *k.shape[2:])
    scores = impl.selection_scores(x.q, k_cmp, cfg).cpu()
    for p in range(T):
        J = p // cfg.sel_block
        assert bool(torch.isfinite(scores[:, p, :, :J + 1]).all()), f"non-finite scores at position {p}: {scores[:, p]}"
        assert bool(torch.isneginf(scores[:, p, :, J + 1:]).all()), f"blocks after J={J} must score -inf at {p}"


def test_long_sequence_stays_finite(impl, envelope, device, low_dtype):
    """T = 320 with small blocks (many compressed, selection and window edges): finite outputs and
    gradients in float64 and in the low precision."""
    impl.require("nsa_forward")
    cfg = envelope.fit(envelope.conventions.replace(cmp_block=8, cmp_stride=4, sel_block=16, n_sel=4, n_init=1,
                                                    n_local=2, window=32, n_heads=2, n_kv_heads=1, head_dim_qk=4,
                                                    head_dim_v=4), equal_block=8)
    x = inputs_for(impl, cfg, 320, seed=11, device=device, scale=3.0)
    for dtype in (torch.float64, low_dtype):
        out, grads = forward_and_grads(impl, x.to(dtype=dtype), cfg, 12)
        assert_finite(out, grads, f"T=320 {dtype}")


def test_nan_query_is_refused_or_stays_in_its_row(impl, envelope, device):
    """A NaN in one query (q at one position and head) is refused with a ValueError (an input check), or it
    shows as NaN in that query's output and in no other position's: an implementation must neither answer a
    non-finite question with a finite number nor spread the NaN to other queries."""
    impl.require("nsa_forward")
    cfg = envelope.fit(envelope.conventions.replace(cmp_block=4, cmp_stride=2, sel_block=8, n_sel=3, n_init=1,
                                                    n_local=1, window=8, n_heads=4, n_kv_heads=2, head_dim_qk=8,
                                                    head_dim_v=4), equal_block=4)
    T, p, head = 24, 13, 1
    x = inputs_for(impl, cfg, T, seed=5, device=device)
    with torch.no_grad():
        x.q[0, p, head, 0] = float("nan")
    try:
        out = impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)
    except ImplementationError as exc:  # raised inside the implementation: only an input check naming q may refuse
        refusal = exc.__cause__
        if not isinstance(refusal, ValueError):
            raise
        assert "q" in str(refusal), f"refused a NaN in q without naming q: {refusal}"
        return
    o = out.o.detach().cpu()
    assert bool(torch.isnan(o[0, p, head]).all()), (
        f"q[0, {p}, {head}] is NaN but that query's output is {o[0, p, head].tolist()}: the NaN was hidden")
    nan_positions = sorted({int(t) for t in (~torch.isfinite(o[0])).nonzero()[:, 0]} - {p})
    assert not nan_positions, (f"a NaN in the query at position {p} made the outputs at positions {nan_positions} "
                               f"non-finite")
