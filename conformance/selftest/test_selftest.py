"""Self-test of the conformance suite: it must catch known bugs, and pass the implementation they break.

Each variant in conformance/selftest/variants plants one bug into `optimized`. The suite runs on it in a fresh
subprocess (`pytest -x` on the property modules the catalog names, stopping at the first failure) and must
report at least one property FAIL caused by an assertion (a crash does not count as caught). The control:
the unbroken `optimized` passes those property modules, with its metrics compared to the committed baseline
(reports/baselines/conformance.json).

With --report-dir, the table of variants (what was caught, by which test) is written there as selftest.json
and selftest.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.selftest.variants import CATALOG

PROPERTY = "Self-test: known bugs are caught"
EQUATION = "suite"

ROOT = Path(__file__).resolve().parents[2]
RESULTS: dict[str, dict] = {}


def run_suite(impl_spec: str, paths: list[str], report_dir: Path, *, stop_at_first_failure: bool,
              baseline: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning",
           *(["-x", "-p", "conformance.selftest.no_shrink"] if stop_at_first_failure else []), *paths,
           f"--impl={impl_spec}", f"--report-dir={report_dir}",
           f"--baseline={baseline}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # tiny tensors: threads only contend with each other
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    reports = sorted(report_dir.glob("*.json"))
    return proc, (json.loads(reports[0].read_text()) if reports else None)


def tail(proc: subprocess.CompletedProcess, lines: int = 40) -> str:
    return "\n".join((proc.stdout + proc.stderr).splitlines()[-lines:])


@pytest.mark.parametrize("variant", sorted(CATALOG))
def test_broken_variant_is_caught(variant, tmp_path):
    modules = list(CATALOG[variant])
    proc, report = run_suite(f"conformance.selftest.variants.{variant}:IMPL", modules, tmp_path,
                             stop_at_first_failure=True, baseline=str(tmp_path / "no-baseline.json"))
    assert report is not None, f"no report from the suite on {variant} (exit {proc.returncode}):\n{tail(proc)}"
    failed = [p for p in report["properties"] if p["verdict"] == "FAIL"]
    caught = [(p["property"], f) for p in failed for f in p["failures"] if ": AssertionError" in f]
    RESULTS[variant] = {"modules": modules, "exit": proc.returncode,
                        "caught_by": caught[0][0] if caught else None,
                        "failure": caught[0][1] if caught else None}
    assert proc.returncode == 1 and caught, (
        f"broken variant {variant!r} was NOT caught by {modules} (exit {proc.returncode}; failures "
        f"{[f for p in failed for f in p['failures']]}):\n{tail(proc)}")


def test_unbroken_optimized_passes_the_catching_properties(tmp_path):
    """Control: the property modules that catch the variants all PASS on the unbroken optimized (otherwise a
    variant's FAIL would prove nothing), with metrics within the committed baseline. The full verdict of
    optimized is `nox -s conformance`'s job."""
    modules = sorted({m.split("::")[0] for ms in CATALOG.values() for m in ms})
    proc, report = run_suite("optimized", modules, tmp_path, stop_at_first_failure=False,
                             baseline=str(ROOT / "reports" / "baselines" / "conformance.json"))
    assert report is not None, f"no report (exit {proc.returncode}):\n{tail(proc)}"
    bad = {p["property"]: p["failures"] + p["baseline_regressions"] for p in report["properties"]
           if p["verdict"] != "PASS"}
    RESULTS["(unbroken optimized)"] = {"modules": modules, "exit": proc.returncode, "caught_by": None,
                                       "failure": None,
                                       "verdicts": {p["property"]: p["verdict"] for p in report["properties"]}}
    assert proc.returncode == 0 and not bad, f"optimized does not pass the catching properties: {bad}\n{tail(proc)}"


@pytest.fixture(scope="module", autouse=True)
def write_selftest_table(request):
    yield
    report_dir = request.config.getoption("--report-dir")
    if not report_dir or not RESULTS:
        return
    directory = Path(report_dir)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "selftest.json").write_text(json.dumps(RESULTS, indent=2) + "\n")
    lines = ["# Conformance self-test: broken variants of `optimized`", "",
             "Each variant plants one bug (conformance/selftest/variants/<variant>.py documents it); the suite runs "
             "the listed property modules with `pytest -x` and must FAIL on an assertion.", "",
             "| Variant | Modules run | Caught | Caught by | First failing test |", "|---|---|---|---|---|"]
    for name, r in sorted(RESULTS.items()):
        if name.startswith("("):
            verdicts = ", ".join(f"{k}: {v}" for k, v in r["verdicts"].items())
            lines.append(f"| {name} | the modules above | control (must pass) | - | {verdicts} |")
            continue
        first = (r["failure"] or "").split(" (call)")[0]
        lines.append(f"| {name} | {', '.join(m.split('/')[-1] for m in r['modules'])} | "
                     f"{'yes' if r['caught_by'] else 'NO'} | {r['caught_by'] or '-'} | `{first}` |")
    (directory / "selftest.md").write_text("\n".join(lines) + "\n")
