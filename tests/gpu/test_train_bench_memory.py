"""`perf train`'s peak memory of a graphed case is the case's own: the same case reports the same reserved peak
whether it runs first in the process or after other cases. Each graph recording runs on streams of its own, and
cuBLAS keeps a workspace for every stream it ran on for the life of the process; without dropping those between
cases, and the allocator's cache before the timed steps, every case before added its share to the next one's peak.
"""

from __future__ import annotations

import time

import torch

from perf.train_bench import OK, run_case
from perf.train_model import Execution, batch_plan


def _graphed_peak(geometry: str, model: str, seq_len: int) -> int:
    row = run_case(geometry, model, batch_plan(seq_len, 4 * seq_len, 2 * seq_len), warmup=2, steps=2,
                   device=torch.device("cuda"), deadline=time.perf_counter() + 600,
                   execution=Execution(cuda_graphs=True))
    assert row.status == OK, row.note
    return row.peak_mem_bytes


def test_a_graphed_case_peaks_the_same_after_other_cases():
    first = _graphed_peak("prod-125m", "nsa", 2048)
    _graphed_peak("prod-125m", "dense", 4096)
    _graphed_peak("paper", "nsa", 2048)
    again = _graphed_peak("prod-125m", "nsa", 2048)
    assert abs(again - first) <= 0.01 * first, (first / 2**20, again / 2**20)
