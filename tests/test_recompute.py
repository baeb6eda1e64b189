"""optimized.recompute.ForwardTape: the recomputation of a forward gets each NSA call's kept selection back, in call
order, as many times as it runs; outside a tape nothing is kept."""

from __future__ import annotations

import pytest
import torch

from optimized.recompute import FORWARD_TAPE, ForwardTape


def test_replays_hand_back_the_recorded_entries_in_call_order():
    tape = ForwardTape()
    assert FORWARD_TAPE.get() is None
    with tape.run() as replay:
        assert not replay and FORWARD_TAPE.get() is tape
        first, second = tape.next_call(), tape.next_call()
        assert not first.replay and first is not second
        first.indices, second.indices = torch.zeros(1), torch.ones(1)
    assert FORWARD_TAPE.get() is None
    for _ in range(2):  # a backward with retain_graph runs the recomputation twice
        with tape.run() as replay:
            assert replay
            a, b = tape.next_call(), tape.next_call()
            assert a is first and b is second and a.replay and b.replay
            with pytest.raises(RuntimeError, match="more NSA calls than the 2 of the forward"):
                tape.next_call()


def test_tapes_nest_and_restore_the_outer_one():
    outer, inner = ForwardTape(), ForwardTape()
    with outer.run():
        with inner.run():
            assert FORWARD_TAPE.get() is inner
        assert FORWARD_TAPE.get() is outer
