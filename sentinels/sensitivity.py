"""`python -m sentinels sensitivity`: how many random-label steps a planted leak needs before the sentinel trips.

For each seed, the random-label run of the profile (its probe model and geometry) trains with the plant for up to
--max-steps steps, evaluated every --every steps, without stopping at the trip; the report gives, per seed, the
first evaluation where the held-out loss over all positions, and where the worst position class, fell below
ln V - RANDOM_LABEL_MARGIN_NATS. `--plant none` measures clean runs the same way (false alarms: no trip
expected). The profile's random_label train.steps is chosen from these numbers with a margin (docs/sentinels.md).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

from . import thresholds
from .config import load_config
from .plants import PLANTS
from .profiles import get_profile
from .suite import SentinelRunner


def first_trip(evals: list[dict], key: str) -> int | None:
    margin = thresholds.RANDOM_LABEL_MARGIN_NATS
    return next((ev["step"] for ev in evals if ev[key] < -margin), None)


def measure(profile_name: str, plant_name: str, seeds: list[int], max_steps: int, every: int, *,
            log=print) -> dict:
    profile = get_profile(profile_name)
    profile = dataclasses.replace(profile, random_label={**profile.random_label, "train.steps": max_steps},
                                  random_label_eval_every=every, run_cap_s=1e9)
    plant = None if plant_name == "none" else PLANTS[plant_name]
    probe = load_config(profile.probe_config)
    rows = []
    for seed in seeds:
        with tempfile.TemporaryDirectory(prefix="sentinels-sensitivity-") as work:
            runner = SentinelRunner(profile, run_config=probe, probe_config=probe, work_dir=Path(work), corpus=None,
                                    budget_s=1e9, log=log, seed=seed)
            t0 = time.monotonic()
            result = runner.random_label(plant, planted=plant_name, trained_isolation=False, stop_on_trip=False)[0]
            wall = time.monotonic() - t0
        evals = result.metrics["evals"]
        row = {"seed": seed, "first_trip_all_positions": first_trip(evals, "gap"),
               "first_trip_position_class": first_trip(evals, "class_gap"),
               "final_gap": evals[-1]["gap"], "final_class_gap": evals[-1]["class_gap"],
               "final_class": evals[-1]["class"], "min_gap": min(ev["gap"] for ev in evals),
               "min_class_gap": min(ev["class_gap"] for ev in evals), "steps": result.metrics["steps"],
               "wall_s": wall, "s_per_step": wall / max(1, result.metrics["steps"]), "evals": evals}
        rows.append(row)
        log(f"[sensitivity] seed {seed}: first trip all positions {row['first_trip_all_positions']}, position "
            f"class {row['first_trip_position_class']}; min gap {row['min_gap']:+.4f}, min class gap "
            f"{row['min_class_gap']:+.4f}; {wall:.0f} s")
    return {"profile": profile.name, "plant": plant_name, "max_steps": max_steps, "every": every,
            "seq_len": profile.random_label.get("train.seq_len"), "margin_nats": thresholds.RANDOM_LABEL_MARGIN_NATS,
            "profile_steps": get_profile(profile_name).random_label.get("train.steps"), "seeds": rows}


def markdown(report: dict) -> str:
    lines = [f"# Random-label sensitivity: `{report['plant']}` on the {report['profile']} profile", "",
             f"Random-label runs at seq_len {report['seq_len']}, up to {report['max_steps']} steps, held-out loss "
             f"evaluated every {report['every']} steps; a trip is an evaluation more than {report['margin_nats']} "
             f"nats below ln V. The profile runs {report['profile_steps']} steps.", "",
             "| seed | first trip (all positions) | first trip (worst position class) | min gap | min class gap | "
             "s/step |", "|---|---|---|---|---|---|"]
    for r in report["seeds"]:
        lines.append(f"| {r['seed']} | {r['first_trip_all_positions'] or 'none'} | "
                     f"{r['first_trip_position_class'] or 'none'} | {r['min_gap']:+.4f} | {r['min_class_gap']:+.4f} "
                     f"| {r['s_per_step']:.3f} |")
    trips = [r["first_trip_position_class"] for r in report["seeds"]]
    if trips and all(t is not None for t in trips):
        lines += ["", f"Worst position class: trips after {min(trips)}-{max(trips)} steps "
                      f"(median {statistics.median(trips):g})."]
    return "\n".join(lines) + "\n"


def write(report: dict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"sensitivity-{report['profile']}-{report['plant']}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown(report))
    return stem.with_suffix(".md")
