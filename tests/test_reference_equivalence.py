"""Cover-all equivalence: when a branch can see every causal key, the reference equals plain dense causal
attention, computed independently with an explicit masked score matrix and softmax."""

import pytest
import torch

import reference as R
from conformance.helpers import dense_causal_attention, make_inputs

BASE = R.NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, n_sel=4, n_init=1, n_local=2, window=6,
                   n_heads=4, n_kv_heads=2, head_dim_qk=5, head_dim_v=3, phi="avg")


@pytest.mark.parametrize("T", [1, 7, 25, 32])
def test_selected_branch_covering_all_blocks_is_dense_causal(T):
    cfg = BASE  # n * l' = 32 >= T: every block is selected
    x = make_inputs(cfg, T, seed=T)
    out = R.nsa_forward(x.q, x.kv, x.gates, cfg)
    expected = dense_causal_attention(x.q, x.kv.slc.k, x.kv.slc.v)
    torch.testing.assert_close(out.o_slc, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("T", [1, 9, 30])
def test_window_branch_covering_all_keys_is_dense_causal(T):
    cfg = BASE.replace(window=32)
    x = make_inputs(cfg, T, seed=T)
    gates = torch.zeros_like(x.gates)
    gates[..., 2] = 1.0  # window branch only
    out = R.nsa_forward(x.q, x.kv, gates, cfg)
    torch.testing.assert_close(out.o, dense_causal_attention(x.q, x.kv.win.k, x.kv.win.v), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("window_keys, width", [("w", 6), ("w+1", 7)])
def test_window_branch_is_banded_dense_attention(window_keys, width):
    cfg = BASE.replace(window_keys=window_keys)
    x = make_inputs(cfg, 21, seed=5)
    out = R.nsa_forward(x.q, x.kv, x.gates, cfg)
    expected = dense_causal_attention(x.q, x.kv.win.k, x.kv.win.v, window=width)
    torch.testing.assert_close(out.o_win, expected, rtol=1e-12, atol=1e-12)


def test_compressed_branch_with_unit_blocks_is_dense_causal():
    cfg = BASE.replace(cmp_block=1, cmp_stride=1)  # each compressed key is one raw key (avg of one row)
    x = make_inputs(cfg, 19, seed=6)
    gates = torch.zeros_like(x.gates)
    gates[..., 0] = 1.0
    out = R.nsa_forward(x.q, x.kv, gates, cfg)
    torch.testing.assert_close(out.o, dense_causal_attention(x.q, x.kv.cmp.k, x.kv.cmp.v), rtol=1e-12, atol=1e-12)


def test_gates_combine_branches_linearly():
    cfg = BASE.replace(n_sel=3)
    x = make_inputs(cfg, 40, seed=7)
    out = R.nsa_forward(x.q, x.kv, x.gates, cfg)
    g = x.gates
    expected = g[..., 0:1] * out.o_cmp + g[..., 1:2] * out.o_slc + g[..., 2:3] * out.o_win
    torch.testing.assert_close(out.o, expected, rtol=0, atol=0)
