"""Bug: the selected branch turns -1 padding slots into block 0 (an index clamped before the gather, the mask then
built from the clamped index), so every row with a padding slot reads block 0 whether or not it selected it.

Adapter: selected_attention = optimized.selected_attention on the indices with -1 replaced by 0 (a repeated
block 0 is kept once, as a kernel that masks duplicates would).
Caught by: Small-T equivalence, selected_attention on index sets without block 0 and with padding.
"""

import torch

import optimized

from conformance.selftest.variants import optimized_variant


def selected_attention_padding_as_block0(q, k, v, indices, cfg, **kwargs):
    clamped = indices.clamp(min=0)
    first = torch.zeros_like(clamped, dtype=torch.bool)
    first[..., 1:] = clamped[..., 1:] == clamped[..., :-1]  # ascending input: a repeat follows its first copy
    return optimized.selected_attention(q, k, v, clamped.masked_fill(first, -1), cfg, **kwargs)


IMPL = optimized_variant("slc_padding_reads_block0",
                         selected_attention=selected_attention_padding_as_block0)
