"""Eq. 7 compression, vectorized: all compressed blocks at once as strided windows of the key/value sequence."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from reference.config import NSAConfig
from reference.contract import PhiMLPWeights, PhiWeights

from . import masks
from .documents import Documents, documents
from .dispatch import compute_dtype, in_autocast_dtype


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


def phi_mlp_chunked(x: Tensor, w: PhiMLPWeights, cfg: NSAConfig) -> Tensor:
    """phi_mlp(block_windows(x, cfg), w) without building the blocks (NSAConfig has d | l; m = l / d): block i
    is the d-row chunks i .. i + m - 1, so w1^T flatten(block_i + pos) = sum_a w1_a^T chunk_{i+a} + w1^T flatten(pos),
    w1_a the rows of w1 that meet the block's a-th chunk. One matmul of every chunk against the m parts of w1 side by
    side ([chunks, d*D] x [d*D, m*hidden]), then m shifted adds: each key row is read once, where the blocks hold
    every row m times, widened to the compute dtype. x [B, T, H, D] -> [B, N, H, D] (N >= 1 complete blocks) in the
    compute dtype; the same function as phi_mlp, its sums grouped differently."""
    B, T, H, D = x.shape
    cd = compute_dtype(x.dtype)
    m, d = cfg.cmp_block // cfg.cmp_stride, cfg.cmp_stride
    n_blocks = masks.compressed_block_count(T, cfg)
    n_chunks = n_blocks - 1 + m
    chunks = x[:, : n_chunks * d].reshape(B, n_chunks, d, H, D).transpose(2, 3).reshape(B, n_chunks, H, d * D)
    w1 = w.w1.to(cd)
    hidden = w1.shape[1]
    w1_parts = w1.view(m, d * D, hidden).permute(1, 0, 2).reshape(d * D, m * hidden)
    # back to cd after the matmul (autocast returns its own dtype): the parts are summed in cd, as phi_mlp's
    # matmul result meets b1 in cd. Under autocast to x's own dtype the matmul would narrow widened rows straight
    # back (an exact round trip, a copy each way and two more in backward): it takes them as they are.
    parts = ((chunks if in_autocast_dtype(x) else chunks.to(cd)) @ w1_parts).to(cd).view(B, n_chunks, H, m, hidden)
    pre = parts[:, :n_blocks, :, 0]
    for a in range(1, m):
        pre = pre + parts[:, a:a + n_blocks, :, a]
    hidden_act = F.silu(pre + (w.pos.to(cd).reshape(1, -1) @ w1 + w.b1.to(cd)).view(hidden))
    return hidden_act @ w.w2.to(cd) + w.b2.to(cd)


def _differentiated(k: Tensor, v: Tensor | None, phi: PhiWeights) -> bool:
    """Whether autograd records Eq. 7 on these inputs (grad mode on and one of them requires a gradient); without v
    (the keys only) phi.v's weights are not read, so they do not count."""
    weights = (t for w in ((phi.k,) if v is None else (phi.k, phi.v)) for t in (w.pos, w.w1, w.b1, w.w2, w.b2))
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (k, v, *weights))


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
    on_kernels (the kernel path's choice), for phi = "mlp" over independent rows: under autocast to the inputs'
    dtype (the training setup) its Triton kernels (kernels/compression_mlp.py: one launch forward, three backward,
    the blocks never materialised; fp32 out, which the kernel path rounds to q's dtype next); otherwise, where
    autograd will take its gradients, phi_mlp_chunked (its backward adds m shifted slices where the blocks' scatters
    l/d copies of every row back; forward alone measured no faster, so a forward without gradients keeps the blocks,
    perf/NOTES.md). Mean pooling, packed documents and the torch path keep the blocks' matmul."""
    _check_kv(k, k if v is None else v)
    check_phi(cfg, phi, k.shape[-1], cfg.head_dim_v if v is None else v.shape[-1])
    mlp_rows = docs is None and cfg.phi == "mlp" and masks.compressed_block_count(k.shape[1], cfg) > 0
    if on_kernels and mlp_rows and in_autocast_dtype(k):
        from .kernels.compression_mlp import phi_mlp_kernel

        return tuple(None if x is None else phi_mlp_kernel(x, w, cfg.cmp_block, cfg.cmp_stride)
                     for x, w in ((k, phi.k), (v, phi.v)))
    if on_kernels and mlp_rows and _differentiated(k, v, phi):
        return phi_mlp_chunked(k, phi.k, cfg), None if v is None else phi_mlp_chunked(v, phi.v, cfg)
    if docs is None:
        k_blocks = block_windows(k, cfg)
        v_blocks = None if v is None else block_windows(v, cfg)
    else:
        k_blocks = packed_block_windows(k, docs, cfg)
        v_blocks = None if v is None else packed_block_windows(v, docs, cfg)
    if cfg.phi == "avg":
        return phi_avg(k_blocks), None if v is None else phi_avg(v_blocks)
    return phi_mlp(k_blocks, phi.k), None if v is None else phi_mlp(v_blocks, phi.v)
