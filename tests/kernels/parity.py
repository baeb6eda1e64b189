"""Helpers of the optimized-vs-reference parity suites (CPU: test_parity_optimized.py, GPU: test_parity_gpu.py).

The oracle is the loop reference in float64 unless a test says otherwise. Nothing here calls the optimized
stage functions to build an expected value: the reference side is composed from `reference` only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st
from torch import Tensor

import reference
from reference.branches import selected_attention_rows, window_attention_rows
from reference.compression import compressed_attention_rows
from reference.config import NSAConfig
from reference.forward import gated_sum
from reference.selection import forced_blocks

from conformance.helpers import Inputs, error_ratio, make_inputs

LOW_PRECISION = (torch.float32, torch.bfloat16, torch.float16)


def tensor_names(inp: Inputs) -> list[str]:
    """Names of inp.tensors() in order: q, gates, each distinct branch k/v, then phi weights."""
    names = ["q", "gates"]
    seen = [inp.q, inp.gates]
    for branch in ("cmp", "slc", "win"):
        kv = inp.kv.branch(branch)
        for part, t in (("k", kv.k), ("v", kv.v)):
            if all(t is not s for s in seen):
                names.append(f"{part}_{branch}")
                seen.append(t)
    if inp.phi is not None:
        for which, w in (("k", inp.phi.k), ("v", inp.phi.v)):
            names += [f"phi_{which}.{f}" for f in ("pos", "w1", "b1", "w2", "b2")]
    return names


def cotangent(shape: tuple[int, ...], seed: int = 1234) -> Tensor:
    """A fixed random output weighting R, so that loss = sum(o * R) has generic gradients."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def grads_of(o: Tensor, inp: Inputs, weight: Tensor) -> dict[str, Tensor]:
    """d sum(o * weight) / d every input tensor (zeros for an input the output does not depend on)."""
    tensors = inp.tensors()
    got = torch.autograd.grad((o * weight.to(o.dtype)).sum(), tensors, allow_unused=True)
    return {name: (g if g is not None else torch.zeros_like(t))
            for name, t, g in zip(tensor_names(inp), tensors, got)}


def reference_teacher_forced(inp: Inputs, cfg: NSAConfig, indices: Tensor,
                             positions: Tensor | None = None) -> dict[str, Tensor]:
    """The reference NSA with the selection replaced by `indices`, composed from the reference's row functions
    (its _forward_rows with Eq. 8-11 skipped). positions: absolute positions of the rows of inp.q / inp.gates /
    indices (default 0..T-1, prefill) over all keys of inp.kv."""
    pos = list(range(inp.q.shape[1])) if positions is None else [int(p) for p in positions]
    k_cmp, v_cmp = reference.compress(inp.kv.cmp.k, inp.kv.cmp.v, cfg, inp.phi)
    o_cmp = compressed_attention_rows(inp.q, k_cmp, v_cmp, cfg, pos)[0]
    o_slc = selected_attention_rows(inp.q, inp.kv.slc.k, inp.kv.slc.v, indices, cfg, pos)[0]
    o_win = window_attention_rows(inp.q, inp.kv.win.k, inp.kv.win.v, cfg, pos)[0]
    return {"o": gated_sum(inp.gates, o_cmp, o_slc, o_win), "o_cmp": o_cmp, "o_slc": o_slc, "o_win": o_win,
            "k_cmp": k_cmp, "v_cmp": v_cmp}


# Tie-aware selection comparison ------------------------------------------------------------------------------
@dataclass
class SelectionMismatch:
    row: tuple[int, int, int]  # (b, p, g)
    reason: str


def score_tolerance(scores64: Tensor, scores_low: Tensor | None, rel_slack: float = 1e-12) -> Tensor:
    """Per-row tolerance [B, T, Hkv] for comparing free selections: 2 x the reference's own score error in the
    low precision (0 in float64) + rel_slack x the row's largest |score| (float64 rounding)."""
    finite = torch.isfinite(scores64)
    scale = torch.where(finite, scores64.abs(), torch.zeros_like(scores64)).amax(dim=-1)
    tol = rel_slack * scale
    if scores_low is not None:
        err = torch.where(finite, (scores_low.to(torch.float64) - scores64).abs(), torch.zeros_like(scores64))
        tol = tol + 2 * err.amax(dim=-1)
    return tol


def selection_mismatches(got: Tensor, ref: Tensor, scores64: Tensor, tol: Tensor, cfg: NSAConfig,
                         positions: Tensor | None = None) -> list[SelectionMismatch]:
    """Rows where `got` is not an acceptable Eq. 11 selection given the reference's `ref` and float64 scores:
    got must be ascending, -1 padded, hold every forced block and as many blocks as ref; a free block it picks
    instead of one ref picks must score within tol of it."""
    B, T, H, _ = got.shape
    if positions is None:
        positions = torch.arange(T)
    out = []
    differs = (got.cpu() != ref.cpu()).any(dim=-1)
    for b, t, g in torch.nonzero(differs).tolist():
        p = int(positions[t])
        J = p // cfg.sel_block
        row = [int(x) for x in got[b, t, g]]
        want = [int(x) for x in ref[b, t, g]]
        chosen = [x for x in row if x >= 0]
        expected = [x for x in want if x >= 0]
        s = scores64[b, t, g]
        tag = (b, t, g)
        if row != chosen + [-1] * (len(row) - len(chosen)) or chosen != sorted(set(chosen)):
            out.append(SelectionMismatch(tag, f"not ascending/unique/-1 padded: {row}"))
            continue
        if len(chosen) != len(expected) or any(x > J for x in chosen):
            out.append(SelectionMismatch(tag, f"{row} vs reference {want} (J={J})"))
            continue
        missing = set(forced_blocks(J, cfg)) - set(chosen)
        if missing:
            out.append(SelectionMismatch(tag, f"forced blocks {sorted(missing)} missing from {row}"))
            continue
        extra, dropped = set(chosen) - set(expected), set(expected) - set(chosen)
        gap = max(abs(float(s[a]) - float(s[d])) for a in extra for d in dropped)
        if not gap <= float(tol[b, t, g]):
            out.append(SelectionMismatch(tag, f"{row} vs reference {want}: float64 scores differ by {gap:.3e} "
                                              f"> tolerance {float(tol[b, t, g]):.3e}"))
    return out


# Hypothesis strategies ---------------------------------------------------------------------------------------
@st.composite
def small_configs(draw, max_heads: int = 4) -> NSAConfig:
    """Every NSAConfig switch with tiny dims (the loop reference must stay fast)."""
    d = draw(st.integers(1, 4))
    l = d * draw(st.integers(1, 3))
    lp = d * draw(st.integers(l // d, l // d + 3))
    n_init = draw(st.integers(0, 2))
    n_local = draw(st.integers(0, 2))
    n_sel = draw(st.integers(max(1, n_init + n_local), n_init + n_local + 3))
    n_kv = draw(st.integers(1, 2))
    group = draw(st.integers(1, max(1, max_heads // n_kv)))
    return NSAConfig(
        cmp_block=l, cmp_stride=d, sel_block=lp, n_sel=n_sel, n_init=n_init, n_local=n_local,
        window=draw(st.integers(1, 12)), n_heads=n_kv * group, n_kv_heads=n_kv,
        head_dim_qk=draw(st.integers(2, 6)), head_dim_v=draw(st.integers(1, 5)),
        phi=draw(st.sampled_from(["avg", "mlp"])),
        window_keys=draw(st.sampled_from(["w", "w+1"])),
        cmp_visibility=draw(st.sampled_from(["inclusive", "strict"])),
        selection_score=draw(st.sampled_from(["probs", "logits"])),
        group_reduce=draw(st.sampled_from(["sum", "mean"])),
    )


def sequence_lengths(cfg: NSAConfig, max_T: int) -> st.SearchStrategy[int]:
    """T from 1 to max_T, biased to the block boundaries: T < l, T = l - 1, l, multiples of l' and d, +-1."""
    l, d, lp, n = cfg.cmp_block, cfg.cmp_stride, cfg.sel_block, cfg.n_sel
    edges = {l - 1, l, l + 1, lp - 1, lp, lp + 1, n * lp - 1, n * lp, n * lp + 1, (n + 1) * lp + 1,
             2 * lp, 3 * lp - 1, 5 * d + l - 1, cfg.window_size, cfg.window_size + 1, max_T}
    edges = sorted(t for t in edges if 1 <= t <= max_T)
    return st.one_of(st.sampled_from(edges), st.integers(1, max_T))




# One low-precision example, shared by the CPU and GPU suites ------------------------------------------------------
@dataclass
class LowPrecisionResult:
    ratios: dict[str, float]  # error ratios (helpers.error_ratio) of outputs and gradients; <= 1 passes
    score_ratio: float  # error ratio of selection_scores (finite entries)
    neg_inf_pattern_equal: bool  # selection_scores is -inf exactly where the reference's is
    selection: list[SelectionMismatch]  # free selection rows outside the tie tolerance


def low_precision_example(cfg: NSAConfig, T: int, dtype: torch.dtype, *, seed: int, B: int = 1,
                          shared_kv: bool = False, device: str | torch.device = "cpu",
                          backend: str = "torch", range_backend: str = "torch") -> LowPrecisionResult:
    """The optimized path (inputs on `device`, selected-branch `backend`, compressed/window/scoring
    `range_backend`) vs the loop reference on CPU.

    All runs share the inputs: low-precision tensors, which the float64 oracle gets as exact float64 values.
    Outputs and gradients are teacher-forced on the oracle's selection; the free selection of the optimized path
    in this dtype is checked tie-aware against the oracle's float64 scores."""
    import optimized

    base = make_inputs(cfg, T, B=B, seed=seed, phi_hidden=3, dtype=dtype, shared_kv=shared_kv).to(dtype=torch.float64)
    oracle_in = base.to(requires_grad=True)
    oracle = reference.nsa_forward(oracle_in.q, oracle_in.kv, oracle_in.gates, cfg, oracle_in.phi)
    weight = cotangent(tuple(oracle.o.shape)).to(dtype).to(torch.float64)
    oracle_grads = grads_of(oracle.o, oracle_in, weight)
    with torch.no_grad():
        scores64 = reference.selection_scores(base.q, reference.compress(base.kv.cmp.k, base.kv.cmp.v, cfg,
                                                                         base.phi)[0], cfg)

    low_in = base.to(dtype=dtype, requires_grad=True)
    low = reference_teacher_forced(low_in, cfg, oracle.indices)
    low_grads = grads_of(low["o"], low_in, weight)

    opt_in = base.to(dtype=dtype, device=device, requires_grad=True)
    opt = optimized.nsa_forward(opt_in.q, opt_in.kv, opt_in.gates, cfg, opt_in.phi, backend=backend,
                                indices=oracle.indices.to(device), range_backend=range_backend)
    opt_grads = grads_of(opt.o, opt_in, weight.to(device))

    ratios = {name: error_ratio(getattr(opt, name), low[name], getattr(oracle, name))
              for name in ("o", "o_cmp", "o_slc", "o_win")}
    ratios.update({f"d{name}": error_ratio(g, low_grads[name], oracle_grads[name]) for name, g in opt_grads.items()})

    with torch.no_grad():
        scores_low_ref = reference.selection_scores(low_in.q, low["k_cmp"], cfg)
        k_cmp = optimized.compress(opt_in.kv.cmp.k, opt_in.kv.cmp.v, cfg, opt_in.phi)[0]
        scores = optimized.selection_scores(opt_in.q, k_cmp, cfg, range_backend=range_backend).cpu()
        indices = optimized.selection_indices(opt_in.q, k_cmp, cfg, range_backend=range_backend).cpu()
    finite = torch.isfinite(scores64)
    return LowPrecisionResult(
        ratios=ratios,
        score_ratio=error_ratio(scores[finite], scores_low_ref[finite], scores64[finite]),
        neg_inf_pattern_equal=bool(torch.equal(torch.isneginf(scores), ~finite)),
        selection=selection_mismatches(indices, oracle.indices, scores64, score_tolerance(scores64, scores_low_ref),
                                       cfg),
    )
