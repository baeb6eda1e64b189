"""The only arithmetic the reference allows itself: dot products of one query with gathered key rows
and a softmax over that one row (Eq. 2). Every index set is built by explicit loops elsewhere."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def attend(q_vec: Tensor, keys: Tensor, values: Tensor) -> Tensor:
    """Eq. 2 for one query: softmax(q.k_i / sqrt(d_k)) weighted sum of v_i over the given rows.

    q_vec [d_k]; keys [n, d_k]; values [n, d_v]. An empty key set returns exactly 0 (docs/spec.md, A14).
    """
    if keys.shape[0] == 0:
        return values.new_zeros(values.shape[-1])
    logits = (keys @ q_vec) / math.sqrt(q_vec.shape[-1])
    probs = softmax_row(logits)
    return probs @ values


def softmax_row(logits: Tensor) -> Tensor:
    """Softmax over one row, max-subtracted so large logits cannot overflow."""
    shifted = logits - logits.max()
    e = torch.exp(shifted)
    return e / e.sum()


def gather_rows(x: Tensor, b: int, rows: list[int], h: int) -> Tensor:
    """x[b, rows, h] for an explicit list of row indices (the index set a branch uses)."""
    return x[b, rows, h] if rows else x.new_zeros((0, x.shape[-1]))
