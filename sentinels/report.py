"""Sentinel reports: the verdict table on the console, a JSON report, and one loss-curve PNG per sentinel."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

from . import thresholds
from .config import RunConfig
from .profiles import Profile
from .suite import SentinelResult
from .trainer import atomic_write_bytes, git_commit, versions


def print_table(results: list[SentinelResult], planted: list[SentinelResult], verdict: str) -> None:
    rows = [(r.name, r.verdict, r.summary) for r in results]
    rows += [(f"selftest: {r.planted}", "TRIPPED" if r.tripped else ("SKIP" if r.verdict == "SKIP" else "MISSED"),
              f"{r.name} -> {r.verdict}: {r.summary}") for r in planted]
    width = max(len(r[0]) for r in rows) if rows else 10
    print(f"{'sentinel':<{width}}  {'verdict':<8}  detail")
    print("-" * (width + 40))
    for name, v, detail in rows:
        print(f"{name:<{width}}  {v:<8}  {detail}")
    print("-" * (width + 40))
    print(f"{'OVERALL':<{width}}  {verdict}")


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def plot_result(result: SentinelResult, path: Path, *, extra_lines: dict[str, float]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    if not result.curves:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, values in result.curves.items():
        ax.plot(range(len(values)), [v if math.isfinite(v) else float("nan") for v in values], label=label,
                linewidth=1)
    for label, y in extra_lines.items():
        ax.axhline(y, linestyle="--", linewidth=0.8, color="gray")
        ax.text(0, y, f" {label}", va="bottom", fontsize=7, color="gray")
    title = result.name if result.planted is None else f"{result.name} (planted: {result.planted})"
    ax.set_title(f"{title}: {result.verdict}", fontsize=10)
    ax.set_xlabel("step")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def _reference_lines(result: SentinelResult) -> dict[str, float]:
    m = result.metrics
    if result.name == "random_label" and "ln_v" in m:
        return {"ln V": m["ln_v"], f"ln V - {thresholds.RANDOM_LABEL_MARGIN_NATS}":
                m["ln_v"] - thresholds.RANDOM_LABEL_MARGIN_NATS}
    if result.name == "long_range" and "chance" in m:
        return {"chance ln(n_values)": m["chance"], "full must reach": thresholds.LONG_RANGE_FULL_MAX_ANSWER_LOSS}
    name = result.name.removesuffix("_varlen")  # the real-text verdicts of the packed (varlen) run
    if name == "loss_floor":
        return {"loss floor": thresholds.LOSS_FLOOR_NATS}
    if name == "gate_collapse":
        return {"high": thresholds.GATE_COLLAPSE_HIGH, "low": thresholds.GATE_COLLAPSE_LOW}
    return {}


def write_report(out_root: Path, name: str, *, profile: Profile, run_config: RunConfig, run_config_path: Path,
                 probe_config: RunConfig, corpus: Path | None, results: list[SentinelResult],
                 planted: list[SentinelResult], verdict: str, started: float, selftest: bool,
                 plots: bool = True) -> Path:
    """The JSON report (and, with plots, one PNG per result). Called after every step with plots=False and
    verdict RUNNING, so a run killed mid-way still leaves what it measured."""
    out_root.mkdir(parents=True, exist_ok=True)
    plot_dir = out_root / name
    entries = []
    for r in results + planted:
        stem = r.name if r.planted is None else f"selftest-{_slug(r.planted)}-{r.name}"
        png = plot_dir / f"{stem}.png"
        plotted = plots and plot_result(r, png, extra_lines=_reference_lines(r))
        entry = r.as_dict()
        entry["tripped"] = r.tripped
        entry["plot"] = str(png.relative_to(out_root)) if plotted else None
        entry["curves"] = {k: [round(v, 6) if math.isfinite(v) else None for v in vals]
                           for k, vals in r.curves.items()}
        entries.append(entry)
    report = {
        "profile": profile.name,
        "device": name.split("-", 1)[1],
        "verdict": verdict,
        "selftest": selftest,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "wall_s": time.time() - started,
        "run_config": {"path": str(run_config_path), "hash": run_config.config_hash(), "name": run_config.name},
        "probe_config": {"hash": probe_config.config_hash(), "name": probe_config.name},
        "corpus": str(corpus) if corpus else None,
        "thresholds": {k: v for k, v in vars(thresholds).items() if k.isupper()},
        "git": git_commit(),
        "versions": versions(),
        "sentinels": [e for e in entries if e["planted"] is None],
        "planted": [e for e in entries if e["planted"] is not None],
    }
    path = out_root / f"{name}.json"
    atomic_write_bytes(path, json.dumps(report, indent=2, default=str).encode())
    return path
