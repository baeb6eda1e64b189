"""Float64 gradcheck of the reference through every branch, gates and phi."""

import pytest
import torch

import reference as R
from conformance.helpers import make_inputs
from reference.contract import KV, BranchKV, PhiMLPWeights, PhiWeights


@pytest.mark.parametrize("phi", ["avg", "mlp"])
def test_gradcheck_nsa_forward(phi):
    cfg = R.NSAConfig(cmp_block=4, cmp_stride=2, sel_block=4, n_sel=2, n_init=1, n_local=1, window=3,
                      n_heads=2, n_kv_heads=1, head_dim_qk=3, head_dim_v=2, phi=phi)
    x = make_inputs(cfg, 11, seed=3, phi_hidden=3).to(requires_grad=True)
    leaves = x.tensors()

    def f(*ts):
        q, gates = ts[0], ts[1]
        kv = BranchKV(KV(ts[2], ts[3]), KV(ts[4], ts[5]), KV(ts[6], ts[7]))
        phi_w = None
        if phi == "mlp":
            phi_w = PhiWeights(k=PhiMLPWeights(*ts[8:13]), v=PhiMLPWeights(*ts[13:18]))
        out = R.nsa_forward(q, kv, gates, cfg, phi_w)
        return out.o

    assert torch.autograd.gradcheck(f, tuple(leaves), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("branch", ["cmp", "slc", "win"])
def test_gradcheck_each_branch_stage(branch):
    cfg = R.NSAConfig(cmp_block=4, cmp_stride=2, sel_block=4, n_sel=2, n_init=1, n_local=1, window=3,
                      n_heads=2, n_kv_heads=1, head_dim_qk=3, head_dim_v=2, phi="avg")
    x = make_inputs(cfg, 10, seed=4).to(requires_grad=True)
    k, v = x.kv.branch(branch)
    with torch.no_grad():
        k_cmp, _ = R.compress(x.kv.cmp.k, x.kv.cmp.v, cfg)
        indices = R.select_blocks(R.selection_scores(x.q, k_cmp, cfg), cfg)

    def f(q, k, v):
        if branch == "cmp":
            kc, vc = R.compress(k, v, cfg)
            return R.compressed_attention(q, kc, vc, cfg)
        if branch == "slc":
            return R.selected_attention(q, k, v, indices, cfg)
        return R.window_attention(q, k, v, cfg)

    assert torch.autograd.gradcheck(f, (x.q, k, v), eps=1e-6, atol=1e-7, rtol=1e-5)
