"""Compression branch (Eq. 7) and its attention (Eq. 4 with the compressed keys/values)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .config import NSAConfig
from .contract import PhiMLPWeights, PhiWeights
from .primitives import attend, gather_rows


def compressed_block_visible(i: int, p: int, cfg: NSAConfig) -> bool:
    """Eq. 7: compressed block i covers keys [i*d, i*d + l - 1]; query p may read it only once its last
    key is at or before p ("inclusive") or strictly before p ("strict" switch)."""
    last_key = i * cfg.cmp_stride + cfg.cmp_block - 1
    return last_key <= p if cfg.cmp_visibility == "inclusive" else last_key < p


def compressed_block_count(n_keys: int, cfg: NSAConfig) -> int:
    """Number of compressed blocks whose keys all lie in 0..n_keys-1, counted block by block."""
    count = 0
    while count * cfg.cmp_stride + cfg.cmp_block <= n_keys:
        count += 1
    return count


def visible_compressed_blocks(p: int, n_blocks: int, cfg: NSAConfig) -> list[int]:
    """The compressed block indices query p reads (Eq. 7), by testing every block."""
    return [i for i in range(n_blocks) if compressed_block_visible(i, p, cfg)]


def phi_avg(block: Tensor) -> Tensor:
    """phi = mean pooling over the l rows of one block [l, D]."""
    total = block[0]
    for r in range(1, block.shape[0]):
        total = total + block[r]
    return total / block.shape[0]


def phi_mlp(block: Tensor, w: PhiMLPWeights) -> Tensor:
    """phi = MLP over the flattened block plus a learned intra-block position embedding (Eq. 7)."""
    x = (block + w.pos).reshape(-1)
    hidden = F.silu(w.w1.T @ x + w.b1)
    return w.w2.T @ hidden + w.b2


def compress(k: Tensor, v: Tensor, cfg: NSAConfig, phi: PhiWeights | None = None) -> tuple[Tensor, Tensor]:
    """Eq. 7 for every complete block: k [B, T, Hkv, d_k], v [B, T, Hkv, d_v] ->
    (k_cmp [B, N, Hkv, d_k], v_cmp [B, N, Hkv, d_v]) with N = number of complete blocks in T."""
    if cfg.phi == "mlp" and phi is None:
        raise ValueError("NSAConfig.phi='mlp' needs phi weights (a PhiWeights); got phi=None")
    B, T, H, _ = k.shape
    n_blocks = compressed_block_count(T, cfg)
    out_k: list[list[list[Tensor]]] = []
    out_v: list[list[list[Tensor]]] = []
    for b in range(B):
        rows_k, rows_v = [], []
        for i in range(n_blocks):
            start = i * cfg.cmp_stride
            stop = start + cfg.cmp_block
            heads_k, heads_v = [], []
            for h in range(H):
                kb, vb = k[b, start:stop, h], v[b, start:stop, h]
                if cfg.phi == "avg":
                    heads_k.append(phi_avg(kb))
                    heads_v.append(phi_avg(vb))
                else:
                    heads_k.append(phi_mlp(kb, phi.k))
                    heads_v.append(phi_mlp(vb, phi.v))
            rows_k.append(torch.stack(heads_k))
            rows_v.append(torch.stack(heads_v))
        out_k.append(rows_k)
        out_v.append(rows_v)
    return _stack_blocks(out_k, k, n_blocks), _stack_blocks(out_v, v, n_blocks)


def _stack_blocks(rows: list[list[Tensor]], like: Tensor, n_blocks: int) -> Tensor:
    B, _, H, D = like.shape
    if n_blocks == 0:
        return like.new_zeros((B, 0, H, D))
    return torch.stack([torch.stack(r) for r in rows])


def compressed_attention_rows(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, cfg: NSAConfig,
                              positions: list[int]) -> tuple[Tensor, Tensor]:
    """Compressed-branch attention for queries q[:, iq] at absolute positions[iq].

    Returns (o_cmp [B, TQ, Hq, d_v], reads [B, TQ, Hkv]) where reads counts the compressed keys gathered.
    """
    B, TQ, Hq, _ = q.shape
    n_blocks = k_cmp.shape[1]
    G = cfg.group_size
    outs, reads = [], []
    for b in range(B):
        out_b, reads_b = [], []
        for iq, p in enumerate(positions):
            blocks = visible_compressed_blocks(p, n_blocks, cfg)
            out_h, reads_g = [], []
            for g in range(cfg.n_kv_heads):
                keys = gather_rows(k_cmp, b, blocks, g)
                values = gather_rows(v_cmp, b, blocks, g)
                reads_g.append(len(blocks))
                for h in range(g * G, (g + 1) * G):
                    out_h.append(attend(q[b, iq, h], keys, values))
            out_b.append(torch.stack(out_h))
            reads_b.append(reads_g)
        outs.append(torch.stack(out_b))
        reads.append(reads_b)
    return torch.stack(outs), torch.tensor(reads, dtype=torch.int64)


def compressed_attention(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, cfg: NSAConfig) -> Tensor:
    """Compressed branch for prefill queries at positions 0..T-1: o_cmp [B, T, Hq, d_v].
    A query with no visible compressed block gets exactly 0."""
    return compressed_attention_rows(q, k_cmp, v_cmp, cfg, list(range(q.shape[1])))[0]
