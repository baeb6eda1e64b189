"""Triton kernels of the optimized NSA path (issue 3, section 3).

triton_selected_attention(q, k, v, indices, sel_block, scale=None): Eq. 12, forward + backward.
selected_attention_naive: the pure-torch gather + masked-softmax oracle the kernel tests compare against.
"""

from .selected_attention import triton_selected_attention
from .selected_attention_naive import selected_attention_naive

__all__ = ["triton_selected_attention", "selected_attention_naive"]
