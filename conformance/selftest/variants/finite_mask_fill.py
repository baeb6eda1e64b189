"""Bug: the attention mask is filled with a finite -1e4 instead of -inf (fully masked rows still handled, so
empty sets still give 0). With ordinary logits exp(-1e4 - max) underflows to 0 and nothing shows; once the
real logits fall below -1e4, the masked keys - future tokens included - dominate the softmax.

Patch: optimized.masked_attention._unnormalised (the masked exp(logits - row max) that every branch's forward
and backward use).
Caught by: Numerical safety (logits ~ -1e5: outputs differ from the float64 reference).
"""

import torch

from optimized import masked_attention

from conformance.selftest.variants import optimized_variant


def unnormalised_with_finite_fill(logits, mask, row_max=None):
    masked = logits.masked_fill(~mask, -1e4)
    if row_max is None:
        row_max = masked.amax(dim=-1, keepdim=True)
    return torch.exp(masked - row_max) * mask.any(dim=-1, keepdim=True), row_max  # an empty row stays empty


masked_attention._unnormalised = unnormalised_with_finite_fill
IMPL = optimized_variant("finite_mask_fill")
