"""Precision as precision: the working precision of the implementation under test, and the numeric checks that
judge it.

An implementation that computes in the dtype of its inputs is checked in float64 against tolerances such as
1e-12 relative (float64 rounding). One that computes in float32 whatever its inputs (declared with
Capabilities(precision="float32"), or detected: float64 inputs give float32-sized errors) cannot meet those; its
float64 checks are judged instead by FlashAttention's error-ratio rule against the reference run in float32 on
the same inputs rounded to float32: |impl - oracle| <= 2 |reference float32 - oracle| + 1e-6. Semantic checks
(indices, visibility, no peeking, counted reads, ties) are never relaxed. Metrics are recorded in two units:
kind "tolerance" (a float64 error divided by its tolerance) and kind "ratio" (an error ratio).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

ATOL = 1e-6  # the error-ratio rule's absolute term (conformance.helpers.error_ratio)


@dataclass(frozen=True)
class Precision:
    """The precision the implementation computes in when given float64 inputs, and how the suite knows."""

    dtype: torch.dtype = torch.float64
    how: str = "inputs"  # "inputs" (computes in its inputs' dtype), "declared", "detected"

    @property
    def float64(self) -> bool:
        return self.dtype == torch.float64

    def describe(self) -> str:
        if self.float64:
            return "computes in its inputs' dtype: float64 checks at float64 tolerances"
        return (f"computes in {str(self.dtype).replace('torch.', '')} ({self.how}): float64 checks judged at "
                f"{str(self.dtype).replace('torch.', '')} by the error-ratio rule")


FLOAT64 = Precision()


def max_abs(a: Tensor, b: Tensor) -> float:
    """max |a - b| in float64 on CPU; inf if either holds NaN; 0 for empty tensors."""
    a64, b64 = a.detach().to(torch.float64).cpu(), b.detach().to(torch.float64).cpu()
    if a64.shape != b64.shape:
        raise AssertionError(f"shapes differ: {tuple(a64.shape)} vs {tuple(b64.shape)}")
    if torch.isnan(a64).any() or torch.isnan(b64).any():
        return math.inf
    return float((a64 - b64).abs().max()) if a64.numel() else 0.0


def error_budget(reference_error: float, floor: float = 0.0) -> float:
    """The error-ratio rule's budget for an implementation computing in float32: 2 x the reference's own float32
    error + ATOL, plus a floor the check derives from its inputs (default 0; e.g. `logit_rounding_floor`)."""
    return 2 * reference_error + ATOL + floor


def close(what: str, got: Tensor, want: Tensor, *, precision: Precision, record_metric, metric: str,
          rtol: float, low: Callable[[], Tensor] | None = None, oracle: Tensor | None = None,
          floor: float = 0.0) -> float:
    """Assert got == want within float64 rounding: |got - want| <= rtol (1 + max |want|). For an implementation
    computing in float32, judge by the error-ratio rule instead: |got - want| <= 2 |low() - oracle| + ATOL + floor,
    where low() is the same computation by the reference (or the test's own oracle) in float32 on the inputs
    rounded to float32, oracle its float64 value (default want), and floor an error that every float32 computation
    of this check makes whatever its order, derived by the test from its inputs (default 0; e.g.
    `logit_rounding_floor`). Records the metric (kind "tolerance" or "ratio") and returns it."""
    err = max_abs(got, want)
    if not precision.float64 and low is None:
        raise TypeError(f"{what}: a check of a {precision.dtype} implementation needs low= (the reference in that "
                        "precision)")
    if precision.float64:
        scale = float(want.detach().double().abs().max()) if want.numel() else 0.0
        tol = rtol * (1 + scale)
        value = err / tol
        record_metric(metric, value, kind="tolerance")
        assert err <= tol, f"{what}: max error {err:.3g} > {tol:.3g} (float64 tolerance {rtol:g} relative)"
        return value
    budget = error_budget(max_abs(low(), want if oracle is None else oracle), floor)
    value = err / budget
    record_metric(metric, value, kind="ratio")
    with_floor = f" + rounding floor {floor:.3g}" if floor else ""
    assert value <= 1, (f"{what}: error ratio {value:.3g} > 1 at {str(precision.dtype).replace('torch.', '')} "
                        f"(max error {err:.3g}, budget 2 x the reference's own error + {ATOL:g}{with_floor} = "
                        f"{budget:.3g})")
    return value


def logit_rounding_floor(q: Tensor, k: Tensor, v: Tensor, dtype: torch.dtype = torch.float32) -> float:
    """The output error of softmax attention (Eq. 2) that one rounding of each logit to `dtype` causes, which every
    computation in that precision makes whatever its order of operations. A logit s rounded once carries
    |ds| <= u |s| (u the unit roundoff); with softmax weights p the output sum_i p_i v_i then moves by
    sum_i p_i (ds_i - sum_j p_j ds_j) v_i, at most 2 u max|s| max|v|, and |s| <= max ||q|| max ||k|| / sqrt(d_k)
    (Cauchy-Schwarz). Negligible for logits of order 1; with logits near 1e5 in float32 it is about 1e-2 max|v|,
    larger than the reference's own error on many draws: the error-ratio rule alone would then judge rounding luck.
    q [..., d_k], k [..., d_k], v [..., d_v]: every query, key and value the output can read."""
    if not (q.numel() and k.numel() and v.numel()):
        return 0.0
    u = torch.finfo(dtype).eps / 2
    qn = float(q.detach().double().norm(dim=-1).max())
    kn = float(k.detach().double().norm(dim=-1).max())
    return 2 * u * qn * kn / math.sqrt(q.shape[-1]) * float(v.detach().double().abs().max())


def rounded(x, dtype: torch.dtype = torch.float32):
    """x (Inputs or a tensor) rounded to dtype, as the reference's low-precision run gets it."""
    return x.to(dtype=dtype)


def detect_precision(impl, envelope, device) -> Precision:
    """The declared precision, or for precision="detect" a measurement: nsa_forward on a small float64 example
    against the float64 reference; float32 outputs, or errors beyond float64 rounding yet within the float32
    error-ratio budget, mean the implementation computes in float32."""
    import pytest

    mode = impl.caps.precision
    if mode == "inputs":
        return FLOAT64
    if mode == "float32":
        return Precision(torch.float32, "declared")
    try:
        return _probe(impl, envelope, device)
    except (Exception, pytest.skip.Exception):
        return Precision(torch.float64, "inputs (not measured: the probe could not run)")


def _probe(impl, envelope, device) -> Precision:
    from conformance.adapters import load_impl
    from conformance.helpers import inputs_for

    if not impl.has("nsa_forward"):
        return Precision(torch.float64, "inputs (not measured: no nsa_forward)")
    base = envelope.conventions.replace(cmp_block=4, cmp_stride=2, sel_block=4, n_sel=3, n_init=1, n_local=1,
                                        window=4, n_heads=2, n_kv_heads=1, head_dim_qk=4, head_dim_v=4, phi="avg")
    cfg = envelope.fit(base, equal_block=2)
    x = inputs_for(impl, cfg, 13, B=1, seed=5, device=device)
    reference = load_impl("reference")
    got = impl.stages["nsa_forward"](x.q, x.kv, x.gates, cfg, x.phi).o
    xc = x.to(device="cpu")
    want = reference.nsa_forward(xc.q, xc.kv, xc.gates, cfg, xc.phi).o
    if got.dtype == torch.float32:
        return Precision(torch.float32, "detected: float64 inputs give float32 outputs")
    err = max_abs(got, want)
    if err <= 1e-10 * (1 + float(want.abs().max())):
        return FLOAT64
    low = xc.to(dtype=torch.float32)
    err32 = max_abs(reference.nsa_forward(low.q, low.kv, low.gates, cfg, low.phi).o, want)
    if err <= error_budget(err32):
        return Precision(torch.float32, f"detected: float64 error {err:.2g} is float32-sized")
    return FLOAT64
