"""optimized.NSAAttention.project: the reference module's projections (same parameters) computed as one matmul
and one RoPE call. Equal to reference.NSAAttention.project up to the matmul's rounding, packed or not, with the
same parameter gradients; a state_dict moves between the two modules."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import optimized
import reference
from reference.config import NSAConfig

CFG = NSAConfig(cmp_block=4, cmp_stride=2, sel_block=8, n_sel=3, window=6, n_heads=6, n_kv_heads=2, head_dim_qk=8,
                head_dim_v=6, phi="mlp")


def _modules(seed: int = 0) -> tuple[reference.NSAAttention, optimized.NSAAttention]:
    torch.manual_seed(seed)
    ref = reference.NSAAttention(24, CFG, check_finite=False).double()
    with torch.no_grad():
        ref.gate[-1].weight.normal_(0, 0.5)  # gates away from exactly 0.5
    opt = optimized.NSAAttention(24, CFG).double()
    opt.load_state_dict(ref.state_dict())
    return ref, opt


def _flat(q, kv, gates) -> list[torch.Tensor]:
    return [q, *(t for branch in (kv.cmp, kv.slc, kv.win) for t in (branch.k, branch.v)), gates]


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("position_offset", [0, 5])
def test_project_equals_the_reference_projections(packed, position_offset):
    if packed and position_offset:
        pytest.skip("not applicable: a packed batch restarts positions at 0")
    ref, opt = _modules()
    x = torch.randn(1, 19, 24, dtype=torch.float64)
    cu = torch.tensor([0, 7, 19], dtype=torch.int32) if packed else None
    want = _flat(*ref.project(x, position_offset, cu_seqlens=cu))
    got = _flat(*opt.project(x, position_offset, cu_seqlens=cu))
    for name, g, w in zip(["q", "k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win", "gates"], got, want):
        assert g.shape == w.shape, name
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")
        assert g.stride(-1) == 1, name


def test_project_gives_the_reference_parameter_gradients():
    ref, opt = _modules(1)
    x = torch.randn(2, 11, 24, dtype=torch.float64)
    weights = torch.randn(8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    grads = []
    for module in (ref, opt):
        outs = _flat(*module.project(x, 3))
        loss = sum(w * (o ** 2).sum() for w, o in zip(weights, outs))
        grads.append(dict(zip([n for n, _ in module.named_parameters()],
                              torch.autograd.grad(loss, list(module.parameters()), allow_unused=True))))
    for name, g in grads[0].items():
        other = grads[1][name]
        if g is None:
            assert other is None, name
            continue
        torch.testing.assert_close(other, g, rtol=1e-10, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")


def test_the_layer_output_equals_the_reference_layer():
    ref, opt = _modules(2)
    x = torch.randn(1, 40, 24, dtype=torch.float64)
    torch.testing.assert_close(opt(x), ref(x), rtol=1e-10, atol=1e-12)


def test_under_autocast_backward_keeps_one_copy_of_x_and_not_the_pre_rope_projection(saved_under_bf16_autocast):
    """What autograd saves for a layer on the kernels under bf16 autocast (the training setup on CUDA; here in
    Triton's interpreter): one bf16 copy of x, shared by the q/k/v matmul and the gate MLP (not one per matmul),
    no hidden activation of the gate MLP (recomputed in backward), and v without the matmul output it was cut
    from (its pre-RoPE q and k)."""
    torch.manual_seed(4)
    opt = optimized.NSAAttention(24, CFG, gate_hidden=10, backend="triton", range_backend="triton")
    T = 19  # gate_hidden 10: no other [T, 10] activation
    x = torch.randn(1, T, 24, requires_grad=True) * 1.0  # an activation (autocast caches the casts of leaves)

    def layer():
        q, kv, gates = opt.project(x)
        opt.functional_forward(q, kv, gates, opt.phi_weights())

    saved, copies_of = saved_under_bf16_autocast(layer)
    shapes = [(tuple(t.shape), t.dtype) for t in saved]
    assert len(copies_of(x)) == 1 and not copies_of(x, torch.float32), shapes  # one copy, in bf16
    storage_bytes = [t.untyped_storage().nbytes() for t in saved]
    assert T * 10 * 2 not in storage_bytes, shapes  # no gate MLP hidden activation
    width = (CFG.n_heads + 3 * CFG.n_kv_heads) * CFG.head_dim_qk + 3 * CFG.n_kv_heads * CFG.head_dim_v
    assert T * width * 2 not in storage_bytes, shapes  # not the q/k/v matmul's bf16 output


def _autograd_nodes(outputs: list[torch.Tensor]) -> set[str]:
    seen, names, stack = set(), set(), [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return names


def test_project_backward_builds_no_full_size_gradient_per_part():
    """q, the branch keys and the values are parts of one matmul output (and of RoPE's output): taken by
    torch.split, their gradients are concatenated; taken by slicing, each part's backward would zero-fill a
    gradient of the whole tensor and the parts would then be added."""
    _, opt = _modules()
    x = torch.randn(2, 19, 24, dtype=torch.float64, requires_grad=True)
    names = _autograd_nodes(_flat(*opt.project(x)))
    assert "SplitWithSizesBackward0" in names or "SplitBackward0" in names
    assert not {n for n in names if n.startswith("SliceBackward")}, names


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_equals_the_rotation_written_with_slices(dtype):
    """reference.module.apply_rope against the rotation spelled here with slices: the same values and the same
    input gradient, bit for bit (splitting x only changes how backward assembles the gradient)."""
    from reference.module import apply_rope, rope_angles

    torch.manual_seed(1)
    x = torch.randn(2, 13, 3, 8, dtype=dtype, requires_grad=True)
    positions = torch.arange(4, 17)
    grad_out = torch.randn(2, 13, 3, 8, dtype=dtype)
    cos, sin = (t.to(dtype)[None, :, None, :] for t in rope_angles(positions, 8, 500.0))
    x_ref = x.detach().clone().requires_grad_(True)
    x1, x2 = x_ref[..., :4], x_ref[..., 4:]
    want = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    got = apply_rope(x, positions, 500.0)
    assert torch.equal(got, want)
    want.backward(grad_out)
    got.backward(grad_out)
    assert torch.equal(x.grad, x_ref.grad)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels compiled, or in Triton's interpreter


def _kernel_layer(seed: int) -> optimized.NSAAttention:
    torch.manual_seed(seed)
    layer = optimized.NSAAttention(24, CFG, gate_hidden=10, backend="triton", range_backend="triton")
    with torch.no_grad():
        layer.gate[-1].weight.normal_(0, 0.5)  # gates away from exactly 0.5
    return layer.to(DEVICE)


@pytest.mark.parametrize("autocast", [False, True])
def test_backward_keeps_no_reference_to_the_attention_output(autocast):
    """On the kernels, the output projection's input (Eq. 5's output o) is recomputed in backward from the gates
    and branch outputs Eq. 5's backward keeps, so once the forward has returned nothing holds o (under bf16
    autocast too, where o goes to the matmul uncast); projecting o directly keeps it alive for backward."""
    layer = _kernel_layer(5)
    x = torch.randn(1, 19, 24, device=DEVICE, requires_grad=True)

    def alive_after_forward(project) -> bool:
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
            o = layer.attention(x).o
            y = project(o)
        o_ref = weakref.ref(o)
        del o
        gc.collect()
        alive = o_ref() is not None
        y.float().sum().backward()
        return alive

    assert alive_after_forward(lambda o: layer.o_proj(o.reshape(1, 19, -1)))
    assert not alive_after_forward(lambda o: layer.project_output(o, torch.float32))


@pytest.mark.parametrize("autocast", [False, True])
def test_recomputed_output_gives_bitwise_the_gradients_of_keeping_it(autocast):
    """project_output's gradients (x and every parameter) equal, bit for bit, those of o_proj over a kept o."""
    layer = _kernel_layer(6)
    x = torch.randn(2, 21, 24, device=DEVICE)
    g = torch.randn(2, 21, 24, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    grads = []
    for project in (lambda o: layer.o_proj(o.reshape(2, 21, -1).to(x.dtype)),
                    lambda o: layer.project_output(o, x.dtype)):
        leaf = x.clone().requires_grad_(True)
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
            y = project(layer.attention(leaf).o)
        params = [leaf, *layer.parameters()]
        grads.append([y, *torch.autograd.grad(y, params, g.to(y.dtype), allow_unused=True)])
    for kept, recomputed in zip(*grads):
        if kept is None:
            assert recomputed is None
            continue
        assert torch.equal(kept, recomputed)


def test_the_layer_forward_projects_with_project_output():
    layer = _kernel_layer(8)
    x = torch.randn(1, 17, 24, device=DEVICE)
    with torch.no_grad():
        assert torch.equal(layer(x), layer.o_proj(layer.attention(x).o.reshape(1, 17, -1)))
