"""The verdict plugin: groups test outcomes per property, prints the PASS / FAIL / NOT COVERED table,
writes <stem>.json and .md to --report-dir, and compares deterministic metrics with the baseline.

A property is a test module under conformance/ with module attributes PROPERTY (its name) and
EQUATION (what of the paper it checks). Its verdict:
- FAIL: a test failed (an assertion of the suite, or an exception raised inside the implementation, counted
  apart), or a metric regressed against the baseline;
- PASS: every test ran and passed (tests skipped as not applicable, e.g. a GPU-only check on CPU, aside);
- PARTIAL: tests passed, but some were NOT COVERED (the implementation lacks a stage they need, or nothing inside
  its declared capabilities can exercise them; the reasons are listed);
- NOT COVERED: no test of the property could run;
- N/A: every test was skipped as not applicable here (e.g. GPU-only tests on CPU).

The baseline entry of a run also records each property's verdict and test counts: fewer tests run than recorded
(coverage lost) fails the run like a metric regression. With --expect-baseline-verdicts (a third-party report
card, whose FAILs are the library's known defects) the run passes exactly when every verdict and test count
equals the entry's, and fails on any difference.

Metrics are recorded by tests through the `record_metric` fixture, in three units: kind "tolerance" (a float64
error divided by its float64 tolerance), kind "ratio" (an error ratio: error against the float64 oracle divided
by 2 x the reference's own error in the low precision + 1e-6) - both pass at <= 1 and the worst of each per
property is reported in its own column - and kind "count" (exact integers such as counted reads). Baseline rule:
a worst tolerance or ratio that grows by more than 2x (both sides floored at RATIO_FLOOR, below which rounding
noise dominates) fails, and a count must equal its baseline.

The run's exit status: 1 on any FAIL (or a regression, or a --require'd property NOT COVERED), 5 when no test of
any property ran (everything NOT COVERED or N/A), 0 otherwise; 4 for a usage error (a bad --impl, --set, ...).
"""

from __future__ import annotations

import json
import math
import os
import platform
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from .adapters import NOT_COVERED, file_stem

PROPERTY_KEY = "nsa_property"
METRIC_KEY = "nsa_metric"
CONFIG_KEY = "nsa_config"
METRIC_KINDS = ("ratio", "tolerance", "count")
NOTHING_RAN = 5  # exit status when no test of any property ran (pytest's "no tests collected")
# What the report lists of the configs a property's tests ran on: NSAConfig field -> label.
OBSERVED = {"blocks": "l/d/l'", "forced": "n_init/n_local", "n_sel": "n", "window": "w", "group_size": "group",
            "n_kv_heads": "kv heads", "head_dims": "d_k/d_v", "phi": "phi"}
RATIO_GROWTH_LIMIT = 2.0
RATIO_FLOOR = 0.01
VERDICTS = ("PASS", "FAIL", "PARTIAL", "NOT COVERED", "N/A")


@dataclass
class PropertyResult:
    name: str
    equation: str
    module: str
    passed: int = 0
    failed: int = 0
    not_covered: int = 0
    not_applicable: int = 0
    implementation_errors: int = 0
    ratios: dict[str, float] = field(default_factory=dict)
    tolerances: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    not_covered_reasons: list[str] = field(default_factory=list)
    regressions: list[str] = field(default_factory=list)
    accepted_changes: list[str] = field(default_factory=list)  # differences from the baseline that
    #   --update-baseline accepted (written as the new entry): reported, not failed
    observed: dict[str, set] = field(default_factory=dict)

    @property
    def worst_ratio(self) -> float | None:
        return max(self.ratios.values()) if self.ratios else None

    @property
    def worst_tolerance(self) -> float | None:
        return max(self.tolerances.values()) if self.tolerances else None

    @property
    def ran(self) -> bool:
        return self.passed + self.failed > 0

    def envelope_checked(self) -> dict[str, list]:
        """Per NSAConfig aspect, the distinct values the property's tests ran on."""
        return {OBSERVED[k]: sorted(v, key=lambda x: (str(type(x)), x)) for k, v in self.observed.items()}

    @property
    def verdict(self) -> str:
        if self.failed or self.regressions:
            return "FAIL"
        if self.passed == 0:
            return "N/A" if self.not_covered == 0 and self.not_applicable else "NOT COVERED"
        return "PARTIAL" if self.not_covered else "PASS"

    def to_dict(self) -> dict[str, Any]:
        return {
            "property": self.name, "equation": self.equation, "module": self.module, "verdict": self.verdict,
            "tests": {"passed": self.passed, "failed": self.failed, "not_covered": self.not_covered,
                      "not_applicable": self.not_applicable, "implementation_errors": self.implementation_errors},
            "worst_float64_tolerance": self.worst_tolerance, "worst_error_ratio": self.worst_ratio,
            "tolerances": self.tolerances, "ratios": self.ratios, "counts": self.counts,
            "failures": self.failures, "not_covered_reasons": sorted(set(self.not_covered_reasons)),
            "baseline_regressions": self.regressions, "baseline_changes_accepted": self.accepted_changes,
            "envelope_checked": self.envelope_checked(),
        }


class MetricRecorder:
    """record_metric(name, value, kind="ratio"|"tolerance"|"count"): attach a metric to the running test."""

    current: "MetricRecorder | None" = None

    def __init__(self) -> None:
        self.item: pytest.Item | None = None
        MetricRecorder.current = self

    def __call__(self, name: str, value: float, kind: str = "ratio") -> None:
        if kind not in METRIC_KINDS:
            raise ValueError(f"record_metric kind must be one of {METRIC_KINDS}, got {kind!r}")
        if self.item is None:
            raise RuntimeError("record_metric called outside a running test")
        value = int(value) if kind == "count" else float(value)
        self.item.user_properties.append((METRIC_KEY, (name, kind, value)))


def observe_config(cfg) -> None:
    """Note that the running test exercised cfg (the report's per-property envelope checked)."""
    recorder = MetricRecorder.current
    if recorder is None or recorder.item is None:
        return
    seen = {"blocks": f"{cfg.cmp_block}/{cfg.cmp_stride}/{cfg.sel_block}", "forced": f"{cfg.n_init}/{cfg.n_local}",
            "n_sel": cfg.n_sel, "window": cfg.window, "group_size": cfg.group_size, "n_kv_heads": cfg.n_kv_heads,
            "head_dims": f"{cfg.head_dim_qk}/{cfg.head_dim_v}", "phi": cfg.phi}
    entry = (CONFIG_KEY, tuple(sorted(seen.items())))
    if entry not in recorder.item.user_properties:
        recorder.item.user_properties.append(entry)


class VerdictPlugin:
    def __init__(self, config: pytest.Config, run_info: dict[str, Any]) -> None:
        self.config = config
        self.run_info = run_info
        self.recorder = MetricRecorder()
        self.results: dict[str, PropertyResult] = {}
        self.baseline_note = ""
        self.exit_notes: list[str] = []
        self.written: list[Path] = []
        self.suite_dir = Path(__file__).parent.resolve()
        # property modules of which this run selected only some tests (-k, -m, module.py::test): their test counts
        # are not compared with the baseline's
        self.partial_modules: set[str] = {Path(a.split("::")[0]).resolve().as_posix()
                                          for a in config.args if "::" in a}

    def pytest_deselected(self, items: list[pytest.Item]) -> None:
        for item in items:
            self.partial_modules.add(Path(str(getattr(item, "path", ""))).resolve().as_posix())

    # Collection: tag each conformance item with its property --------------------------------------
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        if config.getoption("--properties-only"):
            kept = [item for item in items if self._is_property(item)]
            dropped = [item for item in items if not self._is_property(item)]
            if dropped:
                config.hook.pytest_deselected(items=dropped)
                items[:] = kept
        for item in items:
            module = getattr(item, "module", None)
            path = Path(str(getattr(item, "path", ""))).resolve()
            if module is None or self.suite_dir not in path.parents:
                continue
            rel = path.relative_to(self.suite_dir.parent).as_posix()
            name = getattr(module, "PROPERTY", None) or f"(no PROPERTY) {rel}"
            equation = getattr(module, "EQUATION", None) or "-"
            item.user_properties.append((PROPERTY_KEY, (name, equation, rel)))

    def _is_property(self, item: pytest.Item) -> bool:
        """A test of a conformance property module (declares PROPERTY; the self-test is not a property)."""
        path = Path(str(getattr(item, "path", ""))).resolve()
        module = getattr(item, "module", None)
        return (module is not None and self.suite_dir in path.parents and hasattr(module, "PROPERTY")
                and (self.suite_dir / "selftest") not in path.parents)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item: pytest.Item):
        self.recorder.item = item
        try:
            yield
        finally:
            self.recorder.item = None

    # Outcomes -----------------------------------------------------------------------------------
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        props = dict(report.user_properties)
        if PROPERTY_KEY not in props:
            return
        name, equation, module = props[PROPERTY_KEY]
        res = self.results.setdefault(name, PropertyResult(name, equation, module))
        if report.failed:
            res.failed += 1
            message = _failure_message(report)
            if message.startswith("conformance.adapters.ImplementationError"):
                res.implementation_errors += 1
            res.failures.append(f"{report.nodeid} ({report.when}): {message}")
        elif report.skipped and report.when in ("setup", "call"):
            reason = _skip_reason(report)
            if reason.startswith(NOT_COVERED):
                res.not_covered += 1
                res.not_covered_reasons.append(reason[len(NOT_COVERED):].lstrip(": "))
            else:
                res.not_applicable += 1
        elif report.passed and report.when == "call":
            res.passed += 1
        if report.when == "call":
            for key, value in report.user_properties:
                if key == CONFIG_KEY:
                    for aspect, seen in value:
                        res.observed.setdefault(aspect, set()).add(seen)
                if key != METRIC_KEY:
                    continue
                metric, kind, number = value
                if kind == "count":
                    res.counts[metric] = number
                else:
                    worst = res.ratios if kind == "ratio" else res.tolerances
                    worst[metric] = max(worst.get(metric, -math.inf), number)

    # Verdict, baseline, reports -------------------------------------------------------------------
    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if hasattr(self.config, "workerinput") or not self.results:
            return
        self._compare_with_baseline()
        if self.config.getoption("--update-baseline"):  # the differences become the new baseline: accepted
            for res in self.results.values():
                res.accepted_changes, res.regressions = res.regressions, []
            self._write_baseline()
        expected = self.config.getoption("--expect-baseline-verdicts") and not self.config.getoption(
            "--update-baseline")
        differences = self._verdict_differences() if expected else []
        report_dir = self.config.getoption("--report-dir")
        if report_dir:
            self._write_reports(Path(report_dir))
        if session.exitstatus not in (0, pytest.ExitCode.TESTS_FAILED, NOTHING_RAN):
            return  # interrupted, internal or usage error: keep pytest's status
        properties = [r for r in self.results.values() if not r.module.startswith("conformance/selftest")]
        missing = self._required_not_covered(properties)
        if missing:
            self.exit_notes.append(f"required propert{'y' if len(missing) == 1 else 'ies'} NOT COVERED: "
                                   f"{', '.join(missing)} (exit 1)")
        if expected:
            self.exit_notes += [f"differs from the baseline card: {d}" for d in differences]
            ok = not differences and not any(r.regressions for r in self.results.values()) and not missing
            if ok:
                self.exit_notes.append("every verdict and test count equals the baseline card's (exit 0)")
            session.exitstatus = pytest.ExitCode.OK if ok else pytest.ExitCode.TESTS_FAILED
            return
        if any(r.regressions for r in self.results.values()) or missing:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        elif properties and not any(r.ran for r in properties) and session.exitstatus == 0:
            self.exit_notes.append(f"no test of any property ran: nothing was checked (exit {NOTHING_RAN})")
            session.exitstatus = NOTHING_RAN

    def _verdict_differences(self) -> list[str]:
        """Where this run's verdicts and test counts differ from the baseline entry's (all of them if none)."""
        entry = self._load_baseline().get(self._baseline_key())
        if entry is None:
            return [f"no entry {self._baseline_key()!r} in {self._baseline_path()}"]
        out = []
        for r in self._ordered():
            if r.module.startswith("conformance/selftest"):
                continue
            old = entry.get(r.name, {})
            now = {"verdict": r.verdict, "tests": _test_counts(r)}
            for key in ("verdict", "tests"):
                if old.get(key) != now[key]:
                    out.append(f"{r.name}: {key} {now[key]} (baseline {old.get(key)})")
        return out

    def _required_not_covered(self, properties: list[PropertyResult]) -> list[str]:
        wanted = [w.strip() for option in self.config.getoption("--require") for w in option.split(",") if w.strip()]
        require_all = self.config.getoption("--require-all")
        out = []
        for r in properties:
            ids = {r.name.lower(), Path(r.module).stem.removeprefix("test_").lower()}
            if (require_all or ids & {w.lower() for w in wanted}) and r.verdict == "NOT COVERED":
                out.append(r.name)
        return sorted(out)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if hasattr(self.config, "workerinput") or not self.results:
            return
        tr = terminalreporter
        tr.write_sep("=", "NSA conformance verdict")
        tr.write_line(self._header())
        for line in self._table_lines():
            tr.write_line(line)
        for res in self._ordered():
            for failure in res.failures[:3]:
                tr.write_line(f"  FAIL {res.name}: {failure}")
            if res.verdict in ("NOT COVERED", "PARTIAL"):
                for reason in sorted(set(res.not_covered_reasons))[:3]:
                    tr.write_line(f"  NOT COVERED {res.name}: {reason}")
            for regression in res.regressions:
                tr.write_line(f"  BASELINE {res.name}: {regression}")
            for change in res.accepted_changes:
                tr.write_line(f"  BASELINE {res.name} (accepted by --update-baseline): {change}")
        if self.baseline_note:
            tr.write_line(self.baseline_note)
        for note in self.exit_notes:
            tr.write_line(note)
        for path in self.written:
            tr.write_line(f"wrote {path}")

    # Helpers ------------------------------------------------------------------------------------
    def _ordered(self) -> list[PropertyResult]:
        return sorted(self.results.values(), key=lambda r: (r.module.startswith("conformance/selftest"), r.module))

    def _header(self) -> str:
        i = self.run_info
        return (f"impl={i['impl']}  device={i['device']}  dtype={i['dtype']}  preset={i['preset']}  "
                f"hypothesis profile={i['hypothesis_profile']}\n"
                f"conventions: {_conventions_line(i['conventions'])}\nprecision: {i['precision']}")

    def _table_lines(self) -> list[str]:
        rows = [TABLE_COLUMNS]
        for r in self._ordered():
            rows.append(_row(r.to_dict()))
        widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return lines

    def _baseline_key(self) -> str:
        i = self.run_info
        return "|".join((i["impl"], i["device"], i["dtype"], i["preset"] + _changes_suffix(i["conventions"]),
                         i["hypothesis_profile"]))

    def _baseline_path(self) -> Path:
        return Path(self.config.getoption("--baseline"))

    def _load_baseline(self) -> dict[str, Any]:
        path = self._baseline_path()
        if not path.exists():
            return {}
        with path.open() as f:
            return json.load(f)

    def _compare_with_baseline(self) -> None:
        entry = self._load_baseline().get(self._baseline_key())
        if entry is None:
            self.baseline_note = (f"baseline: no entry {self._baseline_key()!r} in {self._baseline_path()} "
                                  "(not compared)")
            return
        self.baseline_note = f"baseline: compared with {self._baseline_key()!r} in {self._baseline_path()}"
        for res in self.results.values():
            old = entry.get(res.name, {})
            ran, before = res.passed + res.failed, old.get("tests", {})
            partial = (self.suite_dir.parent / res.module).resolve().as_posix() in self.partial_modules
            if before and not partial and ran < before.get("passed", 0) + before.get("failed", 0):
                res.regressions.append(f"coverage lost: {ran} tests ran, the baseline ran "
                                       f"{before.get('passed', 0) + before.get('failed', 0)}")
            for unit, values in (("ratios", res.ratios), ("tolerances", res.tolerances)):
                for metric, value in values.items():
                    before = old.get(unit, {}).get(metric)
                    if before is None:
                        continue
                    if max(value, RATIO_FLOOR) > RATIO_GROWTH_LIMIT * max(before, RATIO_FLOOR):
                        res.regressions.append(f"{metric} ({unit[:-1]}) grew from {before:.3g} to {value:.3g} "
                                               f"(> {RATIO_GROWTH_LIMIT}x)")
            for metric, value in res.counts.items():
                before = old.get("counts", {}).get(metric)
                if before is not None and before != value:
                    res.regressions.append(f"{metric} changed from {before} to {value}")

    def _write_baseline(self) -> None:
        path = self._baseline_path()
        data = self._load_baseline()
        data[self._baseline_key()] = {
            r.name: {"verdict": r.verdict, "tests": _test_counts(r),
                     "ratios": {k: _round(v) for k, v in sorted(r.ratios.items())},
                     "tolerances": {k: _round(v) for k, v in sorted(r.tolerances.items())},
                     "counts": dict(sorted(r.counts.items()))}
            for r in self._ordered() if not r.module.startswith("conformance/selftest")
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dict(sorted(data.items())), indent=2) + "\n")
        self.written.append(path)

    def _write_reports(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        i = self.run_info
        stem = file_stem(i["impl"]) + f"-{i['device']}"
        if i["dtype"] != "float32":
            stem += f"-{i['dtype']}"
        if i["preset"] != "paper":
            stem += f"-{i['preset']}"
        stem += _changes_suffix(i["conventions"], "-")
        stem = self.config.getoption("--report-name") or stem
        # The self-test checks the suite, not --impl: it is in the printed table but not in the impl's report.
        results = [r.to_dict() for r in self._ordered() if not r.module.startswith("conformance/selftest")]
        if not results:
            return
        summary = {v: sum(r["verdict"] == v for r in results) for v in VERDICTS}
        payload = {**i, "baseline": self.baseline_note, "exit_notes": self.exit_notes, "summary": summary,
                   "properties": results}
        json_path, md_path = directory / f"{stem}.json", directory / f"{stem}.md"
        json_path.write_text(json.dumps(payload, indent=2) + "\n")
        md_path.write_text(self._markdown(payload))
        self.written += [json_path, md_path]

    def _markdown(self, payload: dict[str, Any]) -> str:
        caps = payload["capabilities"]
        lines = [f"# NSA conformance: {payload['impl']} on {payload['device']} ({payload['dtype']})", "",
                 f"- implementation: `{payload['impl_spec']}`",
                 f"- conventions checked: {_conventions_line(payload['conventions'])} "
                 f"(`{payload['conventions']['source']}`)",
                 f"- precision: {payload['precision']}",
                 f"- declared capabilities: `{json.dumps(_declared(caps))}`",
                 f"- sizes the strategies prefer: `{json.dumps(payload['strategy_sizes'])}`",
                 f"- hypothesis profile: `{payload['hypothesis_profile']}`; torch {payload['torch']}; "
                 f"python {payload['python']}",
                 f"- {payload['baseline']}", *[f"- {n}" for n in payload.get("exit_notes", [])], "",
                 "| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
        for r in payload["properties"]:
            lines.append("| " + " | ".join(_row(r)) + " |")
        lines += ["", "float64 err/tol: the worst float64 error divided by its tolerance; error ratio: the worst error "
                  "against the float64 oracle divided by 2 x the reference's own error in the lower precision + "
                  "1e-6 (both pass at <= 1). tests: pass/fail/not covered/n.a. (failures raised inside the "
                  "implementation in brackets)."]
        details = [r for r in payload["properties"] if r["failures"] or r["not_covered_reasons"]
                   or r["baseline_regressions"] or r.get("baseline_changes_accepted") or r["counts"]
                   or r["envelope_checked"]]
        if details:
            lines += ["", "## Details", ""]
        for r in details:
            lines.append(f"### {r['property']}")
            lines += [f"- FAIL: `{f}`" for f in r["failures"]]
            lines += [f"- baseline: {g}" for g in r["baseline_regressions"]]
            lines += [f"- baseline change accepted by --update-baseline: {g}"
                      for g in r.get("baseline_changes_accepted", [])]
            lines += [f"- NOT COVERED: {n}" for n in r["not_covered_reasons"]]
            lines += [f"- {k} = {v}" for k, v in r["counts"].items()]
            if r["envelope_checked"]:
                lines.append("- envelope checked: " + "; ".join(
                    f"{k} {', '.join(map(str, v))}" for k, v in r["envelope_checked"].items()))
            lines.append("")
        return "\n".join(lines).rstrip() + "\n"


TABLE_COLUMNS = ("Property", "Equation", "Verdict", "tests", "float64 err/tol", "error ratio")


def _row(r: dict[str, Any]) -> tuple[str, ...]:
    t = r["tests"]
    tests = f"{t['passed']}/{t['failed']}/{t['not_covered']}/{t['not_applicable']}"
    if t.get("implementation_errors"):
        tests += f" ({t['implementation_errors']} raised)"

    def worst(x):
        return "-" if x is None else f"{x:.3g}"

    return (r["property"], r["equation"], r["verdict"], tests, worst(r["worst_float64_tolerance"]),
            worst(r["worst_error_ratio"]))


def _conventions_line(c: dict[str, Any]) -> str:
    return (f"preset {c['preset']}" + "".join(f", {k}={v}" for k, v in c["changes"].items()) + " -> "
            + ", ".join(f"{k}={c[k]}" for k in ("phi", "window_keys", "cmp_visibility", "selection_score",
                                                  "group_reduce")))


def _changes_suffix(c: dict[str, Any], sep: str = "+") -> str:
    return "".join(f"{sep}{k}={v}" for k, v in sorted(c["changes"].items())).replace("=", "_" if sep == "-" else "=")


def _declared(caps: dict[str, Any]) -> dict[str, Any]:
    """The capabilities that differ from "everything" (the defaults)."""
    from .adapters.capabilities import EVERYTHING

    everything = EVERYTHING.describe()
    return {k: v for k, v in caps.items() if v != everything[k]}


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        reason = str(longrepr[2])
    else:
        reason = str(longrepr)
    return reason[len("Skipped: "):] if reason.startswith("Skipped: ") else reason


def _failure_message(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else report.longreprtext
    first = text.strip().splitlines()[0] if text.strip() else "failed"
    if first.startswith("ExceptionGroup"):  # hypothesis found several distinct failures: name each
        found = []
        for line in report.longreprtext.splitlines():
            line = line.strip().lstrip("|").strip()
            if line.startswith(("AssertionError:", "conformance.adapters.ImplementationError:")) and line not in found:
                found.append(line)
        if found:
            first = f"{len(found)} distinct failures: " + " / ".join(found)
    return first if len(first) <= 300 else first[:297] + "..."


def _test_counts(r: PropertyResult) -> dict[str, int]:
    return {"passed": r.passed, "failed": r.failed, "not_covered": r.not_covered}


def _round(x: float) -> float:
    return float(f"{x:.4g}")


def run_info(config: pytest.Config, impl, envelope, conventions, precision) -> dict[str, Any]:
    import torch

    from conformance.strategies import current_sizes

    return {
        "impl": impl.name,
        "impl_spec": config.getoption("--impl"),
        "device": torch.device(config.getoption("--device")).type,
        "dtype": config.getoption("--dtype"),
        "preset": conventions.preset,
        "conventions": conventions.describe(),
        "capabilities": envelope.caps.describe(),
        "precision": precision.describe(),
        "stages": sorted(impl.stages),
        "strategy_sizes": dataclasses.asdict(current_sizes()),
        "hypothesis_profile": os.environ.get("HYPOTHESIS_PROFILE", "ci"),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
