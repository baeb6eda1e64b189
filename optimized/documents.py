"""The document layout of a packed batch (cu_seqlens, reference.packing), as per-token tensors built once with
tensor ops, so every stage handles packed input without a Python loop over documents.

A packed batch has batch size 1 and documents back to back: document i owns tokens cu_seqlens[i] .. cu_seqlens[i+1]-1
and its compressed tokens (Eq. 7 blocks inside the document) follow those of documents 0..i-1
(reference.packing.compressed_cu_seqlens). Everything NSA counts is document-relative: a token's position is
t - token_start[t], compressed block c of a document covers its relative tokens c*d .. c*d + l - 1, selection block j
its relative tokens j*l' .. (j+1)*l' - 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from reference.config import NSAConfig
from reference.packing import check_cu_seqlens, compressed_cu_seqlens

from . import masks


@dataclass(frozen=True)
class Documents:
    """Per-token and per-compressed-token document tensors (int64, on the data's device)."""

    bounds: Tensor  # [N + 1] cu_seqlens
    token_doc: Tensor  # [T] document of token t
    token_start: Tensor  # [T] first token of t's document
    cmp_bounds: Tensor  # [N + 1] compressed_cu_seqlens: document i's compressed tokens start at cmp_bounds[i]
    cmp_doc: Tensor  # [Nc] document of packed compressed token c
    cmp_local: Tensor  # [Nc] index of compressed token c inside its document (Eq. 7 block number)
    cmp_first_token: Tensor  # [Nc] packed token index of the first key of compressed token c's block
    max_doc_length: int  # longest document
    n_sel_blocks: int  # NB = max_i ceil(L_i / l'): selection-score columns of a packed batch

    @property
    def n_tokens(self) -> int:
        return self.token_doc.shape[0]

    @property
    def n_compressed(self) -> int:
        return self.cmp_doc.shape[0]

    def relative(self, positions: Tensor) -> Tensor:
        """Document-relative positions p - start of p's document, for packed positions [TQ]."""
        return positions - self.token_start[positions]

    def cmp_range(self, positions: Tensor) -> tuple[int, int]:
        """[first, stop) of the packed compressed tokens of the documents holding the given packed positions
        (increasing): every compressed token any of those queries may read lies in it."""
        if positions.numel() == 0:
            return 0, 0
        first_doc, last_doc = self.token_doc[positions[0]], self.token_doc[positions[-1]]
        return int(self.cmp_bounds[first_doc]), int(self.cmp_bounds[last_doc + 1])


def documents(cu_seqlens: Tensor, n_tokens: int, batch: int, cfg: NSAConfig,
              device: torch.device | str) -> Documents:
    """Validate cu_seqlens (reference.packing.check_cu_seqlens: ValueError naming `cu_seqlens` and the rule) and
    build the layout of a packed batch of n_tokens tokens."""
    spans = check_cu_seqlens(cu_seqlens, n_tokens, batch, "cu_seqlens")
    bounds = cu_seqlens.to(device=device, dtype=torch.int64)
    cmp_bounds = compressed_cu_seqlens(bounds, cfg)
    tokens = torch.arange(n_tokens, device=device)
    # an empty document's end equals its start, so no token is placed in it
    token_doc = torch.searchsorted(bounds[1:], tokens, right=True)
    n_cmp = int(cmp_bounds[-1])
    cmp = torch.arange(n_cmp, device=device)
    cmp_doc = torch.searchsorted(cmp_bounds[1:], cmp, right=True)
    cmp_local = cmp - cmp_bounds[cmp_doc]
    lengths = [end - start for start, end in spans]
    longest = max(lengths)
    return Documents(
        bounds=bounds,
        token_doc=token_doc,
        token_start=bounds[token_doc],
        cmp_bounds=cmp_bounds,
        cmp_doc=cmp_doc,
        cmp_local=cmp_local,
        cmp_first_token=bounds[cmp_doc] + cmp_local * cfg.cmp_stride,  # Eq. 7: block c starts at c*d
        max_doc_length=longest,
        n_sel_blocks=-(-longest // cfg.sel_block),
    )


def stage_documents(cu_seqlens: Tensor | None, cfg: NSAConfig, q: Tensor, **same_tokens: Tensor) -> Documents | None:
    """The layout of a stage's packed batch q [1, T, ...] (None when cu_seqlens is None); every tensor in
    same_tokens must hold the same T tokens (ValueError naming it)."""
    if cu_seqlens is None:
        return None
    for name, t in same_tokens.items():
        if t.shape[1] != q.shape[1]:
            raise ValueError(f"{name} must hold the same T = {q.shape[1]} tokens as q in a packed batch "
                             f"(cu_seqlens), got {t.shape[1]}")
    return documents(cu_seqlens, q.shape[1], q.shape[0], cfg, q.device)


def check_packed_compressed(name: str, k_cmp: Tensor, docs: Documents) -> None:
    """A packed compressed tensor must hold exactly the documents' compressed tokens (compressed_cu_seqlens)."""
    if k_cmp.shape[1] != docs.n_compressed:
        raise ValueError(f"{name} must hold sum_i N_i = {docs.n_compressed} packed compressed tokens for these "
                         f"cu_seqlens (compressed_cu_seqlens), got {k_cmp.shape[1]}")


def visible_compressed(docs: Documents, cmp_tokens: Tensor, positions: Tensor, cfg: NSAConfig) -> Tensor:
    """[TQ, K]: query at packed position p reads packed compressed token c iff c belongs to p's document and its
    block is visible at p's relative position (masks.compressed_block_visible, Eq. 7)."""
    same_doc = docs.cmp_doc[cmp_tokens][None, :] == docs.token_doc[positions][:, None]
    return same_doc & masks.compressed_block_visible(docs.cmp_local[cmp_tokens][None, :],
                                                     docs.relative(positions)[:, None], cfg)
