"""Where the perf tools write by default (each takes `--out DIR` to write elsewhere), and the JSON a kernel probe
writes."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch

DECODE_OUT = Path("reports/decode")  # decode bench, decode profile and the decode kernel probes
PERF_OUT = Path("reports/perf")  # perf run (paper sweep), the layer profile and the prefill probe


def printed_rows(rows: Iterable[dict]) -> list[dict]:
    """A kernel probe's result rows, each printed (floats to 4 decimals) as soon as it is measured."""
    out = []
    for row in rows:
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        out.append(row)
    return out


def write_probe_report(out_dir: Path, name: str, timing: str, results: list[dict]) -> Path:
    """A kernel probe's results as out_dir/<name>.json, with the GPU and versions they came from."""
    import triton

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps({
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "timing": timing, "results": results}, indent=2))
    return path
