"""Literal, loop-based reference of Native Sparse Attention (arXiv 2502.11089, Eq. 1-12): the oracle.

Stage functions follow the contract API (docs/api.md); each is one step of the paper.
"""

from .branches import selected_attention, window_attention
from .compression import compress, compressed_attention
from .config import PRESETS, NSAConfig
from .contract import KV, BranchKV, NSAOutput, PhiMLPWeights, PhiWeights, Reads
from .forward import decode_step, nsa_forward
from .module import NSAAttention, apply_rope
from .selection import select_blocks, selection_scores

NAME = "reference"

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
    "selected_attention",
    "window_attention",
    "nsa_forward",
    "decode_step",
    "NSAAttention",
    "apply_rope",
]
