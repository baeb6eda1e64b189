"""python -m conformance.spread: over many draws it tells an implementation that loses precision from rounding
luck. A planted float32 implementation whose outputs carry 32 units of float32 rounding too many sits above
budget on most draws; the control (this project's `optimized`) stays under it."""

from __future__ import annotations

import csv
import statistics
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from conformance import spread
from conformance.adapters import Capabilities, load_impl
from conformance.cards import CARDS, Card


def _imprecise_forward(q, kv, gates, cfg, phi=None):
    """The reference on its float32 inputs, every output scaled by (1 + 32 eps): a systematic loss of precision."""
    out = load_impl("reference").nsa_forward(q, kv, gates, cfg, phi)
    c = 1 + 32 * torch.finfo(torch.float32).eps
    return replace(out, o=out.o * c, o_cmp=out.o_cmp * c, o_slc=out.o_slc * c, o_win=out.o_win * c)


IMPRECISE = SimpleNamespace(NAME="imprecise", CAPABILITIES=Capabilities(precision="float32",
                                                                         stages=frozenset({"nsa_forward"})),
                            nsa_forward=_imprecise_forward)


@pytest.fixture
def imprecise_card(monkeypatch):
    monkeypatch.setitem(CARDS, "imprecise", Card("test_conformance_spread:IMPRECISE", "cpu", "equal_blocks",
                                                 ("phi=avg",), ()))
    return "imprecise"


def read(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_gradients_tell_a_loss_of_precision_from_the_control(imprecise_card, tmp_path):
    assert spread.main([imprecise_card, "--check", "gradients", "--draws", "4", "--max-t", "10",
                        "--out", str(tmp_path)]) == 0
    rows = read(tmp_path / "spread-imprecise-gradients.csv")
    assert {r["field"] for r in rows} >= {"o", "dq", "dgates"} and len({r["draw"] for r in rows}) == 4
    for field in ("o", "dq"):
        impl = [float(r["impl_ratio"]) for r in rows if r["field"] == field]
        control = [float(r["control_ratio"]) for r in rows if r["field"] == field]
        assert statistics.median(impl) > 1, (field, impl)
        assert max(control) <= 1, (field, control)
    text = (tmp_path / "spread-imprecise-gradients.md").read_text()
    assert "| o |" in text and "4 draws" in text
    assert "`python -m conformance.spread imprecise --check gradients --draws 4 --max-t 10 --out DIR`" in text


def test_large_logits_list_the_floor_and_the_ratio_without_it(imprecise_card, tmp_path):
    assert spread.main([imprecise_card, "--check", "large_logits", "--draws", "2", "--max-t", "10",
                        "--out", str(tmp_path)]) == 0
    rows = read(tmp_path / "spread-imprecise-large_logits.csv")
    assert {r["field"] for r in rows} == {"o_cmp", "o_slc", "o_win", "o"}
    for r in rows:
        floor, ref = float(r["floor"]), float(r["reference_error"])
        assert floor > 0
        assert float(r["impl_ratio"]) == pytest.approx(float(r["impl_error"]) / (2 * ref + 1e-6 + floor))
        assert float(r["impl_ratio_no_floor"]) == pytest.approx(float(r["impl_error"]) / (2 * ref + 1e-6))
    assert "without the floor" in (tmp_path / "spread-imprecise-large_logits.md").read_text()


def test_bad_arguments_get_one_line(imprecise_card, tmp_path, capsys):
    with pytest.raises(SystemExit):
        spread.main([imprecise_card, "--check", "large_logits", "--branch", "slc", "--out", str(tmp_path)])
    assert "--branch applies to --check gradients" in capsys.readouterr().err
