"""On a CUDA device the defaults run the Triton kernels (`pytest -m gpu tests/test_dispatch_gpu.py`): nsa_forward,
NSAAttention (forward and backward), the sentinel model and NSADecodeCache (prefill and steps) with no backend
keyword, each kernel's launcher counted (tests/test_dispatch.py checks the decision itself on CPU)."""

from __future__ import annotations

import pytest
import torch

import optimized
from conformance.helpers import make_inputs
from optimized.decode import NSADecodeCache
from optimized.kernels import decode_step, gated_sum, range_attention, selected_attention, selection
from reference.config import NSAConfig
from reference.contract import KV, BranchKV

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CFG = NSAConfig.preset("paper", n_heads=16, n_kv_heads=2, head_dim_qk=64, head_dim_v=64, n_sel=4, window=128)
FORWARD = ["range_attention_forward", "group_scores", "select_top_n", "selected_attention_forward",
           "gated_sum_forward"]
BACKWARD = ["range_attention_backward", "selected_attention_backward", "gated_sum_backward"]


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the kernel launchers called, in order."""
    seen: list[str] = []
    for module, name in ((range_attention, "range_attention_forward"), (selection, "group_scores"),
                         (selection, "select_top_n"), (selected_attention, "selected_attention_forward"),
                         (gated_sum, "gated_sum_forward"), (range_attention, "range_attention_backward"),
                         (selected_attention, "selected_attention_backward"), (gated_sum, "gated_sum_backward")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name, **k: seen.append(_name) or _real(*a, **k))
    return seen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_nsa_forward_runs_the_kernels_by_default(dtype: torch.dtype, launches: list[str]) -> None:
    x = make_inputs(CFG, 1024, dtype=dtype, device="cuda")
    optimized.nsa_forward(x.q, x.kv, x.gates, CFG, x.phi)
    assert sorted(set(launches)) == sorted(FORWARD)


def test_nsa_attention_trains_on_the_kernels_by_default(launches: list[str]) -> None:
    torch.manual_seed(0)
    module = optimized.NSAAttention(1024, CFG).cuda()
    x = torch.randn(2, 1024, 1024, device="cuda", requires_grad=True)
    module(x).sum().backward()
    assert sorted(set(launches)) == sorted(FORWARD + BACKWARD)


def test_sentinel_model_runs_the_kernels_by_default(launches: list[str], tmp_path) -> None:
    from pathlib import Path

    from sentinels.config import load_config
    from sentinels.model import build_model

    root = Path(optimized.__file__).resolve().parent.parent
    cfg = load_config(root / "configs" / "tiny-cpu.yaml", [f"train.out_dir={tmp_path}", "train.device=cuda"])
    model = build_model(cfg).cuda()
    model(torch.zeros(2, 256, dtype=torch.int64, device="cuda")).float().sum().backward()
    assert sorted(set(launches)) == sorted(FORWARD + BACKWARD)


def test_decode_cache_runs_the_kernels_by_default(launches: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    steps: list[int] = []
    real_step = decode_step.lean_decode_step
    monkeypatch.setattr(decode_step, "lean_decode_step", lambda *a, **k: steps.append(1) or real_step(*a, **k))
    x = make_inputs(CFG, 520, dtype=torch.bfloat16, device="cuda")
    cache = NSADecodeCache(CFG, 1, 520, dtype=torch.bfloat16, device="cuda", phi=x.phi)
    cache.prefill(x.q[:, :512], BranchKV(*(KV(b.k[:, :512], b.v[:, :512]) for b in (x.kv.cmp, x.kv.slc, x.kv.win))),
                  x.gates[:, :512])
    assert sorted(set(launches)) == sorted(FORWARD)
    for t in range(512, 520):
        cache.step(x.q[:, t:t + 1], BranchKV(*(KV(b.k[:, t:t + 1], b.v[:, t:t + 1])
                                                for b in (x.kv.cmp, x.kv.slc, x.kv.win))), x.gates[:, t:t + 1])
    assert len(steps) == 8, "every step on the lean decode step"


def test_nsa_attention_under_autocast_trains_the_gates_on_their_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    from optimized.kernels import gate_mlp

    seen: list[str] = []
    for name in ("gate_mlp_forward", "gate_mlp_backward"):
        real = getattr(gate_mlp, name)
        monkeypatch.setattr(gate_mlp, name,
                            lambda *a, _real=real, _name=name, **k: seen.append(_name) or _real(*a, **k))
    torch.manual_seed(0)
    module = optimized.NSAAttention(1024, CFG).cuda()
    x = torch.randn(2, 1024, 1024, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = module(x)
    y.float().sum().backward()
    assert seen == ["gate_mlp_forward", "gate_mlp_backward"]
