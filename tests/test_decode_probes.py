"""The decode kernel probes in the interpreter (fp32), so their GPU timings compare like for like:
- perf/decode_select_probe.py: the variants that only reorganise the select kernel's work (tile, rounds) give the
  kernel's own top-n lists; the variants that drop work (no_top_n, top_n_only) do not;
- perf/decode_cmp_probe.py: other key-tile rows and split counts of the compressed split kernel write the lean
  launch's logits (the same dot products; only the partials' split boundaries move)."""

import torch

from perf import decode_cmp_probe as cmp_probe
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


def test_cmp_probe_launch_shapes_write_the_lean_launchs_logits():
    x = cmp_probe.inputs(batch=1, context=1024, device=torch.device("cpu"), dtype=torch.float32)  # 63 tokens
    lean_run, lean_logits = cmp_probe.launcher(x, 1, *cmp_probe.LEAN)
    lean_run()
    assert torch.isfinite(lean_logits).all()
    for block_n, splits in ((16, 1), (16, 3), (32, 2)):
        run, logits = cmp_probe.launcher(x, splits, block_n, 4, 2)
        run()
        assert torch.equal(logits, lean_logits), (block_n, splits)
