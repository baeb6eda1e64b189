"""Visibility edges of the reference: p = l-2, l-1, l; selection-block boundaries
p = k*l'-1 and k*l'; T not a multiple of any block; forced blocks and ties (Eq. 11); window width."""

import pytest
import torch

import reference as R
from conformance.helpers import make_inputs
from reference.selection import forced_blocks, select_row

CFG = R.NSAConfig(cmp_block=8, cmp_stride=4, sel_block=16, n_sel=3, n_init=1, n_local=2, window=8,
                  n_heads=2, n_kv_heads=1, head_dim_qk=4, head_dim_v=3, phi="avg")


@pytest.fixture(scope="module")
def run():
    T = 77  # not a multiple of d=4, l=8, l'=16 or w=8
    x = make_inputs(CFG, T, seed=1)
    return x, R.nsa_forward(x.q, x.kv, x.gates, CFG)


def test_compressed_block_count_for_t_not_a_multiple(run):
    x, _ = run
    k_cmp, v_cmp = R.compress(x.kv.cmp.k, x.kv.cmp.v, CFG)
    assert k_cmp.shape[1] == (77 - 8) // 4 + 1 == 18  # last block covers tokens 68..75; token 76 is in none
    assert torch.allclose(k_cmp[0, 17, 0], x.kv.cmp.k[0, 68:76, 0].mean(0))
    assert torch.allclose(v_cmp[0, 0, 0], x.kv.cmp.v[0, 0:8, 0].mean(0))


def test_compressed_visibility_around_l(run):
    x, out = run
    l = CFG.cmp_block
    assert out.reads.cmp[0, l - 2, 0] == 0
    assert torch.equal(out.o_cmp[0, l - 2], torch.zeros_like(out.o_cmp[0, l - 2]))  # empty set -> exactly 0
    assert out.reads.cmp[0, l - 1, 0] == 1  # block 0 ends at p = l-1: visible (inclusive)
    _, v_cmp = R.compress(x.kv.cmp.k, x.kv.cmp.v, CFG)
    # one visible compressed key: softmax weight 1, so the branch returns that compressed value
    assert torch.allclose(out.o_cmp[0, l - 1, 0], v_cmp[0, 0, 0])
    assert out.reads.cmp[0, l, 0] == 1
    assert out.reads.cmp[0, l - 1 + CFG.cmp_stride - 1, 0] == 1
    assert out.reads.cmp[0, l - 1 + CFG.cmp_stride, 0] == 2


def test_strict_visibility_switch_delays_each_block_by_one_token():
    cfg = CFG.replace(cmp_visibility="strict")
    x = make_inputs(cfg, 20, seed=2)
    out = R.nsa_forward(x.q, x.kv, x.gates, cfg)
    assert out.reads.cmp[0, 7, 0] == 0 and out.reads.cmp[0, 8, 0] == 1 and out.reads.cmp[0, 12, 0] == 2


@pytest.mark.parametrize("k", [2, 3, 4])
def test_selection_block_boundaries(run, k):
    _, out = run
    lp = CFG.sel_block
    # p = k*l' - 1: current block k-1 is complete; n = 3 = 1 initial + 2 local, so exactly {0, k-2, k-1}
    p = k * lp - 1
    assert out.indices[0, p, 0].tolist() == sorted({0, k - 2, k - 1}) + [-1] * (3 - len({0, k - 2, k - 1}))
    assert out.reads.slc[0, p, 0] == len({0, k - 2, k - 1}) * lp
    # p = k*l': block k starts and holds one token (the query's own)
    p = k * lp
    assert out.indices[0, p, 0].tolist() == [0, k - 1, k]
    assert out.reads.slc[0, p, 0] == 2 * lp + 1


def test_all_blocks_selected_when_fewer_than_n_exist(run):
    _, out = run
    assert out.indices[0, 5, 0].tolist() == [0, -1, -1]
    assert out.indices[0, 16, 0].tolist() == [0, 1, -1]
    assert out.reads.slc[0, 16, 0] == 17


def test_window_width(run):
    _, out = run
    w = CFG.window
    assert [int(out.reads.win[0, p, 0]) for p in (0, w - 2, w - 1, w, 70)] == [1, w - 1, w, w, w]
    cfg = CFG.replace(window_keys="w+1")
    x = make_inputs(cfg, 12, seed=3)
    out1 = R.nsa_forward(x.q, x.kv, x.gates, cfg)
    assert int(out1.reads.win[0, 11, 0]) == w + 1


def test_forced_blocks_and_tie_break():
    cfg = R.NSAConfig(n_sel=5, n_init=1, n_local=2)
    assert forced_blocks(9, cfg) == [0, 8, 9]
    assert forced_blocks(1, cfg) == [0, 1]
    # equal scores everywhere: free slots go to the lowest block indices
    assert select_row([0.5] * 10, 9, cfg) == [0, 1, 2, 8, 9]
    # a higher score wins regardless of index; ties between 3 and 6 go to 3
    scores = [0.0, 0.1, 0.2, 0.7, 0.1, 0.1, 0.7, 0.9, 0.0, 0.0]
    assert select_row(scores, 9, cfg) == [0, 3, 7, 8, 9]
    # forced blocks never need a score; n_init=0, n_local=1 (only the current block forced)
    cfg0 = R.NSAConfig(n_sel=2, n_init=0, n_local=1)
    assert select_row([9.0, 0.0, 1.0, 0.0], 3, cfg0) == [0, 3]


def test_scores_are_minus_inf_after_the_current_block():
    x = make_inputs(CFG, 40, seed=4)
    k_cmp, _ = R.compress(x.kv.cmp.k, x.kv.cmp.v, CFG)
    s = R.selection_scores(x.q, k_cmp, CFG)
    assert s.shape == (1, 40, 1, 3)
    assert torch.isinf(s[0, 15, 0, 1:]).all() and torch.isfinite(s[0, 16, 0, :2]).all()
    # p = 9: one compressed block (tokens 0..7) visible, prob 1 per head, weight 2 into block 0, 2 heads
    assert s[0, 9, 0, 0].item() == pytest.approx(4.0)
