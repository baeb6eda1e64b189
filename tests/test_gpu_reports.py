"""conformance.helpers.write_merged_report: the GPU report writers stay whole under pytest-xdist; markdown_table,
which their markdown tables go through."""

import json
import os

from conformance.helpers import markdown_table, write_merged_report


def test_parts_of_several_workers_merge_into_one_report(tmp_path, monkeypatch):
    def markdown(report):
        return "\n".join(f"{r['case']}" for r in report["parity"])

    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    write_merged_report(tmp_path, "kernel", {"device": "H100", "parity": [{"case": "a"}], "long": []}, markdown)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    merged = write_merged_report(tmp_path, "kernel", {"device": "H100", "parity": [{"case": "b"}],
                                                      "long": [{"case": "c"}]}, markdown)
    assert merged == {"device": "H100", "parity": [{"case": "a"}, {"case": "b"}], "long": [{"case": "c"}]}
    assert json.loads((tmp_path / "kernel.json").read_text()) == merged
    assert (tmp_path / "kernel.md").read_text() == "a\nb"
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")  # a worker rewriting its part replaces, never duplicates
    again = write_merged_report(tmp_path, "kernel", {"device": "H100", "parity": [{"case": "a"}], "long": []},
                                markdown)
    assert again["parity"] == [{"case": "a"}, {"case": "b"}]
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["kernel.json", "kernel.part-gw0.json",
                                                               "kernel.part-gw1.json"]


def test_finish_gpu_report_stamps_versions_writes_and_prints(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import torch

    from conformance.helpers import finish_gpu_report

    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # the part is "main" outside xdist, as asserted below
    lines = []
    terminal = SimpleNamespace(write_line=lines.append)
    request = SimpleNamespace(config=SimpleNamespace(pluginmanager=SimpleNamespace(getplugin=lambda name: terminal)))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "H100")
    report = {"parity": [{"case": "a"}]}
    finish_gpu_report(request, report, "kernel", lambda r: f"{r['device']}: {len(r['parity'])}", tmp_path)
    written = json.loads((tmp_path / "kernel.json").read_text())
    assert written["device"] == "H100" and written["torch"] == torch.__version__ and "triton" in written
    assert lines[0] == "\nH100: 1" and "kernel.json" in lines[1]
    lines.clear()
    finish_gpu_report(request, {"parity": []}, "kernel", lambda r: f"{r['device']}: {len(r['parity'])}", None)
    assert lines == ["\nH100: 0"]  # nothing written without an output folder, the report still printed
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")  # the part's name under pytest-xdist
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["kernel.json", f"kernel.part-{worker}.json"]


def test_markdown_table_has_one_rule_cell_per_column():
    lines = markdown_table(("case", "ms", "ok"), [("a", "1.00", True), ("b", 2, None)])
    assert lines == ["| case | ms | ok |", "|---|---|---|", "| a | 1.00 | True |", "| b | 2 | None |"]
    assert markdown_table(("x",), []) == ["| x |", "|---|"]
