"""Bug: a compressed block becomes visible one token before its last key (Eq. 7 read as i*d + l - 2 <= p,
e.g. an off-by-one between 1-based t and 0-based p, or `(p - l) // d + 1` blocks instead of `(p + 1 - l) // d + 1`).
The query at p = i*d + l - 2 then reads a summary of key p + 1: it peeks one token into the future.

Patch: optimized.masks.compressed_block_visible (used by prefill, scoring and the decode cache).
Caught by: No peeking (perturbing key i*d + l - 1 changes the output at i*d + l - 2).
"""

from optimized import masks

from conformance.selftest.variants import optimized_variant


def compressed_block_visible_one_early(block_idx, pos, cfg):
    last_key = block_idx * cfg.cmp_stride + (cfg.cmp_block - 1)
    return last_key - 1 <= pos if cfg.cmp_visibility == "inclusive" else last_key - 1 < pos


masks.compressed_block_visible = compressed_block_visible_one_early
IMPL = optimized_variant("cmp_visible_early")
