"""Vectorized NSA (arXiv 2502.11089): the contract API of `reference`, computed with tensor operations, chunked over
queries so memory stays O(T * (w + n*l' + T/d)) per head, with a Triton kernel for the selected branch on CUDA.

Conventions (block visibility, window, Eq. 9 weights, Eq. 10 reduction, Eq. 11 forced blocks and tie-break) are
decided only in `optimized.masks`.
"""

from reference.config import PRESETS, NSAConfig
from reference.contract import KV, BranchKV, NSAOutput, PhiMLPWeights, PhiWeights, Reads
from reference.module import apply_rope

from .compressed import compressed_attention
from .compression import compress
from .forward import decode_step, nsa_forward, nsa_forward_rows
from .module import NSAAttention
from .scoring import select_blocks, selection_indices, selection_scores
from .selected import selected_attention
from .window import window_attention

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
