"""compress_unrounded's routes for Eq. 7: on_kernels (the kernel path's choice) runs phi = "mlp" over independent rows
on its kernels (optimized/kernels/compression_mlp.py, whose numerics tests/kernels/test_kernel_compression_mlp.py
checks), with or without gradients; mean pooling, packed documents and a row without a complete block keep the
blocks, as the torch path does everywhere."""

from __future__ import annotations

import torch

from optimized import compression
from optimized.documents import documents
from optimized.kernels import compression_mlp
from reference.config import NSAConfig
from reference.contract import PhiWeights


def _cfg(l: int, d: int) -> NSAConfig:
    return NSAConfig(cmp_block=l, cmp_stride=d, sel_block=max(l, 8), n_sel=2, n_init=0, n_local=1, window=8,
                     n_heads=4, n_kv_heads=2, head_dim_qk=6, head_dim_v=6, phi="mlp")


def _kernel_calls(monkeypatch) -> list:
    """A list that phi_mlp_kernel appends to at each call (the kernels still run)."""
    calls = []
    real = compression_mlp.phi_mlp_kernel
    monkeypatch.setattr(compression_mlp, "phi_mlp_kernel", lambda *a: calls.append(1) or real(*a))
    return calls


def test_on_kernels_runs_phi_mlp_on_its_kernels_with_or_without_gradients(monkeypatch) -> None:
    calls = _kernel_calls(monkeypatch)
    cfg = _cfg(8, 4)
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, 20, 2, 6, generator=g) for _ in range(2))
    phi = PhiWeights.init(cfg, 5, generator=g)
    with torch.no_grad():
        k_cmp, v_cmp = compression.compress_unrounded(k, v, cfg, phi, on_kernels=True)
    assert len(calls) == 2 and k_cmp.shape == v_cmp.shape == (1, 4, 2, 6)
    k_only, none = compression.compress_unrounded(k.requires_grad_(True), None, cfg, phi, on_kernels=True)
    assert len(calls) == 3 and none is None and k_only.requires_grad
    blocks_phi = compression.compress_unrounded(k, v, cfg, phi)[0]  # fp64: the compute dtype of fp32
    torch.testing.assert_close(k_only.double(), blocks_phi, rtol=1e-5, atol=1e-6)
    compression.compress_unrounded(k, v, cfg, phi)  # the torch path's default: the blocks
    assert len(calls) == 3


def test_on_kernels_keeps_the_blocks_for_mean_pooling_packed_documents_and_no_block(monkeypatch) -> None:
    calls = _kernel_calls(monkeypatch)
    cfg = _cfg(8, 4)
    k = torch.randn(1, 20, 2, 6)
    compression.compress_unrounded(k, None, cfg.replace(phi="avg"), on_kernels=True)
    docs = documents(torch.tensor([0, 9, 20]), 20, 1, cfg, "cpu")
    phi = PhiWeights.init(cfg, 5)
    compression.compress_unrounded(k, None, cfg, phi, docs=docs, on_kernels=True)
    k_cmp, _ = compression.compress_unrounded(k[:, :6], None, cfg, phi, on_kernels=True)
    assert k_cmp.shape == (1, 0, 2, 6)
    assert not calls
