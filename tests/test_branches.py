"""nsa_forward(..., branches=...): a branch left out contributes nothing to o (its output and reads are zero, its
gate is not read and gets a zero gradient) and costs no work (its stages never run), on the torch path and on the
kernels (Triton's interpreter); the argument is validated."""

from __future__ import annotations

import pytest
import torch

import optimized
from conformance.helpers import make_inputs
from optimized import forward
from optimized.kernels import range_attention, selected_attention, selection
from reference.config import NSAConfig

CFG = NSAConfig(cmp_block=4, cmp_stride=2, sel_block=8, n_sel=3, window=5, n_heads=4, n_kv_heads=2, head_dim_qk=8,
                head_dim_v=8, phi="mlp")
GATE = {"cmp": 0, "slc": 1, "win": 2}
KERNELS = dict(backend="triton", range_backend="triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on CPU the kernels run in Triton's interpreter


@pytest.mark.parametrize("bad, rule", [(("cmp", "window"), "unknown branch name"), ((), "at least one"),
                                       (["cmp", "slc"], "a tuple"), ("cmp", "a tuple"), (("slc", "slc"), "once")])
def test_branches_are_validated(bad, rule) -> None:
    x = make_inputs(CFG, 12, phi_hidden=4)
    with pytest.raises(ValueError, match=rf"branches.*{rule}|{rule}.*branches"):
        optimized.nsa_forward(x.q, x.kv, x.gates, CFG, x.phi, branches=bad)
    with pytest.raises(ValueError, match="branches"):
        optimized.NSAAttention(32, CFG.replace(phi="avg"), branches=bad)


def forbid(monkeypatch: pytest.MonkeyPatch, module, name: str) -> None:
    def never(*args, **kwargs):
        raise AssertionError(f"{name} ran for a branch left out")

    monkeypatch.setattr(module, name, never)


def run(x, kept: tuple[str, ...], kernels: bool, gates=None):
    return optimized.nsa_forward(x.q, x.kv, x.gates if gates is None else gates, CFG, x.phi, branches=kept,
                                 **(KERNELS if kernels else {}))


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "kernels"])
@pytest.mark.parametrize("left_out", ["cmp", "slc", "win"])
def test_a_branch_left_out_contributes_nothing(left_out: str, kernels: bool, monkeypatch) -> None:
    dtype = torch.float32 if kernels else torch.float64
    x = make_inputs(CFG, 40, B=2, seed=3, dtype=dtype, device=DEVICE if kernels else "cpu", phi_hidden=4)
    kept = tuple(b for b in ("cmp", "slc", "win") if b != left_out)
    zero_gate = x.gates.clone()
    zero_gate[..., GATE[left_out]] = 0
    full = run(x, ("cmp", "slc", "win"), kernels, gates=zero_gate)  # computed before the stages are forbidden
    if left_out == "win":
        forbid(monkeypatch, forward, "window_attention_rows")
        forbid(monkeypatch, range_attention, "window_branch")
    elif left_out == "slc":
        for module, name in ((forward, "selection_indices_rows"), (forward, "selected_attention_rows"),
                             (selection, "selection_indices_rows"), (selected_attention, "triton_selected_attention")):
            forbid(monkeypatch, module, name)
    else:
        forbid(monkeypatch, forward, "compressed_attention_rows")
    nan_gate = x.gates.clone().requires_grad_(True)
    with torch.no_grad():
        nan_gate[..., GATE[left_out]] = float("nan")  # never read
    got = run(x, kept, kernels, gates=nan_gate)
    assert torch.equal(got.o, full.o), "o must be Eq. 5 over the other two branches"
    assert not getattr(got, f"o_{left_out}").any() and not getattr(got.reads, left_out).any()
    for name in kept:
        assert torch.equal(getattr(got, f"o_{name}"), getattr(full, f"o_{name}"))
        assert torch.equal(getattr(got.reads, name), getattr(full.reads, name))
    if left_out == "slc":
        assert bool((got.indices == -1).all())
    else:
        assert torch.equal(got.indices, full.indices)
    got.o.sum().backward()
    assert torch.equal(nan_gate.grad[..., GATE[left_out]], torch.zeros_like(nan_gate.grad[..., 0]))
    assert nan_gate.grad.isfinite().all()


def test_leaving_out_cmp_on_the_kernels_computes_only_the_normaliser(monkeypatch) -> None:
    """The selection still needs the compressed branch's softmax normaliser (Eq. 8): the range kernel runs without
    values (no P.V product), and no compressed values are built."""
    x = make_inputs(CFG, 40, seed=4, dtype=torch.float32, device=DEVICE, phi_hidden=4)
    calls = []
    real = range_attention.compressed_branch
    monkeypatch.setattr(range_attention, "compressed_branch",
                        lambda q, k, v, *a, **kw: calls.append(v) or real(q, k, v, *a, **kw))
    run(x, ("slc", "win"), True)
    assert calls == [None]
    calls.clear()
    run(x, ("cmp", "slc", "win"), True)
    assert len(calls) == 1 and calls[0] is not None


def test_teacher_forced_selection_without_cmp_compresses_nothing(monkeypatch) -> None:
    x = make_inputs(CFG, 40, seed=5, phi_hidden=4)
    indices = run(x, ("cmp", "slc", "win"), False).indices
    forbid(monkeypatch, forward, "compress_unrounded")
    out = optimized.nsa_forward(x.q, x.kv, x.gates, CFG, x.phi, indices=indices, branches=("slc", "win"))
    assert torch.equal(out.indices, indices)


def test_nsa_attention_takes_branches() -> None:
    torch.manual_seed(0)
    cfg = CFG.replace(phi="avg")
    both = optimized.NSAAttention(32, cfg)
    no_window = optimized.NSAAttention(32, cfg, branches=("slc", "cmp"))
    no_window.load_state_dict(both.state_dict())
    assert no_window.branches == ("cmp", "slc")
    x = torch.randn(2, 20, 32)
    out = no_window.attention(x)
    assert not out.o_win.any() and not out.reads.win.any()
    assert torch.equal(out.o_slc, both.attention(x).o_slc)
