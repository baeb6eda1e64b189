"""Entry points of the decode kernels (optimized.kernels.masked_decode, optimized.kernels.selected_decode),
imported lazily: the torch path never needs Triton."""

from __future__ import annotations

import os

import torch
from torch import Tensor

from .. import masks
from ..seams import SeamSnapshot

# The Eq. 12 clipping the selected-decode kernel implements (token <= p); with another seam in place the torch
# path runs, so a replaced seam still changes decode.
_KERNEL_SELECTED_RULE = SeamSnapshot(masks, "selected_token_visible")


def selected_rule_is_kernel_rule() -> bool:
    return _KERNEL_SELECTED_RULE.unchanged()


# The dtypes the decode kernels compute in (they accumulate in fp32): float64 stays on the torch path.
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_available(device: torch.device) -> None:
    """ValueError unless the kernels can run on `device` (CUDA, or CPU under TRITON_INTERPRET=1)."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("backend='triton' on CPU needs TRITON_INTERPRET=1 set before the kernels are imported")


def masked_decode(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, *, want_logits: bool):
    from optimized.kernels.masked_decode import masked_decode_attention

    return masked_decode_attention(q, k, v, mask, want_logits=want_logits)


def selected_decode(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, positions: Tensor, sel_block: int):
    from optimized.kernels.selected_decode import selected_decode_attention

    return selected_decode_attention(q, k, v, indices, positions, sel_block)
