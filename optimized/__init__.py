"""Vectorized NSA (arXiv 2502.11089): the contract API of `reference`, computed with tensor operations chunked over
queries (the torch path) or with Triton kernels (the kernel path), prefill and decode (optimized.decode).

Conventions (block visibility, window, Eq. 9 weights, Eq. 10 reduction, Eq. 11 forced blocks and tie-break) are
decided only in `optimized.masks`; where a call runs (device, dtype, backend) only in `optimized.dispatch`.

A prefill call on the kernel path (the default for CUDA tensors; `range_backend="triton", backend="triton"`
forces it) crosses these files of optimized/, in this order. forward.py hands the data to each of them once
(q, k, v -> compress -> attend to the compressed and window keys -> score -> select -> attend to the selected
blocks -> gate); dispatch.py, masks.py and kernels/common.py are also asked from inside the stages.

    1. optimized/forward.py                     nsa_forward: checks the inputs, routes once, runs _kernel_path
    2. optimized/dispatch.py                    device, dtype and backend decided (Route); compute_dtype
    3. optimized/documents.py                   the layout of a packed batch (only with cu_seqlens)
    4. optimized/masks.py                       the convention seams the stages ask
    5. optimized/compression.py                 Eq. 7 (its MLP on kernels/compression_mlp.py under autocast)
    6. optimized/kernels/range_attention.py     Eq. 4 and the window branch, key ranges from the seams
    7. optimized/kernels/common.py              launch settings and @triton.jit helpers of the kernels
    8. optimized/kernels/selection.py           Eq. 8-11: group scores, then top-n
    9. optimized/kernels/selected_attention.py  Eq. 12
   10. optimized/kernels/gated_sum.py           Eq. 5

tests/test_prefill_path.py traces a call in Triton's interpreter and checks this list. A call recomputed in
backward under a ForwardTape (recompute.py) takes its selection and selected output back from the forward instead.
The backward pass adds kernels/range_attention_bwd.py, kernels/selected_attention_bwd.py and
kernels/selected_attention_index.py. NSAAttention (module.py) makes q, k and v and the gates before the call, RoPE
with kernels/rope.py and the gate MLP with kernels/gate_mlp.py on the kernel path. The torch path runs forward.py,
dispatch.py, documents.py, masks.py, compression.py, then compressed.py, scoring.py,
selected.py and window.py over masked_attention.py (and numerics.py).
"""

from reference.config import PRESETS, NSAConfig
from reference.contract import KV, BranchKV, NSAOutput, PhiMLPWeights, PhiWeights, Reads
from reference.module import apply_rope

from .forward import decode_step, nsa_forward, nsa_forward_rows
from .module import NSAAttention
from .stages import (compress, compressed_attention, select_blocks, selected_attention, selection_indices,
                     selection_scores, window_attention)

NAME = "optimized"

__all__ = [
    "NAME",
    "NSAConfig",
    "PRESETS",
    "KV",
    "BranchKV",
    "NSAOutput",
    "PhiMLPWeights",
    "PhiWeights",
    "Reads",
    "compress",
    "compressed_attention",
    "selection_scores",
    "select_blocks",
    "selection_indices",
    "selected_attention",
    "window_attention",
    "nsa_forward",
    "nsa_forward_rows",
    "decode_step",
    "NSAAttention",
    "apply_rope",
]
