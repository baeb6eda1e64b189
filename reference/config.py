"""NSAConfig: the typed, validated hyperparameters of Native Sparse Attention.

Symbols follow the paper (arXiv 2502.11089): l = cmp_block, d = cmp_stride, l' = sel_block,
n = n_sel, w = window. Defaults are the paper's Section 4.1 values and its Section 5 head layout
(64 query heads in 4 GQA groups, d_k = 192, d_v = 128).

The convention switches describe choices other public implementations made where the paper is
ambiguous (see docs/spec.md, section "Ambiguities"): they let the conformance suite check an
implementation against the convention it actually claims.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Any

WINDOW_KEYS = ("w", "w+1")
CMP_VISIBILITY = ("inclusive", "strict")
SELECTION_SCORE = ("probs", "logits")
GROUP_REDUCE = ("sum", "mean")
PHI = ("avg", "mlp")

_POSITIVE = (
    "cmp_block",
    "cmp_stride",
    "sel_block",
    "n_sel",
    "window",
    "n_heads",
    "n_kv_heads",
    "head_dim_qk",
    "head_dim_v",
)
_NON_NEGATIVE = ("n_init", "n_local")
# The most elements a forward puts in one row it allocates: offsets into a tensor are 32-bit in the Triton kernels
# (and in several torch index paths), so a row longer than this cannot be addressed.
MAX_ELEMENTS = 2**31 - 1
# (factors, what a forward allocates per token or per query with that many elements)
_ALLOCATED_ROWS = (
    (("n_heads", "head_dim_qk"), "one token's query row"),
    (("n_heads", "head_dim_v"), "one token's output row"),
    (("cmp_block", "head_dim_qk"), "one compressed block of keys (the input of phi, Eq. 7)"),
    (("cmp_block", "head_dim_v"), "one compressed block of values (the input of phi, Eq. 7)"),
    (("window", "head_dim_qk"), "one query's window keys"),
    (("n_sel", "sel_block", "head_dim_qk"), "one query's selected keys (n blocks of l' tokens, Eq. 12)"),
)
_CHOICES = {
    "phi": PHI,
    "window_keys": WINDOW_KEYS,
    "cmp_visibility": CMP_VISIBILITY,
    "selection_score": SELECTION_SCORE,
    "group_reduce": GROUP_REDUCE,
}


@dataclass(frozen=True)
class NSAConfig:
    """Hyperparameters of one NSA attention layer. Every instance is valid (checked in __post_init__)."""

    cmp_block: int = 32  # l: tokens per compressed block (Eq. 7)
    cmp_stride: int = 16  # d: stride between compressed blocks (Eq. 7)
    sel_block: int = 64  # l': tokens per selection block (Eq. 12)
    n_sel: int = 16  # n: selected blocks per (query, group), forced blocks included (Eq. 11)
    n_init: int = 1  # forced initial blocks 0..n_init-1
    n_local: int = 2  # forced most recent blocks J-n_local+1..J
    window: int = 512  # w: sliding-window size (Section 3.3.3)
    n_heads: int = 64  # Hq: query heads
    n_kv_heads: int = 4  # Hkv: key/value heads = GQA groups
    head_dim_qk: int = 192  # d_k
    head_dim_v: int = 128  # d_v
    phi: str = "mlp"  # compression function: "avg" (mean pooling) | "mlp" (learnable, Eq. 7)
    window_keys: str = "w"  # "w": keys [p-w+1, p]; "w+1": keys [p-w, p] (the literal k_{t-w:t})
    cmp_visibility: str = "inclusive"  # "inclusive": i*d+l-1 <= p; "strict": i*d+l-1 < p
    selection_score: str = "probs"  # Eq. 8 input to Eq. 9: "probs" (softmax) | "logits" (scaled q.k)
    group_reduce: str = "sum"  # Eq. 10 over the heads of a group: "sum" | "mean"

    def __post_init__(self) -> None:
        for name in _POSITIVE + _NON_NEGATIVE:  # numpy integers become Python ints (hashing, JSON, kernels)
            _require_int(name, getattr(self, name))
            object.__setattr__(self, name, int(getattr(self, name)))
        for name in _POSITIVE:
            if getattr(self, name) <= 0:
                raise ValueError(f"NSAConfig.{name} must be a positive integer, got {getattr(self, name)}")
        for name in _NON_NEGATIVE:
            if getattr(self, name) < 0:
                raise ValueError(f"NSAConfig.{name} must be >= 0, got {getattr(self, name)}")
        for name, allowed in _CHOICES.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"NSAConfig.{name} must be one of {allowed}, got {value!r}")
        l, d, lp = self.cmp_block, self.cmp_stride, self.sel_block
        if l % d != 0:
            raise ValueError(f"NSAConfig.cmp_stride (d={d}) must divide cmp_block (l={l}) (Eq. 9: d | l)")
        if lp % d != 0:
            raise ValueError(f"NSAConfig.cmp_stride (d={d}) must divide sel_block (l'={lp}) (Eq. 9: d | l')")
        if l > lp:
            raise ValueError(f"NSAConfig.cmp_block (l={l}) must be <= sel_block (l'={lp}) (Eq. 9: l <= l')")
        if self.n_sel < self.n_init + self.n_local:
            raise ValueError(
                f"NSAConfig.n_sel (n={self.n_sel}) must be >= n_init + n_local "
                f"({self.n_init} + {self.n_local}): n counts the forced blocks"
            )
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"NSAConfig.n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads}) (GQA)"
            )
        for factors, what in _ALLOCATED_ROWS:
            values = [getattr(self, name) for name in factors]
            elements = 1
            for value in values:
                elements *= value
            if elements > MAX_ELEMENTS:
                names = " * ".join(f"NSAConfig.{name}" for name in factors)
                shown = " * ".join(str(v) for v in values)
                raise ValueError(f"{names} = {shown} = {elements:,} elements in {what}: a forward allocates it and "
                                 f"cannot address more than {MAX_ELEMENTS:,} (32-bit offsets)")

    # Derived sizes -------------------------------------------------------------------------
    @property
    def group_size(self) -> int:
        """H in Eq. 10: query heads per GQA group."""
        return self.n_heads // self.n_kv_heads

    @property
    def window_size(self) -> int:
        """Number of keys in a full sliding window (w, or w+1 with window_keys="w+1")."""
        return self.window + (1 if self.window_keys == "w+1" else 0)

    @property
    def pieces_per_sel_block(self) -> int:
        """l'/d: range of the outer sum of Eq. 9."""
        return self.sel_block // self.cmp_stride

    @property
    def pieces_per_cmp_block(self) -> int:
        """l/d: range of the inner sum of Eq. 9."""
        return self.cmp_block // self.cmp_stride

    def replace(self, **changes: Any) -> "NSAConfig":
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "NSAConfig":
        """A named preset (see PRESETS), optionally with some fields overridden."""
        if name not in PRESETS:
            raise ValueError(f"unknown NSAConfig preset {name!r}; known presets: {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "NSAConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"NSAConfig has no field(s) {unknown}; fields are {sorted(known)}")
        return cls(**values)


def _require_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"NSAConfig.{name} must be an int, got {type(value).__name__} {value!r}")


_PAPER = NSAConfig()

PRESETS: dict[str, NSAConfig] = {
    # The paper's Section 4.1 / Section 5 configuration.
    "paper": _PAPER,
    # l = d = l' = 64: the only block layout some Triton NSA kernels support (then p_slc = p_cmp).
    "equal_blocks": dataclasses.replace(_PAPER, cmp_block=64, cmp_stride=64, sel_block=64),
    # Single-switch variants naming the conventions other implementations chose (docs/spec.md).
    "window_w_plus_1": dataclasses.replace(_PAPER, window_keys="w+1"),
    "strict_cmp_visibility": dataclasses.replace(_PAPER, cmp_visibility="strict"),
    "logit_scores": dataclasses.replace(_PAPER, selection_score="logits"),
    "mean_group_reduce": dataclasses.replace(_PAPER, group_reduce="mean"),
    # Mean pooling as phi (what most public implementations compress with), with the paper's or equal blocks.
    "paper_avg": dataclasses.replace(_PAPER, phi="avg"),
    "equal_blocks_avg": dataclasses.replace(_PAPER, cmp_block=64, cmp_stride=64, sel_block=64, phi="avg"),
}
