"""Where a call runs (optimized/dispatch.py): "auto" is the kernels for CUDA tensors and the torch path on CPU; every
entry point a user reaches (nsa_forward, the stage functions, NSAAttention, the sentinel model and trainer,
NSADecodeCache.prefill) hands "auto" to the one decision unchanged, so on a GPU they all run the kernels. On this
machine "what a GPU would decide" is dispatch.auto_picks_kernels replaced by True (the kernels then run in Triton's
interpreter); tests/test_dispatch_gpu.py checks the same on a real GPU.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

import optimized
from conformance.helpers import make_inputs
from optimized import dispatch, forward
from optimized.decode import NSADecodeCache
from optimized.kernels import gated_sum, range_attention, selected_attention, selection
from reference.config import NSAConfig

CUDA = torch.device("cuda")
CPU = torch.device("cpu")
CFG = NSAConfig(cmp_block=4, cmp_stride=2, sel_block=8, n_sel=3, window=5, n_heads=4, n_kv_heads=2, head_dim_qk=8,
                head_dim_v=8, phi="avg")


# The decision ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_auto_runs_the_kernels_for_cuda_tensors(dtype: torch.dtype) -> None:
    where = dispatch.decide(CUDA, dtype, 16, 128, 128)
    assert where.ranges and where.selected
    assert where.compute == (torch.float64 if dtype == torch.float32 else torch.float32)


def test_auto_runs_the_torch_path_on_cpu_and_for_float64() -> None:
    for device, dtype in ((CPU, torch.float32), (CPU, torch.bfloat16), (CUDA, torch.float64)):
        where = dispatch.decide(device, dtype, 16, 128, 128)
        assert not where.ranges and not where.selected, (device, dtype)


def test_explicit_backends_override_auto() -> None:
    assert not dispatch.decide(CUDA, torch.bfloat16, 16, 128, 128, backend="torch", range_backend="torch").ranges
    where = dispatch.decide(CUDA, torch.bfloat16, 16, 128, 128, backend="torch")
    assert where.ranges and not where.selected
    assert not dispatch.decide(CUDA, torch.bfloat16, 16, 128, 128, queries_are_suffix=False).selected
    where = dispatch.decide(CPU, torch.float32, 16, 128, 128, backend="triton", range_backend="triton")
    assert where.ranges and where.selected  # the interpreter (TRITON_INTERPRET=1, root conftest)
    with pytest.raises(ValueError, match="range_backend must be one of"):
        dispatch.decide(CUDA, torch.bfloat16, 16, 128, 128, range_backend="cuda")


@pytest.mark.parametrize("group, dk, dv", [(1, 64, 64), (6, 64, 64), (16, 128, 128), (64, 192, 192), (64, 256, 64)])
def test_supported_shapes_run_on_the_kernels_without_a_warning(group: int, dk: int, dv: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        where = dispatch.decide(CUDA, torch.bfloat16, group, dk, dv)
    assert where.ranges and where.selected


def test_a_shape_past_the_kernels_warns_once_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch, "_warned", set())
    with pytest.warns(UserWarning, match="group_size=128, head_dim_qk=64, head_dim_v=64") as caught:
        where = dispatch.decide(CUDA, torch.bfloat16, 128, 64, 64)
        dispatch.decide(CUDA, torch.bfloat16, 128, 64, 64)
    assert len(caught) == 1, "one warning per shape"
    assert where.ranges and not where.selected
    with pytest.warns(UserWarning, match="head_dim_qk=320, head_dim_v=128"):
        where = dispatch.decide(CUDA, torch.bfloat16, 8, 320, 128)
    assert not where.ranges and not where.selected


def test_cuda_without_triton_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch, "_warned", set())
    monkeypatch.setattr(dispatch, "triton_imports", lambda: False)
    with pytest.warns(UserWarning, match="Triton does not import") as caught:
        where = dispatch.decide(CUDA, torch.bfloat16, 16, 128, 128)
        dispatch.decide(CUDA, torch.bfloat16, 8, 64, 64)
    assert len(caught) == 1 and not where.ranges and not where.selected


# Nothing between the user and the decision overrides "auto" -----------------------------------------------------
def test_every_backend_keyword_defaults_to_auto() -> None:
    entry_points = [optimized.nsa_forward, optimized.nsa_forward_rows, optimized.decode_step,
                    optimized.compressed_attention, optimized.selection_scores, optimized.selection_indices,
                    optimized.selected_attention, optimized.window_attention, optimized.NSAAttention.__init__,
                    NSADecodeCache.__init__]
    seen = 0
    for fn in entry_points:
        for name, parameter in inspect.signature(fn).parameters.items():
            if name in ("backend", "range_backend"):
                assert parameter.default == "auto", f"{fn.__qualname__}({name}={parameter.default!r})"
                seen += 1
    assert seen == 14


class Reached(Exception):
    """Raised by the spy in place of the kernel path: the call got there (with this route)."""


@pytest.fixture
def on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> list[tuple[dict, dispatch.Route]]:
    """dispatch decides as for CUDA tensors; every route forward.py asks for is recorded with its arguments, and
    the kernel path raises Reached instead of running."""
    monkeypatch.setattr(dispatch, "auto_picks_kernels", lambda device, dtype: dtype in dispatch.KERNEL_DTYPES)
    routes: list[tuple[dict, dispatch.Route]] = []
    real_route = forward.route

    def recording_route(*args, **kwargs):
        where = real_route(*args, **kwargs)
        routes.append((kwargs, where))
        return where

    def kernel_path(*args, **kwargs):
        raise Reached

    monkeypatch.setattr(forward, "route", recording_route)
    monkeypatch.setattr(forward, "_kernel_path", kernel_path)
    return routes


def assert_auto_to_the_kernels(routes: list[tuple[dict, dispatch.Route]]) -> None:
    assert routes, "no call reached optimized.forward's decision"
    for kwargs, where in routes:
        assert kwargs["backend"] == "auto" and kwargs["range_backend"] == "auto", kwargs
        assert where.ranges and where.selected, where


def test_nsa_attention_reaches_the_kernel_path(on_a_gpu) -> None:
    module = optimized.NSAAttention(32, CFG)
    with pytest.raises(Reached):
        module(torch.randn(1, 20, 32))
    assert_auto_to_the_kernels(on_a_gpu)


def test_sentinel_model_and_trainer_reach_the_kernel_path(on_a_gpu, tmp_path) -> None:
    from sentinels.config import load_config
    from sentinels.model import build_model
    from sentinels.trainer import Trainer

    cfg = load_config(optimized_root() / "configs" / "tiny-cpu.yaml",
                      [f"train.out_dir={tmp_path}", "train.seq_len=32", "train.micro_batch_size=1", "train.steps=1",
                       "train.warmup_steps=0"])
    with pytest.raises(Reached):
        build_model(cfg)(torch.zeros(1, 32, dtype=torch.int64))
    assert_auto_to_the_kernels(on_a_gpu)
    on_a_gpu.clear()
    trainer = Trainer(cfg, console=False)
    try:
        with pytest.raises(Reached):
            trainer.train()
    finally:
        trainer.close()
    assert_auto_to_the_kernels(on_a_gpu)


def test_decode_cache_prefill_reaches_the_kernel_path(on_a_gpu) -> None:
    x = make_inputs(CFG, 12, dtype=torch.float32)
    cache = NSADecodeCache(CFG, 1, 16)
    assert cache.use_kernels and cache.uses_lean_step()
    with pytest.raises(Reached):
        cache.prefill(x.q, x.kv, x.gates)
    assert_auto_to_the_kernels(on_a_gpu)


def optimized_root():
    from pathlib import Path

    return Path(optimized.__file__).resolve().parent.parent


def test_nsa_attention_runs_every_kernel_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not a spy on the route: the launches themselves, forward and backward (on CPU in the interpreter)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        monkeypatch.setattr(dispatch, "auto_picks_kernels", lambda device, dtype: dtype in dispatch.KERNEL_DTYPES)
    launched: list[str] = []
    for module, name in ((range_attention, "range_attention_forward"), (selection, "group_scores"),
                         (selection, "select_top_n"), (selected_attention, "selected_attention_forward"),
                         (gated_sum, "gated_sum_forward"), (selected_attention, "selected_attention_backward"),
                         (range_attention, "range_attention_backward"), (gated_sum, "gated_sum_backward")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name, **k: launched.append(_name)
                            or _real(*a, **k))
    torch.manual_seed(0)
    module = optimized.NSAAttention(32, CFG).to(device)
    # 40 tokens: rows 0-23 select every block they have (attended on the range kernel), rows 24-39 are gathered
    module(torch.randn(1, 40, 32, device=device)).sum().backward()
    assert sorted(set(launched)) == sorted(["range_attention_forward", "group_scores", "select_top_n",
                                            "selected_attention_forward", "gated_sum_forward",
                                            "selected_attention_backward", "range_attention_backward",
                                            "gated_sum_backward"])


def test_nsa_attention_under_autocast_runs_the_gate_mlp_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under half-precision autocast (the trainer's setup) the default module's gates come from the gate MLP's
    kernels, forward and backward; without autocast (fp32) from the torch expression."""
    from optimized.kernels import gate_mlp

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        monkeypatch.setattr(dispatch, "auto_picks_kernels", lambda device, dtype: dtype in dispatch.KERNEL_DTYPES)
    launched: list[str] = []
    for name in ("gate_mlp_forward", "gate_mlp_backward"):
        real = getattr(gate_mlp, name)
        monkeypatch.setattr(gate_mlp, name, lambda *a, _real=real, _name=name, **k: launched.append(_name)
                            or _real(*a, **k))
    torch.manual_seed(0)
    module = optimized.NSAAttention(32, CFG).to(device)
    x = torch.randn(1, 12, 32, device=device, requires_grad=True)
    module.gates(x).sum().backward()
    assert launched == []
    with torch.autocast(device, dtype=torch.bfloat16):
        gates = module.gates(x.to(torch.bfloat16))
    gates.float().sum().backward()
    assert launched == ["gate_mlp_forward", "gate_mlp_backward"]
    assert x.grad is not None and module.gate[0].weight.grad is not None
