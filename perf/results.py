"""Result rows (one per (T, implementation, stage, pass)) and the CSV / JSON files holding them.

results.csv: the rows. results.json: {"meta": {environment, spec, ceilings, budget notes}, "rows": [...]}.
ceilings.csv: the measured matmul and copy ceilings the floors and fractions are computed from.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

OK = "ok"
OOM = "oom"
ERROR = "error"
SKIPPED = "skipped"
STATUSES = (OK, OOM, ERROR, SKIPPED)

RESULTS_CSV = "results.csv"
RESULTS_JSON = "results.json"
CEILINGS_CSV = "ceilings.csv"


@dataclass
class Row:
    seq_len: int
    impl: str
    stage: str
    pass_name: str
    status: str
    workload: str = "single"
    documents: int | None = None  # documents packed into the row (packed workload; perf/cases.py)
    median_ms: float | None = None  # median of all timed runs of all rounds
    min_ms: float | None = None
    p20_ms: float | None = None
    p80_ms: float | None = None
    round_medians_ms: str = ""  # ';'-joined median of each round
    spread: float | None = None  # (max - min) / min of the round medians
    n_runs: int = 0
    flops: float | None = None  # useful FLOPs of this pass (flops.py)
    tflops: float | None = None  # flops / median time
    frac_peak: float | None = None  # tflops / measured matmul peak
    flop_floor_ms: float | None = None  # flops / measured matmul peak
    bytes: float | None = None  # compulsory bytes of this pass (flops.py)
    byte_floor_ms: float | None = None  # bytes / measured copy bandwidth
    floor_ms: float | None = None  # max(flop floor, byte floor)
    selected_tokens: int | None = None  # counted from the indices used (selected stage, layer)
    peak_mem_bytes: int | None = None  # torch.cuda.max_memory_allocated during the case (reset per case)
    start_mem_bytes: int | None = None  # allocated when the case began (flush buffer, nothing else)
    note: str = ""

    @property
    def key(self) -> str:
        return f"{self.workload}|T={self.seq_len}|{self.impl}|{self.stage}|{self.pass_name}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_FIELD_TYPES = {f.name: f.type for f in fields(Row)}


def parse_cell(kind: str, text: str) -> Any:
    """One CSV cell back to the type a dataclass field declares (its annotation as a string): str, int, float,
    bool or "bool | str" (True / False, else the text), "| None" fields empty as None."""
    if kind == "str":
        return text
    if text == "":
        return None if "None" in kind else 0
    if kind.startswith("bool | str"):  # a flag or a named mode
        return {"True": True, "False": False}.get(text, text)
    if kind.startswith("bool"):
        return text == "True"
    if kind.startswith("int"):
        return int(float(text))
    return float(text)


def write_csv(path: Path, rows: list[Any], cls: type) -> None:
    """Dataclass rows of type cls as CSV, one column per field, floats to 6 significant digits."""
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=[f.name for f in fields(cls)])
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _format(v) for k, v in dataclasses.asdict(row).items()})


def read_csv(path: Path, cls: type) -> list[Any]:
    """The rows write_csv wrote (a column cls does not declare is an error naming it)."""
    types = {f.name: f.type for f in fields(cls)}
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        unknown = sorted(set(reader.fieldnames or []) - set(types))
        if unknown:
            raise ValueError(f"{path}: unknown column(s) {unknown}; expected {sorted(types)}")
        return [cls(**{k: parse_cell(types[k], v) for k, v in rec.items()}) for rec in reader]


def write_rows(rows: list[Row], out_dir: Path, meta: dict[str, Any]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_csv(out_dir / RESULTS_CSV, rows, Row)
    with open(out_dir / RESULTS_JSON, "w") as fh:
        json.dump({"meta": meta, "rows": [r.to_dict() for r in rows]}, fh, indent=1, default=str)
    ceilings = meta.get("ceilings")
    if ceilings:
        with open(out_dir / CEILINGS_CSV, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(ceilings))
            writer.writeheader()
            writer.writerow(ceilings)


def _format(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.6g}"
    return value


def read_rows(path: Path) -> list[Row]:
    """Rows from results.csv (or a results.json's "rows")."""
    path = Path(path)
    if path.suffix == ".json":
        with open(path) as fh:
            return [Row(**r) for r in json.load(fh)["rows"]]
    return read_csv(path, Row)


def read_meta(out_dir: Path) -> dict[str, Any]:
    path = Path(out_dir) / RESULTS_JSON
    if not path.exists():
        return {}
    with open(path) as fh:
        return json.load(fh).get("meta", {})


def merge_rows(old: list[Any], new: list[Any]) -> list[Any]:
    """old rows with every key that `new` measured replaced (so a sweep can be split over several commands). A case
    `new` skipped for time measured nothing, so it does not replace an old row that holds a measurement. Any rows
    with a `key` and a `status` (Row, perf.train_bench.TrainRow)."""
    measured = {r.key for r in old if r.status != SKIPPED}
    new = [r for r in new if r.status != SKIPPED or r.key not in measured]
    replaced = {r.key for r in new}
    return [r for r in old if r.key not in replaced] + new
