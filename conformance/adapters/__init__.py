"""Adapters: how the conformance suite reaches an NSA implementation.

An implementation is any object (usually a module) exposing some of the contract's stage functions
under their contract names (docs/api.md). `--impl` takes `reference`, `optimized`, or
`package.module:attr` (attr may be a module, a class instance or a namespace). A property whose stages
the implementation lacks is reported NOT COVERED, never PASS. docs/adapters.md explains how to write one.

Besides the contract's functions, a stateful decoder is a stage: `NSADecodeCache(cfg, batch_size, capacity,
*, dtype, device, phi)` with `prefill(q, kv, gates)`, `step(q, kv, gates)` (one token) and
`extend(q, kv, gates)` (a chunk), each returning the NSAOutput of its queries (optimized.decode).

Optional attributes an implementation may expose besides its stages:
- NAME: a short name for the reports (default: the --impl value).
- SHARED_KV = True: its branches share one k/v (the suite then builds inputs with BranchKV.shared).
An adapter raises NotCovered from a stage for an input it cannot take (a config it does not support,
independent k/v, ...); the test that asked is then reported NOT COVERED instead of FAIL.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
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
    "NSADecodeCache",
)
# Where a stage may live besides the target's top level (dotted: a submodule of a module target).
STAGE_ALTERNATIVES = {"NSADecodeCache": ("decode.NSADecodeCache",)}

NOT_COVERED = "NOT COVERED"


class NotCovered(Exception):
    """Raised by an adapter's stage for an input it cannot handle; the calling test becomes NOT COVERED."""


def not_covered(reason: str) -> None:
    """Skip the calling test as NOT COVERED with a reason (for tests that find a stage's output lacking)."""
    pytest.skip(f"{NOT_COVERED}: {reason}")


@dataclass
class Implementation:
    name: str
    target: Any
    stages: dict[str, Any] = field(default_factory=dict)
    spec: str = ""
    shared_kv: bool = False

    def has(self, *names: str) -> bool:
        return all(n in self.stages for n in names)

    def require(self, *names: str) -> None:
        """Skip the calling test as NOT COVERED when a stage it needs is missing."""
        missing = [n for n in names if n not in self.stages]
        if missing:
            not_covered(f"{self.name} provides no {', '.join(missing)}")

    def takes(self, stage: str, argument: str) -> bool:
        """Whether a stage accepts a keyword argument (e.g. chunk_size)."""
        if stage not in self.stages:
            return False
        try:
            return argument in inspect.signature(self.stages[stage]).parameters
        except (TypeError, ValueError):
            return False

    def require_argument(self, argument: str, *names: str) -> None:
        """Skip the calling test as NOT COVERED when a stage it needs is missing or takes no keyword `argument`
        (e.g. cu_seqlens for packed documents)."""
        self.require(*names)
        lacking = [n for n in names if not self.takes(n, argument)]
        if lacking:
            not_covered(f"{self.name}'s {', '.join(lacking)} take(s) no {argument} argument")

    def __getattr__(self, item: str) -> Any:
        stages = self.__dict__.get("stages", {})
        if item in stages:
            return _reporting_not_covered(stages[item])
        raise AttributeError(f"implementation {self.__dict__.get('name')!r} provides no {item!r}")


def _reporting_not_covered(stage: Any) -> Any:
    @functools.wraps(stage)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return stage(*args, **kwargs)
        except NotCovered as exc:
            not_covered(str(exc))

    return call


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
    stages = {}
    for name in STAGES:
        for where in (name, *STAGE_ALTERNATIVES.get(name, ())):
            found = _lookup(target, where)
            if found is not None:
                stages[name] = found
                break
    name = str(getattr(target, "NAME", spec))
    return Implementation(name=name, target=target, stages=stages, spec=spec,
                          shared_kv=bool(getattr(target, "SHARED_KV", False)))


def _lookup(target: Any, dotted: str) -> Any:
    """target.a.b..., importing submodules of a module target on the way; None if absent."""
    obj = target
    for part in dotted.split("."):
        nxt = getattr(obj, part, None)
        if nxt is None and inspect.ismodule(obj) and hasattr(obj, "__path__"):
            try:
                nxt = importlib.import_module(f"{obj.__name__}.{part}")
            except ImportError:
                nxt = None
        if nxt is None:
            return None
        obj = nxt
    return obj


def file_stem(name: str) -> str:
    """A file-name-safe form of an implementation name."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "impl"
