"""Batches of next-token examples, checked when they are created.

Contiguous windows: labels[:, :-1] == inputs[:, 1:] (labels are the window shifted left by one).
Packed documents (cu_seqlens, batch size 1): within each document [s, e) labels[s:e-1] == inputs[s+1:e], and
the document's last position has the ignore label IGNORE_INDEX (no position predicts across a boundary).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor

from reference.packing import check_cu_seqlens

IGNORE_INDEX = -100  # torch.nn.functional.cross_entropy's default ignore_index: no loss at this position


class LabelShiftError(AssertionError):
    """Inputs and labels are not a one-token shift of one contiguous window (or of each packed document)."""


def check_next_token_alignment(inputs: Tensor, labels: Tensor) -> None:
    """Fail loudly unless labels[:, :-1] == inputs[:, 1:] (labels are the inputs shifted left by one)."""
    if inputs.shape != labels.shape or inputs.ndim != 2:
        raise LabelShiftError(f"inputs {tuple(inputs.shape)} and labels {tuple(labels.shape)} must both be [B, T]")
    if inputs.shape[1] >= 2 and not torch.equal(labels[:, :-1], inputs[:, 1:]):
        bad = (labels[:, :-1] != inputs[:, 1:]).nonzero()[0].tolist()
        raise LabelShiftError(
            f"label misalignment: labels[:, :-1] != inputs[:, 1:] (first mismatch at batch row {bad[0]}, "
            f"position {bad[1]}); next-token labels must be the same window shifted by one")


def document_ends(cu_seqlens: Tensor) -> Tensor:
    """Last position (end - 1) of every non-empty document of cu_seqlens, int64."""
    starts, ends = cu_seqlens[:-1].long(), cu_seqlens[1:].long()
    return ends[ends > starts] - 1


def packed_labels(inputs: Tensor, cu_seqlens: Tensor) -> Tensor:
    """The labels of a packed row [1, T]: inputs shifted left by one inside each document, IGNORE_INDEX at every
    document's last position (cu_seqlens must be valid: check_cu_seqlens)."""
    labels = torch.cat([inputs[:, 1:], inputs.new_full((inputs.shape[0], 1), IGNORE_INDEX)], dim=1)
    labels[:, document_ends(cu_seqlens)] = IGNORE_INDEX
    return labels


def check_packed_alignment(inputs: Tensor, labels: Tensor, cu_seqlens: Tensor) -> None:
    """Fail loudly unless, for every document [s, e) of cu_seqlens, labels[s:e-1] == inputs[s+1:e] and
    labels[e-1] == IGNORE_INDEX (a label never comes from another document)."""
    if inputs.shape != labels.shape or inputs.ndim != 2:
        raise LabelShiftError(f"inputs {tuple(inputs.shape)} and labels {tuple(labels.shape)} must both be [1, T]")
    try:
        spans = check_cu_seqlens(cu_seqlens, inputs.shape[1], inputs.shape[0])
    except ValueError as exc:
        raise LabelShiftError(f"packed batch: {exc}") from None
    expected = packed_labels(inputs, cu_seqlens)
    if torch.equal(labels, expected):
        return
    bad = int((labels != expected).nonzero()[0, 1])
    doc, (start, end) = next((i, span) for i, span in enumerate(spans) if span[0] <= bad < span[1])
    if bad == end - 1:
        raise LabelShiftError(
            f"packed label crosses a document boundary: the last position {bad} of document {doc} [{start}, {end}) "
            f"has label {int(labels[0, bad])}, it must be the ignore label {IGNORE_INDEX} (no position predicts "
            f"the next document's first token)")
    raise LabelShiftError(
        f"packed label misalignment in document {doc} [{start}, {end}): labels[t] != inputs[t + 1] at position "
        f"{bad}; within a document the labels must be its inputs shifted by one")


@dataclass
class Batch:
    inputs: Tensor  # [B, T] int64
    labels: Tensor  # [B, T] int64, labels[:, t] = token t+1 of the window (packed: of the document, or IGNORE)
    loss_mask: Tensor | None = None  # [B, T] 0/1: positions whose loss counts (None = all)
    cu_seqlens: Tensor | None = None  # packed documents (B = 1): int32 [N + 1] document boundaries

    def __post_init__(self) -> None:
        if self.cu_seqlens is None:
            check_next_token_alignment(self.inputs, self.labels)
        else:
            check_packed_alignment(self.inputs, self.labels, self.cu_seqlens)
            ignored = self.labels == IGNORE_INDEX
            if self.loss_mask is None or bool((self.loss_mask[ignored] != 0).any()):
                raise ValueError("a packed batch needs a loss_mask that is 0 at every ignore-label position")
        if self.loss_mask is not None and self.loss_mask.shape != self.inputs.shape:
            raise ValueError(f"loss_mask {tuple(self.loss_mask.shape)} must match inputs {tuple(self.inputs.shape)}")

    @classmethod
    def packed(cls, tokens: Tensor, cu_seqlens: Tensor) -> "Batch":
        """One packed row of documents: tokens [T] (or [1, T]) with document boundaries cu_seqlens [N + 1];
        labels per document (packed_labels), loss only where a label exists."""
        inputs = tokens.reshape(1, -1).long()
        cu_seqlens = cu_seqlens.to(torch.int32)
        labels = packed_labels(inputs, cu_seqlens)
        return cls(inputs=inputs, labels=labels, loss_mask=(labels != IGNORE_INDEX).float(), cu_seqlens=cu_seqlens)

    @property
    def n_documents(self) -> int | None:
        """Documents of a packed batch (cu_seqlens entries - 1); None for contiguous windows."""
        return None if self.cu_seqlens is None else self.cu_seqlens.numel() - 1

    @classmethod
    def from_windows(cls, windows: Tensor, loss_mask: Tensor | None = None) -> "Batch":
        """windows [B, T+1] of contiguous tokens -> inputs = windows[:, :-1], labels = windows[:, 1:]."""
        if windows.ndim != 2 or windows.shape[1] < 2:
            raise ValueError(f"windows must be [B, T+1] with T >= 1, got {tuple(windows.shape)}")
        windows = windows.long()
        return cls(inputs=windows[:, :-1], labels=windows[:, 1:], loss_mask=loss_mask)

    @property
    def n_tokens(self) -> int:
        return self.inputs.numel()

    def to(self, device: torch.device | str) -> "Batch":
        """The same batch on device. Its alignment was checked when it was built and a copy keeps every value, so
        the copy is not checked again: on a GPU the check waits for the device (a host sync per micro-step, which
        drains the queue of the previous micro-step's backward before the next forward is launched)."""
        moved = copy.copy(self)  # copy.copy does not run __post_init__
        moved.inputs = self.inputs.to(device, non_blocking=True)
        moved.labels = self.labels.to(device, non_blocking=True)
        moved.loss_mask = None if self.loss_mask is None else self.loss_mask.to(device, non_blocking=True)
        moved.cu_seqlens = None if self.cu_seqlens is None else self.cu_seqlens.to(device, non_blocking=True)
        return moved
