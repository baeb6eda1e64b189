"""perf/range_screen.py: which tilings go on to the rounds (the three fastest that ran and the entry, per kernel and
branch), the rounds' alternating order and medians, and one whole screen in Triton's interpreter on tiny inputs
(fp32 is not what the GPU run times, but every launch of every kind runs and is recorded); bad options are refused
in one line."""

import pytest
import torch

from perf import prefill_probe, range_screen
from reference.config import NSAConfig

TINY = NSAConfig(cmp_block=8, cmp_stride=4, sel_block=16, n_sel=3, n_init=1, n_local=1, window=10, n_heads=4,
                 n_kv_heads=2, head_dim_qk=16, head_dim_v=16)


def row(kind, branch, shape, ms, entry=False):
    return {"seq_len": 64, "pass": "screen", "kind": kind, "branch": branch, "tiling": list(shape), "entry": entry,
            "ms": ms}


def test_finalists_are_the_three_fastest_that_ran_and_the_entry():
    rows = [row("dq", "cmp", (64, 32, 4, n), ms) for n, ms in ((1, 5.0), (2, 1.0), (3, None), (4, 3.0), (5, 2.0))]
    rows += [row("dq", "cmp", (128, 32, 8, 2), 9.0, entry=True), row("dq", "win", (64, 32, 4, 2), 4.0),
             row("scores", None, (64, 64, 4, 2), None, entry=True)]
    assert range_screen.finalists(rows) == [
        ("dq", "cmp", (64, 32, 4, 2)), ("dq", "cmp", (64, 32, 4, 4)), ("dq", "cmp", (64, 32, 4, 5)),
        ("dq", "cmp", (128, 32, 8, 2)),  # the entry, though slowest
        ("dq", "win", (64, 32, 4, 2)),
        ("scores", None, (64, 64, 4, 2))]  # an entry that did not fit still goes on (and says so again)


def test_rounds_alternate_and_medians_skip_the_screen_and_failed_launches():
    finals = [("a", None, (1,)), ("b", None, (2,)), ("c", None, (3,))]
    order = range_screen.round_order(finals, 3)
    assert [case[0] for _, case in order] == list("abc" "cba" "abc")
    assert [r for r, _ in order] == [0] * 3 + [1] * 3 + [2] * 3
    rows = [row("dq", "cmp", (1,), 100.0)]  # the screen's time is not a round's
    rows += [{**row("dq", "cmp", (1,), ms), "pass": f"round {i}"} for i, ms in enumerate((3.0, 1.0, 2.0))]
    rows += [{**row("dq", "cmp", (2,), None), "pass": "round 0"}]
    assert range_screen.medians(rows) == {(64, "dq", "cmp", (1,)): 2.0}


def test_a_whole_screen_runs_every_kernel_in_the_interpreter(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(prefill_probe, "CFG", TINY)
    ran = []
    clock = iter(range(1, 10_000))

    def fake_bench(run, rep_ms):  # the launch already ran once in `launched`; times in the order measured
        ran.append(run)
        return float(next(clock))

    monkeypatch.setattr(range_screen, "bench_ms", fake_bench)
    candidates = {"forward": ((16, 16, 4, 1), (32, 16, 4, 1, 2)), "dq": ((16, 16, 4, 1), (16, 32, 4, 1)),
                  "dkdv": ((16, 16, 4, 1),), "scores": ((16, 16, 4, 1), (32, 16, 4, 1))}
    made = []

    def make(n):
        made.append(n)
        return range_screen.Launches(n, torch.device("cpu"), 1, score_rows=24)

    rows = range_screen.screen(make, 40, [33], candidates, 2, rep_ms=1)
    screened = [r for r in rows if r["pass"] == "screen"]
    assert made == [40, 33] and len(screened) == 2 * (2 + 2 + 1) + 2
    assert all(r["ms"] is not None for r in rows)
    # the interpreter's entry is 16 x 16, 4 warps, 1 stage: marked, and always among the finalists
    assert {r["kind"] for r in screened if r["entry"]} == {"forward", "dq", "dkdv", "scores"}
    rounds = [r for r in rows if r["pass"] != "screen"]
    assert len(rounds) == 2 * 2 * len(range_screen.finalists(screened))
    assert {r["seq_len"] for r in rounds} == {40, 33} and len(ran) == len(rows)


def test_the_forward_entry_is_the_tile_its_branch_launches(monkeypatch: pytest.MonkeyPatch):
    """At d = 128 the forward's launch-table tile follows the branch's longest range (common.range_tiling), so the
    screen marks as the entry of each branch the tile that branch runs: 64 x 32 for the window's 512 keys, 64 x 64
    for the compressed branch's 1023 tokens at 16k; the inputs carry those widths as the branches hand them over."""
    monkeypatch.setattr(prefill_probe, "CFG", TINY)
    launches = range_screen.Launches(40, torch.device("cpu"), 1, score_rows=24)
    assert (launches.max_width("win"), launches.max_width(None)) == (TINY.window, None)
    lo, hi = launches.x["cmp"]
    assert launches.max_width("cmp") == int((hi - lo + 1).max())
    monkeypatch.setattr(prefill_probe, "CFG", prefill_probe.LAYOUTS["paper"])
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the compiled-GPU launch table, not the interpreter's 16 x 16
    assert range_screen.is_entry("forward", (64, 32, 4, 3, 16), 512)
    assert not range_screen.is_entry("forward", (64, 64, 4, 3, 16), 512)
    assert range_screen.is_entry("forward", (64, 64, 4, 3, 16), 1023)
    assert range_screen.is_entry("forward", (128, 64, 8, 3, 16), 4095)
    assert range_screen.is_entry("dq", (128, 64, 8, 3, 16), 512)  # the other kernels do not look at the width


def test_bad_options_are_refused_in_one_line(capsys):
    for argv, words in ((["--confirm-seq-lens", "8k"], "--confirm-seq-lens must be a comma list of integers"),
                        (["--rounds", "0"], "--rounds must be >= 1"),
                        (["--seq-len", "0"], "--batch and --seq-len must be >= 1")):
        with pytest.raises(SystemExit) as stop:
            range_screen.main(argv)
        assert stop.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert words in err[-1], err
