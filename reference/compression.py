"""Compression branch (Eq. 7) and its attention (Eq. 4 with the compressed keys/values)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .config import NSAConfig
from .contract import PhiMLPWeights, PhiWeights
from .documents import concat_documents, document_spans
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


def compress(k: Tensor, v: Tensor, cfg: NSAConfig, phi: PhiWeights | None = None, *,
             cu_seqlens: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Eq. 7 for every complete block: k [B, T, Hkv, d_k], v [B, T, Hkv, d_v] ->
    (k_cmp [B, N, Hkv, d_k], v_cmp [B, N, Hkv, d_v]) with N = number of complete blocks in T.

    Packed (cu_seqlens, B = 1): each document compressed alone, so no block straddles a boundary; document i's
    N_i compressed tokens follow those of documents 0..i-1 (N = sum N_i)."""
    if cu_seqlens is not None:
        spans = document_spans(cu_seqlens, "k", k, v=v)
        parts = [compress(k[:, s:e], v[:, s:e], cfg, phi) for s, e in spans]
        return torch.cat([kc for kc, _ in parts], dim=1), torch.cat([vc for _, vc in parts], dim=1)
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


def compressed_spans(spans: list[tuple[int, int]], k_cmp: Tensor, cfg: NSAConfig) -> list[tuple[int, int]]:
    """Where each document's compressed tokens lie in a packed k_cmp [1, N, ...]: document i's
    compressed_block_count(L_i) tokens follow those of documents 0..i-1. ValueError if k_cmp holds another N."""
    out, start = [], 0
    for s, e in spans:
        count = compressed_block_count(e - s, cfg)
        out.append((start, start + count))
        start += count
    if k_cmp.shape[0] != 1 or k_cmp.shape[1] != start:
        raise ValueError(f"k_cmp/v_cmp of a packed batch must be [1, N, Hkv, D] with N = {start}, the compressed "
                         f"tokens of the documents of cu_seqlens (packed per document); got {tuple(k_cmp.shape)}")
    return out


def compressed_attention(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, cfg: NSAConfig, *,
                         cu_seqlens: Tensor | None = None) -> Tensor:
    """Compressed branch for prefill queries at positions 0..T-1: o_cmp [B, T, Hq, d_v].
    A query with no visible compressed block gets exactly 0.

    Packed (cu_seqlens, B = 1): k_cmp, v_cmp packed per document as compress returns them; each document's
    queries attend to its own compressed tokens alone, at positions relative to its start."""
    if cu_seqlens is not None:
        spans = document_spans(cu_seqlens, "q", q)
        if tuple(v_cmp.shape[:2]) != tuple(k_cmp.shape[:2]):
            raise ValueError(f"v_cmp {tuple(v_cmp.shape)} and k_cmp {tuple(k_cmp.shape)} differ in [B, N]")
        pieces = [compressed_attention(q[:, s:e], k_cmp[:, cs:ce], v_cmp[:, cs:ce], cfg)
                  for (s, e), (cs, ce) in zip(spans, compressed_spans(spans, k_cmp, cfg)) if e > s]
        return concat_documents(pieces, q.new_zeros((1, 0, q.shape[2], v_cmp.shape[-1])))
    return compressed_attention_rows(q, k_cmp, v_cmp, cfg, list(range(q.shape[1])))[0]
