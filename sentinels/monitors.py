"""Online monitors fed with each step's telemetry record; each returns the events it raises.

LossFloorMonitor, GateCollapseMonitor, Watchdog (per-step checks) and HeartbeatWatchdog (a thread that notices
when steps stop completing). Thresholds come from config.MonitorsConfig (defaults: sentinels/thresholds.py).
Each condition fires once per episode and re-arms when it clears.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from .config import GateCollapseConfig, LossFloorConfig, WatchdogConfig

BRANCHES = ("cmp", "slc", "win")


@dataclass
class Event:
    # loss_floor | gate_collapse | nonfinite | zero_grad | throughput_drop | fetch_slowdown | heartbeat_stall
    # | data_fallback
    kind: str
    step: int
    message: str
    halt: bool = False  # the run must stop (after a checkpoint)
    data: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class LossFloorMonitor:
    """A step loss below `threshold` before `before_step` on real text means a leak: halt."""

    def __init__(self, cfg: LossFloorConfig):
        self.cfg = cfg
        self.tripped = False

    def observe(self, record: dict) -> list[Event]:
        step, loss = record["step"], record["loss"]
        if self.tripped or step >= self.cfg.before_step or not math.isfinite(loss):
            return []
        if loss < self.cfg.threshold:
            self.tripped = True
            return [Event("loss_floor", step, f"loss {loss:.5f} < floor {self.cfg.threshold} at step {step} "
                          f"(before step {self.cfg.before_step}): labels are probably visible to the model",
                          halt=True, data={"loss": loss})]
        return []


class GateCollapseMonitor:
    """A layer's mean gate of one branch above `high` or below `low` for more than `steps` consecutive steps."""

    def __init__(self, cfg: GateCollapseConfig):
        self.cfg = cfg
        self.run_length: dict[tuple[int, str], int] = {}
        self.fired: set[tuple[int, str]] = set()

    def observe(self, record: dict) -> list[Event]:
        events = []
        for layer, means in enumerate(record["gate_mean_per_layer"]):
            for branch, mean in zip(BRANCHES, means):
                key = (layer, branch)
                if mean > self.cfg.high or mean < self.cfg.low:
                    self.run_length[key] = self.run_length.get(key, 0) + 1
                else:
                    self.run_length[key] = 0
                    self.fired.discard(key)
                if self.run_length[key] > self.cfg.steps and key not in self.fired:
                    self.fired.add(key)
                    side = "high" if mean > self.cfg.high else "low"
                    events.append(Event(
                        "gate_collapse", record["step"],
                        f"layer {layer} {branch} gate mean {mean:.4f} outside [{self.cfg.low}, {self.cfg.high}] "
                        f"for {self.run_length[key]} consecutive steps ({side})",
                        data={"layer": layer, "branch": branch, "mean": mean, "steps": self.run_length[key]}))
        return events


class Watchdog:
    """Non-finite loss/grad norm, zero grad norm, tokens/s drop, growing dt_fetch."""

    def __init__(self, cfg: WatchdogConfig):
        self.cfg = cfg
        self.seen = 0
        self.tps_history: list[float] = []
        self.fetch_baseline: list[float] = []
        self.recent_fetch: list[float] = []
        self.slow_steps = 0
        self.active: set[str] = set()

    def _episode(self, kind: str, condition: bool, make: Callable[[], Event]) -> list[Event]:
        if condition and kind not in self.active:
            self.active.add(kind)
            return [make()]
        if not condition:
            self.active.discard(kind)
        return []

    def observe(self, record: dict) -> list[Event]:
        step, loss, gnorm = record["step"], record["loss"], record["grad_norm"]
        events = []
        nonfinite = not (math.isfinite(loss) and math.isfinite(gnorm))
        events += self._episode("nonfinite", nonfinite, lambda: Event(
            "nonfinite", step, f"non-finite loss {loss} or grad norm {gnorm} at step {step} (update skipped)",
            data={"loss": loss, "grad_norm": gnorm}))
        events += self._episode("zero_grad", gnorm == 0.0, lambda: Event(
            "zero_grad", step, f"grad norm is exactly 0 at step {step}: no parameter receives gradient"))

        self.seen += 1
        if self.seen <= 2:  # the first steps include compilation / allocator warm-up
            return events
        tps, fetch = record["tokens_per_s"], record["dt_fetch_s"]
        n = self.cfg.baseline_steps
        if len(self.fetch_baseline) < n:
            self.fetch_baseline.append(fetch)
        self.recent_fetch = (self.recent_fetch + [fetch])[-self.cfg.throughput_drop_steps:]
        # tokens/s: baseline = median of the previous (up to) n steps that were not themselves slow
        if len(self.tps_history) >= n:
            baseline = statistics.median(self.tps_history[-n:])
            slow = tps < (1.0 - self.cfg.throughput_drop) * baseline
            self.slow_steps = self.slow_steps + 1 if slow else 0
            if not slow:
                self.tps_history.append(tps)
            events += self._episode("throughput_drop", self.slow_steps >= self.cfg.throughput_drop_steps,
                                    lambda: Event("throughput_drop", step,
                                                  f"tokens/s {tps:.0f} below {1 - self.cfg.throughput_drop:.0%} "
                                                  f"of the baseline {baseline:.0f} for {self.slow_steps} steps",
                                                  data={"tokens_per_s": tps, "baseline": baseline}))
        else:
            self.tps_history.append(tps)
        if len(self.fetch_baseline) >= n and len(self.recent_fetch) >= self.cfg.throughput_drop_steps:
            base = statistics.median(self.fetch_baseline)
            now = statistics.median(self.recent_fetch)
            grown = now > self.cfg.fetch_growth * base and now > self.cfg.fetch_floor_s
            events += self._episode("fetch_slowdown", grown, lambda: Event(
                "fetch_slowdown", step, f"dt_fetch median {now * 1e3:.2f} ms > {self.cfg.fetch_growth}x the "
                f"baseline {base * 1e3:.2f} ms: the data pipeline is slowing down",
                data={"dt_fetch_s": now, "baseline_s": base}))
        return events


class HeartbeatWatchdog:
    """A daemon thread: if no step completes for stall_s seconds, report one heartbeat_stall event."""

    def __init__(self, stall_s: float, report: Callable[[Event], None], poll_s: float | None = None):
        self.stall_s, self.report = stall_s, report
        self.poll_s = poll_s if poll_s is not None else min(5.0, stall_s / 4)
        self.last_beat = time.monotonic()
        self.step = 0
        self._stalled = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="heartbeat-watchdog", daemon=True)

    def start(self) -> "HeartbeatWatchdog":
        self._thread.start()
        return self

    def beat(self, step: int) -> None:
        self.last_beat, self.step, self._stalled = time.monotonic(), step, False

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            idle = time.monotonic() - self.last_beat
            if idle > self.stall_s and not self._stalled:
                self._stalled = True
                self.report(Event("heartbeat_stall", self.step,
                                  f"no step completed for {idle:.1f} s (> {self.stall_s} s) after step {self.step}",
                                  data={"idle_s": idle}))
