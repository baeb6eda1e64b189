"""Sentinel reports: the verdict table on the console, a JSON report with a markdown summary beside it, and one
PNG per sentinel that has curves (training loss, held-out loss, gate values or tokens/s against the step)."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

from . import thresholds
from .config import RunConfig
from .profiles import Profile
from .suite import NOT_APPLICABLE, SKIP, SentinelResult
from .trainer import atomic_write_bytes, versions

REPO_ROOT = Path(__file__).resolve().parent.parent


def planted_state(r: SentinelResult) -> str:
    """How a self-test row reads: the planted fault must trip its sentinel."""
    if r.tripped:
        return "tripped (expected)"
    if r.verdict == NOT_APPLICABLE:
        return "not applicable"
    if r.verdict == SKIP:
        return "SKIP"
    return "MISSED"


def print_table(results: list[SentinelResult], planted: list[SentinelResult], verdict: str) -> None:
    rows = [(r.name, r.verdict, r.summary) for r in results]
    rows += [(f"selftest: {r.planted}", planted_state(r), f"{r.name} -> {r.verdict}: {r.summary}") for r in planted]
    width = max(len(r[0]) for r in rows) if rows else 10
    state = max((len(r[1]) for r in rows), default=8)
    print(f"{'sentinel':<{width}}  {'verdict':<{state}}  detail")
    print("-" * (width + state + 40))
    for name, v, detail in rows:
        print(f"{name:<{width}}  {v:<{state}}  {detail}")
    print("-" * (width + state + 40))
    print(f"{'OVERALL':<{width}}  {verdict}")


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def result_figure(result: SentinelResult, *, extra_lines: dict[str, float]):
    """One figure: every curve against the training step (sparse curves, e.g. held-out evaluations, as markers),
    the reference lines dashed; the y axis names the unit; the legend sits outside the axes, covering nothing.
    None when matplotlib is missing or the result has no curve."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    if not result.curves:
        return None
    fig, ax = plt.subplots(figsize=(9, 4))
    for label, values in result.curves.items():
        points = [(i, v) for i, v in enumerate(values) if v is not None and math.isfinite(v)]
        if not points:
            continue
        xs, ys = zip(*points)
        sparse = len(points) < len(values) / 2
        ax.plot(xs, ys, label=label, linewidth=1, marker="o" if sparse else None, markersize=3)
    for label, y in extra_lines.items():  # chance levels gray, trip lines red
        ax.axhline(y, linestyle="--", linewidth=0.8, color="gray" if "chance" in label else "tab:red", label=label)
    title = result.name if result.planted is None else f"{result.name} (planted: {result.planted})"
    ax.set_title(f"{title}: {result.verdict}", fontsize=10)
    ax.set_xlabel(result.curve_x)
    ax.set_ylabel(result.curve_units)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    return fig


def plot_result(result: SentinelResult, path: Path, *, extra_lines: dict[str, float]) -> bool:
    fig = result_figure(result, extra_lines=extra_lines)
    if fig is None:
        return False
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def _reference_lines(result: SentinelResult) -> dict[str, float]:
    m = result.metrics
    if result.name == "random_label" and "ln_v" in m:
        margin = thresholds.RANDOM_LABEL_MARGIN_NATS
        return {"ln V (chance)": m["ln_v"], f"ln V - {margin} (trip)": m["ln_v"] - margin}
    if result.name == "long_range" and "chance" in m:
        return {"chance ln(n_values)": m["chance"], "full must reach": thresholds.LONG_RANGE_FULL_MAX_ANSWER_LOSS}
    name = result.name.removesuffix("_varlen")  # the real-text verdicts of the packed (varlen) run
    if name == "loss_floor":
        return {"loss floor": thresholds.LOSS_FLOOR_NATS}
    if name == "gate_collapse":
        return {"collapse above": thresholds.GATE_COLLAPSE_HIGH, "collapse below": thresholds.GATE_COLLAPSE_LOW}
    return {}


def _shown_path(path: Path | None) -> str | None:
    """A path as a reader of the report can use it: relative to the repository when inside it, else its name."""
    if path is None:
        return None
    resolved = Path(path).resolve()
    try:
        return str(resolved.relative_to(REPO_ROOT))
    except ValueError:
        return resolved.name


def markdown_summary(report: dict) -> str:
    """The JSON report as a page: verdicts, the self-test and the plots."""
    lines = [f"# Sentinels: {report['profile']} profile on {report['device']}", "",
             f"**Overall: {report['verdict']}** in {report['wall_s']:.0f} s. "
             f"Run config `{report['run_config']['path']}`"
             f" ({report['run_config']['name']}), probe model {report['probe_config']['name']}, seed "
             f"{report['seed'] if report['seed'] is not None else 'from the configs'}"
             + (f", only {', '.join(report['only'])}" if report.get("only") else "") + ".", "",
             "Thresholds: `sentinels/thresholds.py`; what each sentinel catches and why: `docs/sentinels.md`.", "",
             "| sentinel | verdict | result | threshold |", "|---|---|---|---|"]

    def cell(text: str) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    for s in report["sentinels"]:
        plot = f" ([plot]({s['plot']}))" if s.get("plot") else ""
        lines.append(f"| `{s['name']}` | {s['verdict']} | {cell(s['summary'])}{plot} | {cell(s['threshold'])} |")
    if report["planted"]:
        lines += ["", "## Self-test: planted faults", "",
                  "Each planted fault must trip the named sentinel; \"tripped (expected)\" is the pass state of a "
                  "row. Plants: `sentinels/plants.py` and the table in `docs/sentinels.md`.", "",
                  "| planted fault | must trip | result | detail |", "|---|---|---|---|"]
        for p in report["planted"]:
            plot = f" ([plot]({p['plot']}))" if p.get("plot") else ""
            lines.append(f"| {cell(p['planted'])} | `{p['name']}` | {p['state']} | {p['verdict']}: "
                         f"{cell(p['summary'])}{plot} |")
    env = report["versions"]
    lines += ["", "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items() if v) + "."]
    return "\n".join(lines) + "\n"


def write_report(out_root: Path, name: str, *, profile: Profile, run_config: RunConfig, run_config_path: Path,
                 probe_config: RunConfig, corpus: Path | None, results: list[SentinelResult],
                 planted: list[SentinelResult], verdict: str, started: float, selftest: bool,
                 plots: bool = True, seed: int | None = None, only: list[str] | None = None) -> Path:
    """The JSON report and its markdown summary (and, with plots, one PNG per result with curves). Called after
    every step with plots=False and verdict RUNNING, so a run killed mid-way still leaves what it measured."""
    out_root.mkdir(parents=True, exist_ok=True)
    plot_dir = out_root / name
    entries = []
    for r in results + planted:
        stem = r.name if r.planted is None else f"selftest-{_slug(r.planted)}-{r.name}"
        png = plot_dir / f"{stem}.png"
        plotted = plots and plot_result(r, png, extra_lines=_reference_lines(r))
        entry = r.as_dict()
        entry["tripped"] = r.tripped
        if r.planted is not None:
            entry["state"] = planted_state(r)
        entry["plot"] = str(png.relative_to(out_root)) if plotted else None
        entry["curves"] = {k: [round(v, 6) if v is not None and math.isfinite(v) else None for v in vals]
                           for k, vals in r.curves.items()}
        entries.append(entry)
    report = {
        "profile": profile.name,
        "device": name.split("-", 1)[1],
        "verdict": verdict,
        "selftest": selftest,
        "seed": seed,
        "only": only,
        "wall_s": time.time() - started,
        "run_config": {"path": _shown_path(run_config_path), "hash": run_config.config_hash(),
                       "name": run_config.name},
        "probe_config": {"path": _shown_path(profile.probe_config), "hash": probe_config.config_hash(),
                         "name": probe_config.name},
        "corpus": _shown_path(corpus),
        "thresholds": {k: v for k, v in vars(thresholds).items() if k.isupper()},
        "versions": versions(),
        "sentinels": [e for e in entries if e["planted"] is None],
        "planted": [e for e in entries if e["planted"] is not None],
    }
    path = out_root / f"{name}.json"
    atomic_write_bytes(path, json.dumps(report, indent=2, default=str).encode())
    atomic_write_bytes(out_root / f"{name}.md", markdown_summary(report).encode())
    return path
