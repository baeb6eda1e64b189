"""perf/selected_probe.py in Triton's interpreter (fp32, tiny shapes): the selections it draws follow Eq. 11's forced
blocks and causality, its gather-only kernel loads exactly the keys and values the forward reads (their sums against
torch's), its byte count is the keys the kernels admit, and every launch setting of the forward, dq and dk/dv
computes the default's result; both kernel probes refuse a non-positive --batch or --seq-len in one line."""

import importlib

import pytest
import torch

from perf import selected_probe
from reference.config import NSAConfig


def test_random_selections_force_block_0_and_the_two_most_recent_and_stay_causal():
    g = torch.Generator().manual_seed(0)
    idx = selected_probe.selections(2, 200, 3, 5, 16, "random", g, torch.device("cpu"))
    assert idx.shape == (2, 200, 3, 5) and idx.dtype == torch.int32
    for t in (0, 15, 16, 47, 120, 199):
        J = t // 16
        for row in idx[:, t].reshape(-1, 5).tolist():
            valid = [b for b in row if b >= 0]
            assert row == valid + [-1] * (5 - len(valid)), row  # valid blocks first, then padding
            assert valid == sorted(set(valid)) and all(0 <= b <= J for b in valid), (t, row)
            assert len(valid) == min(5, J + 1)
            assert {0, J, max(J - 1, 0)} <= set(valid), (t, row)
    assert not torch.equal(idx[0], idx[1])  # drawn, not a fixed pattern
    same = selected_probe.selections(1, 40, 1, 3, 16, "same", g, torch.device("cpu"))
    assert same[0, 39, 0].tolist() == [0, 1, 2] and same[0, 20, 0].tolist() == [0, 1, -1]


def test_gather_kernel_loads_what_the_forward_reads_and_the_bytes_count_those_keys():
    g = torch.Generator().manual_seed(1)
    B, T, Hkv, d_k, d_v, l_sel = 1, 40, 2, 16, 32, 16
    k = torch.randn(B, T, Hkv, d_k, generator=g)
    v = torch.randn(B, T, Hkv, d_v, generator=g)
    idx = selected_probe.selections(B, T, Hkv, 2, l_sel, "random", g, torch.device("cpu"))
    sums = selected_probe.gather_only(k, v, idx, l_sel, selected_probe.Tiling(16, 4, 1))
    keys = 0
    for t in range(T):
        for h in range(Hkv):
            pos = [p for b in idx[0, t, h].tolist() if b >= 0 for p in range(b * l_sel, min((b + 1) * l_sel, t + 1))]
            keys += len(pos)
            want = torch.cat([k[0, pos, h].sum(0), v[0, pos, h].sum(0)])
            torch.testing.assert_close(sums[0, t, h], want, rtol=1e-5, atol=1e-5)
    assert selected_probe.gathered_bytes(idx, l_sel, d_k, d_v, 2) == keys * (d_k + d_v) * 2


def test_every_launch_setting_computes_the_defaults_result(monkeypatch):
    monkeypatch.setattr(selected_probe, "SEL_BLOCK", 16)
    monkeypatch.setattr(selected_probe, "N_SEL", 3)
    monkeypatch.setattr(selected_probe, "bench_ms", lambda fn, rep_ms: 1.0)
    monkeypatch.setattr(selected_probe, "FORWARD_TILINGS", ((16, 4, 1), (16, 2, 1)))
    monkeypatch.setattr(selected_probe, "DQ_TILINGS", ((16, 2, 1),))
    monkeypatch.setattr(selected_probe, "DKDV_TILINGS", ((16, 16, 4, 1), (16, 32, 2, 1), (16, 1, 4, 1)))
    cfg = NSAConfig.preset("paper", n_heads=4, n_kv_heads=2, head_dim_qk=16, head_dim_v=16)
    x = selected_probe._inputs(cfg, 48, 1, "random", torch.device("cpu"), torch.float32)
    rows = list(selected_probe.probe(x, rep_ms=1))
    kernels = [r["kernel"] for r in rows]
    assert set(kernels) == {"gather", "forward", "dq", "dkdv"}
    for kernel in ("gather", "forward", "dq", "dkdv"):
        assert sum(r["default"] for r in rows if r["kernel"] == kernel) == 1, kernel
        assert rows[kernels.index(kernel)]["default"]  # the default runs first
    assert len([r for r in rows if r["kernel"] == "dkdv"]) == 3  # the 1-column setting is below the group's heads
    assert max(r["max_abs_diff_vs_default"] for r in rows if r["kernel"] != "gather") < 1e-5
    assert all(r["gathered_gb"] == rows[0]["gathered_gb"] > 0 for r in rows)


@pytest.mark.parametrize("probe_main", ["selected_probe", "prefill_probe"])
@pytest.mark.parametrize("flag", ["--batch", "--seq-len"])
def test_probes_refuse_a_non_positive_batch_or_length(probe_main, flag, capsys):
    module = importlib.import_module(f"perf.{probe_main}")
    with pytest.raises(SystemExit) as exc:
        module.main([flag, "0"])
    assert exc.value.code == 2
    assert "--batch and --seq-len must be >= 1" in capsys.readouterr().err


def test_a_launch_the_gpu_cannot_fit_is_a_row_with_its_error(monkeypatch):
    """A launch setting that needs more shared memory than the GPU has (64 x 128 dk/dv tiles at d_k = 192) gives a
    row naming the error, without a time, and the probe goes on with the next setting."""
    from triton.runtime.errors import OutOfResources

    monkeypatch.setattr(selected_probe, "SEL_BLOCK", 16)
    monkeypatch.setattr(selected_probe, "N_SEL", 3)
    monkeypatch.setattr(selected_probe, "bench_ms", lambda fn, rep_ms: 1.0)
    monkeypatch.setattr(selected_probe, "FORWARD_TILINGS", ((16, 2, 1), (16, 1, 1)))
    monkeypatch.setattr(selected_probe, "DQ_TILINGS", ((16, 2, 1),))
    monkeypatch.setattr(selected_probe, "DKDV_TILINGS", ((16, 32, 2, 1), (16, 16, 2, 1)))
    forward, dkdv = selected_probe.selected_attention_forward, selected_probe.selected_attention_backward_dkdv

    def forward_short_of_memory(*args, tiling=None, **kwargs):
        if tiling is not None and tiling.num_warps == 2:
            raise OutOfResources(247808, 232448, "shared memory")
        return forward(*args, tiling=tiling, **kwargs)

    def dkdv_short_of_memory(*args):
        if (args[-1].block_cols, args[-1].num_warps) == (32, 2):
            raise OutOfResources(247808, 232448, "shared memory")
        return dkdv(*args)

    monkeypatch.setattr(selected_probe, "selected_attention_forward", forward_short_of_memory)
    monkeypatch.setattr(selected_probe, "selected_attention_backward_dkdv", dkdv_short_of_memory)
    cfg = NSAConfig.preset("paper", n_heads=4, n_kv_heads=2, head_dim_qk=16, head_dim_v=16)
    x = selected_probe._inputs(cfg, 48, 1, "random", torch.device("cpu"), torch.float32)
    rows = list(selected_probe.probe(x, rep_ms=1))
    failed = [r for r in rows if r["ms"] is None]
    assert [(r["kernel"], r["tiling"]) for r in failed] == [("forward", [16, 2, 1]), ("dkdv", [16, 32, 2, 1])]
    assert all("shared memory" in r["error"] and "gb_per_s" not in r for r in failed)
    # the probe went on past each failed setting
    assert [r["tiling"] for r in rows if r["kernel"] == "forward"][-1] == [16, 1, 1]
    assert [r["tiling"] for r in rows if r["kernel"] == "dkdv"][-1] == [16, 16, 2, 1]
    assert all(r["ms"] == 1.0 for r in rows if r not in failed)
