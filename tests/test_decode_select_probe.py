"""perf/decode_select_probe.py in the interpreter: the variants that only reorganise the select kernel's work (tile,
rounds) give the kernel's own top-n lists, so the probe's GPU timings compare like for like; the variants that drop
work (no_top_n, top_n_only) do not."""

import torch

from perf import decode_select_probe as probe


def test_probe_variants_compute_the_kernels_lists():
    x = probe.inputs(batch=1, context=4096, splits=2, device=torch.device("cpu"))
    lists = {}
    for variant in probe.VARIANTS:
        run, out = probe.launcher(x, lists=4, splits=2, variant=variant)
        run()
        lists[variant] = out.clone()
    full = lists["full (1 warp)"]
    assert (full[:, :, :probe.N_SEL] >= 0).all()  # every list holds n real blocks (64 blocks per list here)
    for variant in ("full (4 warps)", *probe.COMPARED):
        assert torch.equal(lists[variant], full), variant
    assert not torch.equal(lists["no_top_n"], full) and not torch.equal(lists["top_n_only"], full)
