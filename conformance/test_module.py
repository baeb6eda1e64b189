"""Module level (NSAAttention): RoPE rotates q and every branch's k, never v, before compression; the
gates of Eq. 5 are g = sigmoid(MLP(x)) in [0, 1] per query head and branch, with the MLP's last layer
zero-initialised, so every gate is exactly 0.5 at initialisation.

- With phi = mean pooling, rotating only q and k makes every logit (and every compressed key's logit,
  since mean pooling commutes with a common rotation) depend on relative positions only, so the module
  output is invariant to a global position offset; rotating v breaks that (this test fails).
- A fresh module's gates are exactly 0.5; with large random gate weights they stay in [0, 1].
- Loaded with the same weights (the reference module's parameter names), the module equals
  reference.NSAAttention (float64; low precision by the error-ratio rule).
- Any module with its own projections, through forward(x) only (the black-box protocol, `make_module`; an
  `NSAAttention` counts): a row's output does not depend on the other rows of the batch, and where forward takes
  `position_offset`, the offset invariance above (no peeking: conformance/test_no_peeking.py).
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

from conformance.adapters import not_covered
from conformance.helpers import BLACK_BOX_HIDDEN, black_box_module, call_module, error_ratio
from conformance.precision import close

PROPERTY = "Module level"
EQUATION = "RoPE on q, k only; Eq. 5 gates"

HIDDEN = 16
RTOL = 1e-10  # float64, through projections and RoPE angles
FLOAT32_RTOL = 2e-5  # a module computing in float32: rounding through projections (no reference to budget it)


def module_config(envelope, phi: str):
    """Small sizes inside the envelope (l = 4, d = 2, l' = 4, or equal blocks of 2; 2 groups of 2 heads)."""
    return envelope.fit(envelope.conventions.replace(cmp_block=4, cmp_stride=2, sel_block=4, n_sel=3, n_init=1,
                                                     n_local=1, window=4, n_heads=4, n_kv_heads=2, head_dim_qk=6,
                                                     head_dim_v=4, phi=phi), equal_block=2)


def make_module(impl, cfg, device, seed: int = 0):
    impl.require("NSAAttention")
    torch.manual_seed(seed)
    return impl.NSAAttention(HIDDEN, cfg).to(device=device, dtype=torch.float64)


def randomize(module, seed: int, scale: float = 0.3) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_((torch.randn(p.shape, generator=g, dtype=torch.float64) * scale).to(p))


def test_output_is_invariant_to_a_position_offset(impl, envelope, device, precision, record_metric):
    """RoPE on q and k only: m(x) == m(x, position_offset=37) with phi = avg. Fails if v is rotated. Any module
    (make_module) whose forward takes position_offset."""
    impl.require("make_module")
    cfg = module_config(envelope, "avg")
    if impl.has("NSAAttention"):
        m = make_module(impl, cfg, device)
        randomize(m, 1)
    else:
        m = black_box_module(impl, cfg, device, seed=1, hidden=HIDDEN)
    if "position_offset" not in inspect.signature(m.forward).parameters:
        pytest.skip(f"not applicable: {impl.name}'s module forward takes no position_offset")
    x = torch.randn(2, 13, HIDDEN, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(device)
    with torch.no_grad():
        a, b = call_module(impl, m, x), call_module(impl, m, x, position_offset=37)
    err = float((a - b).abs().max())
    tol = (RTOL if precision.float64 else FLOAT32_RTOL) * (1 + float(a.abs().max()))
    record_metric("offset_invariance", err / tol, kind="tolerance")
    assert err <= tol, (f"module output changed by {err:.3g} under a position offset of 37: something besides q and "
                        f"k is rotated (v?), or RoPE is not relative")


def test_black_box_batch_rows_are_independent(impl, envelope, device, precision, record_metric):
    """make_module (any module with its own projections, forward(x) only): each row of a batch of three computed
    alone equals that row in the batch (up to rounding); a module that mixes rows (e.g. normalises over the
    batch) fails."""
    impl.require("make_module")
    cfg = module_config(envelope, envelope.conventions.phi)
    m = black_box_module(impl, cfg, device, seed=3)
    x = torch.randn(3, 11, BLACK_BOX_HIDDEN, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    x = x.to(device)
    with torch.no_grad():
        batch = call_module(impl, m, x)
        for row in range(3):
            alone = call_module(impl, m, x[row:row + 1])
            err = float((alone - batch[row:row + 1]).abs().max())
            tol = (RTOL if precision.float64 else FLOAT32_RTOL) * (1 + float(batch.abs().max()))
            record_metric("batch_row_independence", err / tol, kind="tolerance")
            assert err <= tol, f"row {row} computed alone differs from row {row} in a batch of 3 by {err:.3g}"


def gates_of(m, x):
    if hasattr(m, "project"):
        return m.project(x)[2]
    return None


def test_gates_start_at_exactly_one_half(impl, envelope, device):
    """Zero-initialised last gate layer: sigmoid(0) = 0.5 for every head, branch and input."""
    cfg = module_config(envelope, envelope.conventions.phi)
    m = make_module(impl, cfg, device)
    x = 10 * torch.randn(2, 9, HIDDEN, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(device)
    gates = gates_of(m, x)
    if gates is not None:
        gates = gates.detach()
        assert torch.equal(gates, torch.full_like(gates, 0.5)), (
            f"fresh module gates are not all 0.5: min {float(gates.min())}, max {float(gates.max())}")
        return
    if not hasattr(m, "attention"):
        not_covered(f"{impl.name}.NSAAttention exposes neither project() nor attention()")
    out = m.attention(x)
    half_sum = 0.5 * (out.o_cmp + out.o_slc + out.o_win)
    err = float((out.o - half_sum).abs().max())
    assert err <= RTOL * (1 + float(half_sum.abs().max())), (
        f"fresh module output is not 0.5 * (o_cmp + o_slc + o_win) (error {err:.3g}, config {cfg})")


def test_gates_stay_in_the_unit_interval(impl, envelope, device):
    """With large random gate weights, sigmoid gates stay in [0, 1] (and are no longer all 0.5)."""
    m = make_module(impl, module_config(envelope, envelope.conventions.phi), device)
    gate_params = [p for name, p in m.named_parameters() if "gate" in name]
    if not hasattr(m, "project") or not gate_params:
        not_covered(f"{impl.name}.NSAAttention exposes no project() or no parameters named *gate*")
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in gate_params:
            p.copy_((torch.randn(p.shape, generator=g, dtype=torch.float64) * 100).to(p))
    x = torch.randn(2, 9, HIDDEN, generator=g, dtype=torch.float64).to(device)
    gates = m.project(x)[2].detach()
    assert gates.shape[-1] == 3, f"gates must be [B, T, Hq, 3], got {tuple(gates.shape)}"
    assert float(gates.min()) >= 0 and float(gates.max()) <= 1, (
        f"gates outside [0, 1]: min {float(gates.min())}, max {float(gates.max())}")
    assert not torch.equal(gates, torch.full_like(gates, 0.5)), "gates ignore the gate weights"


def test_module_equals_the_reference_module(impl, envelope, device, low_dtype, precision, record_metric):
    """Same state_dict in reference.NSAAttention and the module: equal outputs at offsets 0 and 5."""
    from reference.module import NSAAttention as ReferenceModule

    cfg = module_config(envelope, envelope.conventions.phi)
    m = make_module(impl, cfg, device)
    randomize(m, 5)
    ref = ReferenceModule(HIDDEN, cfg).to(torch.float64)
    try:
        ref.load_state_dict({k: v.cpu() for k, v in m.state_dict().items()}, strict=True)
    except RuntimeError as exc:
        not_covered(f"{impl.name}.NSAAttention's parameters do not match reference.NSAAttention's names: "
                    f"{str(exc).splitlines()[0]}")
    x = torch.randn(2, 11, HIDDEN, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    for offset in (0, 5):
        with torch.no_grad():
            want = ref(x, position_offset=offset)
            got = m(x.to(device), position_offset=offset).cpu()

            def reference_in_float32():
                return copy.deepcopy(ref).to(torch.float32)(x.to(torch.float32), position_offset=offset)

            close(f"module output vs reference.NSAAttention at offset {offset}", got, want, precision=precision,
                  record_metric=record_metric, metric="float64", rtol=RTOL, low=reference_in_float32)
        m_low, ref_low = copy.deepcopy(m).to(low_dtype), copy.deepcopy(ref).to(low_dtype)
        oracle = copy.deepcopy(ref_low).to(torch.float64)  # float64 on the same rounded weights and inputs
        x_low = x.to(low_dtype)
        with torch.no_grad():
            ratio = error_ratio(m_low(x_low.to(device), position_offset=offset), ref_low(x_low, position_offset=offset),
                                oracle(x_low.to(torch.float64), position_offset=offset))
        record_metric(f"error_ratio_{str(low_dtype).replace('torch.', '')}", ratio)
        assert ratio <= 1, f"module in {low_dtype} at offset {offset}: error ratio {ratio:.3g} > 1"
