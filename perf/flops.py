"""Useful work per stage: matmul FLOPs over the keys each branch actually uses, and compulsory memory bytes.

FLOPs (forward) of an attention branch = 2 * (d_k + d_v) per (query head, key) pair: one multiply-add per
element of q.k (d_k) and of p.v (d_v). Pairs per branch:
- full causal attention (SDPA): T(T+1)/2 per head;
- compressed (Eq. 7): the compressed blocks visible to each query, sum over p of N_cmp(p);
- window (Sec. 3.3.3): sum over p of min(p + 1, window size);
- selected (Eq. 12): tokens of the selected blocks clipped to <= p, COUNTED from the index tensor the
  implementation produced, per (p, group), times the group size (every head of a group reads the same tokens).
Scoring (Eq. 8) costs 2 * d_k per (head, visible compressed key) for q.k_cmp; Eq. 9-11 pooling and top-n are
not matmul work and are not counted. phi "mlp" (Eq. 7) costs 2 * (l*D*hidden + hidden*D) per block and KV
head for keys and for values. The gated sum (Eq. 5) has no matmul work. Packed batches (the "packed" workload):
every count is per document and summed over the documents (StageWork(lengths=...)), since nothing attends across
a document boundary.

Backward convention (stated, not counted): attention branches 2.5x their forward FLOPs (FlashAttention's
5 backward matmuls against 2 forward ones), the phi MLP 2x (dX and dW), selection 0 (top-n is discrete,
no gradient flows through it), the gated sum 0.

Bytes are compulsory HBM traffic: every input read once, every output written once (bf16 = 2 bytes), i.e.
what a perfectly fused kernel with full on-chip reuse must move. Backward: read inputs, output and the
output gradient, write the input gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from reference.config import NSAConfig

ATTENTION_BWD_FACTOR = 2.5
MLP_BWD_FACTOR = 2.0


@dataclass(frozen=True)
class Work:
    """Forward FLOPs and bytes of one stage, plus its backward by the stated convention."""

    fwd_flops: float
    bwd_flops: float
    fwd_bytes: float
    bwd_bytes: float

    def flops(self, pass_name: str) -> float:
        return self.fwd_flops if pass_name == "fwd" else self.fwd_flops + self.bwd_flops

    def bytes(self, pass_name: str) -> float:
        return self.fwd_bytes if pass_name == "fwd" else self.fwd_bytes + self.bwd_bytes

    def __add__(self, other: "Work") -> "Work":
        return Work(self.fwd_flops + other.fwd_flops, self.bwd_flops + other.bwd_flops,
                    self.fwd_bytes + other.fwd_bytes, self.bwd_bytes + other.bwd_bytes)


# Key counts ---------------------------------------------------------------------------------------------

def causal_pairs(T: int) -> int:
    """Query-key pairs of causal full attention over positions 0..T-1."""
    return T * (T + 1) // 2


def compressed_pairs(T: int, cfg: NSAConfig) -> int:
    """sum over p of the compressed blocks visible to p: block i (keys i*d .. i*d+l-1) is visible iff
    i*d + l - 1 <= p ("inclusive") or < p ("strict"), so N_cmp(p) = max(0, floor((p' - l + 1)/d) + 1) with
    p' = p (inclusive) or p - 1 (strict)."""
    p = torch.arange(T, dtype=torch.int64)
    if cfg.cmp_visibility == "strict":
        p = p - 1
    visible = torch.div(p - cfg.cmp_block + 1, cfg.cmp_stride, rounding_mode="floor") + 1
    return int(visible.clamp(min=0).sum())


def window_pairs(T: int, cfg: NSAConfig) -> int:
    """sum over p of the window keys max(0, p - w_size + 1) .. p."""
    p = torch.arange(T, dtype=torch.int64)
    return int(torch.clamp(p + 1, max=cfg.window_size).sum())


def selected_token_count(indices: Tensor, sel_block: int, doc_start: Tensor | None = None) -> int:
    """Tokens the selected branch reads, summed over (batch, query, group): for each index j >= 0 in
    indices [B, T, Hkv, n] the keys j*l' .. min((j+1)*l', p+1) - 1 of the query at position p (Eq. 12).
    doc_start [T] (packed batch): indices are document-relative, p is the position inside the document."""
    B, T, Hkv, n = indices.shape
    p = torch.arange(T, device=indices.device, dtype=torch.int64)
    if doc_start is not None:
        p = p - doc_start.to(device=indices.device, dtype=torch.int64)
    p = p.view(1, T, 1, 1)
    start = indices.to(torch.int64) * sel_block
    tokens = torch.clamp(torch.minimum(start + sel_block, p + 1) - start, min=0)
    return int(torch.where(indices >= 0, tokens, torch.zeros_like(tokens)).sum())


# Work per stage -----------------------------------------------------------------------------------------

def _attention_work(pair_flops: float, in_bytes: float, out_bytes: float) -> Work:
    return Work(fwd_flops=pair_flops, bwd_flops=ATTENTION_BWD_FACTOR * pair_flops,
                fwd_bytes=in_bytes + out_bytes, bwd_bytes=2 * in_bytes + 2 * out_bytes)


class StageWork:
    """FLOPs and bytes of every stage for one (T, batch, config, element size). lengths: the documents of a
    packed row (summing to T); default one sequence of T tokens."""

    def __init__(self, T: int, cfg: NSAConfig, batch: int, elem_bytes: int, phi_hidden: int,
                 lengths: tuple[int, ...] | None = None):
        self.T, self.cfg, self.B, self.e, self.phi_hidden = T, cfg, batch, elem_bytes, phi_hidden
        self.lengths = (T,) if lengths is None else tuple(lengths)
        if sum(self.lengths) != T or any(n < 0 for n in self.lengths):
            raise ValueError(f"StageWork.lengths must be non-negative and sum to T = {T}, got {self.lengths}")
        self.n_cmp_blocks = sum(max(0, (n - cfg.cmp_block) // cfg.cmp_stride + 1) for n in self.lengths)

    def _pairs(self, per_document) -> int:
        return sum(per_document(n) for n in self.lengths if n > 0)

    # sizes in bytes
    def _q(self) -> float:
        return self.B * self.T * self.cfg.n_heads * self.cfg.head_dim_qk * self.e

    def _o(self) -> float:
        return self.B * self.T * self.cfg.n_heads * self.cfg.head_dim_v * self.e

    def _kv(self) -> float:
        return self.B * self.T * self.cfg.n_kv_heads * (self.cfg.head_dim_qk + self.cfg.head_dim_v) * self.e

    def _kv_cmp(self) -> float:
        c = self.cfg
        return self.B * self.n_cmp_blocks * c.n_kv_heads * (c.head_dim_qk + c.head_dim_v) * self.e

    def _lse(self) -> float:
        return self.B * self.T * self.cfg.n_heads * 4

    def _per_head_pair_flops(self, pairs: int) -> float:
        c = self.cfg
        return 2.0 * (c.head_dim_qk + c.head_dim_v) * c.n_heads * self.B * pairs

    def sdpa(self) -> Work:
        return _attention_work(self._per_head_pair_flops(self._pairs(causal_pairs)), self._q() + self._kv(),
                               self._o() + self._lse())

    def compress(self) -> Work:
        c = self.cfg
        blocks = self.B * self.n_cmp_blocks * c.n_kv_heads
        if c.phi == "mlp":
            h = self.phi_hidden
            flops = 0.0
            weight_bytes = 0.0
            for dim in (c.head_dim_qk, c.head_dim_v):
                flops += 2.0 * blocks * (c.cmp_block * dim * h + h * dim)
                weight_bytes += (c.cmp_block * dim * h + h * dim + c.cmp_block * dim + h + dim) * self.e
        else:
            flops, weight_bytes = 0.0, 0.0
        fwd_bytes = self._kv() + weight_bytes + self._kv_cmp()
        return Work(fwd_flops=flops, bwd_flops=MLP_BWD_FACTOR * flops, fwd_bytes=fwd_bytes,
                    bwd_bytes=2 * (self._kv() + weight_bytes) + 2 * self._kv_cmp())

    def cmp_attn(self) -> Work:
        return _attention_work(self._per_head_pair_flops(self._pairs(lambda n: compressed_pairs(n, self.cfg))),
                               self._q() + self._kv_cmp(), self._o() + self._lse())

    def select(self) -> Work:
        c = self.cfg
        flops = 2.0 * c.head_dim_qk * c.n_heads * self.B * self._pairs(lambda n: compressed_pairs(n, c))
        indices = self.B * self.T * c.n_kv_heads * c.n_sel * 8
        k_cmp = self.B * self.n_cmp_blocks * c.n_kv_heads * c.head_dim_qk * self.e
        return Work(fwd_flops=flops, bwd_flops=0.0, fwd_bytes=self._q() + k_cmp + indices, bwd_bytes=0.0)

    def selected(self, token_count: int | None) -> Work | None:
        """token_count: selected_token_count of the indices used (None when no indices were produced)."""
        if token_count is None:
            return None
        c = self.cfg
        flops = 2.0 * (c.head_dim_qk + c.head_dim_v) * c.group_size * token_count
        indices = self.B * self.T * c.n_kv_heads * c.n_sel * 8
        return _attention_work(flops, self._q() + self._kv() + indices, self._o() + self._lse())

    def window(self) -> Work:
        return _attention_work(self._per_head_pair_flops(self._pairs(lambda n: window_pairs(n, self.cfg))),
                               self._q() + self._kv(),
                               self._o() + self._lse())

    def gate(self) -> Work:
        gates = self.B * self.T * self.cfg.n_heads * 3 * self.e
        fwd = 3 * self._o() + gates + self._o()
        return Work(fwd_flops=0.0, bwd_flops=0.0, fwd_bytes=fwd, bwd_bytes=fwd + 3 * self._o() + gates)

    def layer(self, token_count: int | None, branches: tuple[str, ...] = ("cmp", "slc", "win")) -> Work | None:
        """Sum of the stages' FLOPs; bytes = the layer's own inputs (q, the computed branches' k/v, gates, phi) and
        output, as a fully fused layer would move them (intermediates stay on chip). branches: the layer run
        without some branch (nsa_forward(branches=...)) does none of its work; compression and scoring stay
        whenever the selected branch runs (Eq. 8-11 select from the compressed keys)."""
        selected = self.selected(token_count) if "slc" in branches else None
        if selected is None and "slc" in branches:
            return None
        stages = []
        if "cmp" in branches or "slc" in branches:
            stages.append(self.compress())
        if "cmp" in branches:
            stages.append(self.cmp_attn())
        if "slc" in branches:
            stages += [self.select(), selected]
        if "win" in branches:
            stages.append(self.window())
        flops = sum(stages, Work(0.0, 0.0, 0.0, 0.0))
        gates = self.B * self.T * self.cfg.n_heads * 3 * self.e
        in_bytes = self._q() + len(branches) * self._kv() + gates
        return Work(fwd_flops=flops.fwd_flops, bwd_flops=flops.bwd_flops, fwd_bytes=in_bytes + self._o(),
                    bwd_bytes=2 * in_bytes + 2 * self._o())

    def stage(self, name: str, token_count: int | None,
              branches: tuple[str, ...] = ("cmp", "slc", "win")) -> Work | None:
        if name == "selected":
            return self.selected(token_count)
        if name == "layer":
            return self.layer(token_count, branches)
        return getattr(self, name)()
