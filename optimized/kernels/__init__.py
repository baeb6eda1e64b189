"""Triton kernels of the optimized NSA path (issue 3, section 3; issue 8).

triton_selected_attention(q, k, v, indices, sel_block, scale=None): Eq. 12, forward + backward.
selected_attention_naive: the pure-torch gather + masked-softmax oracle the kernel tests compare against.
triton_range_attention(q, k, v, lo, hi, scale=None): Eq. 2 over one contiguous key range per query row (the
compressed and window branches), forward + backward; range_attention_naive is its dense oracle.
"""

from .range_attention import range_attention_lse2, range_logsumexp2, triton_range_attention
from .range_attention_naive import range_attention_naive
from .selected_attention import triton_selected_attention
from .selected_attention_naive import selected_attention_naive

__all__ = ["triton_selected_attention", "selected_attention_naive", "triton_range_attention", "range_attention_lse2",
           "range_logsumexp2", "range_attention_naive"]
