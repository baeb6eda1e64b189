"""Bug: Eq. 9 read with 0-based vector indices, literally p_slc[j] = sum_m sum_n p_cmp[(l'/d) j - m - n]:
selection block j is then scored mostly by the compressed blocks of block j - 1 (docs/spec.md). A Rust NSA
port shipped this reading.

Patch: optimized.masks.eq9_pool_weights returns the band of the literal 0-based index: offsets
-(l'/d - 1) - (l/d - 1) .. 0 relative to (l'/d) j, weighted by how many (m, n) pairs reach each offset.
Caught by: CSR overlap scoring (scores differ from the printed double sum read 1-based / from token overlap).
"""

from collections import Counter

from optimized import masks

from conformance.selftest.variants import optimized_variant


def eq9_zero_based_band(cfg):
    per_sel, per_cmp = cfg.sel_block // cfg.cmp_stride, cfg.cmp_block // cfg.cmp_stride
    reach = Counter(-m - n for m in range(per_sel) for n in range(per_cmp))
    first = min(reach)
    return masks.Eq9Band(first, tuple(float(reach[r]) for r in range(first, 1)))


masks.eq9_pool_weights = eq9_zero_based_band
IMPL = optimized_variant("eq9_zero_based")
