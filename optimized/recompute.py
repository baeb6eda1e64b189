"""What an NSA call recomputed in backward (activation checkpointing) takes back from the forward it repeats.

Recomputing a layer's attention in backward (sentinels.model.DecoderBlock.recomputed_attention) runs its forward a
second time. On the kernel path the costliest part of that forward is the selection (Eq. 8-11: the group scores and
the top-n) and the selected branch (Eq. 12), and neither is needed again: the selection only feeds the selected
branch, and what the selected branch's backward needs beyond q, k and v (recomputed anyway) is its output and softmax
statistics. A ForwardTape keeps those of each NSA call of the forward and hands them back to the same call of the
recomputation, in order, so the recomputation runs only the cheap stages (projections, Eq. 7, the compressed and
window branches, Eq. 5). The values handed back are the forward's own, so the recomputation stays bitwise the
forward. The torch path and teacher-forced indices keep nothing.

    tape = ForwardTape()
    with tape.run() as replay:   # the forward (replay False): each NSA call keeps a KeptSelection
        ...
    with tape.run() as replay:   # the recomputation (replay True): each NSA call takes its KeptSelection back
        ...
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

from torch import Tensor


@dataclass
class KeptSelection:
    """One NSA call's selection and selected-branch results, filled by the forward (replay False) and read by the
    recomputation (replay True). indices: Eq. 11's [B, TQ, Hkv, n]; o, stats, lse2: SelectedAttentionFunction's
    output, softmax statistics and the leading full rows' LSE (None without such rows)."""

    replay: bool = False
    indices: Tensor | None = None
    o: Tensor | None = None
    stats: Tensor | None = None
    lse2: Tensor | None = None


class ForwardTape:
    """The KeptSelection of each NSA call of one forward, in call order. The first run() records them; every later
    run() (the recomputation; twice for a backward with retain_graph) hands them back from the first. They live as
    long as the tape, which a checkpointed function's closure holds until autograd frees its graph."""

    def __init__(self) -> None:
        self._kept: list[KeptSelection] = []
        self._recorded = False
        self._replaying = False
        self._next = 0

    @contextlib.contextmanager
    def run(self) -> Iterator[bool]:
        """The tape active for the NSA calls inside; yields whether they replay (False the first time)."""
        self._replaying, self._next = self._recorded, 0
        self._recorded = True
        token = FORWARD_TAPE.set(self)
        try:
            yield self._replaying
        finally:
            FORWARD_TAPE.reset(token)

    def kept_tensors(self) -> list[Tensor]:
        """The tensors the tape holds for the recomputation, in call order (what keeping the selection costs)."""
        return [t for kept in self._kept for t in (kept.indices, kept.o, kept.stats, kept.lse2) if t is not None]

    def next_call(self) -> KeptSelection:
        """The entry of the NSA call starting now: a new one while recording, the forward's while replaying."""
        if not self._replaying:
            self._kept.append(KeptSelection())
            return self._kept[-1]
        if self._next >= len(self._kept):
            raise RuntimeError(f"the recomputation makes more NSA calls than the {len(self._kept)} of the forward "
                               f"it repeats")
        kept = self._kept[self._next]
        self._next += 1
        kept.replay = True
        return kept


# The tape of the NSA calls running now, or None (forward.py reads it with ContextVar.get, no call into this file).
FORWARD_TAPE: contextvars.ContextVar[ForwardTape | None] = contextvars.ContextVar("nsa_forward_tape", default=None)
