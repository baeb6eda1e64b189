"""conformance.cards without running a card: the pytest command line each card gets, and the refusals of bad usage
(one line, exit 2, before any card starts)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conformance import cards

REPO = Path(__file__).resolve().parent.parent


def test_a_card_runs_the_properties_under_the_library_conventions(tmp_path):
    cmd = cards.card_command("fla-parallel", tmp_path / "out", tmp_path / "baseline.json")
    assert cmd[1:3] == ["-m", "pytest"]
    assert cmd[cmd.index("--impl") + 1] == "conformance.adapters.fla_nsa:PARALLEL"
    assert cmd[cmd.index("--device") + 1] == "cuda"
    assert cmd[cmd.index("--preset") + 1] == "equal_blocks" and "phi=avg" in cmd
    assert cmd[cmd.index("--report-name") + 1] == "fla-parallel-cuda"
    assert "--properties-only" in cmd
    assert "-n" not in cmd and "--update-baseline" not in cmd and "--expect-baseline-verdicts" not in cmd


def test_workers_baseline_update_and_check_reach_pytest(tmp_path):
    cmd = cards.card_command("fla-naive", tmp_path, tmp_path / "b.json", workers=6, update_baseline=True, check=True)
    assert cmd[cmd.index("-n") + 1] == "6"
    assert "--update-baseline" in cmd and "--expect-baseline-verdicts" in cmd


@pytest.mark.parametrize("args, message", [
    (["no-such-card"], "unknown card(s) ['no-such-card']"),
    (["fla-naive", "--workers", "0"], "--workers and --jobs must be at least 1"),
    (["fla-naive", "--jobs", "0"], "--workers and --jobs must be at least 1"),
])
def test_bad_usage_is_refused_before_any_card_runs(tmp_path, args, message):
    done = subprocess.run([sys.executable, "-m", "conformance.cards", *args, "--out", str(tmp_path / "out")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert message in done.stderr
    assert not (tmp_path / "out").exists()


def test_each_card_runs_under_its_hypothesis_profile():
    """The GPU card does not shrink (each shrink step compiles the library's kernels anew); CPU cards do. The
    profile is part of a card's baseline key, so it belongs to the card, not to one command line."""
    assert cards.CARDS["fla-parallel"].hypothesis_profile == "ci-no-shrink"
    assert {cards.CARDS[n].hypothesis_profile for n in ("fla-naive", "native-sparse-attention-pytorch")} == {"ci"}
    import hypothesis

    no_shrink = hypothesis.settings.get_profile("ci-no-shrink")
    assert no_shrink.max_examples == hypothesis.settings.get_profile("ci").max_examples
    assert hypothesis.Phase.shrink not in hypothesis.settings.get_profile("ci-no-shrink").phases
