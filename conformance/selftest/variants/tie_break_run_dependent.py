"""Bug: exact score ties broken by an epsilon "jitter" instead of by block index, so which of two tied blocks
is selected depends on the run (and on how the queries were chunked): a tie-break that is not a function of
the scores. (Unstable top-k on GPUs behaves the same way: the order of equal keys depends on the launch.)

Patch: optimized.masks.top_n_blocks adds 1e-12 * random noise to the scores before the stable sort.
Caught by: Tie-break determinism (exact ties must select the lower block index; repeated runs must agree).
"""

import torch

from optimized import masks

from conformance.selftest.variants import optimized_variant

_top_n_blocks = masks.top_n_blocks


def top_n_blocks_with_jitter(scores, J, cfg):
    jitter = 1e-12 * torch.rand(scores.shape, dtype=scores.dtype, device=scores.device)
    return _top_n_blocks(scores + jitter * scores.abs().clamp(min=1.0), J, cfg)


masks.top_n_blocks = top_n_blocks_with_jitter
IMPL = optimized_variant("tie_break_run_dependent")
