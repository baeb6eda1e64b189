"""Packed sequences (cu_seqlens): a batch of one row holding documents back to back,
cu_seqlens = [0, L_0, L_0 + L_1, ..., T], computes exactly what each document computes alone. Every rule of
Eq. 1-12 restarts at a document start s: positions p - s, compressed blocks (Eq. 7: block i of a document covers
its tokens s + i*d .. s + i*d + l - 1, so no block straddles a boundary; the compressed tokens are packed per
document), selection blocks and forced blocks (Eq. 11, document-relative indices; Eq. 12: index j means tokens
s + j*l' ..), the window (keys max(s, p - w + 1) .. p), and the counted reads (Eq. 6).

(a) packed = separate: every stage with cu_seqlens, nsa_forward and NSAAttention against the same
    implementation run on each document alone (float64: values within 1e-12 relative, indices and reads
    identical; gradients of q, every branch's k and v, the gates and the phi weights within 1e-12).
(b) document isolation: perturbing one document's q, k and v of every branch and gates changes no output,
    index, read or gradient of any other document, bit for bit (the compressed tokens of the others included).
(c) edge shapes: documents shorter than l, of exactly l, l' and w tokens, empty documents, and lengths
    [0, 15, 205, 550, 800] (a small config: l = 8, d = 4, l' = 16, w = 32).
An implementation whose stages take no `cu_seqlens` keyword is NOT COVERED. For an implementation computing in
float32, the nsa_forward comparisons are judged by the error-ratio rule: a difference may be as large as twice the
reference's own float32 error on the same tensor (plus 1e-6).
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conformance.adapters import load_impl, not_covered
from conformance.helpers import (Inputs, conform_gates, first_difference, inputs_for, make_inputs, named_tensors,
                                 select_rows)
from conformance.precision import ATOL, max_abs
from conformance.rules import complete_cmp_blocks, current_sel_block
from conformance.strategies import configs, document_lengths, show_reproducer
from reference.packing import cu_seqlens_of

PROPERTY = "Packed sequences (cu_seqlens)"
EQUATION = "Eq. 1-12 per document"

RTOL = 1e-12  # float64
RTOL_MODULE = 1e-10  # float64, through projections of a different number of rows and RoPE angles
FIELDS = ("o", "o_cmp", "o_slc", "o_win")
HIDDEN = 8


# ----------------------------------------------------------------------------------------------- helpers

def require_float64_stages(impl, precision) -> None:
    """The stage-level comparisons here are float64-only: an implementation computing in float32 is checked on
    nsa_forward (judged by the error-ratio rule) instead."""
    if not precision.float64:
        not_covered(f"{impl.name} computes in float32: the per-stage packed comparisons are float64 checks; its "
                    "nsa_forward is checked packed instead")


def spans_of(lengths: list[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for n in lengths:
        out.append((start, start + n))
        start += n
    return out


def compressed_spans_of(lengths: list[int], cfg) -> list[tuple[int, int]]:
    """Where each document's compressed tokens lie in the packed k_cmp (Eq. 7 per document, rules.py)."""
    return spans_of([complete_cmp_blocks(n, cfg) for n in lengths])


def sel_columns(lengths: list[int], cfg) -> int:
    """NB = max_i ceil(L_i / l') columns of the packed selection scores."""
    return max(-(-n // cfg.sel_block) for n in lengths)


class Closeness:
    """float64 comparisons of candidate vs expected: |difference| <= RTOL * (1 + max |expected|); the worst
    ratio is recorded as the property's metric. With budgets (an implementation computing in float32), a check
    naming a budget passes when |difference| <= that budget (2 x the reference's float32 error + 1e-6)."""

    def __init__(self, rtol: float = RTOL, budgets=None) -> None:
        self.rtol = rtol
        self.make_budgets = budgets  # None, or a zero-argument callable computing them (once, when first needed)
        self.budgets: dict[str, float] | None = None
        self.worst = 0.0

    @property
    def kind(self) -> str:
        return "tolerance" if self.make_budgets is None else "ratio"

    def check(self, what: str, got: torch.Tensor, want: torch.Tensor, budget: str | None = None) -> None:
        if self.make_budgets is not None and budget is not None:
            assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
            if self.budgets is None:
                self.budgets = self.make_budgets()
            err = max_abs(got, want)
            self.worst = max(self.worst, err / self.budgets[budget])
            assert err <= self.budgets[budget], (f"{what}: max error {err:.3g} > 2 x the reference's float32 error + "
                                                 f"{ATOL:g} = {self.budgets[budget]:.3g}")
            return
        assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        got64, want64 = got.detach().double().cpu(), want.detach().double().cpu()
        finite = torch.isfinite(want64)
        assert torch.equal(torch.isfinite(got64), finite) and torch.equal(got64[~finite], want64[~finite]), (
            f"{what}: the -inf/NaN entries differ ({first_difference(got64, want64)})")
        if not bool(finite.any()):
            return
        err = float((got64[finite] - want64[finite]).abs().max())
        tol = self.rtol * (1 + float(want64[finite].abs().max()))
        self.worst = max(self.worst, err / tol)
        assert err <= tol, f"{what}: max error {err:.3g} > {tol:.3g} ({first_difference(got64, want64)})"


def grads_of(loss: torch.Tensor, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if not loss.requires_grad:  # e.g. no compressed block anywhere: the branch output is a constant 0
        return {n: torch.zeros_like(t) for n, t in named.items()}
    got = torch.autograd.grad(loss, list(named.values()), allow_unused=True)
    return {n: (torch.zeros_like(t) if g is None else g) for (n, t), g in zip(named.items(), got)}


def loss_weights(shape, seed: int, device) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(device)


def assert_output_shapes(out, T: int, cfg) -> None:
    for field in FIELDS:
        t = getattr(out, field)
        assert tuple(t.shape) == (1, T, cfg.n_heads, cfg.head_dim_v), f"{field} shape {tuple(t.shape)}"
    assert tuple(out.indices.shape) == (1, T, cfg.n_kv_heads, cfg.n_sel), f"indices shape {tuple(out.indices.shape)}"


def float32_budgets(cfg, x: Inputs, lengths: list[int], seed: int) -> dict[str, float]:
    """For an implementation computing in float32: per output field and per input gradient, 2 x the error of the
    reference's packed nsa_forward run in float32 on x rounded to float32 (against float64) + 1e-6."""
    reference = load_impl("reference")
    T = sum(lengths)
    weights = loss_weights((1, T, cfg.n_heads, cfg.head_dim_v), seed, "cpu")
    runs = []
    for dtype in (torch.float64, torch.float32):
        y = x.to(dtype=dtype, device="cpu", requires_grad=True)
        out = reference.nsa_forward(y.q, y.kv, y.gates, cfg, y.phi, cu_seqlens=cu_seqlens_of(lengths, "cpu"))
        runs.append((out, grads_of((out.o * weights.to(out.o.dtype)).sum(), named_tensors(y))))
    (o64, g64), (o32, g32) = runs
    budgets = {field: 2 * max_abs(getattr(o32, field), getattr(o64, field)) + ATOL for field in FIELDS}
    budgets.update({f"grad:{name}": 2 * max_abs(g32[name], g64[name]) + ATOL for name in g64})
    return budgets


def forward_packed_and_separate(impl, cfg, x: Inputs, lengths: list[int], seed: int, device):
    """nsa_forward on the packed batch and on each non-empty document alone (both with the loss sum(o * W));
    returns (packed output, per-document outputs, packed gradients, separate gradients)."""
    T = sum(lengths)
    weights = loss_weights((1, T, cfg.n_heads, cfg.head_dim_v), seed, device)
    xg = x.to(requires_grad=True)
    packed = impl.nsa_forward(xg.q, xg.kv, xg.gates, cfg, xg.phi, cu_seqlens=cu_seqlens_of(lengths, device))
    assert_output_shapes(packed, T, cfg)
    g_packed = grads_of((packed.o * weights).sum(), named_tensors(xg))
    xs = x.to(requires_grad=True)
    alone, loss = [], 0
    for s, e in spans_of(lengths):
        if e > s:
            y = select_rows(xs, time=slice(s, e))
            alone.append((s, e, impl.nsa_forward(y.q, y.kv, y.gates, cfg, y.phi)))
            loss = loss + (alone[-1][2].o * weights[:, s:e]).sum()
    return packed, alone, g_packed, grads_of(loss, named_tensors(xs))


def check_packed_equals_separate(impl, cfg, x: Inputs, lengths: list[int], seed: int, device, close: Closeness):
    packed, alone, g_packed, g_alone = forward_packed_and_separate(impl, cfg, x, lengths, seed, device)
    for s, e, out in alone:
        where = f"document [{s}, {e}) of lengths {lengths}"
        diff = first_difference(packed.indices[:, s:e].cpu(), out.indices.cpu())
        assert not diff, f"indices of {where} differ from the document alone (document-relative): {diff}"
        if packed.reads is not None and out.reads is not None:
            for branch in ("cmp", "slc", "win"):
                diff = first_difference(getattr(packed.reads, branch)[:, s:e].cpu(), getattr(out.reads, branch).cpu())
                assert not diff, f"reads.{branch} of {where} differ from the document alone: {diff}"
        for field in FIELDS:
            close.check(f"{field} of {where}", getattr(packed, field)[:, s:e], getattr(out, field), budget=field)
    for name in g_packed:
        close.check(f"gradient of {name} (lengths {lengths})", g_packed[name], g_alone[name], budget=f"grad:{name}")


def perturb_span(x: Inputs, start: int, end: int, *, seed: int, scale: float = 3.0) -> Inputs:
    """A detached copy of x whose q, every branch's k/v and gates at positions start..end-1 hold new random values
    (gates stay in [0, 1]); phi weights are kept; shared k/v stay shared."""
    y = x.to()
    g = torch.Generator().manual_seed(seed)
    for name, t in named_tensors(y).items():
        if name.startswith("phi."):
            continue
        fresh = torch.rand if name == "gates" else torch.randn
        new = fresh(t[:, start:end].shape, generator=g, dtype=torch.float64)
        if name != "gates":
            new = new * scale
        with torch.no_grad():
            t[:, start:end] = new.to(dtype=t.dtype, device=t.device)
    return y


def outside(t: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """t without the positions start..end-1 (dim 1)."""
    return torch.cat([t[:, :start], t[:, end:]], dim=1).cpu()


def closeness(precision, cfg, x: Inputs, lengths: list[int], seed: int, rtol: float = RTOL) -> Closeness:
    """A Closeness for nsa_forward checks at the implementation's precision."""
    return Closeness(rtol, None if precision.float64 else lambda: float32_budgets(cfg, x, lengths, seed))


def draw_case(data, envelope, *, min_nonempty: int = 1):
    cfg = data.draw(configs(envelope), label="cfg")
    lengths = data.draw(document_lengths(cfg, min_nonempty=min_nonempty), label="lengths")
    seed = data.draw(st.integers(0, 2**20), label="seed")
    return cfg, lengths, seed


def reproducer(impl, cfg, lengths, seed, call: str) -> None:
    bounds = [0] + [sum(lengths[:i + 1]) for i in range(len(lengths))]
    show_reproducer(impl.spec, cfg, f"cu_seqlens = torch.tensor({bounds}"
                    f", dtype=torch.int32)\n{call}", T=sum(lengths), seed=seed, shared_kv=impl.shared_kv)


# ---------------------------------------------------------------------------------- (a) packed = separate
@given(data=st.data())
def test_nsa_forward_packed_equals_separate(impl, envelope, device, precision, record_metric, data):
    """nsa_forward(cu_seqlens) == nsa_forward on each document alone: outputs, indices, reads and gradients."""
    impl.require_argument("cu_seqlens", "nsa_forward")
    cfg, lengths, seed = draw_case(data, envelope)
    reproducer(impl, cfg, lengths, seed,
               "out = impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi, cu_seqlens=cu_seqlens)")
    x = inputs_for(impl, cfg, sum(lengths), seed=seed, device=device)
    close = closeness(precision, cfg, x, lengths, seed)
    check_packed_equals_separate(impl, cfg, x, lengths, seed, device, close)
    record_metric("packed_vs_alone", close.worst, kind=close.kind)


@given(data=st.data())
def test_compressed_branch_packed_equals_separate(impl, envelope, device, precision, record_metric, data):
    """compress(cu_seqlens) packs each document's own compressed tokens (N = sum_i N_i, Eq. 7 per document);
    compressed_attention(cu_seqlens) over them == each document alone; gradients of q, k, v (and phi)."""
    impl.require_argument("cu_seqlens", "compress", "compressed_attention")
    require_float64_stages(impl, precision)
    cfg, lengths, seed = draw_case(data, envelope)
    reproducer(impl, cfg, lengths, seed, "k_cmp, v_cmp = impl.compress(x.kv.cmp.k, x.kv.cmp.v, cfg, x.phi, "
               "cu_seqlens=cu_seqlens)\no = impl.compressed_attention(x.q, k_cmp, v_cmp, cfg, cu_seqlens=cu_seqlens)")
    T, c = sum(lengths), cu_seqlens_of(lengths, device)
    x = make_inputs(cfg, T, seed=seed, device=device)
    weights = loss_weights((1, T, cfg.n_heads, cfg.head_dim_v), seed, device)
    close = Closeness()

    xg = x.to(requires_grad=True)
    named = {"q": xg.q, "k": xg.kv.cmp.k, "v": xg.kv.cmp.v, **{n: t for n, t in named_tensors(xg).items()
                                                           if n.startswith("phi.")}}
    k_cmp, v_cmp = impl.compress(xg.kv.cmp.k, xg.kv.cmp.v, cfg, xg.phi, cu_seqlens=c)
    n_cmp = sum(complete_cmp_blocks(n, cfg) for n in lengths)
    assert tuple(k_cmp.shape) == (1, n_cmp, cfg.n_kv_heads, cfg.head_dim_qk), (
        f"packed k_cmp shape {tuple(k_cmp.shape)}: expected sum_i N_i = {n_cmp} compressed tokens for {lengths}")
    assert tuple(v_cmp.shape) == (1, n_cmp, cfg.n_kv_heads, cfg.head_dim_v), f"packed v_cmp {tuple(v_cmp.shape)}"
    o = impl.compressed_attention(xg.q, k_cmp, v_cmp, cfg, cu_seqlens=c)
    g_packed = grads_of((o * weights).sum(), named)

    xs = x.to(requires_grad=True)
    named_s = {"q": xs.q, "k": xs.kv.cmp.k, "v": xs.kv.cmp.v, **{n: t for n, t in named_tensors(xs).items()
                                                             if n.startswith("phi.")}}
    loss = torch.zeros((), dtype=torch.float64, device=device)
    for (s, e), (cs, ce) in zip(spans_of(lengths), compressed_spans_of(lengths, cfg)):
        if e == s:
            continue
        kc, vc = impl.compress(xs.kv.cmp.k[:, s:e], xs.kv.cmp.v[:, s:e], cfg, xs.phi)
        close.check(f"compressed keys of document [{s}, {e})", k_cmp[:, cs:ce], kc)
        close.check(f"compressed values of document [{s}, {e})", v_cmp[:, cs:ce], vc)
        o_alone = impl.compressed_attention(xs.q[:, s:e], kc, vc, cfg)
        close.check(f"o_cmp of document [{s}, {e})", o[:, s:e], o_alone)
        loss = loss + (o_alone * weights[:, s:e]).sum()
    g_alone = grads_of(loss, named_s)
    for name in g_packed:
        close.check(f"gradient of {name} through compress + compressed_attention", g_packed[name], g_alone[name])
    record_metric("packed_vs_alone", close.worst, kind="tolerance")


@given(data=st.data())
def test_selection_packed_equals_separate(impl, envelope, device, precision, record_metric, data):
    """selection_scores(cu_seqlens): [1, T, Hkv, max_i ceil(L_i / l')], each document's own scores in its first
    ceil(L_i / l') columns, -inf after; select_blocks(cu_seqlens): each document's own (document-relative)
    indices."""
    impl.require_argument("cu_seqlens", "selection_scores")
    require_float64_stages(impl, precision)
    cfg, lengths, seed = draw_case(data, envelope)
    reproducer(impl, cfg, lengths, seed, "k_cmp = torch.randn(1, N, cfg.n_kv_heads, cfg.head_dim_qk, "
               "dtype=torch.float64)  # N = sum_i N_i\nscores = impl.selection_scores(x.q, k_cmp, cfg, "
               "cu_seqlens=cu_seqlens)")
    T, c = sum(lengths), cu_seqlens_of(lengths, device)
    x = make_inputs(cfg, T, seed=seed, device=device)
    g = torch.Generator().manual_seed(seed)
    cmp_spans = compressed_spans_of(lengths, cfg)
    k_cmp = torch.randn(1, cmp_spans[-1][1], cfg.n_kv_heads, cfg.head_dim_qk, generator=g,
                        dtype=torch.float64).to(device)
    scores = impl.selection_scores(x.q, k_cmp, cfg, cu_seqlens=c)
    NB = sel_columns(lengths, cfg)
    assert tuple(scores.shape) == (1, T, cfg.n_kv_heads, NB), f"packed scores shape {tuple(scores.shape)}, NB = {NB}"
    close = Closeness()
    for (s, e), (cs, ce) in zip(spans_of(lengths), cmp_spans):
        if e == s:
            continue
        own = impl.selection_scores(x.q[:, s:e], k_cmp[:, cs:ce], cfg)
        close.check(f"selection scores of document [{s}, {e})", scores[:, s:e, :, : own.shape[-1]], own)
        assert bool((scores[:, s:e, :, own.shape[-1]:] == -math.inf).all()), (
            f"columns past document [{s}, {e})'s {own.shape[-1]} selection blocks must be -inf")
    record_metric("packed_vs_alone", close.worst, kind="tolerance")
    if impl.takes("select_blocks", "cu_seqlens"):
        # random distinct finite scores up to each query's own J (the packed layout), -inf after
        free = torch.rand(1, T, cfg.n_kv_heads, NB, generator=g, dtype=torch.float64)
        for s, e in spans_of(lengths):
            for p in range(s, e):
                free[0, p, :, current_sel_block(p - s, cfg) + 1:] = -math.inf
        indices = impl.select_blocks(free.to(device), cfg, cu_seqlens=c)
        assert tuple(indices.shape) == (1, T, cfg.n_kv_heads, cfg.n_sel), f"indices shape {tuple(indices.shape)}"
        for s, e in spans_of(lengths):
            if e > s:
                own = impl.select_blocks(free[:, s:e, :, : -(-(e - s) // cfg.sel_block)].to(device), cfg)
                diff = first_difference(indices[:, s:e].cpu(), own.cpu())
                assert not diff, f"select_blocks of document [{s}, {e}) differs from the document alone: {diff}"


def random_document_indices(cfg, lengths: list[int], seed: int) -> torch.Tensor:
    """Valid document-relative Eq. 11-shaped indices: per query its current block J = (p - s) // l' plus random
    earlier blocks of its document, n at most, ascending, padded with -1."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((1, sum(lengths), cfg.n_kv_heads, cfg.n_sel), -1, dtype=torch.int64)
    for s, e in spans_of(lengths):
        for p in range(s, e):
            J = current_sel_block(p - s, cfg)
            for h in range(cfg.n_kv_heads):
                others = torch.randperm(J, generator=g)[: cfg.n_sel - 1].tolist() if J else []
                chosen = sorted(set(others) | {J})
                out[0, p, h, : len(chosen)] = torch.tensor(chosen)
    return out


@pytest.mark.parametrize("branch", ["slc", "win"])
@given(data=st.data())
def test_token_branches_packed_equal_separate(impl, envelope, device, precision, record_metric, branch, data):
    """selected_attention (document-relative indices, Eq. 12) and window_attention with cu_seqlens == each
    document alone; gradients of q, k, v."""
    stage = {"slc": "selected_attention", "win": "window_attention"}[branch]
    impl.require_argument("cu_seqlens", stage)
    require_float64_stages(impl, precision)
    cfg, lengths, seed = draw_case(data, envelope)
    args = "x.kv.slc.k, x.kv.slc.v, indices" if branch == "slc" else "x.kv.win.k, x.kv.win.v"
    reproducer(impl, cfg, lengths, seed, f"o = impl.{stage}(x.q, {args}, cfg, cu_seqlens=cu_seqlens)  # indices: "
               "random_document_indices in conformance/test_packed_sequences.py")
    T, c = sum(lengths), cu_seqlens_of(lengths, device)
    indices = random_document_indices(cfg, lengths, seed).to(device)

    def run(q, k, v, s=None, e=None):
        if s is None:
            extra = (indices,) if branch == "slc" else ()
            return getattr(impl, stage)(q, k, v, *extra, cfg, cu_seqlens=c)
        extra = (indices[:, s:e],) if branch == "slc" else ()
        return getattr(impl, stage)(q[:, s:e], k[:, s:e], v[:, s:e], *extra, cfg)

    x = make_inputs(cfg, T, seed=seed, device=device)
    weights = loss_weights((1, T, cfg.n_heads, cfg.head_dim_v), seed, device)
    close = Closeness()
    xg = x.to(requires_grad=True)
    named = dict(zip(("q", "k", "v"), (xg.q, *xg.kv.branch(branch))))
    o = run(*named.values())
    assert tuple(o.shape) == (1, T, cfg.n_heads, cfg.head_dim_v), f"{stage} shape {tuple(o.shape)}"
    g_packed = grads_of((o * weights).sum(), named)
    xs = x.to(requires_grad=True)
    named_s = dict(zip(("q", "k", "v"), (xs.q, *xs.kv.branch(branch))))
    loss = torch.zeros((), dtype=torch.float64, device=device)
    for s, e in spans_of(lengths):
        if e > s:
            o_alone = run(*named_s.values(), s, e)
            close.check(f"{stage} of document [{s}, {e})", o[:, s:e], o_alone)
            loss = loss + (o_alone * weights[:, s:e]).sum()
    g_alone = grads_of(loss, named_s)
    for name in g_packed:
        close.check(f"gradient of {name} through {stage}", g_packed[name], g_alone[name])
    record_metric("packed_vs_alone", close.worst, kind="tolerance")


def test_module_packed_equals_separate(impl, envelope, device, precision, record_metric):
    """NSAAttention.forward(x, cu_seqlens=...) == the module on each document alone (RoPE positions restart at
    each document start); position_offset != 0 with cu_seqlens is a ValueError."""
    impl.require("NSAAttention")
    require_float64_stages(impl, precision)
    cfg = edge_config(envelope)
    torch.manual_seed(0)
    m = impl.NSAAttention(HIDDEN, cfg).to(device=device, dtype=torch.float64)
    if "cu_seqlens" not in inspect.signature(m.forward).parameters:
        not_covered(f"{impl.name}.NSAAttention.forward takes no cu_seqlens argument")
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_((torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3).to(p))
    lengths = edge_document_lengths(cfg)
    x = torch.randn(1, sum(lengths), HIDDEN, generator=g, dtype=torch.float64).to(device)
    close = Closeness(RTOL_MODULE)
    with torch.no_grad():
        y = m(x, cu_seqlens=cu_seqlens_of(lengths, device))
        assert tuple(y.shape) == tuple(x.shape), f"packed module output shape {tuple(y.shape)}"
        for s, e in spans_of(lengths):
            if e > s:
                close.check(f"module output of document [{s}, {e})", y[:, s:e], m(x[:, s:e]))
    record_metric("module_packed_vs_alone", close.worst, kind="tolerance")
    with pytest.raises(ValueError, match="position_offset"):
        m(x, position_offset=3, cu_seqlens=cu_seqlens_of(lengths, device))


# ---------------------------------------------------------------------------------- (b) document isolation
@given(data=st.data())
def test_document_isolation(impl, envelope, device, data):
    """Perturb one document's q, k/v of every branch and gates: every other document's outputs, indices, reads,
    compressed tokens and input gradients (loss over all documents) stay bitwise identical."""
    impl.require_argument("cu_seqlens", "nsa_forward")
    cfg, lengths, seed = draw_case(data, envelope, min_nonempty=2)
    victim = data.draw(st.sampled_from([i for i, n in enumerate(lengths) if n > 0]), label="perturbed document")
    reproducer(impl, cfg, lengths, seed, f"out = impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi, cu_seqlens="
               f"cu_seqlens)  # then perturb document {victim}'s q, k, v, gates")
    check_isolation(impl, cfg, lengths, victim, seed, device)


def check_isolation(impl, cfg, lengths: list[int], victim: int, seed: int, device) -> None:
    T, c = sum(lengths), cu_seqlens_of(lengths, device)
    s, e = spans_of(lengths)[victim]
    weights = loss_weights((1, T, cfg.n_heads, cfg.head_dim_v), seed, device)

    def run(x: Inputs):
        xg = x.to(requires_grad=True)
        out = impl.nsa_forward(xg.q, xg.kv, xg.gates, cfg, xg.phi, cu_seqlens=c)
        assert_output_shapes(out, T, cfg)
        named = {n: t for n, t in named_tensors(xg).items() if not n.startswith("phi.")}  # weights: shared
        return out, grads_of((out.o * weights).sum(), named)

    x = inputs_for(impl, cfg, T, seed=seed, device=device)
    y = perturb_span(x, s, e, seed=seed + 1)
    conform_gates(y.gates, impl.caps)
    (a, ga), (b, gb) = run(x), run(y)
    where = f"outside the perturbed document [{s}, {e}) of lengths {lengths}"
    for field in (*FIELDS, "indices"):
        diff = first_difference(outside(getattr(a, field), s, e), outside(getattr(b, field), s, e))
        assert not diff, f"{field} changed {where}: {diff}"
    if a.reads is not None:
        for branch in ("cmp", "slc", "win"):
            diff = first_difference(outside(getattr(a.reads, branch), s, e), outside(getattr(b.reads, branch), s, e))
            assert not diff, f"reads.{branch} changed {where}: {diff}"
    for name in ga:
        diff = first_difference(outside(ga[name], s, e), outside(gb[name], s, e))
        assert not diff, f"gradient of {name} changed {where}: {diff}"
    if impl.takes("compress", "cu_seqlens"):
        (ka, va), (kb, vb) = (impl.compress(*z.kv.cmp, cfg, z.phi, cu_seqlens=c) for z in (x, y))
        cs, ce = compressed_spans_of(lengths, cfg)[victim]
        for what, u, w in (("compressed keys", ka, kb), ("compressed values", va, vb)):
            diff = first_difference(outside(u, cs, ce), outside(w, cs, ce))
            assert not diff, f"{what} of other documents changed (a block straddles [{s}, {e})?): {diff}"


# ------------------------------------------------------------------------------------------ (c) edge shapes
def edge_config(envelope):
    """Small sizes inside the envelope: l = 4, d = 2, l' = 8, w = 5 (equal blocks: l = d = l' = 4)."""
    return envelope.fit(envelope.conventions.replace(cmp_block=4, cmp_stride=2, sel_block=8, n_sel=3, n_init=1,
                                                     n_local=1, window=5, n_heads=2, n_kv_heads=1, head_dim_qk=4,
                                                     head_dim_v=3), equal_block=4)


def edge_document_lengths(cfg) -> list[int]:
    """Empty first, inside and last; shorter than l; exactly l, l', w; one token; two selection blocks and more."""
    return [0, cfg.cmp_block - 1, cfg.cmp_block, 0, cfg.sel_block, cfg.window_size, 1, 2 * cfg.sel_block + 3, 0]


def long_config(envelope):
    """The [0, 15, 205, 550, 800] case: l = 8, d = 4, l' = 16 (equal blocks: 16, 16, 16), w = 32, n = 4, one head
    (or the smallest group inside the envelope)."""
    return envelope.fit(envelope.conventions.replace(cmp_block=8, cmp_stride=4, sel_block=16, n_sel=4, n_init=1,
                                                     n_local=1, window=32, n_heads=1, n_kv_heads=1, head_dim_qk=4,
                                                     head_dim_v=3), equal_block=16)


def test_edge_lengths_packed_equal_separate(impl, envelope, device, precision, record_metric):
    """Documents empty, shorter than l, of exactly l, l' and w tokens: packed = separate, and each is isolated."""
    impl.require_argument("cu_seqlens", "nsa_forward")
    cfg = edge_config(envelope)
    lengths = edge_document_lengths(cfg)
    x = inputs_for(impl, cfg, sum(lengths), seed=21, device=device, phi_hidden=3)
    close = closeness(precision, cfg, x, lengths, 21)
    check_packed_equals_separate(impl, cfg, x, lengths, 21, device, close)
    record_metric("edge_packed_vs_alone", close.worst, kind=close.kind)
    for victim in (1, 2, 4, 5):  # shorter than l, exactly l, l', w
        check_isolation(impl, cfg, lengths, victim, 30 + victim, device)


def test_mixed_long_documents_packed_equal_separate(impl, envelope, device, precision, record_metric):
    """Lengths [0, 15, 205, 550, 800] (1570 tokens, many compressed and selection blocks per document)."""
    impl.require_argument("cu_seqlens", "nsa_forward")
    cfg = long_config(envelope)
    lengths = [0, 15, 205, 550, 800]
    x = inputs_for(impl, cfg, sum(lengths), seed=22, device=device, phi_hidden=3)
    close = closeness(precision, cfg, x, lengths, 22)
    check_packed_equals_separate(impl, cfg, x, lengths, 22, device, close)
    record_metric("long_packed_vs_alone", close.worst, kind=close.kind)
