"""Known-broken variants of the optimized implementation, one module each, for the suite's self-test.

Each variant module plants ONE bug that public NSA code has shipped (or that the paper's text invites), by
replacing one convention seam of `optimized` (optimized.masks and friends are looked up at call time, so a
replaced attribute changes prefill, scoring and decode alike) or by a thin adapter around `optimized` that
changes one thing. Importing a variant module applies its patch to the process: load exactly one variant per
process (`--impl conformance.selftest.variants.<name>:IMPL`), as test_selftest.py does with a subprocess each.

CATALOG maps each variant to the property modules (or single tests, `module.py::test`) expected to catch it: the
self-test runs only those, with `pytest -x`, and requires at least one FAIL caused by an assertion. Each blind spot
that public libraries fell into has its variant caught by the test written for it.
"""

from __future__ import annotations

from types import SimpleNamespace

CATALOG: dict[str, tuple[str, ...]] = {
    "cmp_visible_early": ("conformance/test_no_peeking.py",),
    "window_off_by_one": ("conformance/test_small_t_equivalence.py",),
    "eq9_zero_based": ("conformance/test_eq9_overlap.py",),
    "per_head_selection": ("conformance/test_gqa_consistency.py",),
    "tie_break_run_dependent": ("conformance/test_tie_break.py",),
    "decode_top_left_mask": ("conformance/test_decode_reads.py",),
    "finite_mask_fill": ("conformance/test_numerical_safety.py",),
    "decode_reads_formula": ("conformance/test_decode_reads.py",),
    "v_rotated": ("conformance/test_module.py",),
    "cache_emits_late": ("conformance/test_decode_reads.py",),
    "cmp_straddles_boundary": ("conformance/test_packed_sequences.py",),
    # blind spots of public NSA libraries, each caught by the test written for it
    "slc_padding_reads_block0": ("conformance/test_small_t_equivalence.py::test_selected_stage_on_sparse_index_sets",),
    "forced_finite_score": (
        "conformance/test_tie_break.py::test_forced_blocks_and_selection_size_whatever_the_scores",),
    "top_n_epsilon": ("conformance/test_tie_break.py::test_end_to_end_selection_size_and_forced_blocks",),
    "scores_see_future_blocks": ("conformance/test_no_peeking.py::test_prefill_end_to_end",),
    "decode_shared_one_key": ("conformance/test_decode_reads.py::test_decode_equals_the_reference",),
    "module_sees_next_token": ("conformance/test_no_peeking.py::test_black_box_module",),
    "module_mixes_batch": ("conformance/test_module.py::test_black_box_batch_rows_are_independent",),
}


def optimized_variant(name: str, **replaced) -> SimpleNamespace:
    """optimized's contract stages (and its NSADecodeCache) under the name optimized[<name>], with the given
    stages replaced; unreplaced stages still run optimized's code, so a patched seam reaches them."""
    import optimized
    from optimized.decode import NSADecodeCache

    from conformance.adapters import EVERYTHING, STAGES

    stages = {stage: getattr(optimized, stage) for stage in STAGES if hasattr(optimized, stage)}
    stages["NSADecodeCache"] = NSADecodeCache
    stages.update(replaced)
    stages = {stage: fn for stage, fn in stages.items() if fn is not None}  # None: the variant drops that stage
    return SimpleNamespace(NAME=f"optimized[{name}]", CAPABILITIES=EVERYTHING, **stages)
