"""Eq. 7 compression, vectorized: all compressed blocks at once as strided windows of the key/value sequence."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from reference.config import NSAConfig
from reference.contract import PhiMLPWeights, PhiWeights

from . import masks
from .documents import Documents, documents
from .dispatch import compute_dtype


def block_windows(x: Tensor, cfg: NSAConfig) -> Tensor:
    """The N complete compressed blocks of x [B, T, H, D] as a strided view [B, N, H, l, D]:
    block i holds rows i*d .. i*d + l - 1 (Eq. 7)."""
    B, T, H, D = x.shape
    n_blocks = masks.compressed_block_count(T, cfg)
    if n_blocks == 0:
        return x.new_zeros((B, 0, H, cfg.cmp_block, D))
    used = x[:, : (n_blocks - 1) * cfg.cmp_stride + cfg.cmp_block]
    return used.unfold(1, cfg.cmp_block, cfg.cmp_stride).transpose(-1, -2)


def packed_block_windows(x: Tensor, docs: Documents, cfg: NSAConfig) -> Tensor:
    """The compressed blocks of a packed batch x [1, T, H, D] as [1, Nc, H, l, D]: packed compressed token c holds
    rows cmp_first_token[c] .. + l - 1, all inside its document (Eq. 7 blocks never straddle a boundary).
    Gathered (a copy), not a view: block starts are not evenly spaced across documents."""
    rows = docs.cmp_first_token[:, None] + torch.arange(cfg.cmp_block, device=x.device)  # [Nc, l]
    return x[:, rows].transpose(2, 3)  # [1, Nc, l, H, D] -> [1, Nc, H, l, D]


def phi_avg(blocks: Tensor) -> Tensor:
    """phi = mean pooling over the l rows of each block: [..., l, D] -> [..., D] (compute dtype)."""
    return blocks.to(compute_dtype(blocks.dtype)).mean(dim=-2)


def phi_mlp(blocks: Tensor, w: PhiMLPWeights) -> Tensor:
    """phi = w2^T silu(w1^T flatten(block + pos) + b1) + b2 for every block at once (Eq. 7): [..., l, D] -> [..., D].
    The flatten is row-major over (l, D), as in contract.PhiMLPWeights. Result in the compute dtype."""
    cd = compute_dtype(blocks.dtype)
    x = (blocks.to(cd) + w.pos.to(cd)).flatten(-2)
    hidden = F.silu(x @ w.w1.to(cd) + w.b1.to(cd))
    return hidden @ w.w2.to(cd) + w.b2.to(cd)


def _check_kv(k: Tensor, v: Tensor) -> None:
    if k.ndim != 4 or v.ndim != 4 or k.shape[:3] != v.shape[:3]:
        raise ValueError(f"compress needs k [B,T,Hkv,dk] and v [B,T,Hkv,dv] with equal [B,T,Hkv]; "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}")


def check_phi(cfg: NSAConfig, phi: PhiWeights | None, dk: int, dv: int) -> None:
    """phi weights are given when cfg.phi = "mlp" and have the shapes of l, d_k and d_v (ValueError naming the
    tensor and the rule)."""
    if cfg.phi != "mlp":
        return
    if phi is None:
        raise ValueError("NSAConfig.phi='mlp' needs phi weights (a PhiWeights); got phi=None")
    for name, w, dim in (("phi.k", phi.k, dk), ("phi.v", phi.v, dv)):
        if tuple(w.pos.shape) != (cfg.cmp_block, dim):
            raise ValueError(f"{name}.pos must be [l, D] = {(cfg.cmp_block, dim)}, got {tuple(w.pos.shape)}")
        if w.w1.shape[0] != cfg.cmp_block * dim:
            raise ValueError(f"{name}.w1 must have l*D = {cfg.cmp_block * dim} rows, got {tuple(w.w1.shape)}")
        if w.w2.shape[1] != dim:
            raise ValueError(f"{name}.w2 must have D = {dim} columns, got {tuple(w.w2.shape)}")


def compress(k: Tensor, v: Tensor, cfg: NSAConfig, phi: PhiWeights | None = None, *,
             cu_seqlens: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Eq. 7 for every complete block: k [B, T, Hkv, d_k], v [B, T, Hkv, d_v] ->
    (k_cmp [B, N, Hkv, d_k], v_cmp [B, N, Hkv, d_v]) with N = number of complete blocks in T, in k's dtype.
    cu_seqlens (packed batch, B = 1): the blocks of each document, packed in document order,
    N = sum_i N_i (reference.packing.compressed_cu_seqlens)."""
    docs = None
    if cu_seqlens is not None:
        _check_kv(k, v)
        docs = documents(cu_seqlens, k.shape[1], k.shape[0], cfg, k.device)
    k_cmp, v_cmp = compress_unrounded(k, v, cfg, phi, docs=docs)
    return k_cmp.to(k.dtype), v_cmp.to(v.dtype)


def compress_unrounded(k: Tensor, v: Tensor | None, cfg: NSAConfig, phi: PhiWeights | None = None, *,
                       docs: Documents | None = None, on_kernels: bool = False) -> tuple[Tensor, Tensor | None]:
    """compress, left in the compute dtype (dispatch.compute_dtype) for nsa_forward's attention.
    v=None: the keys only (v_cmp is None), for a call that selects blocks but leaves the compressed branch out.
    docs: the layout of a packed batch (documents.documents), None for independent rows.
    on_kernels: phi = "mlp" over independent rows on its Triton kernels (kernels/compression_mlp.py, the kernel
    path's choice: one launch forward, three backward, the blocks never materialised; fp32 for every input dtype,
    which the kernel path rounds to q's dtype next); mean pooling and packed documents keep the blocks, as the torch
    path does everywhere."""
    _check_kv(k, k if v is None else v)
    check_phi(cfg, phi, k.shape[-1], cfg.head_dim_v if v is None else v.shape[-1])
    if on_kernels and docs is None and cfg.phi == "mlp" and masks.compressed_block_count(k.shape[1], cfg) > 0:
        from .kernels.compression_mlp import phi_mlp_kernel

        return tuple(None if x is None else phi_mlp_kernel(x, w, cfg.cmp_block, cfg.cmp_stride)
                     for x, w in ((k, phi.k), (v, phi.v)))
    if docs is None:
        k_blocks = block_windows(k, cfg)
        v_blocks = None if v is None else block_windows(v, cfg)
    else:
        k_blocks = packed_block_windows(k, docs, cfg)
        v_blocks = None if v is None else packed_block_windows(v, docs, cfg)
    if cfg.phi == "avg":
        return phi_avg(k_blocks), None if v is None else phi_avg(v_blocks)
    return phi_mlp(k_blocks, phi.k), None if v is None else phi_mlp(v_blocks, phi.v)
