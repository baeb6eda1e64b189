"""The range kernels' launch entries screened against other tilings at one layout (a GPU diagnostic, like
perf.prefill_probe, whose inputs it times).

For each range kernel and branch (the forward, dq and dk/dv over the compressed branch's ranges and over the
window's; the group-scores kernel over the last --score-rows rows) a screening pass times every candidate tiling
of the layout (CANDIDATES) at --seq-len, each launched as given (one the GPU cannot fit gives a row with ms None);
then the three fastest and the launch table's entry of each (kernel, branch) are timed again in --rounds rounds,
the order reversed every other round, at --seq-len and at each of --confirm-seq-lens. dq and dk/dv rows time the
whole range_attention_backward of the branch with the other kernel at its entry. Compare an entry with the others
by the median of its rounds at every length (reports/perf/range_entries/ has a reading of two such runs).
bf16, triton.testing.do_bench medians (L2 flushed). Tilings are (query rows, key rows, warps, stages[, heads]).

    python -m perf.range_screen --layout paper --seq-len 65536 --confirm-seq-lens 16384,8192 --out DIR
"""

from __future__ import annotations

import argparse
import math
from statistics import median
from typing import Callable

import torch

from optimized.kernels.range_attention import range_attention_forward
from optimized.kernels.range_attention_bwd import range_attention_backward
from optimized.kernels.selection import group_scores

from . import prefill_probe
from .outputs import add_probe_arguments, check_probe_arguments, launched, printed_rows, write_probe_report
from .timing import bench_ms

KINDS = ("forward", "dq", "dkdv", "scores")
BRANCHES = ("cmp", "win")
FINALISTS = 3  # fastest tilings of the screen timed again beside the entry

# Candidate tilings per layout and kernel, around each entry of optimized/kernels/common.py's launch table.
CANDIDATES = {
    "paper": {
        "forward": ((64, 64, 4, 3, 16), (128, 64, 8, 3, 16), (128, 64, 8, 2, 16), (64, 64, 4, 2, 16),
                    (64, 32, 4, 3, 16), (128, 32, 8, 3, 16), (64, 64, 4, 4, 16), (128, 128, 8, 2, 16),
                    (64, 128, 4, 2, 16), (64, 64, 8, 3, 16)),
        "dq": ((128, 64, 8, 2, 16), (128, 64, 8, 3, 16), (64, 64, 4, 2, 16), (64, 64, 4, 3, 16), (128, 32, 8, 2, 16),
               (128, 32, 8, 3, 16), (64, 32, 4, 3, 16), (64, 64, 8, 2, 16), (128, 128, 8, 2, 16), (64, 32, 4, 2, 16)),
        "dkdv": ((32, 64, 4, 3, 16), (32, 64, 4, 2, 16), (16, 64, 4, 3, 16), (64, 64, 8, 2, 16), (32, 128, 8, 2, 16),
                 (64, 128, 8, 2, 16), (32, 64, 8, 3, 16), (16, 128, 8, 2, 16), (64, 64, 4, 2, 16),
                 (32, 32, 4, 3, 16), (16, 64, 4, 4, 16), (32, 64, 4, 4, 16)),
        "scores": ((128, 128, 8, 2), (128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 2), (128, 128, 8, 3),
                   (64, 128, 8, 2), (64, 64, 8, 2)),
    },
    "paper-dk192": {
        "forward": ((128, 64, 8, 2, 16), (128, 32, 8, 2), (128, 32, 8, 2, 16), (64, 32, 4, 3, 16),
                    (128, 64, 8, 3, 16), (64, 64, 4, 3, 16)),
        "dq": ((64, 32, 8, 2), (64, 32, 8, 2, 16), (64, 32, 8, 3), (64, 32, 8, 3, 16), (64, 64, 8, 2),
               (64, 64, 8, 2, 16), (32, 32, 4, 2, 16), (32, 64, 4, 2, 16), (64, 16, 4, 2, 16), (64, 32, 4, 3, 16),
               (128, 32, 8, 2, 16), (32, 32, 4, 3, 16), (64, 16, 8, 2, 16)),
        "dkdv": ((16, 64, 4, 2), (16, 64, 4, 2, 16), (16, 64, 4, 3, 16), (16, 64, 4, 3), (32, 64, 4, 2, 16),
                 (16, 128, 8, 2, 16), (16, 128, 8, 2), (32, 32, 4, 2, 16), (16, 32, 4, 2, 16), (32, 64, 8, 2, 16),
                 (16, 64, 8, 2, 16), (32, 128, 8, 2, 16)),
        "scores": ((128, 32, 8, 2), (64, 32, 4, 2), (128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 8, 3),
                   (64, 32, 8, 2), (128, 32, 4, 2)),
    },
    "prod-125m": {
        "forward": ((128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3), (128, 128, 8, 2), (64, 32, 4, 3),
                    (128, 32, 8, 3), (64, 64, 4, 4), (128, 64, 4, 3)),
        "dq": ((64, 32, 4, 3), (64, 64, 4, 3), (64, 32, 4, 2), (128, 32, 8, 3), (128, 64, 8, 3), (64, 64, 8, 3),
               (32, 32, 4, 3), (64, 32, 4, 4), (128, 64, 8, 2)),
        "dkdv": ((32, 64, 4, 3), (32, 64, 4, 2), (64, 64, 4, 3), (32, 128, 8, 3), (64, 128, 8, 2), (16, 64, 4, 3),
                 (32, 32, 4, 3), (64, 64, 8, 3), (32, 64, 4, 4), (16, 128, 4, 3)),
        "scores": ((64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (64, 128, 8, 2), (64, 32, 4, 2),
                   (128, 128, 8, 2)),
    },
}


class Launches:
    """The kernel calls of one length's inputs (perf.prefill_probe._inputs at the probed layout): call(kind,
    branch, shape) is a no-argument function launching that kernel with that tiling."""

    def __init__(self, seq_len: int, device: torch.device, batch: int, score_rows: int):
        self.x = prefill_probe._inputs(seq_len, device, batch=batch)
        q = self.x["q"]
        g = torch.Generator(device=device).manual_seed(1)
        self.do = torch.randn(q.shape[:3] + (prefill_probe.CFG.head_dim_v,), generator=g, device=device).to(q.dtype)
        self.scale = 1.0 / math.sqrt(prefill_probe.CFG.head_dim_qk)
        self.score_rows = score_rows
        self.forwards: dict[str, tuple] = {}

    def max_width(self, branch: str | None) -> int | None:
        """The branch's longest range, which its forward's tile follows (None: the scores kernel)."""
        return None if branch is None else self.x["max_width"][branch]

    def call(self, kind: str, branch: str | None, shape: tuple[int, ...]) -> Callable[[], object]:
        x, scale = self.x, self.scale
        q, t = x["q"], prefill_probe._tiling(shape)
        if kind == "scores":
            lo, hi = x["cmp"]
            r0 = max(0, q.shape[1] - self.score_rows)
            lo, hi = lo[r0:].contiguous(), hi[r0:].contiguous()
            lse2 = x["cmp_lse2"][:, r0:].contiguous()
            width = max(1, int((hi - lo + 1).max()))
            return lambda: group_scores(q[:, r0:], x["k_cmp"], lo, hi, lse2, width, scale, tiling=t)
        k, v = x[f"k_{branch}"], x[f"v_{branch}"]
        lo, hi = x[branch]
        if kind == "forward":
            return lambda: range_attention_forward(q, k, v, lo, hi, scale, tiling=t)
        if branch not in self.forwards:
            self.forwards[branch] = range_attention_forward(q, k, v, lo, hi, scale, max_width=self.max_width(branch))
        o, lse2 = self.forwards[branch]
        dq = t if kind == "dq" else prefill_probe._default_tiling("dq", q.dtype)
        dkdv = t if kind == "dkdv" else prefill_probe._default_tiling("dkdv", q.dtype)
        return lambda: range_attention_backward(q, k, v, lo, hi, o, lse2, self.do, scale, dq_tiling=dq,
                                                dkdv_tiling=dkdv)


def cases(candidates: dict) -> list[tuple[str, str | None, tuple[int, ...]]]:
    """(kind, branch, tiling) of the screen: every candidate of each range kernel on both branches, then the
    scores kernel's (no branch: it reads the compressed tokens)."""
    return ([(kind, branch, shape) for branch in BRANCHES for kind in KINDS[:3] for shape in candidates[kind]]
            + [("scores", None, shape) for shape in candidates["scores"]])


def is_entry(kind: str, shape: tuple[int, ...], max_width: int | None = None) -> bool:
    """Whether shape is the launch table's tiling of the kernel (the forward's for ranges of max_width keys)."""
    return prefill_probe._tiling(shape) == prefill_probe._default_tiling(kind, torch.bfloat16, max_width)


def timed(launches: Launches, kind: str, branch: str | None, shape: tuple[int, ...], rep_ms: int) -> float | None:
    """The median ms of one launch, None where the GPU cannot fit the tiling."""
    run = launches.call(kind, branch, shape)
    _, error = launched(run)
    return None if error is not None else bench_ms(run, rep_ms)


def finalists(screen_rows: list[dict], keep: int = FINALISTS) -> list[tuple[str, str | None, tuple[int, ...]]]:
    """Per (kind, branch) of the screen: the `keep` fastest tilings that ran and the entry, in ascending order."""
    out = []
    for kind, branch in dict.fromkeys((r["kind"], r["branch"]) for r in screen_rows):
        group = [r for r in screen_rows if (r["kind"], r["branch"]) == (kind, branch)]
        ran = sorted((r for r in group if r["ms"] is not None), key=lambda r: r["ms"])
        shapes = {tuple(r["tiling"]) for r in ran[:keep]} | {tuple(r["tiling"]) for r in group if r["entry"]}
        out += [(kind, branch, shape) for shape in sorted(shapes)]
    return out


def round_order(finals: list, n_rounds: int) -> list[tuple[int, tuple]]:
    """(round, case) in the order they are timed: the finalists as listed, reversed every other round."""
    return [(rnd, case) for rnd in range(n_rounds) for case in (finals if rnd % 2 == 0 else finals[::-1])]


def medians(rows: list[dict]) -> dict[tuple, float]:
    """(seq_len, kind, branch, tiling) -> the median ms of its rounds."""
    times: dict[tuple, list[float]] = {}
    for r in rows:
        if r["pass"] != "screen" and r["ms"] is not None:
            times.setdefault((r["seq_len"], r["kind"], r["branch"], tuple(r["tiling"])), []).append(r["ms"])
    return {key: median(ms) for key, ms in times.items()}


def screen(make: Callable[[int], Launches], seq_len: int, confirm: list[int], candidates: dict, n_rounds: int,
           rep_ms: int) -> list[dict]:
    """The screen at seq_len, then the rounds at seq_len and each confirming length (module docstring)."""
    launches = make(seq_len)
    rows = printed_rows({"seq_len": seq_len, "pass": "screen", "kind": kind, "branch": branch, "tiling": list(shape),
                         "entry": is_entry(kind, shape, launches.max_width(branch)),
                         "ms": timed(launches, kind, branch, shape, rep_ms)}
                        for kind, branch, shape in cases(candidates))
    finals = finalists(rows)
    for length in [seq_len, *confirm]:
        if length != seq_len:
            del launches  # one length's inputs at a time
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            launches = make(length)
        rows += printed_rows({"seq_len": length, "pass": f"round {rnd}", "kind": kind, "branch": branch,
                              "tiling": list(shape), "entry": is_entry(kind, shape, launches.max_width(branch)),
                              "ms": timed(launches, kind, branch, shape, rep_ms)}
                             for rnd, (kind, branch, shape) in round_order(finals, n_rounds))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_probe_arguments(parser, "range_screen", CANDIDATES, seq_len=65536, rep_ms=200)
    parser.add_argument("--confirm-seq-lens", default="", help="comma list of lengths the finalists are timed at too")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the finalists per length")
    parser.add_argument("--score-rows", type=int, default=8192, help="the last rows the scores kernel reads")
    args = parser.parse_args(argv)
    check_probe_arguments(parser, args)
    try:
        confirm = [int(s) for s in args.confirm_seq_lens.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--confirm-seq-lens must be a comma list of integers, got {args.confirm_seq_lens!r}")
    if any(n < 1 for n in confirm) or args.rounds < 1:
        parser.error(f"--confirm-seq-lens and --rounds must be >= 1, got {confirm} and {args.rounds}")
    prefill_probe.CFG = prefill_probe.LAYOUTS[args.layout]
    device = torch.device("cuda")
    rows = screen(lambda n: Launches(n, device, args.batch, args.score_rows), args.seq_len, confirm,
                  CANDIDATES[args.layout], args.rounds, args.rep_ms)
    write_probe_report(args.out, "range_screen",
                       f"triton.testing.do_bench median (L2 flushed), rep {args.rep_ms} ms; layout {args.layout}, "
                       f"batch {args.batch}, screen at T = {args.seq_len}, {args.rounds} rounds at T = "
                       f"{[args.seq_len, *confirm]}; scores over the last {args.score_rows} rows", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
