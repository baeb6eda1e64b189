"""The decode kernel probes in the interpreter (fp32), so their GPU timings compare like for like:
- perf/decode_select_probe.py: every variant (the step's score + select launches under other score tilings, each
  launch alone, the previous single kernel) gives the step's top-n lists, and those hold n real blocks;
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
    step = lists["step"]
    assert (step[:, :, :probe.N_SEL] >= 0).all()  # every list holds n real blocks (64 blocks per list here)
    for variant, got in lists.items():
        assert torch.equal(got, step), variant


def test_cmp_probe_launch_shapes_write_the_lean_launchs_logits():
    x = cmp_probe.inputs(batch=1, context=1024, device=torch.device("cpu"), dtype=torch.float32)  # 63 tokens
    lean_run, lean_logits = cmp_probe.launcher(x, 1, *cmp_probe.LEAN)
    lean_run()
    assert torch.isfinite(lean_logits).all()
    for block_n, splits in ((16, 1), (16, 3), (32, 2)):
        run, logits = cmp_probe.launcher(x, splits, block_n, 4, 2)
        run()
        assert torch.equal(logits, lean_logits), (block_n, splits)


def test_prefill_probe_variants_agree(monkeypatch):
    """perf/prefill_probe.py in the interpreter (fp32, T = 512, 8 q heads in 2 groups, d = 16): every
    scoring-chunk budget gives the default budget's indices with a different number of chunks, and the other
    tilings of the group-scores and range-attention kernels compute the default tiling's values (up to the fp32
    summation order), as do the backward's D variants (fp32 inputs: D0 and the consistent D agree closely) and its
    dk/dv steps and its dq and forward programs over several heads at once, and its dk/dv rows in each tile's own
    parts or in shared chunks."""
    from perf import prefill_probe
    from reference.config import NSAConfig

    monkeypatch.setattr(prefill_probe, "CFG", NSAConfig.preset("paper", n_heads=8, n_kv_heads=2, head_dim_qk=16,
                                                                head_dim_v=16, window=64))
    monkeypatch.setattr(prefill_probe, "bench_ms", lambda fn, rep_ms: 1.0)
    monkeypatch.setattr(prefill_probe, "BUDGETS_MIB", (24, 1 / 64, 1 / 256))
    monkeypatch.setattr(prefill_probe, "SCORE_TILINGS", ((16, 16, 4, 1), (32, 16, 4, 1), (16, 32, 4, 1)))
    monkeypatch.setattr(prefill_probe, "RANGE_TILINGS", ((16, 16, 4, 1), (32, 16, 4, 1), (32, 16, 4, 1, 4)))
    monkeypatch.setattr(prefill_probe, "BACKWARD_VARIANTS", (
        (False, (16, 16, 4, 1), (16, 16, 4, 1)), (True, (16, 16, 4, 1), (16, 16, 4, 1)),
        (True, (16, 16, 4, 1), (16, 32, 4, 1)), (True, (32, 16, 4, 1), (16, 16, 4, 1))))
    x = prefill_probe._inputs(512, torch.device("cpu"), torch.float32)
    scale = 16 ** -0.5
    selection = prefill_probe.probe_selection(x, rep_ms=1)
    assert all(row["same_indices"] for row in selection)
    assert len({row["chunks"] for row in selection}) == 3
    scores = prefill_probe.probe_scores(x, rows=64, scale=scale, rep_ms=1)
    assert max(row["max_abs_diff_vs_default"] for row in scores) < 1e-4
    ranges = prefill_probe.probe_range(x, scale, rep_ms=1)
    assert {row["branch"] for row in ranges} == {"cmp", "win"}
    assert max(row["max_abs_diff_vs_default"] for row in ranges) < 1e-5
    backward = prefill_probe.probe_backward(x, scale, rep_ms=1)
    assert len(backward) == 2 * len(prefill_probe.BACKWARD_VARIANTS)
    assert max(row["max_abs_grad_diff_vs_first"] for row in backward) < 1e-5
    monkeypatch.setattr(prefill_probe, "HEADS_DKDV_TILINGS", ((16, 16, 4, 1, 4), (32, 16, 4, 1, 2)))
    monkeypatch.setattr(prefill_probe, "HEADS_DQ_TILINGS", ((32, 16, 4, 1, 4),))
    heads = prefill_probe.probe_heads(x, scale, rep_ms=1)
    assert [(row["dq_tiling"][4], row["dkdv_tiling"][4]) for row in heads] == [(1, 1), (1, 4), (1, 2), (4, 1)] * 2
    assert max(row["max_abs_grad_diff_vs_first"] for row in heads) < 1e-5
    monkeypatch.setattr(prefill_probe, "ROW_SPLIT_FACTORS", (1, 2))
    # fewer programs in the interpreter: 2 own parts, 3 shared chunks
    monkeypatch.setattr(prefill_probe, "dkdv_parts", lambda chunked, *args: 3 if chunked else 2)
    rows = prefill_probe.probe_rows(prefill_probe._inputs(160, torch.device("cpu"), torch.float32), scale, rep_ms=1)
    assert [row["rows"] for row in rows] == ["own parts", "own parts", "shared chunks", "shared chunks"] * 2
    assert [row["split"] for row in rows] == [2, 4, 3, 6] * 2
    assert sum(row["default"] for row in rows) == 2  # one per branch: this small case keeps its own parts
    assert max(row["max_abs_grad_diff_vs_first"] for row in rows) < 1e-5


def test_prefill_probe_layouts_and_batch(monkeypatch):
    """--layout picks the heads and head dims the probes build their inputs with, and --batch's sequences enter the
    inputs and the useful FLOP count (two sequences: twice one's)."""
    from perf import prefill_probe

    prod = prefill_probe.LAYOUTS["prod-125m"]
    assert (prod.n_heads, prod.n_kv_heads, prod.head_dim_qk, prod.head_dim_v) == (12, 2, 64, 64)
    wide = prefill_probe.LAYOUTS["paper-dk192"]  # the paper's own head dims, NSAConfig's defaults
    assert (wide.n_heads, wide.n_kv_heads, wide.head_dim_qk, wide.head_dim_v) == (64, 4, 192, 128)
    monkeypatch.setattr(prefill_probe, "CFG", prod.replace(window=32))
    monkeypatch.setattr(prefill_probe, "bench_ms", lambda fn, rep_ms: 1.0)
    monkeypatch.setattr(prefill_probe, "RANGE_TILINGS", ((16, 16, 4, 1),))
    one = prefill_probe._inputs(64, torch.device("cpu"), torch.float32)
    two = prefill_probe._inputs(64, torch.device("cpu"), torch.float32, batch=2)
    assert one["q"].shape == (1, 64, 12, 64) and two["q"].shape == (2, 64, 12, 64)
    assert two["k_cmp"].shape[0] == two["v_win"].shape[0] == 2
    flops = {x["q"].shape[0]: {row["branch"]: row["tflops"] for row in prefill_probe.probe_range(x, 0.125, 1)}
             for x in (one, two)}
    assert flops[2] == {branch: 2 * value for branch, value in flops[1].items()}


def test_prefill_probe_rows_for_tiles_the_gpu_cannot_fit(monkeypatch):
    """A tile the GPU cannot launch (out of shared memory) gives a row with the error and no time, for the range
    forward, the backward and the scores probes, and each probe goes on with the next tile."""
    from triton.runtime.errors import OutOfResources

    from perf import prefill_probe
    from reference.config import NSAConfig

    monkeypatch.setattr(prefill_probe, "CFG", NSAConfig.preset("paper", n_heads=4, n_kv_heads=2, head_dim_qk=16,
                                                                head_dim_v=16, window=32))
    monkeypatch.setattr(prefill_probe, "bench_ms", lambda fn, rep_ms: 1.0)
    too_big = prefill_probe._tiling((32, 16, 4, 1))
    monkeypatch.setattr(prefill_probe, "SCORE_TILINGS", ((16, 16, 4, 1), (32, 16, 4, 1)))
    monkeypatch.setattr(prefill_probe, "RANGE_TILINGS", ((32, 16, 4, 1), (16, 16, 4, 1)))
    monkeypatch.setattr(prefill_probe, "BACKWARD_VARIANTS", ((True, (16, 16, 4, 1), (16, 16, 4, 1)),
                                                             (True, (32, 16, 4, 1), (16, 16, 4, 1))))

    def short_of_memory(fn, tiling_names):
        def run(*args, **kwargs):
            if any(kwargs.get(name) == too_big for name in tiling_names):
                raise OutOfResources(247808, 232448, "shared memory")
            return fn(*args, **kwargs)
        return run

    for fn, names in (("range_attention_forward", ("tiling",)), ("group_scores", ("tiling",)),
                      ("range_attention_backward", ("dq_tiling", "dkdv_tiling"))):
        monkeypatch.setattr(prefill_probe, fn, short_of_memory(getattr(prefill_probe, fn), names))
    x = prefill_probe._inputs(128, torch.device("cpu"), torch.float32)
    rows = (prefill_probe.probe_range(x, 0.25, rep_ms=1) + prefill_probe.probe_backward(x, 0.25, rep_ms=1)
            + prefill_probe.probe_scores(x, rows=32, scale=0.25, rep_ms=1))
    failed = [row for row in rows if row["ms"] is None]
    assert len(failed) == 5  # range and backward per branch, scores once
    assert all("shared memory" in row["error"] and "tflops" not in row for row in failed)
    assert all(row["ms"] == 1.0 for row in rows if row["ms"] is not None) and len(rows) == 10
