"""Eq. 2 softmax attention over a per-chunk key set with a validity mask, chunked over queries, as one autograd
Function shared by the compressed, selected (torch backend) and window branches.

Memory: only one query chunk's logits exist at a time, in forward and in backward (the backward recomputes them
from the saved row max and row sum, like FlashAttention's log-sum-exp), so no branch ever holds a T x T (or
T x N) tensor and autograd keeps only q, k, v and two numbers per (query, head). A query with no valid key gets
exactly 0 and zero gradients (no NaN).

Precision: arithmetic runs in the next wider float than the inputs (dispatch.compute_dtype) and the output stays in
it; callers round once, at the end, so gradients also flow back in it. Results are then the inputs' exact function
rounded once (within the wider type's error), which is what lets this path meet FlashAttention's error-ratio rule
against the loop reference even on tiny tensors, where a 1-ulp summation-order difference would otherwise count.

A KeyPlan says which keys each query chunk reads, as one of:
- `SharedKeys`: a contiguous key range [start, stop) read by the whole chunk, valid [C, K] per query and key (the
  compressed and window branches);
- `GatheredKeys`: token indices per (batch, query, KV head), tokens/valid [B, C, Hkv, K] (the selected branch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from .dispatch import compute_dtype
from .numerics import query_chunks


@dataclass
class SharedKeys:
    """Keys start..stop-1 for every query of the chunk; valid [C, stop - start]."""

    start: int
    stop: int
    valid: Tensor


@dataclass
class GatheredKeys:
    """Keys tokens[b, c, h, :] for query c of batch b in KV head h; tokens and valid [B, C, Hkv, K].
    Invalid entries may hold any in-range token index (they are masked)."""

    tokens: Tensor
    valid: Tensor


@dataclass(frozen=True)
class KeyPlan:
    """Which keys each query chunk reads: n_queries rows in chunks of chunk_size, keys(q0, q1) the key set of rows
    q0..q1-1 (each branch of the torch path gives its own keys function)."""

    n_queries: int
    chunk_size: int
    keys: Callable[[int, int], SharedKeys | GatheredKeys]

    def chunks(self) -> list[tuple[int, int]]:
        return query_chunks(self.n_queries, self.chunk_size)


def masked_attention(plan: KeyPlan, q: Tensor, k: Tensor, v: Tensor, *,
                     compute: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """Eq. 2 for every query of q [B, TQ, Hq, dk] over the keys the plan gives it, k [B, TK, Hkv, dk],
    v [B, TK, Hkv, dv]. Returns (o [B, TQ, Hq, dv] in the compute dtype, reads int64 [B, TQ, Hkv]) where reads counts
    the valid keys each (query, KV head) was given. compute: the arithmetic dtype (default compute_dtype(q.dtype);
    nsa_forward passes inputs it has already widened, with the dtype it widened them to)."""
    return _MaskedAttention.apply(plan, compute or compute_dtype(q.dtype), q, k, v)


# Contractions for the two plan kinds. q-like tensors are [B, C, Hkv, G, D]; logits [B, C, Hkv, G, K].
def _logits(qc: Tensor, keys: Tensor, shared: bool) -> Tensor:
    return torch.einsum("bchgd,bkhd->bchgk" if shared else "bchgd,bchkd->bchgk", qc, keys)


def _weighted_values(p: Tensor, values: Tensor, shared: bool) -> Tensor:
    return torch.einsum("bchgk,bkhd->bchgd" if shared else "bchgk,bchkd->bchgd", p, values)


def _key_grad(ds: Tensor, qc: Tensor, shared: bool) -> Tensor:
    return torch.einsum("bchgk,bchgd->bkhd" if shared else "bchgk,bchgd->bchkd", ds, qc)


class _Chunk:
    """The keys/values of one query chunk, upcast to the compute dtype, and the mask in logits layout."""

    def __init__(self, spec: SharedKeys | GatheredKeys, k: Tensor, v: Tensor, cd: torch.dtype):
        self.spec = spec
        self.shared = isinstance(spec, SharedKeys)
        if self.shared:
            self.keys = k[:, spec.start:spec.stop].to(cd)
            self.values = v[:, spec.start:spec.stop].to(cd)
            self.mask = spec.valid[None, :, None, None, :]
            self.n_keys = spec.stop - spec.start
        else:
            B, TK, H = k.shape[:3]
            b = torch.arange(B, device=k.device)[:, None, None, None]
            h = torch.arange(H, device=k.device)[None, None, :, None]
            self.flat = ((b * TK + spec.tokens) * H + h).reshape(-1)
            self.keys = k.reshape(B * TK * H, -1).index_select(0, self.flat).view(*spec.tokens.shape, -1).to(cd)
            self.values = v.reshape(B * TK * H, -1).index_select(0, self.flat).view(*spec.tokens.shape, -1).to(cd)
            self.mask = spec.valid[:, :, :, None, :]
            self.n_keys = spec.tokens.shape[-1]

    def reads(self, B: int, C: int, H: int) -> Tensor:
        counts = self.spec.valid.sum(dim=-1)
        if self.shared:
            return counts[None, :, None].expand(B, C, H)
        return counts

    def scatter(self, dk: Tensor, dv: Tensor, dkeys: Tensor | None, dvalues: Tensor | None) -> None:
        if self.shared:
            if dkeys is not None:
                dk[:, self.spec.start:self.spec.stop] += dkeys
            if dvalues is not None:
                dv[:, self.spec.start:self.spec.stop] += dvalues
            return
        # index_put_(accumulate=True), not index_add_: on CUDA index_add_ sums duplicate tokens with atomics in
        # a run-dependent order, while index_put_ sorts the indices and sums each token's terms in a fixed order,
        # so gradients are bitwise reproducible (gradcheck's reentrancy check and the no-peeking property
        # compare gradients exactly).
        if dkeys is not None:
            dk.view(-1, dk.shape[-1]).index_put_((self.flat,), dkeys.reshape(-1, dk.shape[-1]), accumulate=True)
        if dvalues is not None:
            dv.view(-1, dv.shape[-1]).index_put_((self.flat,), dvalues.reshape(-1, dv.shape[-1]), accumulate=True)


def _row_max(masked_logits: Tensor) -> Tensor:
    """Row max of the masked logits, 0 for a row with no valid key (so exp(-inf - 0) = 0, never NaN)."""
    row_max = masked_logits.amax(dim=-1, keepdim=True)
    return torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))


def _unnormalised(logits: Tensor, mask: Tensor, row_max: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """e = exp(logits - row max), exactly 0 where masked, and the row max used."""
    masked = logits.masked_fill(~mask, float("-inf"))
    if row_max is None:
        row_max = _row_max(masked)
    return torch.exp(masked - row_max), row_max


class _MaskedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: KeyPlan, cd: torch.dtype, q: Tensor, k: Tensor, v: Tensor):
        B, TQ, Hq, dk = q.shape
        H, dv = k.shape[2], v.shape[3]
        G = Hq // H
        inv_sqrt = 1.0 / math.sqrt(dk)
        o = torch.zeros((B, TQ, Hq, dv), dtype=cd, device=q.device)
        row_max = torch.zeros((B, TQ, H, G, 1), dtype=cd, device=q.device)
        row_sum = torch.ones((B, TQ, H, G, 1), dtype=cd, device=q.device)  # 1 where no key: p = 0 / 1
        reads = torch.zeros((B, TQ, H), dtype=torch.int64, device=q.device)
        for q0, q1 in plan.chunks():
            C = q1 - q0
            chunk = _Chunk(plan.keys(q0, q1), k, v, cd)
            reads[:, q0:q1] = chunk.reads(B, C, H)
            if chunk.n_keys == 0:
                continue
            qc = q[:, q0:q1].reshape(B, C, H, G, dk).to(cd)
            e, max_c = _unnormalised(_logits(qc, chunk.keys, chunk.shared) * inv_sqrt, chunk.mask)
            total = e.sum(dim=-1, keepdim=True)
            total = torch.where(total > 0, total, torch.ones_like(total))
            oc = _weighted_values(e, chunk.values, chunk.shared) / total
            o[:, q0:q1] = oc.reshape(B, C, Hq, dv)
            row_max[:, q0:q1], row_sum[:, q0:q1] = max_c, total
        ctx.plan, ctx.cd = plan, cd
        ctx.save_for_backward(q, k, v, row_max, row_sum)
        ctx.mark_non_differentiable(reads)
        return o, reads

    @staticmethod
    def backward(ctx, do: Tensor, _dreads: Tensor):
        q, k, v, row_max, row_sum = ctx.saved_tensors
        plan, cd = ctx.plan, ctx.cd
        B, TQ, Hq, dk = q.shape
        H, dv = k.shape[2], v.shape[3]
        G = Hq // H
        inv_sqrt = 1.0 / math.sqrt(dk)
        need_q, need_k, need_v = ctx.needs_input_grad[2:5]
        dq = torch.zeros(q.shape, dtype=cd, device=q.device) if need_q else None
        dkeys_all = torch.zeros(k.shape, dtype=cd, device=k.device) if need_k else None
        dvalues_all = torch.zeros(v.shape, dtype=cd, device=v.device) if need_v else None
        for q0, q1 in plan.chunks():
            C = q1 - q0
            chunk = _Chunk(plan.keys(q0, q1), k, v, cd)
            if chunk.n_keys == 0:
                continue
            qc = q[:, q0:q1].reshape(B, C, H, G, dk).to(cd)
            doc = do[:, q0:q1].reshape(B, C, H, G, dv).to(cd)
            # Eq. 2 probabilities recomputed exactly as in forward (exp(s - max) / sum); 0 where masked
            e, _ = _unnormalised(_logits(qc, chunk.keys, chunk.shared) * inv_sqrt, chunk.mask, row_max[:, q0:q1])
            p = e / row_sum[:, q0:q1]
            dp = _logits(doc, chunk.values, chunk.shared)
            # delta = dO . o as sum(p * dp) over the recomputed probabilities (o is not saved), so every softmax
            # row's gradient sums to 0 up to rounding (no bias in dk of shift-invariant inputs such as phi's b2)
            delta = (p * dp).sum(dim=-1, keepdim=True)
            ds = p * (dp - delta) * inv_sqrt
            if need_q:
                dq[:, q0:q1] = _weighted_values(ds, chunk.keys, chunk.shared).reshape(B, C, Hq, dk)
            chunk.scatter(dkeys_all, dvalues_all,
                          _key_grad(ds, qc, chunk.shared) if need_k else None,
                          _key_grad(p, doc, chunk.shared) if need_v else None)
        return (None, None,
                dq.to(q.dtype) if need_q else None,
                dkeys_all.to(k.dtype) if need_k else None,
                dvalues_all.to(v.dtype) if need_v else None)
