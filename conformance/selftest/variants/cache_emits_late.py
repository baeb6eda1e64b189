"""Bug: the decode cache makes a compressed token usable one step late: block i (keys i*d .. i*d + l - 1) is
compressed when key i*d + l - 1 arrives, but the query at that very position does not see it (the visible
count is taken from the lengths before the step), although prefill lets it (Eq. 7: i*d + l - 1 <= p).

Patch: optimized.decode.plan.complete_blocks (the count of emitted blocks that a decode call's visibility mask
admits, CallPlan.emitted) lags one token behind.
Caught by: Counted reads and decode = prefill (cached decode differs from prefill at emission steps).
"""

from optimized.decode import emission, plan

from conformance.selftest.variants import optimized_variant


def complete_blocks_one_step_late(n_keys, cfg):
    return emission.complete_blocks(n_keys - 1, cfg)


plan.complete_blocks = complete_blocks_one_step_late
IMPL = optimized_variant("cache_emits_late")
