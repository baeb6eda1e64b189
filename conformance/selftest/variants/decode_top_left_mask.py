"""Bug: decode attention for TQ new queries over TK cached keys with a causal mask anchored top-left
(tril of a TQ x TK matrix: query i sees keys 0..i) instead of bottom-right (query i sits at TK - TQ + i). With
one new query (TQ = 1 < TK) it sees only key 0. A classic of `is_causal=True` on non-square attention.

Adapter: decode_step places its queries at positions 0..TQ-1 instead of TK-TQ..TK-1.
Caught by: Counted reads and decode = prefill (decode differs from the prefill at the same positions).
"""

import torch

import optimized

from conformance.selftest.variants import optimized_variant


def decode_step_top_left(q, kv, gates, cfg, phi=None):
    positions = torch.arange(q.shape[1], device=q.device)  # should be TK - TQ .. TK - 1
    return optimized.nsa_forward_rows(q, kv, gates, cfg, phi, positions)


IMPL = optimized_variant("decode_top_left_mask", decode_step=decode_step_top_left)
