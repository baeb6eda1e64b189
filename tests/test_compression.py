"""Eq. 7's routes through compress_unrounded(on_kernels=True), the kernel path's: under autocast to the inputs' dtype
(the training setup) phi = "mlp" over independent rows runs on its kernels (optimized/kernels/compression_mlp.py, whose
numerics tests/kernels/test_kernel_compression_mlp.py checks), with or without gradients; otherwise, where autograd
takes its gradients, over chunks (phi_mlp_chunked): the function phi_mlp computes over the strided blocks, with the
same gradients, for every m = l / d (NSAConfig has d | l). A row without a complete block, mean pooling and packed
documents keep the blocks."""

from __future__ import annotations

import pytest
import torch

from optimized import compression
from optimized.documents import documents
from optimized.kernels import compression_mlp
from reference.config import NSAConfig
from reference.contract import PhiWeights


def _cfg(l: int, d: int) -> NSAConfig:
    return NSAConfig(cmp_block=l, cmp_stride=d, sel_block=max(l, 8), n_sel=2, n_init=0, n_local=1, window=8,
                     n_heads=4, n_kv_heads=2, head_dim_qk=6, head_dim_v=6, phi="mlp")


@pytest.mark.parametrize("l, d", [(8, 4), (6, 2), (4, 4), (12, 4)], ids=["m2", "m3", "m1", "m3-d4"])
@pytest.mark.parametrize("T", [12, 31], ids=["T12", "T31"])
def test_chunked_phi_is_the_blocks_phi_with_its_gradients(l: int, d: int, T: int) -> None:
    cfg = _cfg(l, d)
    g = torch.Generator().manual_seed(l * 100 + d * 10 + T)
    x = torch.randn(2, T, 2, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w = PhiWeights.init(cfg, 5, generator=g, dtype=torch.float64).k
    leaves = [x, w.pos, w.w1, w.b1, w.w2, w.b2]
    for t in leaves[1:]:
        t.requires_grad_(True)
    blocks = compression.phi_mlp(compression.block_windows(x, cfg), w)
    chunked = compression.phi_mlp_chunked(x, w, cfg)
    assert chunked.shape == blocks.shape == (2, (T - l) // d + 1, 2, 6)
    torch.testing.assert_close(chunked, blocks, rtol=1e-12, atol=1e-12)
    grad = torch.randn(blocks.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(blocks, leaves, grad), torch.autograd.grad(chunked, leaves, grad)):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


def test_compress_chunked_without_a_complete_block_gives_no_compressed_token() -> None:
    cfg, T = _cfg(8, 4), 6
    g = torch.Generator().manual_seed(3)
    k, v = (torch.randn(1, T, 2, 6, generator=g) for _ in range(2))
    phi = PhiWeights.init(cfg, 5, generator=g)
    for a, b in zip(compression.compress_unrounded(k, v, cfg, phi, on_kernels=True),
                    compression.compress_unrounded(k, v, cfg, phi)):
        assert a.shape == b.shape == (1, 0, 2, 6)


def test_compress_chunked_takes_phi_mlp_only_over_independent_rows(monkeypatch) -> None:
    """Mean pooling and packed documents keep their own code (the chunks assume one row of evenly spaced blocks)."""
    def forbidden(*args):
        raise AssertionError("phi_mlp_chunked ran")

    monkeypatch.setattr(compression, "phi_mlp_chunked", forbidden)
    cfg = _cfg(8, 4)
    k = torch.randn(1, 20, 2, 6)
    compression.compress_unrounded(k, None, cfg.replace(phi="avg"), on_kernels=True)
    docs = documents(torch.tensor([0, 9, 20]), 20, 1, cfg, "cpu")
    phi = PhiWeights.init(cfg, 5)
    phi.k.w1.requires_grad_(True)
    compression.compress_unrounded(k, None, cfg, phi, docs=docs, on_kernels=True)
    with pytest.raises(AssertionError, match="phi_mlp_chunked ran"):
        compression.compress_unrounded(k, None, cfg, phi, on_kernels=True)


def _chunked_calls(monkeypatch) -> tuple[list, NSAConfig, torch.Tensor, PhiWeights]:
    """A list that phi_mlp_chunked appends to at each call, and a config, keys and phi weights to compress."""
    calls = []
    real = compression.phi_mlp_chunked
    monkeypatch.setattr(compression, "phi_mlp_chunked", lambda *a: calls.append(1) or real(*a))
    cfg = _cfg(8, 4)
    return calls, cfg, torch.randn(1, 20, 2, 6), PhiWeights.init(cfg, 5)


def test_compress_chunked_only_where_autograd_records_it(monkeypatch) -> None:
    """A forward without gradients keeps the blocks' matmul (as fast there); with a gradient to take, the chunks."""
    calls, cfg, k, phi = _chunked_calls(monkeypatch)
    compression.compress_unrounded(k, None, cfg, phi, on_kernels=True)
    assert not calls
    compression.compress_unrounded(k.requires_grad_(True), None, cfg, phi, on_kernels=True)
    assert calls
    calls.clear()
    with torch.no_grad():
        compression.compress_unrounded(k, None, cfg, phi, on_kernels=True)
    assert not calls


def test_compress_keys_only_ignores_the_value_phi_weights(monkeypatch) -> None:
    """Without v only phi.k is read: phi.v's weights requiring gradients do not make autograd record the keys'
    Eq. 7, so the keys keep the blocks' matmul; phi.k's do."""
    calls, cfg, k, phi = _chunked_calls(monkeypatch)
    phi.v.w1.requires_grad_(True)
    compression.compress_unrounded(k, None, cfg, phi, on_kernels=True)
    assert not calls
    phi.k.w1.requires_grad_(True)
    compression.compress_unrounded(k, None, cfg, phi, on_kernels=True)
    assert calls


def _kernel_calls(monkeypatch) -> list:
    """A list that phi_mlp_kernel appends to at each call (the kernels still run)."""
    calls = []
    real = compression_mlp.phi_mlp_kernel
    monkeypatch.setattr(compression_mlp, "phi_mlp_kernel", lambda *a: calls.append(1) or real(*a))
    return calls


def test_under_autocast_phi_mlp_runs_on_its_kernels_with_or_without_gradients(monkeypatch) -> None:
    calls = _kernel_calls(monkeypatch)
    cfg = _cfg(8, 4)
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, 20, 2, 6, generator=g).to(torch.bfloat16) for _ in range(2))
    phi = PhiWeights.init(cfg, 5, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.no_grad():
            k_cmp, v_cmp = compression.compress_unrounded(k, v, cfg, phi, on_kernels=True)
        assert len(calls) == 2 and k_cmp.shape == v_cmp.shape == (1, 4, 2, 6)
        k_only, none = compression.compress_unrounded(k.requires_grad_(True), None, cfg, phi, on_kernels=True)
        assert len(calls) == 3 and none is None and k_only.requires_grad
        compression.compress_unrounded(k, None, cfg.replace(phi="avg"), on_kernels=True)
        docs = documents(torch.tensor([0, 9, 20]), 20, 1, cfg, "cpu")
        compression.compress_unrounded(k, None, cfg, phi, docs=docs, on_kernels=True)
        compression.compress_unrounded(k, v, cfg, phi)  # the torch path's: the blocks
    assert len(calls) == 3
    compression.compress_unrounded(k, v, cfg, phi, on_kernels=True)  # no autocast: the chunks
    assert len(calls) == 3
