"""Regression gate: compare a sweep's medians with reports/baselines/perf-<gpu-slug>.json.

Threshold rule (per case): a case regresses when

    current median > baseline median * (1 + threshold),  threshold = max(floor, factor * spread)

where spread is the larger of the baseline's and the current sweep's run-to-run spread of that case (each
case is timed in `rounds` independent rounds; spread = (max - min) / min of the round medians), floor =
BenchSpec.regression_floor (10%) and factor = BenchSpec.spread_factor (3). The floor keeps the gate from
tripping on variation that rounds inside one process cannot see (clock and thermal state between runs,
another process on the GPU); the factor widens it for cases measured to be noisier than that (short kernels
dominated by launch gaps). A case that ran ok in the baseline and now fails (OOM, error) also regresses; a
case skipped now (time budget) is reported as not compared, never as passing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .results import OK, SKIPPED, Row


@dataclass
class Comparison:
    key: str
    baseline_ms: float | None
    current_ms: float | None
    threshold: float | None
    verdict: str  # "ok", "regression", "improved", "not compared", "new"
    detail: str = ""

    @property
    def ratio(self) -> float | None:
        if self.baseline_ms and self.current_ms:
            return self.current_ms / self.baseline_ms
        return None


def baseline_path(directory: Path, device_slug: str, spec_name: str) -> Path:
    suffix = "" if spec_name == "paper" else f"-{spec_name}"
    return Path(directory) / f"perf-{device_slug}{suffix}.json"


def write_baseline(path: Path, rows: list[Row], meta: dict[str, Any]) -> None:
    cases = {r.key: {"status": r.status, "median_ms": r.median_ms, "spread": r.spread, "n_runs": r.n_runs}
             for r in rows if r.status != SKIPPED}
    data = {"device": meta["env"]["device"], "shape_key": meta["shape_key"], "env": meta["env"],
            "ceilings": meta.get("ceilings"), "cases": cases}
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        json.dump(data, fh, indent=1, sort_keys=True, default=str)


def load_baseline(path: Path) -> dict[str, Any]:
    if not Path(path).exists():
        raise FileNotFoundError(f"no baseline {path}: run once with --update-baseline on this device to write it")
    with open(path) as fh:
        return json.load(fh)


def compare(rows: list[Row], baseline: dict[str, Any], shape_key: dict[str, Any], floor: float,
            factor: float) -> list[Comparison]:
    if baseline.get("shape_key") != shape_key:
        raise ValueError(f"baseline was measured with different shapes/config: {baseline.get('shape_key')} "
                         f"!= {shape_key}; timings are not comparable (write a new one with --update-baseline)")
    current = {r.key: r for r in rows}
    out = []
    for key, base in sorted(baseline["cases"].items()):
        row = current.get(key)
        base_ok = base["status"] == OK
        if row is None or row.status == SKIPPED:
            why = "not measured in this sweep" if row is None else f"skipped: {row.note}"
            out.append(Comparison(key, base.get("median_ms"), None, None, "not compared", why))
            continue
        if row.status != OK:
            verdict = "regression" if base_ok else "ok"
            out.append(Comparison(key, base.get("median_ms"), None, None, verdict,
                                  f"now {row.status} (baseline {base['status']}): {row.note}"))
            continue
        if not base_ok:
            out.append(Comparison(key, None, row.median_ms, None, "improved", f"baseline was {base['status']}"))
            continue
        spreads = [s for s in (base.get("spread"), row.spread) if s is not None]
        threshold = max([floor] + [factor * s for s in spreads])
        limit = base["median_ms"] * (1 + threshold)
        if row.median_ms > limit:
            verdict = "regression"
        elif row.median_ms < base["median_ms"] / (1 + threshold):
            verdict = "improved"
        else:
            verdict = "ok"
        out.append(Comparison(key, base["median_ms"], row.median_ms, threshold, verdict))
    for key, row in sorted(current.items()):
        if key not in baseline["cases"] and row.status != SKIPPED:
            out.append(Comparison(key, None, row.median_ms, None, "new", row.status))
    return out


def format_comparison(comparisons: list[Comparison]) -> str:
    lines = [f"{'case':58s} {'baseline ms':>12s} {'now ms':>10s} {'ratio':>6s} {'thresh':>7s}  verdict"]
    for c in comparisons:
        base = f"{c.baseline_ms:.3f}" if c.baseline_ms is not None else "-"
        now = f"{c.current_ms:.3f}" if c.current_ms is not None else "-"
        ratio = f"{c.ratio:.3f}" if c.ratio is not None else "-"
        thresh = f"{100 * c.threshold:.0f}%" if c.threshold is not None else "-"
        lines.append(f"{c.key:58s} {base:>12s} {now:>10s} {ratio:>6s} {thresh:>7s}  {c.verdict}"
                     + (f" ({c.detail})" if c.detail else ""))
    regressions = sum(c.verdict == "regression" for c in comparisons)
    lines.append(f"{regressions} regression(s), {sum(c.verdict == 'improved' for c in comparisons)} improved, "
                 f"{sum(c.verdict == 'not compared' for c in comparisons)} not compared")
    return "\n".join(lines)
