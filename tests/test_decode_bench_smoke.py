"""perf/decode_bench.py end to end on CPU (tiny config, eager steps): the report files exist and the counted reads
of the step at context s are Table 4's model s/d + n*l' + w minus one (docs/spec.md, "Table 4 off-by-one")."""

import csv
import json


from perf import decode_bench


def test_decode_bench_cpu_smoke(tmp_path, single_torch_thread):
    assert decode_bench.main(["--device", "cpu", "--tiny", "--contexts", "512", "--batches", "2", "--steps", "2",
                              "--warmup", "1", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "decode_bench.csv")))
    assert len(rows) == 1
    row = rows[0]
    cfg = decode_bench.bench_config(tiny=True)  # l = 16, d = 8, l' = 32, n = 4, w = 64
    assert (int(row["reads_cmp"]), int(row["reads_slc"]), int(row["reads_win"])) == ((512 - 16) // 8 + 1, 4 * 32, 64)
    assert int(row["reads_total"]) == int(row["table4_tokens"]) - 1 == 512 // 8 + 4 * 32 + 64 - 1
    assert float(row["nsa_median_us"]) > 0 and float(row["sdpa_median_us"]) > 0
    assert json.loads((tmp_path / "decode_bench.json").read_text())["config"] == cfg.to_dict()
    assert "| 512 | 2 |" in (tmp_path / "decode_bench.md").read_text()
    assert (tmp_path / "decode_bench.png").stat().st_size > 0
