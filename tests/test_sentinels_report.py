"""Sentinel reports and the `run` options: markdown beside the JSON, readable plots, --only, --out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sentinels.config import load_config
from sentinels.profiles import PROFILES
from sentinels.report import print_table, result_figure, write_report
from sentinels.suite import FAIL, NOT_APPLICABLE, PASS, SentinelResult

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny-cpu.yaml"


def _results():
    clean = SentinelResult("random_label", PASS, "held-out loss 4.16", "|gap| <= 0.1", metrics={"ln_v": 4.159},
                           curves={"train loss": [4.3, 4.2, 4.17], "held-out loss": [float("nan"), float("nan"), 4.16]})
    gates = SentinelResult("gate_collapse", PASS, "no collapse", "-", curves={"gate mean cmp": [0.5, 0.52]},
                           curve_units="mean gate value (0 to 1)")
    tripped = SentinelResult("causal_isolation", FAIL, "changing t=7 moved p=6", "-", planted="leak: cmp_visible_early",
                             curve_units="", curve_x="")
    not_applicable = SentinelResult("causal_isolation", NOT_APPLICABLE, "the path never called the seam", "-",
                                    planted="leak: sel_score_all_blocks", curve_units="", curve_x="")
    return [clean, gates], [tripped, not_applicable]


def test_report_writes_json_and_markdown_with_planted_rows_as_expected_trips(tmp_path, capsys):
    results, planted = _results()
    cfg = load_config(TINY)
    path = write_report(tmp_path, "cpu-cpu", profile=PROFILES["cpu"], run_config=cfg, run_config_path=TINY,
                        probe_config=cfg, corpus=Path("/somewhere/else/wiki.jsonl"), results=results, planted=planted,
                        verdict=PASS, started=0.0, selftest=True, seed=3, only=["causal_isolation"])
    report = json.loads(path.read_text())
    assert report["run_config"]["path"] == "configs/tiny-cpu.yaml" and report["corpus"] == "wiki.jsonl"
    assert "git" not in report and "started_at" not in report and report["seed"] == 3
    assert [p["state"] for p in report["planted"]] == ["tripped (expected)", "not applicable"]
    assert report["sentinels"][0]["plot"] == "cpu-cpu/random_label.png"
    assert (tmp_path / "cpu-cpu" / "random_label.png").is_file()
    assert (tmp_path / "cpu-cpu" / "gate_collapse.png").is_file()
    md = (tmp_path / "cpu-cpu.md").read_text()
    assert "**Overall: PASS**" in md and "| leak: cmp_visible_early | `causal_isolation` | tripped (expected) |" in md
    assert "[plot](cpu-cpu/random_label.png)" in md and "FAIL" not in md.split("## Self-test")[0]
    print_table(results, planted, PASS)
    assert "tripped (expected)" in capsys.readouterr().out


@pytest.mark.parametrize("index", [0, 1])
def test_plots_name_their_units_and_keep_the_legend_off_the_data(index):
    result = _results()[0][index]
    fig = result_figure(result, extra_lines={"reference": 4.0})
    ax = fig.axes[0]
    assert ax.get_xlabel() == "training step" and ax.get_ylabel() in ("loss (nats)", "mean gate value (0 to 1)")
    fig.canvas.draw()
    legend = ax.get_legend().get_window_extent()
    assert legend.x0 >= ax.get_window_extent().x1  # beside the axes, not over the curves
    assert fig.get_window_extent().x1 >= legend.x1  # and not clipped
    import matplotlib.pyplot as plt

    plt.close(fig)


def _run(args, env_extra):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env_extra}
    return subprocess.run([sys.executable, "-m", "sentinels", "run", "--profile", "cpu", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_only_with_an_unknown_name_is_refused_in_one_line(tmp_path, capsys):
    from sentinels.cli import main

    assert main(["run", "--profile", "cpu", "--only", "causal_isolation,random_labels", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --only: unknown sentinel name(s) ['random_labels']")
    assert not any(tmp_path.iterdir())


def test_the_report_goes_where_out_says_and_nowhere_else(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"Document {i} talks about rivers and mills. " * 20})
                                for i in range(20)) + "\n")
    proc = _run(["--only", "label_shift", "--no-selftest", "--corpus", str(corpus), "--out", str(tmp_path / "rep"),
                 "--seed", "4"], {})
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "rep" / "cpu-cpu.json").read_text())
    assert [s["name"] for s in report["sentinels"]] == ["label_shift"] and report["seed"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl", "rep"]
    assert sorted(p.name for p in (tmp_path / "rep").iterdir()) == ["cpu-cpu.json", "cpu-cpu.md"]


def test_determinism_command_writes_its_report(tmp_path, capsys):
    from sentinels.cli import main

    assert main(["determinism", "--profile", "cpu", "--repeats", "1", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "determinism-cpu-cpu.json").read_text())
    assert report["determinism"]["repeat_max_rel"] == 0.0 and report["determinism"]["bound_rel"] == 0.0
    assert report["clean_sweep"]["probes_run"] == 63 * 4 and report["clean_sweep"]["probes_moved"] == 0
    assert "| same input, 1 repeated one-row forwards | 0.000e+00 | 0/1 |" in (
        tmp_path / "determinism-cpu-cpu.md").read_text()


def test_sensitivity_report_names_the_first_trip_of_each_statistic():
    from sentinels.sensitivity import first_trip, markdown

    evals = [{"step": 25, "gap": 0.01, "class_gap": -0.05}, {"step": 50, "gap": -0.02, "class_gap": -0.3},
             {"step": 75, "gap": -0.2, "class_gap": -1.0}]
    assert first_trip(evals, "gap") == 75 and first_trip(evals, "class_gap") == 50
    row = {"seed": 0, "first_trip_all_positions": 75, "first_trip_position_class": 50, "min_gap": -0.2,
           "min_class_gap": -1.0, "s_per_step": 0.1}
    md = markdown({"profile": "cpu", "plant": "cmp_one_early", "max_steps": 100, "every": 25, "seq_len": 128,
                   "margin_nats": 0.1, "profile_steps": 300, "seeds": [row, {**row, "seed": 1,
                                                                            "first_trip_position_class": 75}]})
    assert "| 0 | 75 | 50 | -0.2000 | -1.0000 | 0.100 |" in md and "trips after 50-75 steps (median 62.5)" in md
