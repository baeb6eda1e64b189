"""Triton kernels of the optimized NSA path (fp32/bf16/fp16 inputs, fp32 accumulation; CUDA, or CPU under
TRITON_INTERPRET=1).

Prefill, in the order nsa_forward runs them:
- compression_mlp.py: Eq. 7's MLP (phi = "mlp"), forward + backward;
- range_attention.py: Eq. 2 over one contiguous key range per query row (the compressed and window branches),
  forward + backward (range_attention_bwd.py);
- selection.py: Eq. 8 + 10 (group scores) and Eq. 9-11 (top-n) per chunk of query rows;
- selected_attention.py: Eq. 12, group-centric, forward + backward (selected_attention_bwd.py, over the inverted
  index of selected_attention_index.py);
- gated_sum.py: Eq. 5, forward + backward.
NSAAttention's projections add rope.py (RoPE) and gate_mlp.py (the gate MLP of Eq. 5's gates, at half precision).
common.py holds what they share (dtypes, launch settings, dot settings, @triton.jit helpers); naive.py the
pure-torch oracles the kernel tests compare against.

Decode (optimized.decode): masked_decode.py, selected_decode.py (the seam-by-seam path's branches) and the lean
step (decode_step.py: decode_append.py, decode_step_cmp.py, decode_step_sparse.py over decode_tiles.py,
decode_splits.py and top_n.py).
"""

from .naive import range_attention_naive, selected_attention_naive
from .range_attention import range_attention_lse2, range_logsumexp2, triton_range_attention
from .selected_attention import triton_selected_attention

__all__ = ["triton_selected_attention", "selected_attention_naive", "triton_range_attention", "range_attention_lse2",
           "range_logsumexp2", "range_attention_naive"]
