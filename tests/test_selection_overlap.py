"""perf.selection_overlap: the distinct blocks of a tile of consecutive queries' selections (CPU)."""

from __future__ import annotations

import json

import torch

from perf.selection_overlap import main, overlap_rows, union_sizes
from reference.config import NSAConfig


def test_union_sizes_count_distinct_valid_blocks_per_tile_and_group():
    # rows [T=5, Hkv=2, n=3]; -1 is padding
    indices = torch.tensor([
        [[0, 1, 2], [0, 4, -1]],
        [[1, 2, 3], [0, 4, 5]],
        [[0, 2, 3], [6, -1, -1]],
        [[5, 6, 7], [6, 7, 8]],
        [[9, 9, 9], [9, 9, 9]],  # left out of the tiles of 2 and 4 rows from row 0
    ])
    assert union_sizes(indices, 1).tolist() == [[3, 2], [3, 3], [3, 1], [3, 3], [1, 1]]
    assert union_sizes(indices, 2).tolist() == [[4, 3], [6, 3]]  # rows 0-1 and 2-3
    assert union_sizes(indices, 2, first_row=1).tolist() == [[4, 4], [4, 4]]  # rows 1-2 and 3-4
    assert union_sizes(indices, 4).tolist() == [[7, 6]]


def test_overlap_rows_leave_out_the_rows_without_a_choice():
    cfg = NSAConfig.preset("paper", n_sel=2, n_init=1, n_local=1, sel_block=4, cmp_block=4, cmp_stride=4)
    T = 16  # rows 0..7 have no choice (t < n l' = 8)
    indices = torch.full((T, 1, 2), -1)
    indices[:8] = torch.tensor([0, 1])
    indices[8:12] = torch.tensor([0, 2])  # tile rows 8..11 share block 0: union {0, 2}
    indices[12:] = torch.tensor([1, 3])
    rows = overlap_rows(indices, cfg, [1, 4])
    assert rows[0]["distinct_blocks"] == 2.0 and rows[0]["tiles"] == 8
    assert rows[1]["tiles"] == 2 and rows[1]["distinct_blocks"] == 2.0 and rows[1]["blocks_per_query"] == 0.5
    assert rows[1]["visible_blocks"] == (11 // 4 + 1 + 15 // 4 + 1) / 2  # the tiles' last rows 11 and 15


def test_main_writes_the_report(tmp_path):
    # the tiny sweep's inputs (rows from n l' = 128 on have a choice)
    assert main(["--preset", "tiny", "--seq-len", "256", "--tiles", "1,8", "--device", "cpu", "--out",
                 str(tmp_path)]) == 0
    report = json.loads((tmp_path / "selection_overlap.json").read_text())
    assert [row["tile"] for row in report["rows"]] == [1, 8] and "torch" in json.dumps(report["env"])
    n = report["n_sel"]
    assert report["rows"][0]["distinct_blocks"] == n  # one query: its own n distinct blocks
    assert n <= report["rows"][1]["distinct_blocks"] <= report["rows"][1]["visible_blocks"]
