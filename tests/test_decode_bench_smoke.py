"""perf/decode_bench.py end to end on CPU (tiny config, eager steps): the report files exist, the counted reads of the
step at context s are Table 4's model s/d + n*l' + w minus one (docs/spec.md, "Table 4 off-by-one"), the timed steps
are consecutive and include the steps that emit a compressed token, and the speedup is judged by the mean step."""

import csv
import json

import pytest

from perf import decode_bench


def test_decode_bench_cpu_smoke(tmp_path, single_torch_thread):
    cfg = decode_bench.bench_config(tiny=True)  # l = 16, d = 8, l' = 32, n = 4, w = 64
    steps = 2 * cfg.cmp_stride + 1  # consecutive steps: at least two of them emit a compressed token
    assert decode_bench.main(["--device", "cpu", "--tiny", "--contexts", "512", "--batches", "2", "--steps",
                              str(steps), "--warmup", "1", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "decode_bench.csv")))
    assert len(rows) == 1
    row = rows[0]
    assert (int(row["reads_cmp"]), int(row["reads_slc"]), int(row["reads_win"])) == ((512 - 16) // 8 + 1, 4 * 32, 64)
    assert int(row["reads_total"]) == int(row["table4_tokens"]) - 1 == 512 // 8 + 4 * 32 + 64 - 1
    assert int(row["timed_steps"]) == steps and int(row["emission_steps"]) >= 2
    nsa_mean, sdpa_mean = float(row["nsa_mean_us"]), float(row["sdpa_mean_us"])
    assert nsa_mean > 0 and sdpa_mean > 0 and float(row["nsa_median_emit_us"]) > 0
    assert float(row["measured_speedup"]) == pytest.approx(sdpa_mean / nsa_mean, rel=1e-9)
    assert float(row["median_speedup"]) == pytest.approx(float(row["sdpa_median_us"]) / float(row["nsa_median_us"]),
                                                         rel=1e-9)
    assert json.loads(row["sdpa_forms_us"])[row["sdpa_form"]] == pytest.approx(sdpa_mean)
    assert json.loads((tmp_path / "decode_bench.json").read_text())["config"] == cfg.to_dict()
    text = (tmp_path / "decode_bench.md").read_text()
    assert f"| 512 | 2 | {nsa_mean:.1f} |" in text and f"| {float(row['measured_speedup']):.2f}x |" in text
    assert (tmp_path / "decode_bench.png").stat().st_size > 0

    # the summaries come from the CSV alone
    (tmp_path / "decode_bench.md").write_text("tampered")
    assert decode_bench.main(["--report-from", str(tmp_path / "decode_bench.csv"), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "decode_bench.md").read_text() == text


def test_each_side_starts_its_steps_right_after_holding_the_clocks(tmp_path, single_torch_thread, monkeypatch):
    """The NSA steps and each SDPA form's steps are preceded by Timer.hold_clocks(--hold-clocks-s): an idle GPU
    ramps its clocks over longer than a few decode steps take, so the first case of a process was timed slow."""
    from perf.timing import Timer

    events = []
    real_once = Timer.once_ms
    monkeypatch.setattr(Timer, "hold_clocks", lambda self, seconds: events.append(("hold", seconds)))
    monkeypatch.setattr(Timer, "once_ms", lambda self, fn: events.append(("time", None)) or real_once(self, fn))
    assert decode_bench.main(["--device", "cpu", "--tiny", "--contexts", "256", "--batches", "1", "--steps", "3",
                              "--warmup", "1", "--hold-clocks-s", "0.25", "--out", str(tmp_path)]) == 0
    holds = [i for i, (kind, _) in enumerate(events) if kind == "hold"]
    assert events[0] == ("hold", 0.25) and all(events[i][1] == 0.25 for i in holds)
    forms = json.loads(next(csv.DictReader(open(tmp_path / "decode_bench.csv")))["sdpa_forms_us"])
    assert len(holds) == 1 + len(forms)  # the NSA side, then every SDPA form
    assert events[holds[0] + 1][0] == "time"  # the NSA warm-up steps are timed one by one, right after
