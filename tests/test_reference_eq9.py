"""Eq. 9 in the reference: the literal double sum reproduces the hand-derived weights.

weight(i -> j) is read off the literal loop by feeding one-hot p_cmp rows; the expectation is derived
independently, from token sets: |tokens(cmp block i) & tokens(sel block j)| / d (docs/spec.md, Eq. 9).
"""

import pytest

from reference.config import NSAConfig
from reference.selection import pool_to_selection_blocks


def weights_from_literal_loop(cfg: NSAConfig, n_cmp: int, n_sel: int) -> dict[tuple[int, int], float]:
    out = {}
    for i in range(n_cmp):
        one_hot = [1.0 if x == i else 0.0 for x in range(n_cmp)]
        for j, w in enumerate(pool_to_selection_blocks(one_hot, n_sel, cfg)):
            if w:
                out[(i, j)] = w
    return out


def weights_from_token_overlap(cfg: NSAConfig, n_cmp: int, n_sel: int) -> dict[tuple[int, int], float]:
    out = {}
    for i in range(n_cmp):
        cmp_tokens = set(range(i * cfg.cmp_stride, i * cfg.cmp_stride + cfg.cmp_block))
        for j in range(n_sel):
            sel_tokens = set(range(j * cfg.sel_block, (j + 1) * cfg.sel_block))
            shared = len(cmp_tokens & sel_tokens)
            if shared:
                out[(i, j)] = shared / cfg.cmp_stride
    return out


def test_paper_config_weights_are_1_2_2_2_1_over_blocks_4j_minus_1_to_4j_plus_3():
    cfg = NSAConfig()  # l=32, d=16, l'=64
    n_cmp, n_sel = 40, 9
    weights = weights_from_literal_loop(cfg, n_cmp, n_sel)
    for j in range(1, n_sel - 1):
        got = [weights.get((i, j), 0.0) for i in range(4 * j - 2, 4 * j + 5)]
        assert got == [0.0, 1.0, 2.0, 2.0, 2.0, 1.0, 0.0], f"selection block {j}"
    # block 0 has no compressed block -1: weights 2,2,2,1 over blocks 0..3
    assert [weights.get((i, 0), 0.0) for i in range(5)] == [2.0, 2.0, 2.0, 1.0, 0.0]
    # a fully covered selection block collects (l'/d) * (l/d) = 8 in total
    assert sum(w for (i, j), w in weights.items() if j == 4) == 8.0


@pytest.mark.parametrize(
    "l, d, lp",
    [(32, 16, 64), (16, 16, 64), (64, 16, 64), (32, 8, 64), (48, 16, 96), (8, 4, 24), (64, 64, 64), (4, 1, 8)],
)
def test_literal_double_sum_equals_token_overlap_over_d(l, d, lp):
    cfg = NSAConfig(cmp_block=l, cmp_stride=d, sel_block=lp)
    n_sel = 6
    n_cmp = (n_sel * lp - l) // d + 1
    assert weights_from_literal_loop(cfg, n_cmp, n_sel) == weights_from_token_overlap(cfg, n_cmp, n_sel)


def test_missing_compressed_blocks_contribute_nothing():
    cfg = NSAConfig()
    p_cmp = [1.0, 1.0, 1.0]  # blocks 0..2 visible (e.g. p = 63): block 3 (tokens 48-79) is not there yet
    assert pool_to_selection_blocks(p_cmp, 2, cfg) == [6.0, 0.0]


def test_zero_based_reading_of_the_printed_index_is_shifted():
    """The printed index (l'/d)*j - m - n read with 0-based vectors scores block j with tokens of block j-1:
    for j = 1 it covers compressed blocks 0..4 = tokens 0..95, i.e. mostly selection block 0 (docs/spec.md)."""
    cfg = NSAConfig()
    per_sel, per_cmp = cfg.pieces_per_sel_block, cfg.pieces_per_cmp_block
    shifted = sorted({per_sel * 1 - m - n for m in range(per_sel) for n in range(per_cmp)})
    assert shifted == [0, 1, 2, 3, 4]
    tokens = set()
    for i in shifted:
        tokens |= set(range(i * cfg.cmp_stride, i * cfg.cmp_stride + cfg.cmp_block))
    in_block_0 = len(tokens & set(range(0, 64)))
    in_block_1 = len(tokens & set(range(64, 128)))
    assert (in_block_0, in_block_1) == (64, 32)
    # the reference's reading covers compressed blocks 3..7 = tokens 48..143 for j = 1
    overlap = weights_from_literal_loop(cfg, 12, 3)
    assert sorted(i for (i, j) in overlap if j == 1) == [3, 4, 5, 6, 7]
