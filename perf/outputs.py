"""Where the perf tools write by default (each takes `--out DIR` to write elsewhere), and the JSON a kernel probe
writes."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

import torch

DECODE_OUT = Path("reports/decode")  # decode bench, decode profile and the decode kernel probes
PERF_OUT = Path("reports/perf")  # perf run (paper sweep), the layer profile and the prefill probe
T = TypeVar("T")


def launched(run: Callable[[], T]) -> tuple[T | None, str | None]:
    """(run(), None), or (None, the error's first line) where the launch needs more shared memory or registers than
    the GPU has (Triton's OutOfResources): a kernel probe then writes a row that says so for that launch setting
    and goes on with the next one."""
    from triton.runtime.errors import OutOfResources

    try:
        return run(), None
    except OutOfResources as error:
        return None, str(error).splitlines()[0]


def printed_rows(rows: Iterable[dict]) -> list[dict]:
    """A kernel probe's result rows, each printed (floats to 4 decimals) as soon as it is measured."""
    out = []
    for row in rows:
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        out.append(row)
    return out


def add_probe_arguments(parser: argparse.ArgumentParser, name: str, layouts: Iterable[str], seq_len: int,
                        rep_ms: int) -> None:
    """The options every kernel probe takes: --layout, --seq-len, --batch, --rep-ms and --out (<name>.json)."""
    parser.add_argument("--layout", choices=sorted(layouts), default="paper", help="heads, groups and head dims")
    parser.add_argument("--seq-len", type=int, default=seq_len)
    parser.add_argument("--batch", type=int, default=1, help="sequences of --seq-len tokens")
    parser.add_argument("--rep-ms", type=int, default=rep_ms, help="do_bench's timing window per variant")
    parser.add_argument("--out", type=Path, default=PERF_OUT, help=f"writes {name}.json here (default {PERF_OUT})")


def check_probe_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """add_probe_arguments' rules: --batch and --seq-len >= 1 (parser.error names them otherwise)."""
    if args.batch < 1 or args.seq_len < 1:
        parser.error(f"--batch and --seq-len must be >= 1, got {args.batch} and {args.seq_len}")


def probe_timing(rep_ms: int, layout: str, batch: int, seq_len: int) -> str:
    """How a kernel probe (timing.bench_ms) timed its rows, for write_probe_report's `timing`."""
    return (f"triton.testing.do_bench median (L2 flushed), rep {rep_ms} ms; layout {layout}, batch {batch}, "
            f"T = {seq_len}")


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
