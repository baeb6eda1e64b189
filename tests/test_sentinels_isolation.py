"""The causal-isolation check: bitwise clean on the untrained model, the first (p, t) reported, every plant caught."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from reference.config import NSAConfig
from reference.packing import cu_seqlens_of
from sentinels.config import load_config
from sentinels.isolation import (PROBE_KINDS, BranchProbe, check_causal_isolation, isolation_length,
                                 measure_determinism, probe_positions, probes_for, summarize)
from sentinels.model import build_model
from sentinels.plants import PLANTS

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny-cpu.yaml"

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def _model(overrides=None):
    cfg = load_config(TINY).replace(**(overrides or {}))
    torch.manual_seed(0)
    return cfg, build_model(cfg)


def _tokens(T: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 64, (1, T), generator=torch.Generator().manual_seed(seed))


def test_isolation_length_exceeds_the_selection_budget():
    tiny = load_config(TINY).model.nsa_config()  # n*l' + w = 4*8 + 8 = 40
    assert isolation_length(tiny, 64) == 64
    assert isolation_length(tiny, 32) > 40 and isolation_length(tiny, 32) % tiny.sel_block == 0
    prod = load_config(ROOT / "configs" / "prod-125m.yaml").model.nsa_config()  # 16*64 + 512 = 1536
    assert isolation_length(prod, 2048) == 2048


def test_probe_positions_cover_the_block_edges():
    tiny = load_config(TINY).model.nsa_config()
    assert probe_positions(tiny, 64) == list(range(1, 64))
    nsa = NSAConfig(cmp_block=32, cmp_stride=16, sel_block=64, n_sel=16, window=512, n_heads=4, n_kv_heads=2,
                    head_dim_qk=16, head_dim_v=16)
    positions = probe_positions(nsa, 2048, n_random=8, seed=3)
    assert positions == sorted(set(positions)) and positions[0] >= 1 and positions[-1] == 2047
    for edge in (16, 32, 64, 1024, 2032):
        assert {edge - 1, edge} <= set(positions)
    assert {511, 512, 1535, 1536} <= set(positions)  # the window edge and the end of n*l' + w
    assert len(positions) < 2048 // 4


def test_clean_model_is_bitwise_isolated():
    cfg, model = _model()
    probes = probes_for(range(1, 64))
    out = check_causal_isolation(model, _tokens(64), probes=probes, vocab=64, rows_per_forward=16)
    assert not out.leaked and out.probes_run == len(probes) == 63 * len(PROBE_KINDS)
    assert out.inert_token_probes == 0 and out.bound_rel == 0.0 and out.noise_rel == 0.0
    assert "no earlier logit moved" in summarize(out)


def test_packed_documents_are_checked_one_probe_per_forward():
    cfg, model = _model({"data.packing": "varlen"})
    cu = cu_seqlens_of([11, 48, 7])
    positions = [1, 9, 10, 11, 12, 40, 58, 59, 60, 65]  # document edges, a selection-block edge, the last token
    out = check_causal_isolation(model, _tokens(66), probes=probes_for(positions), vocab=64, cu_seqlens=cu)
    assert not out.leaked and out.documents == [11, 48, 7] and out.inert_token_probes == 0
    assert out.forwards == 3 * len(positions) * len(PROBE_KINDS)  # unchanged, probe, control


def test_the_first_moved_pair_is_reported():
    """cmp_visible_early: the query i*d + l - 2 reads block i, whose last token i*d + l - 1 is in its future."""
    plant = PLANTS["cmp_visible_early"]
    cfg, model = _model()
    with plant.installed(model):
        out = check_causal_isolation(model, _tokens(64), probes=probes_for(range(1, 64)), vocab=64)
    assert out.first["t"] == 7 and out.first["p"] == 6
    # one position in d = 4 sees the future: 6, 10, ..., 62
    assert out.positions_moved == set(range(6, 64, 4))
    assert "changing t=7 moved the logits at p=6" in summarize(out)


def test_stop_at_first_stops_early():
    cfg, model = _model(PLANTS["kv_next_token"].overrides)
    out = check_causal_isolation(model, _tokens(64), probes=probes_for(range(1, 64)), vocab=64,
                                 rows_per_forward=6, stop_at_first=True)
    assert out.leaked and out.stopped_early and out.forwards == 1


def test_branch_probe_changes_one_branch_at_one_position_the_same_in_any_row():
    from reference.contract import KV, BranchKV

    x = torch.randn(3, 10, 2, 4)
    kv = BranchKV(cmp=KV(x, x + 1), slc=KV(x + 2, x + 3), win=KV(x + 4, x + 5))
    probe = BranchProbe()
    probe.edits = [(1, 5, "slc"), (2, 5, "slc")]
    out = probe(0, kv)
    changed = (out.slc.k != kv.slc.k).any(-1).any(-1)
    assert changed.nonzero().tolist() == [[1, 5], [2, 5]]
    assert torch.equal(out.slc.k[1, 5], out.slc.k[2, 5] - kv.slc.k[2, 5] + kv.slc.k[1, 5])
    assert out.cmp is kv.cmp and out.win is kv.win and torch.equal(out.slc.v[0], kv.slc.v[0])


def test_determinism_measurement_on_cpu():
    cfg, model = _model()
    m = measure_determinism(model, _tokens(64), vocab=64, precision="fp32", repeats=2, rows=4)
    assert m["repeat_max_rel"] == 0.0 and m["in_batch_max_rel"] == 0.0 and m["bound_rel"] == 0.0
