"""Batches of next-token examples. Every Batch is checked when it is created: labels[:, :-1] == inputs[:, 1:]."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


class LabelShiftError(AssertionError):
    """Inputs and labels are not a one-token shift of one contiguous window."""


def check_next_token_alignment(inputs: Tensor, labels: Tensor) -> None:
    """Fail loudly unless labels[:, :-1] == inputs[:, 1:] (labels are the inputs shifted left by one)."""
    if inputs.shape != labels.shape or inputs.ndim != 2:
        raise LabelShiftError(f"inputs {tuple(inputs.shape)} and labels {tuple(labels.shape)} must both be [B, T]")
    if inputs.shape[1] >= 2 and not torch.equal(labels[:, :-1], inputs[:, 1:]):
        bad = (labels[:, :-1] != inputs[:, 1:]).nonzero()[0].tolist()
        raise LabelShiftError(
            f"label misalignment: labels[:, :-1] != inputs[:, 1:] (first mismatch at batch row {bad[0]}, "
            f"position {bad[1]}); next-token labels must be the same window shifted by one")


@dataclass
class Batch:
    inputs: Tensor  # [B, T] int64
    labels: Tensor  # [B, T] int64, labels[:, t] = token t+1 of the window
    loss_mask: Tensor | None = None  # [B, T] 0/1: positions whose loss counts (None = all)

    def __post_init__(self) -> None:
        check_next_token_alignment(self.inputs, self.labels)
        if self.loss_mask is not None and self.loss_mask.shape != self.inputs.shape:
            raise ValueError(f"loss_mask {tuple(self.loss_mask.shape)} must match inputs {tuple(self.inputs.shape)}")

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
        mask = None if self.loss_mask is None else self.loss_mask.to(device, non_blocking=True)
        return Batch(self.inputs.to(device, non_blocking=True), self.labels.to(device, non_blocking=True), mask)
