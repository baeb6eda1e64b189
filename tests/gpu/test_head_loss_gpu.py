"""The trainer's LM head loss on CUDA: the fused Triton cross-entropy (the default there) against the torch path,
on a GPT-2-sized vocabulary (50257: padded to 50304 for the matmuls) under bf16 autocast.

Both compute the loss in fp32 from the same bf16 logits; the gradients pass through dlogits rounded to bf16 once.
Rule: each result's error against a float64 computation of the same loss from the same bf16 inputs is at most
twice the torch path's own error (+ a floor for exact agreement), and the default picks the fused path."""

from __future__ import annotations

import pytest
import torch

import sentinels.model as model_module
from sentinels.model import lm_head_loss, lm_loss


def _inputs(rows: int, vocab: int, d: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = (torch.randn(1, rows, d, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_(True)
    weight = (torch.randn(vocab, d, device="cuda", generator=g) * 0.05).bfloat16().requires_grad_(True)
    labels = torch.randint(0, vocab, (1, rows), device="cuda", generator=g)
    labels[0, 3] = -100
    return hidden, weight, labels


@pytest.mark.parametrize("rows, chunk_rows", [(4099, 1024), (300, 4096)])
def test_fused_head_loss_matches_the_torch_path_on_a_gpt2_vocabulary(rows: int, chunk_rows: int) -> None:
    hidden, weight, labels = _inputs(rows, 50257, 256)
    runs = {}
    for fused in (False, True):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = lm_head_loss(hidden, weight, labels, chunk_rows=chunk_rows, fused=fused)
        runs[fused] = (loss, *torch.autograd.grad(loss, (hidden, weight)))
    h64, w64 = hidden.detach().double().requires_grad_(True), weight.detach().double().requires_grad_(True)
    exact = lm_loss((h64 @ w64.t()).bfloat16().double(), labels)  # the logits the matmul rounds to bf16
    exact = (exact, *torch.autograd.grad(exact, (h64, w64)))
    for name, torch_path, fused, want in zip(("loss", "d/dhidden", "d/dweight"), runs[False], runs[True], exact):
        own = (torch_path.double() - want).abs().max().item()
        err = (fused.double() - want).abs().max().item()
        assert err <= 2 * own + 1e-7 * want.abs().max().item(), f"{name}: {err:.3g} against the torch path's {own:.3g}"


def test_the_default_on_cuda_is_the_fused_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    import sentinels.head_loss_kernels as kernels

    original = kernels.softmax_cross_entropy_
    monkeypatch.setattr(kernels, "softmax_cross_entropy_", lambda *a: calls.append(1) or original(*a))
    hidden, weight, labels = _inputs(64, 1000, 64)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model_module.lm_head_loss(hidden, weight, labels)
    assert calls, "lm_head_loss on CUDA did not run the fused cross-entropy"
