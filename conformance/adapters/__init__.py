"""Adapters: how the conformance suite reaches an NSA implementation.

An implementation is any object (usually a module) exposing some of the contract's stage functions
under their contract names (docs/api.md). `--impl` takes `reference`, `optimized`, or
`package.module:attr` (attr may be a module, a class instance or a namespace). A property whose stages
the implementation lacks is reported NOT COVERED, never PASS.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import pytest

STAGES = (
    "compress",
    "compressed_attention",
    "selection_scores",
    "select_blocks",
    "selected_attention",
    "window_attention",
    "nsa_forward",
    "decode_step",
    "NSAAttention",
)

NOT_COVERED = "NOT COVERED"


@dataclass
class Implementation:
    name: str
    target: Any
    stages: dict[str, Any] = field(default_factory=dict)

    def has(self, *names: str) -> bool:
        return all(n in self.stages for n in names)

    def require(self, *names: str) -> None:
        """Skip the calling test as NOT COVERED when a stage it needs is missing."""
        missing = [n for n in names if n not in self.stages]
        if missing:
            pytest.skip(f"{NOT_COVERED}: {self.name} provides no {', '.join(missing)}")

    def __getattr__(self, item: str) -> Any:
        stages = self.__dict__.get("stages", {})
        if item in stages:
            return stages[item]
        raise AttributeError(f"implementation {self.__dict__.get('name')!r} provides no {item!r}")


def load_impl(spec: str) -> Implementation:
    """Resolve an --impl value to an Implementation."""
    if spec in ("reference", "optimized"):
        target = importlib.import_module(spec)
    elif ":" in spec:
        module_name, attr = spec.split(":", 1)
        try:
            target = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"--impl {spec!r}: cannot load {attr!r} from {module_name!r}: {exc}") from exc
    else:
        raise ValueError(f"--impl {spec!r}: expected 'reference', 'optimized' or 'package.module:attr'")
    stages = {name: getattr(target, name) for name in STAGES if getattr(target, name, None) is not None}
    name = getattr(target, "NAME", spec)
    return Implementation(name=name, target=target, stages=stages)
