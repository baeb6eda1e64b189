"""Bug: the sliding window holds one key too many: keys [p - w, p] while claiming w keys (window_keys="w"),
what a FlashAttention-style window (w, 0) gives when w is passed straight through.

Patch: optimized.masks.window_start returns p - window_size instead of p - window_size + 1.
Caught by: Small-T equivalence (the window branch differs from dense banded attention over [p - w + 1, p]).
"""

from optimized import masks

from conformance.selftest.variants import optimized_variant


def window_start_one_key_early(pos, cfg):
    return pos - cfg.window_size


masks.window_start = window_start_one_key_early
IMPL = optimized_variant("window_off_by_one")
