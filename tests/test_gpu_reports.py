"""conformance.helpers.write_merged_report: the GPU report writers stay whole under pytest-xdist."""

import json

from conformance.helpers import write_merged_report


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
