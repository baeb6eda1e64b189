"""Capabilities: what an implementation supports, declared by its adapter as data.

The suite draws its hypothesis examples only inside this envelope (conformance/strategies.py), fits the fixed
configs of its other tests into it, and reports a test NOT COVERED only when nothing inside the envelope can
exercise it. An adapter sets `CAPABILITIES = Capabilities(...)` next to its stages (docs/adapters.md); every field
has the permissive default, so `Capabilities()` is "everything" (what `reference` and `optimized` declare).

Fields, in the order an adapter author meets them:
- conventions: the values of each NSAConfig convention switch the implementation computes (sets): `phi`,
  `window_keys`, `cmp_visibility`, `selection_score`, `group_reduce`;
- block layout: `block_layout` "any" (d | l, d | l', l <= l'), "sel_multiple_of_cmp" (also l | l') or "equal"
  (l = d = l' only), and `block_sizes` (the values l, d and l' may take);
- selection: `forced_blocks` (the (n_init, n_local) pairs it implements, None for any) and `n_sel`;
- sizes: `window`, `kv_heads`, `group_sizes` (query heads per KV head), `head_dims_qk`, `head_dims_v`,
  `equal_head_dims` (d_k = d_v only);
- inputs: `shared_kv` (one k/v for the three branches), `fixed_gates` (None: gates are inputs; else the constant
  (g_cmp, g_slc, g_win) it combines its branches with), `branches` (the branches it computes; a missing branch's
  output is 0 and its gate must be 0);
- `precision`: "inputs" (computes in the dtype of its inputs), "float32" (computes in float32 whatever the
  inputs: float64 checks are judged at float32 by the error-ratio rule) or "detect" (measured once per run);
- `stages`: the stages it has (None: every contract name found on the adapter; a declared stage that is not
  found is an error).
Sizes are `Sizes` rules: explicit values and/or a range, a power-of-two or a multiple-of rule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from reference.config import CMP_VISIBILITY, GROUP_REDUCE, PHI, SELECTION_SCORE, WINDOW_KEYS, NSAConfig

CONVENTIONS = {"phi": PHI, "window_keys": WINDOW_KEYS, "cmp_visibility": CMP_VISIBILITY,
               "selection_score": SELECTION_SCORE, "group_reduce": GROUP_REDUCE}
BLOCK_LAYOUTS = ("any", "sel_multiple_of_cmp", "equal")
PRECISIONS = ("inputs", "float32", "detect")
BRANCHES = ("cmp", "slc", "win")
SEARCH_LIMIT = 4096  # how far Sizes.smallest looks for allowed values


@dataclass(frozen=True)
class Sizes:
    """The values one size may take: `values` (an explicit set; None: any) further limited by `minimum`, `maximum`,
    `power_of_two` and `multiple_of`. Sizes() allows every positive integer."""

    values: tuple[int, ...] | None = None
    minimum: int = 1
    maximum: int | None = None
    power_of_two: bool = False
    multiple_of: int = 1

    def __post_init__(self) -> None:
        if self.values is not None:
            values = tuple(sorted(set(int(v) for v in self.values)))
            if not values or values[0] < 0:
                raise ValueError(f"Sizes.values must be a non-empty set of non-negative integers, got {self.values}")
            object.__setattr__(self, "values", values)
        if self.minimum < 0 or (self.maximum is not None and self.maximum < self.minimum):
            raise ValueError(f"Sizes: need 0 <= minimum <= maximum, got {self.minimum}, {self.maximum}")
        if self.multiple_of < 1:
            raise ValueError(f"Sizes.multiple_of must be >= 1, got {self.multiple_of}")
        if not self.smallest(1):
            raise ValueError(f"Sizes {self.describe()} allows no value")

    def allows(self, n: int) -> bool:
        if self.values is not None and n not in self.values:
            return False
        if n < self.minimum or (self.maximum is not None and n > self.maximum):
            return False
        if self.power_of_two and (n <= 0 or n & (n - 1)):
            return False
        return n % self.multiple_of == 0

    def smallest(self, count: int, at_least: int = 0) -> list[int]:
        """The `count` smallest allowed values >= at_least."""
        pool = self.values if self.values is not None else range(max(at_least, self.minimum), SEARCH_LIMIT + 1)
        return [n for n in pool if n >= at_least and self.allows(n)][:count]

    def pick(self, wanted: int) -> int | None:
        """wanted if allowed, else the smallest allowed value above it, else the largest below; None if none."""
        if self.allows(wanted):
            return wanted
        above = self.smallest(1, at_least=wanted)
        if above:
            return above[0]
        below = [n for n in (self.values or range(self.minimum, wanted)) if n < wanted and self.allows(n)]
        return below[-1] if below else None

    def within(self, preferred: Iterable[int], fallback: int = 1) -> list[int]:
        """The preferred (small) values that are allowed, else the `fallback` smallest allowed values."""
        ok = [n for n in preferred if self.allows(n)]
        return ok or self.smallest(fallback)

    def describe(self) -> str:
        if self == Sizes():
            return "any"
        parts = []
        if self.values is not None:
            parts.append("{" + ", ".join(map(str, self.values)) + "}")
        if self.minimum > 1 or self.maximum is not None:
            parts.append(f"{self.minimum}..{'' if self.maximum is None else self.maximum}")
        if self.power_of_two:
            parts.append("power of two")
        if self.multiple_of > 1:
            parts.append(f"multiple of {self.multiple_of}")
        return ", ".join(parts)


ANY = Sizes()


def _as_frozenset(name: str, value: Any) -> frozenset:
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise ValueError(f"Capabilities.{name} must be a set (or list) of values, got {value!r}")
    return frozenset(value)


@dataclass(frozen=True)
class Capabilities:
    """What an implementation supports (module docstring). Every instance is valid (checked in __post_init__)."""

    phi: frozenset[str] = frozenset(PHI)
    window_keys: frozenset[str] = frozenset(WINDOW_KEYS)
    cmp_visibility: frozenset[str] = frozenset(CMP_VISIBILITY)
    selection_score: frozenset[str] = frozenset(SELECTION_SCORE)
    group_reduce: frozenset[str] = frozenset(GROUP_REDUCE)
    block_layout: str = "any"
    block_sizes: Sizes = ANY
    forced_blocks: frozenset[tuple[int, int]] | None = None
    n_sel: Sizes = ANY
    window: Sizes = ANY
    kv_heads: Sizes = ANY
    group_sizes: Sizes = ANY
    head_dims_qk: Sizes = ANY
    head_dims_v: Sizes = ANY
    equal_head_dims: bool = False
    shared_kv: bool = False
    fixed_gates: tuple[float, float, float] | None = None
    branches: frozenset[str] = frozenset(BRANCHES)
    precision: str = "inputs"
    stages: frozenset[str] | None = None

    def __post_init__(self) -> None:
        for name, allowed in CONVENTIONS.items():
            values = _as_frozenset(name, getattr(self, name))
            bad = sorted(values - set(allowed))
            if not values or bad:
                raise ValueError(f"Capabilities.{name} must be a non-empty subset of {allowed}, got {sorted(values)}")
            object.__setattr__(self, name, values)
        if self.block_layout not in BLOCK_LAYOUTS:
            raise ValueError(f"Capabilities.block_layout must be one of {BLOCK_LAYOUTS}, got {self.block_layout!r}")
        for name in ("block_sizes", "n_sel", "window", "kv_heads", "group_sizes", "head_dims_qk", "head_dims_v"):
            if not isinstance(getattr(self, name), Sizes):
                raise ValueError(f"Capabilities.{name} must be a Sizes, got {type(getattr(self, name)).__name__}")
        if self.forced_blocks is not None:
            pairs = frozenset(tuple(int(x) for x in p) for p in _as_frozenset("forced_blocks", self.forced_blocks))
            if not pairs or any(len(p) != 2 or min(p) < 0 for p in pairs):
                raise ValueError("Capabilities.forced_blocks must be a non-empty set of (n_init, n_local) pairs >= 0, "
                                 f"got {self.forced_blocks}")
            object.__setattr__(self, "forced_blocks", pairs)
        branches = _as_frozenset("branches", self.branches)
        if not branches or not branches <= set(BRANCHES):
            raise ValueError(f"Capabilities.branches must be a non-empty subset of {BRANCHES}, got {sorted(branches)}")
        object.__setattr__(self, "branches", branches)
        if self.fixed_gates is not None:
            gates = tuple(float(g) for g in self.fixed_gates)
            if len(gates) != 3 or any(not 0 <= g <= 1 for g in gates):
                raise ValueError(f"Capabilities.fixed_gates must be three gates in [0, 1], got {self.fixed_gates}")
            off = [b for b, g in zip(BRANCHES, gates) if g and b not in branches]
            if off:
                raise ValueError(f"Capabilities.fixed_gates gives a non-zero gate to branch(es) {off} that are not in "
                                 f"branches {sorted(branches)}")
            object.__setattr__(self, "fixed_gates", gates)
        if self.precision not in PRECISIONS:
            raise ValueError(f"Capabilities.precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.stages is not None:
            object.__setattr__(self, "stages", _as_frozenset("stages", self.stages))

    # Questions the suite asks --------------------------------------------------------------------
    def outside(self, cfg: NSAConfig) -> str | None:
        """Why cfg lies outside the envelope (None if inside)."""
        for name in CONVENTIONS:
            if getattr(cfg, name) not in getattr(self, name):
                return f"{name}={getattr(cfg, name)!r} (declared {sorted(getattr(self, name))})"
        l, d, lp = cfg.cmp_block, cfg.cmp_stride, cfg.sel_block
        if self.block_layout == "equal" and not l == d == lp:
            return f"blocks l={l}, d={d}, l'={lp} (declared equal blocks only)"
        if self.block_layout == "sel_multiple_of_cmp" and lp % l:
            return f"l'={lp} not a multiple of l={l} (declared)"
        for what, n in (("l", l), ("d", d), ("l'", lp)):
            if not self.block_sizes.allows(n):
                return f"block size {what}={n} (declared {self.block_sizes.describe()})"
        if self.forced_blocks is not None and (cfg.n_init, cfg.n_local) not in self.forced_blocks:
            return (f"forced blocks n_init={cfg.n_init}, n_local={cfg.n_local} "
                    f"(declared {sorted(self.forced_blocks)})")
        checks = (("n_sel", cfg.n_sel, self.n_sel), ("window", cfg.window, self.window),
                  ("n_kv_heads", cfg.n_kv_heads, self.kv_heads), ("group size", cfg.group_size, self.group_sizes),
                  ("head_dim_qk", cfg.head_dim_qk, self.head_dims_qk), ("head_dim_v", cfg.head_dim_v, self.head_dims_v))
        for what, n, rule in checks:
            if not rule.allows(n):
                return f"{what}={n} (declared {rule.describe()})"
        if self.equal_head_dims and cfg.head_dim_qk != cfg.head_dim_v:
            return f"d_k={cfg.head_dim_qk} != d_v={cfg.head_dim_v} (declared equal head dims)"
        return None

    def gates_allowed(self, gates: tuple[float, float, float]) -> str | None:
        """Why constant gates (g_cmp, g_slc, g_win) cannot be given (None if they can)."""
        if self.fixed_gates is not None and tuple(gates) != self.fixed_gates:
            return f"gates {tuple(gates)} (declared fixed gates {self.fixed_gates})"
        off = [b for b, g in zip(BRANCHES, gates) if g and b not in self.branches]
        if off:
            return f"a non-zero gate on branch(es) {off} (declared branches {sorted(self.branches)})"
        return None

    def describe(self) -> dict[str, Any]:
        """A JSON-friendly summary for the reports (sets sorted, Sizes described)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Sizes):
                value = value.describe()
            elif isinstance(value, frozenset):
                value = sorted(value)
            out[f.name] = value
        return out


EVERYTHING = Capabilities()
