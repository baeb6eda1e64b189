"""Input checks of the NSA API: non-finite inputs refused when `check_finite=True` (default on for the reference,
off for the optimized path), NSAConfig sizes bounded by what a forward can allocate, numpy integers accepted,
and a `kv` that is not a BranchKV refused with the type expected."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import optimized
import reference
from conformance.helpers import make_inputs
from reference.config import MAX_ELEMENTS, NSAConfig
from reference.contract import KV, BranchKV

CFG = NSAConfig(cmp_block=4, cmp_stride=2, sel_block=4, n_sel=3, window=4, n_heads=4, n_kv_heads=2,
                head_dim_qk=6, head_dim_v=4, phi="avg")
T = 9


def inputs(**kw):
    return make_inputs(CFG, T, seed=3, **kw)


def poisoned(where: str, value: float):
    x = inputs()
    tensor = {"q": x.q, "gates": x.gates, "kv.win.k": x.kv.win.k, "kv.slc.v": x.kv.slc.v}[where]
    tensor[0, 5, 1, 2] = value
    return x


# -- check_finite ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["q", "gates", "kv.win.k", "kv.slc.v"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_reference_refuses_non_finite_inputs_by_default(where, value):
    x = poisoned(where, value)
    with pytest.raises(ValueError) as err:
        reference.nsa_forward(x.q, x.kv, x.gates, CFG)
    message = str(err.value)
    assert message.startswith(f"{where} has 1 non-finite value") and "[0, 5, 1, 2]" in message
    assert "check_finite=False" in message


def test_reference_check_finite_false_lets_nan_through():
    x = poisoned("q", float("nan"))
    out = reference.nsa_forward(x.q, x.kv, x.gates, CFG, check_finite=False)
    assert torch.isnan(out.o[0, 5]).any() and torch.isfinite(out.o[0, :5]).all()


def test_optimized_checks_only_when_asked():
    x = poisoned("q", float("nan"))
    out = optimized.nsa_forward(x.q, x.kv, x.gates, CFG)  # default off: the kernels' path pays nothing
    assert torch.isnan(out.o[0, 5]).any()
    with pytest.raises(ValueError, match=r"^q has 1 non-finite value"):
        optimized.nsa_forward(x.q, x.kv, x.gates, CFG, check_finite=True)


def test_phi_weights_are_checked():
    cfg = CFG.replace(phi="mlp")
    x = make_inputs(cfg, T, seed=1)
    x.phi.k.w1[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"^phi\.k\.w1 has 1 non-finite value"):
        reference.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)


def test_finite_inputs_pass_the_check_unchanged():
    x = inputs()
    checked = reference.nsa_forward(x.q, x.kv, x.gates, CFG)
    unchecked = reference.nsa_forward(x.q, x.kv, x.gates, CFG, check_finite=False)
    assert torch.equal(checked.o, unchecked.o)


@pytest.mark.parametrize("impl,default", [(reference, True), (optimized, False)])
def test_modules_check_their_input_when_asked(impl, default):
    torch.manual_seed(0)
    module = impl.NSAAttention(8, CFG).double()
    assert module.check_finite is default
    x = torch.randn(1, T, 8, dtype=torch.float64)
    x[0, 3, 1] = float("nan")
    module.check_finite = True
    with pytest.raises(ValueError, match=r"^x has 1 non-finite value.*\[0, 3, 1\]"):
        module(x)
    module.check_finite = False
    assert torch.isnan(module(x)[0, 3]).all()
    assert impl.NSAAttention(8, CFG, check_finite=not default).check_finite is (not default)


# -- kv type ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", [reference, optimized])
@pytest.mark.parametrize("kv", ["tuple", "KV", "dict"])
def test_kv_that_is_not_a_branch_kv_is_refused_naming_the_type(impl, kv):
    x = inputs()
    bad = {"tuple": (x.kv.win.k, x.kv.win.v), "KV": x.kv.win, "dict": {"k": x.kv.win.k}}[kv]
    with pytest.raises(ValueError, match=r"kv must be a reference\.contract\.BranchKV .*BranchKV\.shared\(k, v\)"):
        impl.nsa_forward(x.q, bad, x.gates, CFG)


def test_branch_kv_holding_a_non_kv_is_refused():
    x = inputs()
    kv = BranchKV(cmp=(x.kv.cmp.k,), slc=x.kv.slc, win=x.kv.win)
    with pytest.raises(ValueError, match=r"kv\.cmp must be a reference\.contract\.KV"):
        reference.nsa_forward(x.q, kv, x.gates, CFG)
    assert isinstance(x.kv.slc, KV)


# -- NSAConfig -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("np_int", [np.int64, np.int32, np.uint16])
def test_numpy_integers_are_accepted_as_python_ints(np_int):
    cfg = NSAConfig(cmp_block=np_int(32), n_sel=np_int(16), n_heads=np_int(8), n_kv_heads=np_int(2))
    assert cfg == NSAConfig(cmp_block=32, n_sel=16, n_heads=8, n_kv_heads=2)
    assert type(cfg.cmp_block) is int and type(cfg.n_sel) is int
    assert NSAConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("value", [np.float64(32.0), np.bool_(True), "32", 32.0])
def test_non_integers_are_still_refused(value):
    with pytest.raises(ValueError, match=r"NSAConfig\.cmp_block must be an int"):
        NSAConfig(cmp_block=value)


@pytest.mark.parametrize("changes,fields,reason", [
    (dict(n_sel=10**18), ("n_sel", "sel_block", "head_dim_qk"), "one query's selected keys"),
    (dict(n_sel=2**25, sel_block=64), ("n_sel", "sel_block", "head_dim_qk"), "one query's selected keys"),
    (dict(window=2**40), ("window", "head_dim_qk"), "one query's window keys"),
    (dict(n_heads=2**24, n_kv_heads=4), ("n_heads", "head_dim_qk"), "one token's query row"),
    (dict(head_dim_qk=2**30), ("n_heads", "head_dim_qk"), "one token's query row"),
    (dict(head_dim_v=2**30), ("n_heads", "head_dim_v"), "one token's output row"),
    (dict(cmp_block=2**24, cmp_stride=2**24, sel_block=2**24), ("cmp_block", "head_dim_qk"),
     "one compressed block"),
])
def test_sizes_are_bounded_by_what_a_forward_allocates(changes, fields, reason):
    with pytest.raises(ValueError) as err:
        NSAConfig(**changes)
    message = str(err.value)
    assert message.startswith(" * ".join(f"NSAConfig.{f}" for f in fields)), message
    assert reason in message and f"{MAX_ELEMENTS:,}" in message


def test_the_paper_and_long_context_configs_stay_within_the_bounds():
    NSAConfig()  # the paper's sizes
    NSAConfig(n_sel=2048, window=65536)  # every block of a 128k context selected, a 64k window
