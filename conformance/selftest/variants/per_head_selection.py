"""Bug: block selection per query head instead of per GQA group (Eq. 10 skipped): each head attends to the
blocks its own p_slc ranks highest, and the indices reported are those of the group's first head. Shipped by
NSA code that reused an MHA-style top-k per head; it also loses the paper's shared-KV kernel layout.

Adapter: nsa_forward = optimized.nsa_forward with o_slc recomputed head by head (each head as a group of one)
and the first head's indices reported.
Caught by: GQA consistency (heads of a group do not all read the group's selected blocks).
"""

import torch

import optimized
from reference.contract import NSAOutput

from conformance.selftest.variants import optimized_variant


def nsa_forward_per_head(q, kv, gates, cfg, phi=None):
    out = optimized.nsa_forward(q, kv, gates, cfg, phi)
    G = cfg.group_size
    one_head = cfg.replace(n_heads=cfg.n_kv_heads)
    k_cmp, _ = optimized.compress(kv.cmp.k, kv.cmp.v, cfg, phi)
    o_slc = torch.empty_like(out.o_slc)
    first_head_indices = None
    for h in range(G):
        q_h = q[:, :, h::G]
        indices_h = optimized.selection_indices(q_h, k_cmp, one_head)
        o_slc[:, :, h::G] = optimized.selected_attention(q_h, kv.slc.k, kv.slc.v, indices_h, one_head)
        first_head_indices = indices_h if first_head_indices is None else first_head_indices
    o = gates[..., 0:1] * out.o_cmp + gates[..., 1:2] * o_slc + gates[..., 2:3] * out.o_win
    return NSAOutput(o=o, indices=first_head_indices, o_cmp=out.o_cmp, o_slc=o_slc, o_win=out.o_win, reads=out.reads)


IMPL = optimized_variant("per_head_selection", nsa_forward=nsa_forward_per_head)
