"""Report cards of the public NSA libraries: the conformance suite run on each shipped adapter under the library's
own conventions (conformance/adapters/), written as <card>-<device>.md and .json.

    python -m conformance.cards --out DIR [NAME ...]            # run the cards (default: those for this machine)
    python -m conformance.cards --check --out DIR               # CI: pass iff every verdict and test count equals
                                                                #   the committed baseline entry of each card
    python -m conformance.cards --update-baseline --out DIR ... # also write DIR/conformance-baseline.json: the
                                                                #   committed baseline with these cards' entries

The committed cards live in reports/conformance/thirdparty/ (its README.md explains every FAIL and NOT COVERED);
their entries in reports/baselines/conformance.json. Exit status: 0 when every card ran (and, with --check,
matched), 1 otherwise, 2 when a library is not installed (`pip install -c constraints-cpu.txt -e .[thirdparty]`).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = ROOT / "reports" / "baselines" / "conformance.json"


@dataclass(frozen=True)
class Card:
    impl: str
    device: str
    preset: str  # the library's own conventions: a preset and switches changed from it (--preset, --set)
    sets: tuple[str, ...]
    needs: tuple[str, ...]  # the importable packages
    hypothesis_profile: str = "ci"  # ci-no-shrink: a failing test reports its first failing draw (every shrink
    #   step is a new shape, which a GPU library compiles and autotunes anew: minutes per failing test)

    def pytest_args(self) -> list[str]:
        conventions = ["--preset", self.preset, *(arg for switch in self.sets for arg in ("--set", switch))]
        return ["conformance", "--properties-only", "--impl", self.impl, "--device", self.device, *conventions]


CARDS = {
    "fla-naive": Card("conformance.adapters.fla_nsa:NAIVE", "cpu", "equal_blocks", ("phi=avg", "group_reduce=mean"),
                      ("fla",)),
    "native-sparse-attention-pytorch": Card(
        "conformance.adapters.lucidrains_nsa:IMPL", "cpu", "equal_blocks",
        ("phi=avg", "window_keys=w+1", "cmp_visibility=strict", "selection_score=logits", "group_reduce=mean"),
        ("native_sparse_attention_pytorch",)),
    "fla-parallel": Card("conformance.adapters.fla_nsa:PARALLEL", "cuda", "equal_blocks", ("phi=avg",), ("fla",),
                         hypothesis_profile="ci-no-shrink"),
}


def default_cards() -> list[str]:
    import torch

    devices = {"cpu"} | ({"cuda"} if torch.cuda.is_available() else set())
    return [name for name, card in CARDS.items() if card.device in devices]


def card_command(name: str, out: Path, baseline: Path, *, workers: int = 1, update_baseline: bool = False,
                 check: bool = False) -> list[str]:
    """The pytest command line of one card, run from the repository root."""
    card = CARDS[name]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *card.pytest_args(),
           "--report-dir", os.path.relpath(out, ROOT), "--report-name", f"{name}-{card.device}",
           "--baseline", os.path.relpath(baseline, ROOT)]
    cmd += ["-n", str(workers)] if workers > 1 else []
    cmd += ["--update-baseline"] if update_baseline else []
    cmd += ["--expect-baseline-verdicts"] if check else []
    return cmd


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.cards", description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"cards to run: {', '.join(CARDS)} (default: those whose device this machine has)")
    parser.add_argument("--out", required=True, metavar="DIR", help="folder for the cards (<card>-<device>.md, .json)")
    parser.add_argument("--check", action="store_true",
                        help="pass iff each card's verdicts and test counts equal its committed baseline entry")
    parser.add_argument("--jobs", type=int, default=1, help="cards run at the same time (each on one thread)")
    parser.add_argument("--workers", type=int, default=1,
                        help="pytest-xdist workers inside each card (default 1). A GPU card spends its time compiling "
                             "and autotuning the library's kernels for every shape the strategies draw, on the host")
    parser.add_argument("--update-baseline", action="store_true",
                        help="write DIR/conformance-baseline.json: the committed baseline with these cards' entries")
    args = parser.parse_args(argv)
    names = args.names or default_cards()
    if args.workers < 1 or args.jobs < 1:
        parser.error("--workers and --jobs must be at least 1")
    if args.workers > 1 and importlib.util.find_spec("xdist") is None:
        parser.error("--workers needs pytest-xdist (pip install pytest-xdist)")
    unknown = [n for n in names if n not in CARDS]
    if unknown:
        parser.error(f"unknown card(s) {unknown}; cards are {list(CARDS)}")
    missing = sorted({pkg for n in names for pkg in CARDS[n].needs if importlib.util.find_spec(pkg) is None})
    if missing:
        print(f"conformance.cards: {', '.join(missing)} not installed: pip install -c constraints-cpu.txt "
              "-e '.[thirdparty]' (docs/adapters.md)", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    baseline = BASELINE
    if args.update_baseline:
        baseline = out / "conformance-baseline.json"
        shutil.copy(BASELINE, baseline)
    commands = {name: card_command(name, out, baseline, workers=args.workers, update_baseline=args.update_baseline,
                                   check=args.check) for name in names}
    jobs = 1 if args.update_baseline else max(1, args.jobs)  # the baseline file is written by one card at a time
    failed = []
    running: dict[str, tuple[subprocess.Popen, Path]] = {}
    pending = list(names)
    while pending or running:
        while pending and len(running) < jobs:
            name = pending.pop(0)
            log = out / f".{name}.log"
            print(f"== card {name}: {' '.join(commands[name][1:])}", flush=True)
            with log.open("w") as f:
                env = {**os.environ, "OMP_NUM_THREADS": "1", "HYPOTHESIS_PROFILE": CARDS[name].hypothesis_profile}
                running[name] = (subprocess.Popen(commands[name], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                                  env=env), log)
        name = next(iter(running))
        proc, log = running.pop(name)
        code = proc.wait()
        print(f"== card {name} (exit {code}):\n{log.read_text()}", flush=True)
        log.unlink()
        # a card's FAILs are the library's: without --check, only a run that could not finish fails here
        if code not in ((0,) if args.check else (0, 1)):
            failed.append(f"{name} (exit {code})")
    if failed:
        print(f"conformance.cards: {', '.join(failed)}", file=sys.stderr)
        return 1
    print(f"conformance.cards: {len(names)} card(s) in {out}" + (f"; baseline {baseline}" if args.update_baseline
                                                                 else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
