"""Small device tensors built once and kept, for tables every layer of a model asks for again (RoPE's angles, the
per-layer statistics' offsets): a keyed store of the last few, that never keeps a tensor made while a CUDA graph is
being captured (such a tensor holds its values only once the graph replays; one kept from before the capture is
used as it is). Values are built outside inference mode, so a table first asked for under torch.inference_mode can
still be saved for backward by a later training step."""

from __future__ import annotations

import collections
from typing import Callable, Hashable, TypeVar

import torch

T = TypeVar("T")


def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on device's current stream: a tensor made now holds its values only
    once the graph replays, so nothing made now may be kept for later calls."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class DeviceTables:
    """kept(key, device, build): the value stored under key, else build() (stored unless capturing on device)."""

    def __init__(self, size: int = 32):
        self.size = size
        self._store: collections.OrderedDict = collections.OrderedDict()

    def kept(self, key: Hashable, device: torch.device, build: Callable[[], T]) -> T:
        if key in self._store:
            self._store.move_to_end(key)
            return self._store[key]
        with torch.inference_mode(False):  # a table made under inference_mode could not be saved for backward later
            value = build()
        if not capturing(device):
            self._store[key] = value
            while len(self._store) > self.size:
                self._store.popitem(last=False)
        return value

    def clear(self) -> None:
        self._store.clear()
