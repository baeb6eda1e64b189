"""The float32 rounding floor of the large-logit check (conformance.precision.logit_rounding_floor): it bounds what
one rounding of each logit does to a softmax output, a float32 computation stays inside it, and a leaked key
does not."""

from __future__ import annotations

import math

import pytest
import torch

from conformance.precision import ATOL, Precision, close, logit_rounding_floor
from reference.primitives import attend

U32 = torch.finfo(torch.float32).eps / 2


def attend_exp2(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """reference.primitives.attend in the exp2 form kernels use: 2^(s log2(e) - max), in the inputs' dtype."""
    s = (k @ q) / math.sqrt(q.shape[-1]) * (1 / math.log(2))
    e = torch.exp2(s - s.max())
    return (e / e.sum()) @ v


def large_logit_case(seed: int, n: int = 24, d: int = 16, v_scale: float = 50.0):
    """One query and n keys with logits near 1e5 that differ by order 1 (a softmax spread over many keys, where
    logit rounding moves the output most), and a leaked key whose logit exceeds them all by about 10."""
    g = torch.Generator().manual_seed(seed)
    u = torch.nn.functional.normalize(torch.randn(d, generator=g, dtype=torch.float64), dim=0)
    a = math.sqrt(1e5 * math.sqrt(d))
    q = a * u
    k = a * u + (math.sqrt(d) / a) * torch.randn(n, d, generator=g, dtype=torch.float64)
    leak = a * u * (1 + 1e-4)
    v = v_scale * torch.randn(n + 1, d, generator=g, dtype=torch.float64)
    return q, torch.cat([k, leak[None]]), v


@pytest.mark.parametrize("seed", range(4))
def test_floor_bounds_one_rounding_of_each_logit(seed):
    """Logits moved by up to u |s| each (random signs, and the worst case along each output coordinate) move the
    float64 output by no more than the floor."""
    q, k, v = large_logit_case(seed)
    k, v = k[:-1], v[:-1]
    floor = logit_rounding_floor(q[None], k, v)
    s = (k @ q) / math.sqrt(q.shape[-1])
    p = torch.softmax(s, 0)
    o = p @ v
    g = torch.Generator().manual_seed(100 + seed)
    moved = 0.0
    for _ in range(20):
        ds = U32 * s.abs() * (2 * torch.randint(0, 2, s.shape, generator=g, dtype=torch.float64) - 1)
        moved = max(moved, float((torch.softmax(s + ds, 0) @ v - o).abs().max()))
    for j in range(v.shape[1]):  # the sign pattern that moves coordinate j most: up where v_j is above o_j
        ds = U32 * s.abs() * torch.sign(v[:, j] - o[j])
        moved = max(moved, float((torch.softmax(s + ds, 0) @ v - o)[j].abs()))
    assert 0 < moved <= floor, (moved, floor)
    assert moved > floor / 50, "the floor should be of the size of what it bounds"


@pytest.mark.parametrize("seed", range(4))
def test_float32_computations_stay_inside_the_budget_a_leaked_key_does_not(seed):
    """Two float32 orderings of the same attention (the reference's Eq. 2 and its exp2 form) against the float64
    value: each within 2 x the other's error + ATOL + floor; the same computation reading one more key (a masked
    key leaking, with a logit as large as the others') is far outside it."""
    q, k, v = large_logit_case(seed, v_scale=1.0)
    visible = k.shape[0] - 1
    oracle = attend(q, k[:visible], v[:visible])
    floor = logit_rounding_floor(q[None], k[:visible], v[:visible])
    q32, k32, v32 = (t.float() for t in (q, k, v))
    exp_form = attend(q32, k32[:visible], v32[:visible])
    exp2_form = attend_exp2(q32, k32[:visible], v32[:visible])
    leaked = attend(q32, k32, v32)
    metrics = []
    record = lambda name, value, kind: metrics.append(value)  # noqa: E731
    f32 = Precision(torch.float32, "declared")
    for got, low in ((exp_form, exp2_form), (exp2_form, exp_form)):
        close("form", got, oracle, precision=f32, record_metric=record, metric="m", rtol=0.0, low=lambda lo=low: lo,
              floor=floor)
    # judged against a float32 value whose logit rounding happened to cost nothing (the float64 value rounded),
    # the same computation needs the floor: the error-ratio rule alone would judge rounding luck
    lucky = lambda: oracle.float()  # noqa: E731
    with pytest.raises(AssertionError, match=r"error ratio"):
        close("lucky", exp_form, oracle, precision=f32, record_metric=record, metric="m", rtol=0.0, low=lucky)
    close("lucky", exp_form, oracle, precision=f32, record_metric=record, metric="m", rtol=0.0, low=lucky, floor=floor)
    with pytest.raises(AssertionError, match=r"rounding floor"):
        close("leak", leaked, oracle, precision=f32, record_metric=record, metric="m", rtol=0.0,
              low=lambda: exp_form, floor=floor)
    assert metrics[-1] > 3, f"a leaked key should be far outside the budget, ratio {metrics[-1]:.3g}"
    assert (exp_form.double() - oracle).abs().max() > ATOL, "the case must carry float32 logit rounding"


def test_floor_is_negligible_for_logits_of_order_one():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((8, 16), (32, 16), (32, 16)))
    assert logit_rounding_floor(q, k, v) < 1e-5
    assert logit_rounding_floor(q, k[:0], v[:0]) == 0.0
