"""Run-directory telemetry: heartbeat.jsonl (one JSON object per step), metrics.csv, events.jsonl, and a
console progress bar. Memory columns are MiB (2**20 bytes) of CUDA memory; empty on CPU. `documents` counts the
packed documents of the step (data.packing varlen); empty for contiguous windows."""

from __future__ import annotations

import csv
import json
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from .monitors import Event

log = logging.getLogger("sentinels.train")

CSV_COLUMNS = (
    "step", "loss", "lr", "grad_norm", "tokens", "documents", "tokens_per_s", "dt_fetch_s", "dt_step_s",
    "mem_allocated_mib", "mem_reserved_mib",
    "gate_mean_cmp", "gate_mean_slc", "gate_mean_win", "gate_max_cmp", "gate_max_slc", "gate_max_win",
    "sel_distinct_blocks", "reads_cmp", "reads_slc", "reads_win", "reads_total", "wall_time",
)


def _truncate_jsonl(path: Path, keep_below_step: int) -> None:
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip()
            and json.loads(line).get("step", 0) < keep_below_step]
    path.write_text("".join(line + "\n" for line in kept))


def _truncate_csv(path: Path, keep_below_step: int) -> None:
    if not path.exists():
        return
    with path.open(newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if int(r["step"]) < keep_below_step]
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


class Telemetry:
    """Writers for one run directory (rank 0 only). On resume, rows from steps >= the resume step (written
    after the checkpoint by the interrupted run) are dropped so the files describe one history."""

    def __init__(self, run_dir: Path, *, resume_step: int | None):
        self.run_dir = run_dir
        self.heartbeat_path = run_dir / "heartbeat.jsonl"
        self.csv_path = run_dir / "metrics.csv"
        self.events_path = run_dir / "events.jsonl"
        if resume_step is not None:
            _truncate_jsonl(self.heartbeat_path, resume_step)
            _truncate_csv(self.csv_path, resume_step)
        else:
            for path in (self.heartbeat_path, self.csv_path, self.events_path):
                path.unlink(missing_ok=True)
        new_csv = not self.csv_path.exists()
        self._csv_fh = self.csv_path.open("a", newline="")
        self._csv = csv.DictWriter(self._csv_fh, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        if new_csv:
            self._csv.writeheader()
        self._heartbeat_fh = self.heartbeat_path.open("a")
        self._lock = threading.Lock()

    def write_step(self, record: dict[str, Any]) -> None:
        self._heartbeat_fh.write(json.dumps(record) + "\n")
        self._heartbeat_fh.flush()
        row = {k: ("" if record.get(k) is None else record.get(k)) for k in CSV_COLUMNS}
        self._csv.writerow(row)
        self._csv_fh.flush()

    def write_event(self, event: Event) -> None:
        with self._lock:
            with self.events_path.open("a") as fh:
                fh.write(json.dumps({"time": time.time(), **event.as_dict()}) + "\n")
        log.warning("EVENT %s at step %d: %s", event.kind, event.step, event.message)

    def close(self) -> None:
        self._heartbeat_fh.close()
        self._csv_fh.close()


class ProgressBar:
    """A one-line progress bar on a terminal; a plain line every `every` steps otherwise."""

    def __init__(self, total: int, every: int, stream: TextIO = sys.stderr):
        self.total, self.every, self.stream = total, every, stream
        self.tty = hasattr(stream, "isatty") and stream.isatty()

    def update(self, record: dict[str, Any]) -> None:
        step = record["step"] + 1
        text = (f"step {step}/{self.total} loss {record['loss']:.4f} lr {record['lr']:.2e} "
                f"gnorm {record['grad_norm']:.3f} tok/s {record['tokens_per_s']:.0f}")
        if self.tty:
            width = 30
            filled = int(width * step / self.total)
            self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {text}  ")
            if step == self.total:
                self.stream.write("\n")
            self.stream.flush()
        elif step % self.every == 0 or step == self.total or step == 1:
            self.stream.write(text + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

