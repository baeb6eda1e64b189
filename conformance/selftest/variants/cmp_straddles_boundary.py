"""Bug (packed batches): compressed blocks cut from a global stride-d grid over the packed row instead of
restarting at each document start. Document i keeps its own count N_i of Eq. 7 blocks (so every shape check
passes), but its blocks start at the grid point at or before its first token: when a document does not start at
a multiple of d, its first compressed block straddles the boundary and summarizes the previous document's last
tokens (the pattern of packing code that reuses a single-sequence `unfold` and only re-labels the blocks).

Patch: optimized.compression.packed_block_windows (used by prefill compression on packed input).
Caught by: Packed sequences (a packed document no longer equals the document run alone, and perturbing one
document changes the next one's output).
"""

import torch

from optimized import compression

from conformance.selftest.variants import optimized_variant


def packed_block_windows_on_a_global_grid(x, docs, cfg):
    d = cfg.cmp_stride
    grid_start = (docs.bounds[docs.cmp_doc] // d) * d  # the grid point at or before the document start
    first = grid_start + docs.cmp_local * d
    rows = first[:, None] + torch.arange(cfg.cmp_block, device=x.device)
    return x[:, rows].transpose(2, 3)


compression.packed_block_windows = packed_block_windows_on_a_global_grid
IMPL = optimized_variant("cmp_straddles_boundary")
