"""The peer comparison of `perf run --preset equal_blocks` on CPU: fla's parallel_nsa is driven through a stand-in of
its signature (its kernels need CUDA), next to SDPA and ours with and without the window branch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from perf import peers
from perf.implementations import parse_impls
from perf.report import markdown, peer_verdicts
from perf.results import OK, Row
from perf.runner import Runner
from perf.spec import LAYER, PASSES, preset
from reference.config import NSAConfig

# l = d = l' (fla's one block size), phi = avg (its mean pooling), a group of 16 heads (its smallest group)
EQUAL = NSAConfig(cmp_block=16, cmp_stride=16, sel_block=16, n_sel=4, n_init=1, n_local=2, window=32, n_heads=16,
                  n_kv_heads=1, head_dim_qk=16, head_dim_v=16, phi="avg")


def tiny_equal_blocks(cfg: NSAConfig = EQUAL):
    return preset("tiny", cfg=cfg, seq_lens=(64,), repeats=2, rounds=1, warmup=0, stages=())


class StandIn:
    """parallel_nsa's signature over plain causal attention (the plumbing, not fla's arithmetic); records its calls."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, g_cmp=None, g_slc=None, g_swa=None, block_indices=None, block_counts=16,
                 block_size=64, window_size=0, scale=None, cu_seqlens=None):
        self.calls.append({"q": q, "k": k, "v": v, "g_cmp": g_cmp, "g_slc": g_slc, "block_counts": block_counts,
                           "block_size": block_size, "window_size": window_size})
        group = q.shape[2] // k.shape[2]
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.repeat_interleave(group, 2).transpose(1, 2),
                                           v.repeat_interleave(group, 2).transpose(1, 2), is_causal=True)
        return o.transpose(1, 2) * (g_cmp + g_slc).unsqueeze(-1)


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_fla_rows_get_the_sweeps_inputs_and_its_block_layout(one_thread):
    stand_in = StandIn()
    fla = peers.FlaNSA(fn=stand_in, needs_cuda=False)
    impls = parse_impls("sdpa,nsa", "optimized")
    rows = Runner(tiny_equal_blocks(), torch.device("cpu"), impls.with_sdpa, impls.variants, log=lambda s: None,
                  peers=[fla]).run()
    assert {(r.impl, r.stage, r.pass_name) for r in rows} == {(i, LAYER, p) for i in ("sdpa", "nsa", "fla")
                                                              for p in PASSES}
    assert all(r.status == OK for r in rows), [(r.key, r.note) for r in rows]
    fla_rows = [r for r in rows if r.impl == "fla"]
    assert all(r.flops is None and peers.FLA_NOTE in r.note for r in fla_rows)  # no work model for another library
    call = stand_in.calls[0]
    assert (call["block_counts"], call["block_size"], call["window_size"]) == (EQUAL.n_sel, EQUAL.sel_block, 0)
    assert call["q"].shape == (1, 64, 16, 16) and call["k"].shape == call["v"].shape == (1, 64, 1, 16)
    assert call["g_cmp"].shape == call["g_slc"].shape == (1, 64, 16)
    # the fwd_bwd case differentiates through every input fla takes
    train = stand_in.calls[-1]
    assert all(train[name].requires_grad for name in ("q", "k", "v", "g_cmp", "g_slc"))


def test_fla_refuses_what_parallel_nsa_cannot_run():
    fla = peers.FlaNSA(fn=StandIn())
    with pytest.raises(ValueError, match="l = d = l'.*phi = 'avg'.*CUDA"):
        fla.check(preset("paper"), torch.device("cpu"))  # l = 32, d = 16; phi mlp; on CPU
    with pytest.raises(ValueError, match="power-of-2 group size >= 16"):
        peers.FlaNSA(fn=StandIn(), needs_cuda=False).check(tiny_equal_blocks(cfg=EQUAL.replace(n_kv_heads=2)),
                                                          torch.device("cpu"))
    peers.FlaNSA(fn=StandIn()).check(preset("equal_blocks"), torch.device("cuda"))


def test_fla_missing_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setattr(peers, "FLA_FUNCTION", "fla_core_is_not_installed.ops:parallel_nsa")
    with pytest.raises(ValueError, match=r"cannot import fla_core_is_not_installed\.ops .*pip install '\.\[fla\]'"):
        parse_impls("sdpa,fla", "optimized")


def test_equal_blocks_preset_times_ours_without_the_window_next_to_fla():
    """The equal-blocks sweep's default rows. `nsa[branches=cmp+slc]` needs `optimized.nsa_forward(...,
    branches=...)` (the layer without its window branch); until nsa_forward takes that keyword this test fails."""
    spec = preset("equal_blocks")
    assert (spec.cfg.cmp_block, spec.cfg.cmp_stride, spec.cfg.sel_block, spec.cfg.n_sel) == (64, 64, 64, 16)
    assert spec.cfg.phi == "avg" and spec.stages == ()
    impls = parse_impls("sdpa,nsa,nsa[branches=cmp+slc]", "optimized")
    assert impls.variants[1].kwargs == {"branches": ("cmp", "slc")}
    rows = Runner(tiny_equal_blocks(), torch.device("cpu"), True, impls.variants, log=lambda s: None,
                  peers=[peers.FlaNSA(fn=StandIn(), needs_cuda=False)]).run()
    assert all(r.status == OK for r in rows), [(r.key, r.note) for r in rows]
    by = {(r.impl, r.pass_name): r for r in rows}
    no_window, full = by[("nsa[branches=cmp+slc]", "fwd")], by[("nsa", "fwd")]
    assert no_window.flops < full.flops  # the window's work is not counted for the row that does not do it


def _row(impl, T, pass_name, ms):
    return Row(seq_len=T, impl=impl, stage=LAYER, pass_name=pass_name, status=OK, median_ms=ms)


def test_peer_verdict_and_table_say_which_rows_are_which():
    rows = [_row("sdpa", 8192, p, 2.0) for p in PASSES] + [_row("fla", 8192, p, 1.0) for p in PASSES]
    rows += [_row("nsa[branches=cmp+slc]", 8192, "fwd", 0.8), _row("nsa[branches=cmp+slc]", 8192, "fwd_bwd", 1.25)]
    lines = peer_verdicts(rows)
    assert lines == ["- nsa[branches=cmp+slc] faster than fla forward at every T from 8k: MET",
                     "- nsa[branches=cmp+slc] faster than fla forward + backward at every T from 8k: NOT MET: "
                     "slower at 8k (1.250 vs 1.000 ms)"]
    text = markdown(rows, {"spec": {"name": "equal_blocks"}}, "", with_markers=False)
    assert "- `fla`: fla parallel_nsa" in text and "- `nsa[branches=cmp+slc]`: ours without the window branch" in text
    assert "| 8k | fwd | 1.000 | 0.800 | 1.25x |" in text  # fla ms, ours ms, fla / ours
