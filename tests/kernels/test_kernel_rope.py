"""The RoPE kernel (optimized/kernels/rope.py) against the torch expression it replaces, reference.module.apply_rope:
the output and the input's gradient must be IDENTICAL (bitwise), for contiguous inputs and for the strided q/k view of
a projection's output, at position offsets, odd half widths and every kernel dtype; project_heads (a fused
projection's output taken apart into rotated and plain heads) against split views of the same output with the torch
expression, its gradient bitwise, parts without a gradient included. Then the module path: NSAAttention.project and
the dense benchmark layer run the kernels where dispatch says so, with the same q, k, v and gradients as the torch
expression.

Without CUDA the kernel runs in Triton's interpreter on fp32 and fp16; bf16 needs the GPU (the interpreter
truncates fp32 -> bf16 where the GPU and torch round to nearest even). With CUDA every case runs compiled
(`pytest tests/kernels/test_kernel_rope.py` on a GPU host), larger shapes included.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import optimized.kernels.rope as rope_module
from optimized import dispatch
from optimized.kernels.rope import apply_rope_kernel, contiguous_rope_tables, project_heads, rope_tables
import optimized.module as module_module
from optimized.module import NSAAttention, projected_heads
from reference.config import NSAConfig
from reference.module import apply_rope

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_gpu_rounding = pytest.mark.skipif(not CUDA, reason="the interpreter truncates fp32 -> bf16 (module docstring)")
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=needs_gpu_rounding)]
# (B, T, H, D, first position)
SHAPES = [(2, 7, 3, 8, 0), (1, 13, 5, 6, 40), (3, 4, 1, 2, 1)]
if CUDA:
    SHAPES += [(2, 1000, 18, 64, 0), (1, 513, 5, 128, 7), (1, 4096, 14, 64, 4096)]


def both_ways(rotation, x: torch.Tensor, positions: torch.Tensor, dy: torch.Tensor):
    """rotation(x) and the gradient of x for the output gradient dy."""
    leaf = x.detach().clone().requires_grad_(True)
    y = rotation(leaf, positions, 500.0)
    y.backward(dy)
    return y.detach(), leaf.grad


def draw(shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_kernel_equals_the_torch_expression(shape, dtype) -> None:
    B, T, H, D, first = shape
    x = draw((B, T, H, D), dtype, seed=T + H)
    dy = draw((B, T, H, D), dtype, seed=T + H + 1)
    positions = torch.arange(first, first + T, device=DEVICE)
    y_ref, dx_ref = both_ways(apply_rope, x, positions, dy)
    y, dx = both_ways(apply_rope_kernel, x, positions, dy)
    assert y.is_contiguous() and y.shape == x.shape and y.dtype == dtype
    assert torch.equal(y, y_ref), (y.float() - y_ref.float()).abs().max()
    assert torch.equal(dx, dx_ref), (dx.float() - dx_ref.float()).abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_view_of_a_projection_output(dtype) -> None:
    """x as NSAAttention.project hands it: the q/k columns of a wider matmul output, viewed as heads (its token
    stride is the whole row), here with two batch rows."""
    B, T, H, D, extra = 2, 9, 4, 8, 12
    y_full = draw((B, T, H * D + extra), dtype, seed=5)
    x = y_full[..., :H * D].view(B, T, H, D)
    assert not x.is_contiguous()
    dy = draw((B, T, H, D), dtype, seed=6)
    positions = torch.arange(3, 3 + T, device=DEVICE)
    y_ref, dx_ref = both_ways(apply_rope, x, positions, dy)
    y, dx = both_ways(apply_rope_kernel, x, positions, dy)
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)


def test_bad_inputs_raise_value_errors() -> None:
    positions = torch.arange(4, device=DEVICE)
    with pytest.raises(ValueError, match="even D"):
        apply_rope_kernel(torch.zeros((1, 4, 2, 5), device=DEVICE), positions)
    with pytest.raises(ValueError, match="even D"):
        apply_rope_kernel(torch.zeros((1, 4, 2, 4), dtype=torch.float64, device=DEVICE), positions)
    with pytest.raises(ValueError, match=r"positions must be \[T\] = \[4\]"):
        apply_rope_kernel(torch.zeros((1, 4, 2, 4), device=DEVICE), positions[:3])


def test_rope_dispatch() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not dispatch.rope_on_kernels(cpu, torch.float32, "auto"), "auto: CUDA tensors only"
    assert not dispatch.rope_on_kernels(cuda, torch.float64, "auto"), "auto: kernel dtypes only"
    assert not dispatch.rope_on_kernels(cuda, torch.bfloat16, "torch")
    assert dispatch.rope_on_kernels(cuda, torch.bfloat16, "auto") == dispatch.auto_picks_kernels(cuda, torch.bfloat16)
    with pytest.raises(ValueError, match="takes fp32/bf16/fp16"):
        dispatch.rope_on_kernels(torch.device(DEVICE), torch.float64, "triton")
    with pytest.raises(ValueError, match="range_backend must be one of"):
        dispatch.rope_on_kernels(cpu, torch.float32, "cuda")


def test_module_projection_runs_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """NSAAttention.project with range_backend="triton" takes the projection apart with project_heads (one call:
    q and the three branch keys rotated, the three values), and gives q, k, v and the input's gradient bitwise as
    with range_backend="torch", whether every part reaches the loss or only some do."""
    cfg = NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, n_sel=2, n_init=1, n_local=1, window=8, n_heads=4,
                    n_kv_heads=2, head_dim_qk=8, head_dim_v=6, phi="avg")
    torch.manual_seed(0)
    layers = {b: NSAAttention(16, cfg, range_backend=b).to(DEVICE) for b in ("torch", "triton")}
    layers["triton"].load_state_dict(layers["torch"].state_dict())
    x = torch.randn(2, 11, 16, device=DEVICE)
    calls = []
    real = rope_module.project_heads
    monkeypatch.setattr(rope_module, "project_heads", lambda *a: calls.append(a[0].shape) or real(*a))

    def all_parts(q, kv):
        return (q.sum() + 2 * kv.cmp.k.sum() + 3 * kv.slc.k.sum() + 4 * kv.win.k.sum() + (5 * kv.cmp.v).square().sum()
                + 6 * kv.slc.v.sum() + 7 * kv.win.v.sum())

    def some_parts(q, kv):  # the others get no gradient at all
        return (q * q).sum() + 3 * kv.slc.k.sum() + kv.win.v.sum()

    for loss in (all_parts, some_parts):
        grads = {}
        for backend, layer in layers.items():
            leaf = x.clone().requires_grad_(True)
            q, kv, _ = layer.project(leaf, position_offset=5)
            loss(q, kv).backward()
            outs = [q] + [t for b in (kv.cmp, kv.slc, kv.win) for t in (b.k, b.v)]
            grads[backend] = [t.detach() for t in outs] + [leaf.grad, layer.q_proj.weight.grad,
                                                          layer.k_cmp_proj.weight.grad, layer.v_win_proj.weight.grad]
            layer.zero_grad(set_to_none=True)
        assert all(torch.equal(a, b) for a, b in zip(grads["torch"], grads["triton"]))
    assert calls == [(2, 11, (4 + 3 * 2) * 8 + 3 * 2 * 6)] * 2, calls


class NaNEmpty:
    """torch, with torch.empty's memory filled with NaN (a fresh allocation may hold anything)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs):
        return torch.empty(*args, **kwargs).fill_(float("nan"))


def test_dense_benchmark_projection_runs_project_heads(monkeypatch: pytest.MonkeyPatch) -> None:
    """perf.train_model.DenseAttention.project on project_heads (forced here; on CUDA dispatch picks it) gives q, k,
    v and the projection's gradients bitwise as with the torch expression."""
    from perf import train_model

    cfg = NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, n_sel=2, n_init=1, n_local=1, window=8, n_heads=4,
                    n_kv_heads=2, head_dim_qk=8, head_dim_v=6, phi="avg")
    torch.manual_seed(1)
    dense = train_model.DenseAttention(SimpleNamespace(inner=NSAAttention(16, cfg).to(DEVICE)))
    x = torch.randn(2, 7, 16, device=DEVICE)
    results = {}
    for forced in (False, True):
        monkeypatch.setattr(module_module, "rope_on_kernels", lambda *args, forced=forced: forced)
        leaf = x.clone().requires_grad_(True)
        q, k, v = dense.project(leaf, position_offset=3)
        ((q * q).sum() + 2 * k.sum() + (v * 3).square().sum()).backward()
        results[forced] = [q.detach(), k.detach(), v.detach(), leaf.grad, dense.q_proj.weight.grad.clone(),
                           dense.v_proj.weight.grad.clone()]
        dense.zero_grad(set_to_none=True)
    assert all(torch.equal(a, b) for a, b in zip(results[False], results[True]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_project_heads_equals_split_views_with_the_torch_expression(dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """project_heads against what it replaces: RoPE (the torch expression) on the rotated columns viewed as heads,
    split into the parts, and the plain columns copied and split; outputs and y's gradient bitwise, with a part
    that reaches no loss (its columns of the gradient are 0) and columns past the parts (0 too)."""
    B, T, dk, dv, extra = 2, 9, 8, 6, 5
    rotated, plain = (3, 1, 2), (1, 2)
    n_rot, n_plain = sum(rotated) * dk, sum(plain) * dv
    y = draw((B, T, n_rot + n_plain + extra), dtype, seed=11)
    positions = torch.arange(4, 4 + T, device=DEVICE)
    weights = [draw((B, T, h, dk), dtype, seed=20 + i) for i, h in enumerate(rotated)]
    weights += [draw((B, T, h, dv), dtype, seed=30 + i) for i, h in enumerate(plain)]
    unused = 1  # the second rotated part takes no part in the loss

    def split_views(leaf):
        qk = apply_rope(leaf[..., :n_rot].view(B, T, sum(rotated), dk), positions, 300.0)
        v = leaf[..., n_rot:n_rot + n_plain].contiguous().view(B, T, sum(plain), dv)
        return (*qk.split(list(rotated), dim=2), *v.split(list(plain), dim=2))

    results = []
    # the gradient's uninitialised memory as NaN, so that columns project_heads leaves unwritten show
    monkeypatch.setattr(rope_module, "torch", NaNEmpty())
    tables = rope_tables(positions, dk, 300.0, dtype)
    for parts_of in (split_views, lambda leaf: project_heads(leaf, tables, rotated, dk, plain, dv)):
        leaf = y.detach().clone().requires_grad_(True)
        parts = parts_of(leaf)
        sum((p.float() * w.float()).sum() for i, (p, w) in enumerate(zip(parts, weights)) if i != unused).backward()
        results.append(([p.detach() for p in parts], leaf.grad))
    (parts_ref, grad_ref), (parts, grad) = results
    assert [p.shape for p in parts] == [p.shape for p in parts_ref]
    assert all(torch.equal(a, b) for a, b in zip(parts, parts_ref))
    assert torch.equal(grad, grad_ref), (grad.float() - grad_ref.float()).abs().max()
    assert not grad[..., rotated[0] * dk:(rotated[0] + rotated[1]) * dk].any()
    assert not grad[..., n_rot + n_plain:].any() and grad[..., n_rot:n_rot + n_plain].any()


def test_project_heads_refuses_bad_layouts() -> None:
    positions = torch.arange(4, device=DEVICE)
    y = torch.zeros((1, 4, 20), device=DEVICE)
    with pytest.raises(ValueError, match="need 22 columns, y has 20"):
        project_heads(y, rope_tables(positions, 8, 100.0, y.dtype), (2,), 8, (1,), 6)
    with pytest.raises(ValueError, match="dk even"):
        project_heads(y, rope_tables(positions, 6, 100.0, y.dtype), (2,), 5, (1,), 6)
    with pytest.raises(ValueError, match=r"tables must be contiguous \[T, dk / 2\] = \[4, 2\]"):
        project_heads(y, rope_tables(positions[:2], 4, 100.0, y.dtype), (2,), 4, (1,), 6)
    with pytest.raises(ValueError, match="of y's dtype"):
        project_heads(y, rope_tables(positions, 4, 100.0, torch.float16), (2,), 4, (1,), 6)


def test_contiguous_rope_tables_are_built_once_per_run_of_positions() -> None:
    """The tables of positions first .. first + n - 1 are rope_tables' own (bitwise), the same tensors when asked
    again, and their own for another length, start, width, base or dtype."""
    device = torch.device(DEVICE)
    tables = contiguous_rope_tables(9, 5, 8, 100.0, torch.float32, device)
    expected = rope_tables(torch.arange(5, 14, device=DEVICE), 8, 100.0, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(tables, expected))
    assert contiguous_rope_tables(9, 5, 8, 100.0, torch.float32, device) is tables
    for other in ((10, 5, 8, 100.0, torch.float32), (9, 6, 8, 100.0, torch.float32), (9, 5, 6, 100.0, torch.float32),
                  (9, 5, 8, 50.0, torch.float32), (9, 5, 8, 100.0, torch.float16)):
        n, first, dim, base, dtype = other
        got = contiguous_rope_tables(n, first, dim, base, dtype, device)
        want = rope_tables(torch.arange(first, first + n, device=DEVICE), dim, base, dtype)
        assert got is not tables and all(torch.equal(a, b) for a, b in zip(got, want)), other


def test_projected_heads_take_the_torch_expression_off_the_kernel_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rope_module, "project_heads", lambda *a: pytest.fail("the kernel must not run"))
    y = torch.randn(1, 5, 2 * 4 + 3)
    for y, backend in ((y, "torch"), (y.double(), "auto")):
        q, v = projected_heads(y, (2,), 4, (1,), 3, 100.0, range_backend=backend)
        assert torch.equal(q, apply_rope(y[..., :8].view(1, 5, 2, 4), torch.arange(5), 100.0))
        assert torch.equal(v, y[..., 8:].reshape(1, 5, 1, 3))
