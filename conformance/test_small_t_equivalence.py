"""Small-T equivalence, Eq. 2 and 5: configurations in which a branch covers every causal key must equal
plain dense causal attention (an explicit masked score matrix and softmax, computed here), and the
gates of Eq. 5 isolate the branches (o = g_cmp o_cmp + g_slc o_slc + g_win o_win).

- selected branch with n*l' >= T (every block selected) = dense causal attention;
- window branch with w >= T = dense causal attention; with w < T = dense banded attention over
  [p-w+1, p] ([p-w, p] with window_keys="w+1");
- compressed branch with l = d = 1 and mean pooling (every key its own block) = dense causal attention
  (keys < p with cmp_visibility="strict");
- one-hot gates give exactly one branch; any gates give the gated sum of the branch outputs;
- selected_attention on index sets that omit block 0, hold -1 padding, repeat no block and include the partial
  current block = dense attention over exactly those keys (a kernel that turns -1 into block 0 reads it anyway).
Each is checked in float64 (1e-12 relative; by the error-ratio rule against dense attention in float32 for an
implementation computing in float32) and in the low precision (--dtype) by the error-ratio rule: against float64
dense attention on the same rounded inputs, with the loop reference in that precision as the budget.
"""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from conformance.adapters import load_impl, not_covered
from conformance.helpers import error_ratio, inputs_for, make_inputs
from conformance.precision import close
from conformance.rules import attend_keys, causal_mask, current_sel_block, dense_attention, selected_keys
from conformance.strategies import configs, lengths, show_reproducer

PROPERTY = "Small-T equivalence"
EQUATION = "Eq. 2, 5 (cover-all = dense)"

RTOL = 1e-12  # float64
BRANCH_GATE = {"cmp": (1.0, 0.0, 0.0), "slc": (0.0, 1.0, 0.0), "win": (0.0, 0.0, 1.0)}
REFERENCE = load_impl("reference")


def one_hot_gates(impl, x, branch: str) -> None:
    """Gates (1, 0, 0), (0, 1, 0) or (0, 0, 1); NOT COVERED if the implementation cannot take them."""
    why = impl.caps.gates_allowed(BRANCH_GATE[branch])
    if why:
        not_covered(f"outside the declared capabilities: the test needs {why}")
    x.gates.copy_(torch.tensor(BRANCH_GATE[branch], dtype=x.gates.dtype).expand_as(x.gates))


def check_against_dense(what: str, candidate, dense, x, low_dtype, device, record_metric, *, reference,
                        precision) -> None:
    """candidate(x) vs dense(x): float64 within RTOL (for an implementation computing in float32: the error-ratio
    rule against dense attention run in float32); in the low precision by the error-ratio rule, with the float64
    dense attention on the same rounded inputs as the oracle and the loop reference run in that precision
    (reference(inputs), the same stage of `reference`) as the budget."""
    close(f"{what} (float64 inputs) vs dense attention", candidate(x), dense(x), precision=precision,
          record_metric=record_metric, metric="vs_dense", rtol=RTOL,
          low=lambda: dense(x.to(dtype=torch.float32, device="cpu")))
    low = x.to(dtype=low_dtype)
    oracle = dense(low.to(dtype=torch.float64, device="cpu"))  # float64 on the same (rounded) inputs
    ratio = error_ratio(candidate(low.to(device=device)), reference(low.to(device="cpu")), oracle)
    record_metric(f"error_ratio_{str(low_dtype).replace('torch.', '')}", ratio)
    assert ratio <= 1, f"{what} in {low_dtype}: error ratio {ratio:.3g} > 1 against dense attention"


def draw_case(data, envelope, high: int = 40, phi: str | None = None):
    cfg = data.draw(configs(envelope, phi=phi), label="cfg")
    T = data.draw(lengths(cfg, low=1, high=high), label="T")
    B = data.draw(st.integers(1, 2), label="B")
    seed = data.draw(st.integers(0, 2**20), label="seed")
    return cfg, T, B, seed


def cover_all_selection(envelope, cfg, T: int):
    """n >= ceil(T / l'): every existing block is selected (NOT COVERED if no such n is declared)."""
    n = envelope.caps.n_sel.smallest(1, at_least=max(cfg.n_sel, -(-T // cfg.sel_block)))
    if not n:
        not_covered(f"outside the declared capabilities: selecting all {-(-T // cfg.sel_block)} blocks needs n >= "
                    f"that (declared n {envelope.caps.n_sel.describe()})")
    return cfg.replace(n_sel=n[0])


def cover_all_window(envelope, cfg, T: int, extra: int):
    w = envelope.caps.window.smallest(1, at_least=max(1, T - (1 if cfg.window_keys == "w+1" else 0) + extra))
    if not w:
        not_covered(f"outside the declared capabilities: a window over all {T} keys (declared windows "
                    f"{envelope.caps.window.describe()})")
    return cfg.replace(window=w[0])


def unit_blocks(envelope, cfg):
    """l = d = 1 (and l' = 1 with equal blocks): every key its own compressed block."""
    out = cfg.replace(cmp_block=1, cmp_stride=1, sel_block=1 if cfg.sel_block == cfg.cmp_block else cfg.sel_block)
    why = envelope.caps.outside(out)
    if why:
        not_covered(f"outside the declared capabilities: unit compressed blocks: {why}")
    return out


@given(data=st.data())
def test_selected_branch_covering_all_blocks_is_dense(impl, envelope, device, low_dtype, precision, record_metric,
                                                       data):
    impl.require("nsa_forward")
    cfg, T, B, seed = draw_case(data, envelope)
    cfg = cover_all_selection(envelope, cfg, T)
    show_reproducer(impl.spec, cfg, "x.gates[:] = torch.tensor([0.0, 1.0, 0.0], dtype=x.gates.dtype)\n"
                    "out = impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)",
                    T=T, B=B, seed=seed, shared_kv=impl.shared_kv)
    x = inputs_for(impl, cfg, T, B=B, seed=seed, device=device)
    one_hot_gates(impl, x, "slc")
    check_against_dense("o with gates (0,1,0), n*l' >= T", lambda y: impl.nsa_forward(y.q, y.kv, y.gates, cfg, y.phi).o,
                        lambda y: dense_attention(y.q, *y.kv.slc, causal_mask(T)), x, low_dtype, device, record_metric,
                        reference=lambda y: REFERENCE.nsa_forward(y.q, y.kv, y.gates, cfg, y.phi).o,
                        precision=precision)


@given(data=st.data())
def test_window_covering_all_keys_is_dense(impl, envelope, device, low_dtype, precision, record_metric, data):
    impl.require("nsa_forward")
    cfg, T, B, seed = draw_case(data, envelope)
    cfg = cover_all_window(envelope, cfg, T, data.draw(st.integers(0, 2), label="extra"))
    show_reproducer(impl.spec, cfg, "x.gates[:] = torch.tensor([0.0, 0.0, 1.0], dtype=x.gates.dtype)\n"
                    "out = impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)",
                    T=T, B=B, seed=seed, shared_kv=impl.shared_kv)
    x = inputs_for(impl, cfg, T, B=B, seed=seed, device=device)
    one_hot_gates(impl, x, "win")
    check_against_dense("o with gates (0,0,1), w >= T", lambda y: impl.nsa_forward(y.q, y.kv, y.gates, cfg, y.phi).o,
                        lambda y: dense_attention(y.q, *y.kv.win, causal_mask(T)), x, low_dtype, device, record_metric,
                        reference=lambda y: REFERENCE.nsa_forward(y.q, y.kv, y.gates, cfg, y.phi).o,
                        precision=precision)


@given(data=st.data())
def test_compressed_branch_with_unit_blocks_is_dense(impl, envelope, device, low_dtype, precision, record_metric,
                                                      data):
    impl.require("nsa_forward")
    cfg, T, B, seed = draw_case(data, envelope, phi="avg")
    cfg = unit_blocks(envelope, cfg)
    show_reproducer(impl.spec, cfg, "x.gates[:] = torch.tensor([1.0, 0.0, 0.0], dtype=x.gates.dtype)\n"
                    "out = impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)",
                    T=T, B=B, seed=seed, shared_kv=impl.shared_kv)
    x = inputs_for(impl, cfg, T, B=B, seed=seed, device=device)
    one_hot_gates(impl, x, "cmp")
    strict = cfg.cmp_visibility == "strict"
    check_against_dense("o with gates (1,0,0), l = d = 1, phi = avg",
                        lambda y: impl.nsa_forward(y.q, y.kv, y.gates, cfg, y.phi).o,
                        lambda y: dense_attention(y.q, *y.kv.cmp, causal_mask(T, strict=strict)),
                        x, low_dtype, device, record_metric,
                        reference=lambda y: REFERENCE.nsa_forward(y.q, y.kv, y.gates, cfg, y.phi).o,
                        precision=precision)


@given(data=st.data())
def test_gates_isolate_the_branches(impl, envelope, device, precision, record_metric, data):
    """One-hot gates give exactly that branch's output; random gates give the gated sum (Eq. 5)."""
    impl.require("nsa_forward")
    cfg, T, B, seed = draw_case(data, envelope)
    show_reproducer(impl.spec, cfg, "out = impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)",
                    T=T, B=B, seed=seed, shared_kv=impl.shared_kv)
    x = inputs_for(impl, cfg, T, B=B, seed=seed, device=device)
    base = impl.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)
    g = x.gates
    gated = g[..., 0:1] * base.o_cmp + g[..., 1:2] * base.o_slc + g[..., 2:3] * base.o_win
    checks = [("o vs the gated sum of o_cmp, o_slc, o_win", base.o, gated)]
    for branch in ("cmp", "slc", "win"):
        if impl.caps.gates_allowed(BRANCH_GATE[branch]):
            continue  # gates it cannot take (fixed gates, or a branch it lacks)
        y = x.to()
        one_hot_gates(impl, y, branch)
        checks.append((f"o with only the {branch} gate on vs o_{branch}",
                       impl.nsa_forward(y.q, y.kv, y.gates, cfg, y.phi).o, getattr(base, f"o_{branch}")))

    def reference_o(dtype):
        z = x.to(dtype=dtype, device="cpu")
        return REFERENCE.nsa_forward(z.q, z.kv, z.gates, cfg, z.phi).o

    oracle = None if precision.float64 else reference_o(torch.float64)
    for what, got, want in checks:
        close(what, got, want, precision=precision, record_metric=record_metric, metric="gated_sum", rtol=RTOL,
              low=lambda: reference_o(torch.float32), oracle=oracle)


@given(data=st.data())
def test_window_stage_is_banded_dense(impl, envelope, device, low_dtype, precision, record_metric, data):
    """window_attention == dense attention over keys [p - window_size + 1, p]."""
    impl.require("window_attention")
    cfg, T, B, seed = draw_case(data, envelope)
    show_reproducer(impl.spec, cfg, "o = impl.window_attention(x.q, x.kv.win.k, x.kv.win.v, cfg)",
                    T=T, B=B, seed=seed)
    x = make_inputs(cfg, T, B=B, seed=seed, device=device)
    check_against_dense(f"window_attention (window_keys={cfg.window_keys!r}, w={cfg.window})",
                        lambda y: impl.window_attention(y.q, *y.kv.win, cfg),
                        lambda y: dense_attention(y.q, *y.kv.win, causal_mask(T, window=cfg.window_size)),
                        x, low_dtype, device, record_metric,
                        reference=lambda y: REFERENCE.window_attention(y.q, *y.kv.win, cfg), precision=precision)


@given(data=st.data())
def test_selected_stage_with_every_block_is_dense(impl, envelope, device, low_dtype, precision, record_metric, data):
    """selected_attention with indices = all blocks 0..J == dense causal attention."""
    impl.require("selected_attention")
    cfg, T, B, seed = draw_case(data, envelope)
    cfg = cover_all_selection(envelope, cfg, T)
    indices = torch.full((B, T, cfg.n_kv_heads, cfg.n_sel), -1, dtype=torch.int64)
    for p in range(T):
        J = current_sel_block(p, cfg)
        indices[:, p, :, : J + 1] = torch.arange(J + 1)
    show_reproducer(impl.spec, cfg, "o = impl.selected_attention(x.q, x.kv.slc.k, x.kv.slc.v, indices, cfg)"
                    "  # indices[b, p, h] = 0..p // l', then -1", T=T, B=B, seed=seed)
    x = make_inputs(cfg, T, B=B, seed=seed, device=device)
    check_against_dense("selected_attention over every block",
                        lambda y: impl.selected_attention(y.q, *y.kv.slc, indices.to(y.q.device), cfg),
                        lambda y: dense_attention(y.q, *y.kv.slc, causal_mask(T)), x, low_dtype, device,
                        record_metric, reference=lambda y: REFERENCE.selected_attention(y.q, *y.kv.slc, indices, cfg),
                        precision=precision)


@given(data=st.data())
def test_compressed_stage_with_unit_blocks_is_dense(impl, envelope, device, low_dtype, precision, record_metric,
                                                     data):
    """compress + compressed_attention with l = d = 1, phi = avg == dense causal attention."""
    impl.require("compress", "compressed_attention")
    cfg, T, B, seed = draw_case(data, envelope, phi="avg")
    cfg = unit_blocks(envelope, cfg)
    show_reproducer(impl.spec, cfg, "k_cmp, v_cmp = impl.compress(x.kv.cmp.k, x.kv.cmp.v, cfg)\n"
                    "o = impl.compressed_attention(x.q, k_cmp, v_cmp, cfg)", T=T, B=B, seed=seed)
    x = make_inputs(cfg, T, B=B, seed=seed, device=device)
    strict = cfg.cmp_visibility == "strict"
    check_against_dense("compressed_attention with unit blocks",
                        lambda y: impl.compressed_attention(y.q, *impl.compress(*y.kv.cmp, cfg), cfg),
                        lambda y: dense_attention(y.q, *y.kv.cmp, causal_mask(T, strict=strict)), x, low_dtype,
                        device, record_metric,
                        reference=lambda y: REFERENCE.compressed_attention(y.q, *REFERENCE.compress(*y.kv.cmp, cfg),
                                                                           cfg), precision=precision)


def sparse_index_sets(cfg, B: int, T: int, seed: int) -> torch.Tensor:
    """Per (b, p, group): the current (partial) block J and some random earlier blocks other than block 0, no block
    twice, ascending, then -1 padding (at least one -1 wherever n > 1)."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((B, T, cfg.n_kv_heads, cfg.n_sel), -1, dtype=torch.int64)
    for b in range(B):
        for p in range(T):
            J = current_sel_block(p, cfg)
            for h in range(cfg.n_kv_heads):
                earlier = (torch.randperm(J - 1, generator=g) + 1).tolist() if J > 1 else []
                room = max(0, cfg.n_sel - 2)  # leave a -1 slot
                take = int(torch.randint(0, room + 1, (1,), generator=g)) if room else 0
                chosen = sorted(set(earlier[:take]) | {J})
                out[b, p, h, : len(chosen)] = torch.tensor(chosen)
    return out


@given(data=st.data())
def test_selected_stage_on_sparse_index_sets(impl, envelope, device, low_dtype, precision, record_metric, data):
    """selected_attention with index sets without block 0, with -1 padding, no repeats and the partial current
    block == attention over exactly the keys of those blocks (clipped to p)."""
    impl.require("selected_attention")
    cfg, T, B, seed = draw_case(data, envelope, high=48)
    show_reproducer(impl.spec, cfg, f"indices = sparse_index_sets(cfg, {B}, {T}, {seed})  # "
                    "conformance/test_small_t_equivalence.py\n"
                    "o = impl.selected_attention(x.q, x.kv.slc.k, x.kv.slc.v, indices, cfg)", T=T, B=B, seed=seed)
    indices = sparse_index_sets(cfg, B, T, seed)
    x = make_inputs(cfg, T, B=B, seed=seed, device=device)
    G = cfg.group_size

    def over_the_selected_keys(y):
        q, k, v = (t.detach().cpu() for t in (y.q, *y.kv.slc))
        o = torch.empty(q.shape[:3] + (v.shape[-1],), dtype=q.dtype)
        for b in range(B):
            for p in range(T):
                for h in range(cfg.n_kv_heads):
                    keys = selected_keys(p, indices[b, p, h].tolist(), cfg)
                    o[b, p, h * G:(h + 1) * G] = attend_keys(q[b, p, h * G:(h + 1) * G], k[b, :, h], v[b, :, h], keys)
        return o

    check_against_dense("selected_attention on index sets without block 0, with -1 padding",
                        lambda y: impl.selected_attention(y.q, *y.kv.slc, indices.to(y.q.device), cfg),
                        over_the_selected_keys, x, low_dtype, device, record_metric,
                        reference=lambda y: REFERENCE.selected_attention(y.q, *y.kv.slc, indices, cfg),
                        precision=precision)
