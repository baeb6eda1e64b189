"""The Eq. 5 kernels of the range-kernel path (optimized/kernels/gated_sum.py) against the torch expression they
replace, g_cmp o_cmp + g_slc o_slc + g_win o_win in the compute dtype rounded once: the output and the branch
outputs' gradients must be IDENTICAL (bitwise); the gates' gradients (a sum over d_v, whose order the backward
kernel and torch's reduction choose differently) must pass the error-ratio rule against an fp64 oracle with the
torch expression's gradient as the low-precision reference.

Without CUDA the kernel runs in Triton's interpreter on fp32 (fp64 arithmetic) and fp16 (fp32 arithmetic) inputs;
bf16 outputs need the GPU: the interpreter converts fp32 to bf16 by truncating (triton.runtime.interpreter
_convert_float), where the GPU rounds to nearest even as torch does. With CUDA every case runs compiled, bf16
and a paper-sized layer output included (`pytest tests/kernels/test_kernel_gated_sum.py` on a GPU host).
"""

from __future__ import annotations

import pytest
import torch

import optimized as O
from conformance.helpers import error_ratio, make_inputs
from optimized.forward import gated_sum
from optimized.kernels import gated_sum as eq5
from optimized.kernels import range_attention, range_attention_bwd
from optimized.kernels.gated_sum import gated_sum_backward, gated_sum_kernel
from optimized.dispatch import compute_dtype
from reference.config import NSAConfig

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_gpu_rounding = pytest.mark.skipif(not CUDA, reason="the interpreter truncates fp32 -> bf16 (module docstring)")
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=needs_gpu_rounding)]


def torch_expression(gates, o_cmp, o_slc, o_win, dtype):
    """What the kernel path (forward._kernel_path) computed before the kernel: Eq. 5 on widened copies, rounded once."""
    cd = compute_dtype(dtype)
    return gated_sum(gates.to(cd), o_cmp.to(cd), o_slc.to(cd), o_win.to(cd)).to(dtype)


def branch_outputs(shape, dtype, seed: int, slc_dtype=None):
    """gates in (0, 1) and three branch outputs (o_slc in slc_dtype: the selected branch hands the compute dtype)."""
    g = torch.Generator().manual_seed(seed)
    gates = torch.rand((*shape[:3], 3), generator=g).to(DEVICE, dtype)
    outs = [(torch.randn(shape, generator=g) * 4).to(DEVICE, d) for d in (dtype, slc_dtype or dtype, dtype)]
    return gates, outs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 37, 5, 100), (1, 9, 3, 6), (1, 130, 4, 128), (1, 3, 2, 256)])
def test_forward_is_the_torch_expression(shape, dtype) -> None:
    gates, outs = branch_outputs(shape, dtype, seed=sum(shape))
    got = gated_sum_kernel(gates, *outs, compute=compute_dtype(dtype), dtype=dtype)
    assert got.dtype == dtype and got.shape == outs[0].shape
    assert torch.equal(got, torch_expression(gates, *outs, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_dtypes_and_strided_views(dtype) -> None:
    """o_slc in the compute dtype (as selected_attention_rows returns it), gates a slice of a wider tensor, the
    branch outputs transposed views."""
    cd = compute_dtype(dtype)
    gates, outs = branch_outputs((2, 21, 6, 40), dtype, seed=1, slc_dtype=cd)
    wide = torch.cat([gates, torch.ones_like(gates)], dim=-1)[..., :3]
    views = [o.transpose(1, 2).contiguous().transpose(1, 2) for o in outs]
    got = gated_sum_kernel(wide, *views, compute=cd, dtype=dtype)
    assert torch.equal(got, torch_expression(gates, *outs, dtype))


def gates_grad_oracle(gates, outs, do) -> torch.Tensor:
    """d gates of Eq. 5 in fp64 from the same (rounded) inputs: sum over d_v of do * o_c, unrounded."""
    return torch.stack([(do.double() * o.double()).sum(-1) for o in outs], dim=-1)


def assert_gradients_match(leaves, got, want, do) -> None:
    """got / want: gradients of the kernel and of the torch expression for leaves (gates first when asked)."""
    for leaf, a, b in zip([x for x in leaves if x.requires_grad], got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        if leaf is leaves[0]:  # the gates
            oracle = gates_grad_oracle(leaves[0], leaves[1:], do)
            ratio = error_ratio(a, b, oracle)
            assert ratio <= 1.0, f"d gates error ratio {ratio:.3f} (kernel vs fp64 over 2 x torch's error)"
        else:
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("needs", ["all", "gates", "outputs"])
def test_backward_is_the_torch_expressions(dtype, needs: str) -> None:
    """Gradients of autograd through the torch expression (the backward kernel does its arithmetic), for any
    subset of inputs that needs them; o_slc in the compute dtype."""
    cd = compute_dtype(dtype)
    gates, outs = branch_outputs((2, 19, 4, 24), dtype, seed=2, slc_dtype=cd)
    leaves = [gates.requires_grad_(needs != "outputs")] + [o.requires_grad_(needs != "gates") for o in outs]
    wanted = [x for x in leaves if x.requires_grad]
    do = torch.randn(outs[0].shape, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    got = torch.autograd.grad(gated_sum_kernel(*leaves, compute=cd, dtype=dtype), wanted, do)
    want = torch.autograd.grad(torch_expression(*leaves, dtype), wanted, do)
    assert len(got) == len(wanted)
    assert_gradients_match(leaves, got, want, do)


def test_backward_of_some_outputs_and_strided_upstream_gradient() -> None:
    """Only o_slc needs a gradient (the others get None), and the upstream gradient is a strided view."""
    dtype = torch.float16
    gates, outs = branch_outputs((1, 11, 3, 40), dtype, seed=4)
    outs[1].requires_grad_()
    do = torch.randn((1, 3, 11, 40), generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype).transpose(1, 2)
    o = gated_sum_kernel(gates, *outs, compute=torch.float32, dtype=dtype)
    (got,) = torch.autograd.grad(o, [outs[1]], do)
    (want,) = torch.autograd.grad(torch_expression(gates, *outs, dtype), [outs[1]], do)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_writes_delta0_of_the_stored_output_gradients(dtype) -> None:
    """The delta0 buffers receive D0 = sum over d_v of the branch's d o_c as stored (rounded to its dtype) times o_c,
    the FlashAttention-2 D of a range-attention backward, against an fp64 sum of the same values; a branch given no
    buffer writes none. (At fp16 a D0 of the unrounded g_c * do misses the bound by ~25x.)"""
    gates, outs = branch_outputs((2, 13, 3, 40), dtype, seed=6)
    do = torch.randn(outs[0].shape, generator=torch.Generator().manual_seed(7)).to(DEVICE, dtype)
    delta0 = tuple(torch.full(outs[0].shape[:3], float("nan"), device=DEVICE) if i != 1 else None for i in range(3))
    d_gates, *d_outs = gated_sum_backward(do, gates, *outs, compute_dtype(dtype), grad_outs=True, grad_gates=False,
                                          delta0=delta0)
    assert d_gates is None
    for i in (0, 2):
        want = (d_outs[i].double() * outs[i].double()).sum(-1)
        assert (delta0[i].double() - want).abs().max().item() <= 1e-5 * want.abs().max().item(), f"branch {i}"
    with pytest.raises(ValueError, match="delta0 must be a contiguous float32 tensor"):
        gated_sum_backward(do, gates, *outs, compute_dtype(dtype), grad_outs=True, grad_gates=False,
                           delta0=(None, None, torch.zeros(outs[0].shape[:3], dtype=torch.float64, device=DEVICE)))


def test_range_branches_take_delta0_from_eq5_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the kernel path o_cmp and o_win go from the range kernel straight into Eq. 5's kernel, whose backward
    hands each its D0 with its gradient: the range backwards run no D0 pass of their own, and the gradients are
    those of the run where each forms D0 itself (the same sum of the same values, up to its order). A branch output
    that also feeds another op gets the sum of two gradients (a new tensor), so its backward forms D0 itself; no
    handed-over D0 outlives the backward."""
    cfg = NSAConfig(cmp_block=4, cmp_stride=2, sel_block=8, n_sel=3, n_init=1, n_local=1, window=6, n_heads=4,
                    n_kv_heads=2, head_dim_qk=16, head_dim_v=16, phi="avg")
    x = make_inputs(cfg, 33, seed=8, dtype=torch.float32, device=DEVICE)
    leaves = [x.q, x.gates, x.kv.cmp.k, x.kv.cmp.v, x.kv.win.k, x.kv.win.v]
    for t in leaves:
        t.requires_grad_()
    g = torch.Generator().manual_seed(9)
    do, do_cmp = (torch.randn(x.q.shape[:3] + (cfg.head_dim_v,), generator=g).to(DEVICE) for _ in range(2))
    passes = []
    real_delta = range_attention_bwd.range_attention_delta
    monkeypatch.setattr(range_attention_bwd, "range_attention_delta", lambda *a: passes.append(1) or real_delta(*a))

    def grads(also_cmp: bool = False):
        passes.clear()
        out = O.nsa_forward(x.q, x.kv, x.gates, cfg, range_backend="triton", branches=("cmp", "win"))
        loss = (out.o * do).sum() + ((out.o_cmp * do_cmp).sum() if also_cmp else 0)
        return torch.autograd.grad(loss, leaves), len(passes)

    handed, handed_passes = grads()
    summed, summed_passes = grads(also_cmp=True)
    assert len(range_attention._SUPPLIED_DELTA0) == 0
    monkeypatch.setattr(eq5, "takes_supplied_delta0", lambda o: False)
    own, own_passes = grads()
    own_summed, _ = grads(also_cmp=True)
    assert (handed_passes, summed_passes, own_passes) == (0, 1, 2)
    for name, a, b, c, d in zip(("q", "gates", "k_cmp", "v_cmp", "k_win", "v_win"), handed, own, summed, own_summed):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(c, d, rtol=1e-5, atol=1e-6, msg=name)


def test_a_supplied_delta0_is_taken_only_for_the_gradient_it_came_with() -> None:
    """The range backward takes a supplied D0 (NaN here, so that taking it shows in dq and dk; dv = P^T dO does not
    read D) for the very gradient tensor it was supplied with, unchanged; after that tensor changed in place
    (autograd summing another consumer's gradient into it) or for another tensor of the same values, it forms its
    own D0, and the gradients are those of a run with nothing supplied."""
    cfg = NSAConfig(cmp_block=4, cmp_stride=2, sel_block=8, n_sel=3, n_init=1, n_local=1, window=6, n_heads=4,
                    n_kv_heads=2, head_dim_qk=16, head_dim_v=16)
    g = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(shape, generator=g).to(DEVICE).requires_grad_() for shape in
               ((1, 21, 4, 16), (1, 21, 2, 16), (1, 21, 2, 16)))
    lo, hi = range_attention.window_ranges(torch.arange(21, device=DEVICE), cfg)
    do = torch.randn((1, 21, 4, 16), generator=g).to(DEVICE)

    def grads(supplied_to=None, changed: bool = False, passed=None):
        o, _ = range_attention.range_attention_lse2(q, k, v, lo, hi)
        if supplied_to is not None:
            range_attention.supply_delta0(supplied_to, torch.full(o.shape[:3], float("nan"), device=DEVICE))
            if changed:
                supplied_to.mul_(1.0)
        return torch.autograd.grad(o, (q, k, v), do if passed is None else passed)

    plain = grads()
    mine = do.clone()
    dq, dk, dv = grads(supplied_to=mine, passed=mine)
    assert dq.isnan().any() and dk.isnan().any() and torch.equal(dv, plain[2])
    for got in (grads(supplied_to=mine, changed=True, passed=mine), grads(supplied_to=do.clone())):
        for a, b in zip(got, plain):
            assert torch.equal(a, b)
    assert len(range_attention._SUPPLIED_DELTA0) == 0
    with pytest.raises(ValueError, match=r"supply_delta0: delta0 must be a contiguous float32 tensor \[1, 21, 4\]"):
        range_attention.supply_delta0(do, torch.zeros((1, 21, 4), dtype=torch.float64, device=DEVICE))


def test_layer_output_on_the_kernel_path_is_the_gated_sum_of_its_branches() -> None:
    """nsa_forward(range_backend="triton") returns o = Eq. 5 of the o_cmp, o_slc, o_win it returns (fp16: o_slc
    is its kernel's fp16 output widened, so rounding it back loses nothing)."""
    cfg = NSAConfig(cmp_block=4, cmp_stride=2, sel_block=8, n_sel=3, n_init=1, n_local=1, window=6, n_heads=4,
                    n_kv_heads=2, head_dim_qk=16, head_dim_v=16, phi="avg")
    dtype = torch.float16
    x = make_inputs(cfg, 40, seed=5, dtype=dtype, device=DEVICE)
    out = O.nsa_forward(x.q, x.kv, x.gates, cfg, backend="triton", range_backend="triton")
    assert torch.equal(out.o, torch_expression(x.gates, out.o_cmp, out.o_slc, out.o_win, dtype))


def test_bad_inputs_raise_value_errors() -> None:
    gates, outs = branch_outputs((1, 4, 2, 8), torch.float32, seed=0)
    with pytest.raises(ValueError, match="o_slc must be a 4-D fp64/fp32/bf16/fp16 tensor"):
        gated_sum_kernel(gates, outs[0], outs[1].int(), outs[2], compute=torch.float64, dtype=torch.float32)
    with pytest.raises(ValueError, match="must share one shape"):
        gated_sum_kernel(gates, outs[0], outs[1][..., :4], outs[2], compute=torch.float64, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"gates must be \[B, T, Hq, 3\]"):
        gated_sum_kernel(gates[..., :2], *outs, compute=torch.float64, dtype=torch.float32)
    with pytest.raises(ValueError, match="compute must be one of"):
        gated_sum_kernel(gates, *outs, compute=torch.float16, dtype=torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_paper_heads_8k_bf16() -> None:
    """The perf sweep's layer output at T = 8192 (64 heads, d_v 128, bf16; o_slc fp32 as the selected branch
    hands it): output and branch-output gradients bitwise the torch expression's, gate gradients by the
    error-ratio rule."""
    dtype = torch.bfloat16
    gates, outs = branch_outputs((1, 8192, 64, 128), dtype, seed=9, slc_dtype=torch.float32)
    leaves = [gates.requires_grad_()] + [o.requires_grad_() for o in outs]
    do = torch.randn(outs[0].shape, generator=torch.Generator().manual_seed(10)).to(DEVICE, dtype)
    got = gated_sum_kernel(*leaves, compute=torch.float32, dtype=dtype)
    want = torch_expression(*leaves, dtype)
    assert torch.equal(got, want)
    assert_gradients_match(leaves, torch.autograd.grad(got, leaves, do), torch.autograd.grad(want, leaves, do), do)
