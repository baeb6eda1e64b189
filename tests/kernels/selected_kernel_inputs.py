"""Random inputs for the selected-attention kernel tests (CPU interpreter and GPU): q, k, v and valid indices."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Case:
    """One kernel test shape. Queries are the last tq of tk positions (tq = tk: prefill)."""

    tk: int
    tq: int
    n_kv_heads: int
    group: int
    dk: int
    dv: int
    sel_block: int
    n_sel: int
    batch: int = 1

    @property
    def n_heads(self) -> int:
        return self.n_kv_heads * self.group

    def __str__(self) -> str:
        return (f"B{self.batch}-TK{self.tk}-TQ{self.tq}-Hkv{self.n_kv_heads}-h{self.group}-dk{self.dk}-dv{self.dv}"
                f"-l{self.sel_block}-n{self.n_sel}")


def random_qkv(case: Case, *, dtype: torch.dtype, device: torch.device | str, seed: int) -> tuple[Tensor, ...]:
    """Standard-normal q [B, TQ, Hq, dk], k [B, TK, Hkv, dk], v [B, TK, Hkv, dv] (never zeros)."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape: int) -> Tensor:
        return torch.randn(shape, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)

    return (rnd(case.batch, case.tq, case.n_heads, case.dk), rnd(case.batch, case.tk, case.n_kv_heads, case.dk),
            rnd(case.batch, case.tk, case.n_kv_heads, case.dv))


def document_starts(lengths: list[int], tq: int | None = None) -> Tensor:
    """int32 [TQ]: the first key of each of the last tq (default all) rows' documents in a packed batch of
    documents of the given lengths (empty documents allowed)."""
    starts, first = [], 0
    for n in lengths:
        starts += [first] * n
        first += n
    rows = torch.tensor(starts, dtype=torch.int32)
    return rows if tq is None else rows[len(rows) - tq:]


def random_indices(case: Case, *, seed: int, device: torch.device | str = "cpu", forced: bool = True,
                   dtype: torch.dtype = torch.int64, chunk: int = 4096, doc_start: Tensor | None = None) -> Tensor:
    """indices [B, TQ, Hkv, n]: for a query at p, up to n distinct blocks among 0..J = p // l', ascending,
    -1 padded at the end. forced=True always includes block 0 and the blocks J-1, J (Eq. 11 forced blocks);
    the other picks are uniform. Built chunk-wise over queries so T = 64k stays small in memory.
    doc_start [TQ] (packed batch, document_starts): document-relative blocks, J = (p - doc_start) // l'."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    n_blocks = -(-case.tk // case.sel_block)
    n_pick = min(case.n_sel, n_blocks)
    out = []
    for start in range(0, case.tq, chunk):
        rows = min(chunk, case.tq - start)
        pos = torch.arange(case.tk - case.tq + start, case.tk - case.tq + start + rows)
        if doc_start is not None:
            pos = pos - doc_start[start:start + rows].cpu().long()
        last = (pos // case.sel_block).view(1, rows, 1, 1)
        blocks = torch.arange(n_blocks).view(1, 1, 1, n_blocks)
        scores = torch.rand((case.batch, rows, case.n_kv_heads, n_blocks), generator=g)
        if forced:
            scores = torch.where((blocks == 0) | (blocks == last) | (blocks == last - 1), 2.0, scores)
        scores = torch.where(blocks > last, -1.0, scores)
        top, picked = torch.topk(scores.to(device), n_pick, dim=-1)
        picked = torch.where(top >= 0, picked, torch.full_like(picked, n_blocks + 1))
        picked = torch.sort(picked, dim=-1).values
        picked = torch.where(picked > n_blocks, -1, picked)
        if n_pick < case.n_sel:
            pad = torch.full((*picked.shape[:-1], case.n_sel - n_pick), -1, dtype=picked.dtype, device=device)
            picked = torch.cat([picked, pad], dim=-1)
        out.append(picked)
    return torch.cat(out, dim=1).to(dtype)
