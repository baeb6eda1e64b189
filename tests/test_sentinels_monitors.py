"""Monitors on synthetic telemetry: each fires at its documented boundary and not before."""

from __future__ import annotations

import time

from sentinels.config import GateCollapseConfig, LossFloorConfig, WatchdogConfig
from sentinels.monitors import GateCollapseMonitor, HeartbeatWatchdog, LossFloorMonitor, Watchdog


def rec(step, loss=3.0, grad_norm=1.0, tokens_per_s=1000.0, dt_fetch_s=0.001, gates=((0.5, 0.5, 0.5),)):
    return {"step": step, "loss": loss, "grad_norm": grad_norm, "tokens_per_s": tokens_per_s,
            "dt_fetch_s": dt_fetch_s, "gate_mean_per_layer": [list(g) for g in gates]}


def test_loss_floor_trips_below_threshold_before_the_step_limit_only():
    m = LossFloorMonitor(LossFloorConfig(threshold=0.02, before_step=1000))
    assert m.observe(rec(0, loss=0.021)) == []
    events = m.observe(rec(1, loss=0.019))
    assert [e.kind for e in events] == ["loss_floor"] and events[0].halt
    assert m.observe(rec(2, loss=0.001)) == []  # once
    late = LossFloorMonitor(LossFloorConfig(threshold=0.02, before_step=1000))
    assert late.observe(rec(1000, loss=0.001)) == []


def test_gate_collapse_needs_more_than_n_consecutive_steps():
    m = GateCollapseMonitor(GateCollapseConfig(high=0.98, low=0.02, steps=100))
    collapsed = ((0.5, 0.99, 0.5), (0.5, 0.5, 0.01))
    for step in range(100):
        assert m.observe(rec(step, gates=collapsed)) == []
    events = m.observe(rec(100, gates=collapsed))
    assert sorted((e.data["layer"], e.data["branch"]) for e in events) == [(0, "slc"), (1, "win")]
    assert m.observe(rec(101, gates=collapsed)) == []  # once per episode


def test_gate_collapse_run_resets_when_the_gate_recovers():
    m = GateCollapseMonitor(GateCollapseConfig(high=0.98, low=0.02, steps=3))
    seq = [0.99, 0.99, 0.99, 0.5, 0.99, 0.99, 0.99]
    assert all(m.observe(rec(i, gates=((g, 0.5, 0.5),))) == [] for i, g in enumerate(seq))
    assert [e.kind for e in m.observe(rec(7, gates=((0.99, 0.5, 0.5),)))] == ["gate_collapse"]
    # boundaries are exclusive: exactly 0.98 / 0.02 is not collapsed
    edge = GateCollapseMonitor(GateCollapseConfig(high=0.98, low=0.02, steps=1))
    assert all(edge.observe(rec(i, gates=((0.98, 0.02, 0.5),))) == [] for i in range(5))


def _feed(w, records):
    events = []
    for r in records:
        events += w.observe(r)
    return events


def test_watchdog_nonfinite_and_zero_grad():
    w = Watchdog(WatchdogConfig())
    events = _feed(w, [rec(0, loss=float("nan")), rec(1, grad_norm=float("inf")), rec(2), rec(3, grad_norm=0.0)])
    assert [e.kind for e in events] == ["nonfinite", "zero_grad"]
    assert events[0].step == 0  # the inf at step 1 continues the same episode
    again = _feed(w, [rec(4), rec(5, loss=float("nan"))])
    assert [e.kind for e in again] == ["nonfinite"]


def _throughput(values, drop_steps=5):
    w = Watchdog(WatchdogConfig(throughput_drop=0.4, throughput_drop_steps=drop_steps, baseline_steps=10))
    return _feed(w, [rec(i, tokens_per_s=v) for i, v in enumerate(values)])


def test_watchdog_throughput_drop_needs_five_consecutive_slow_steps():
    warm = [10.0, 10.0] + [1000.0] * 10
    assert _throughput(warm + [590.0] * 4 + [1000.0] + [590.0] * 4) == []
    events = _throughput(warm + [590.0] * 5)
    assert [e.kind for e in events] == ["throughput_drop"]
    assert _throughput(warm + [610.0] * 20) == []  # a 39% drop is tolerated


def test_watchdog_fetch_growth():
    cfg = WatchdogConfig(fetch_growth=2.0, fetch_floor_s=0.002, throughput_drop_steps=5, baseline_steps=10)
    base = [rec(i, dt_fetch_s=0.004) for i in range(12)]
    grown = [rec(12 + i, dt_fetch_s=0.0085) for i in range(5)]
    events = _feed(Watchdog(cfg), base + grown)
    assert [e.kind for e in events] == ["fetch_slowdown"]
    same = [rec(12 + i, dt_fetch_s=0.0079) for i in range(5)]
    assert _feed(Watchdog(cfg), base + same) == []
    tiny = [rec(i, dt_fetch_s=0.0001) for i in range(12)] + [rec(12 + i, dt_fetch_s=0.0009) for i in range(5)]
    assert _feed(Watchdog(cfg), tiny) == []  # 9x growth, but below the absolute floor


def test_heartbeat_watchdog_reports_a_stall_once():
    events = []
    hb = HeartbeatWatchdog(stall_s=0.05, report=events.append, poll_s=0.01).start()
    try:
        hb.beat(3)
        deadline = time.monotonic() + 2.0
        while not events and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
    finally:
        hb.stop()
    assert [e.kind for e in events] == ["heartbeat_stall"] and events[0].step == 3


def test_heartbeat_watchdog_quiet_while_beating():
    events = []
    hb = HeartbeatWatchdog(stall_s=0.2, report=events.append, poll_s=0.01).start()
    try:
        for step in range(15):
            hb.beat(step)
            time.sleep(0.01)
    finally:
        hb.stop()
    assert events == []
