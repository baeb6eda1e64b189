"""Bug: RoPE applied to the values as well as to the queries and keys (e.g. a fused qkv rotation). Attention
weights are unchanged, but every output mixes values rotated by their absolute positions.

Adapter: NSAAttention = optimized.NSAAttention whose project() also rotates every branch's v.
Caught by: Module level (the output is no longer invariant to a global position offset).
"""

import optimized
from reference.contract import KV, BranchKV
from reference.module import token_positions

from conformance.selftest.variants import optimized_variant


class NSAAttentionRotatingV(optimized.NSAAttention):
    def project(self, x, position_offset: int = 0, *, cu_seqlens=None):
        q, kv, gates = super().project(x, position_offset, cu_seqlens=cu_seqlens)
        positions = token_positions(x.shape[1], position_offset, cu_seqlens, x.shape[0], x.device)
        rotated = (KV(b.k, optimized.apply_rope(b.v, positions, self.rope_base)) for b in (kv.cmp, kv.slc, kv.win))
        return q, BranchKV(*rotated), gates


IMPL = optimized_variant("v_rotated", NSAAttention=NSAAttentionRotatingV)
