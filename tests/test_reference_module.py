"""reference.NSAAttention: RoPE on q and k only, zero-initialised sigmoid gates, float64 autograd."""

import torch

import reference as R

CFG = R.NSAConfig(cmp_block=4, cmp_stride=2, sel_block=4, n_sel=3, window=4, n_heads=4, n_kv_heads=2,
                  head_dim_qk=6, head_dim_v=4, phi="avg")


def make_module(cfg=CFG, seed=0):
    torch.manual_seed(seed)
    return R.NSAAttention(16, cfg).double()


def test_gates_start_at_one_half_and_stay_in_unit_interval():
    m = make_module()
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    _, _, gates = m.project(x)
    assert torch.equal(gates, torch.full_like(gates, 0.5))
    with torch.no_grad():
        m.gate[-1].weight.normal_(std=100.0)
    _, _, gates = m.project(x)
    assert gates.min() >= 0 and gates.max() <= 1


def test_rope_rotates_q_and_k_but_not_v():
    m = make_module()
    x = torch.randn(1, 7, 16, dtype=torch.float64)
    q, kv, _ = m.project(x)
    for branch in ("cmp", "slc", "win"):
        v_plain = getattr(m, f"v_{branch}_proj")(x).view(1, 7, 2, 4)
        k_plain = getattr(m, f"k_{branch}_proj")(x).view(1, 7, 2, 6)
        assert torch.equal(kv.branch(branch).v, v_plain)
        assert torch.equal(kv.branch(branch).k[:, 0], k_plain[:, 0])  # position 0: no rotation
        assert not torch.allclose(kv.branch(branch).k[:, 1:], k_plain[:, 1:])


def test_output_is_invariant_to_a_rope_position_offset_with_avg_phi():
    """With RoPE on q and k only, logits depend on relative positions; mean pooling of rotated keys keeps that."""
    m = make_module()
    x = torch.randn(1, 13, 16, dtype=torch.float64)
    torch.testing.assert_close(m(x), m(x, position_offset=37), rtol=1e-10, atol=1e-10)


def test_mlp_phi_module_backward_reaches_every_parameter():
    m = make_module(CFG.replace(phi="mlp"))
    with torch.no_grad():
        m.gate[-1].weight.normal_(std=0.1)
    m(torch.randn(1, 9, 16, dtype=torch.float64)).square().sum().backward()
    missing = [n for n, p in m.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []


def test_a_subclass_whose_seams_predate_cu_seqlens_still_runs_unpacked_input():
    """Third-party subclasses (and the v_rotated self-test variant once was one) override project() and
    functional_forward() without the cu_seqlens keyword: forward(x) must still call them, and give the
    parent's output when they only delegate."""

    class OldSeams(R.NSAAttention):
        calls = []

        def project(self, x, position_offset=0):
            self.calls.append("project")
            return super().project(x, position_offset)

        def functional_forward(self, q, kv, gates, phi):
            self.calls.append("functional_forward")
            return super().functional_forward(q, kv, gates, phi)

    torch.manual_seed(0)
    old = OldSeams(16, CFG).double()
    x = torch.randn(1, 9, 16, dtype=torch.float64)
    new = make_module()
    new.load_state_dict(old.state_dict())
    assert torch.equal(old(x), new(x))
    assert OldSeams.calls == ["project", "functional_forward"]
