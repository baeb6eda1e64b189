"""Adapters: how the conformance suite reaches an NSA implementation.

An implementation is any object (usually a module) exposing some of the contract's stage functions
under their contract names (docs/api.md). `--impl` takes `reference`, `optimized`, or
`package.module:attr` (attr may be a module, a class instance or a namespace). A property whose stages
the implementation lacks is reported NOT COVERED, never PASS. docs/adapters.md explains how to write one.

Besides the contract's functions, two stages are objects:
- a stateful decoder `NSADecodeCache(cfg, batch_size, capacity, *, dtype, device, phi)` with
  `prefill(q, kv, gates)`, `step(q, kv, gates)` (one token) and `extend(q, kv, gates)` (a chunk), each returning
  the NSAOutput of its queries (optimized.decode);
- a black-box module `make_module(cfg, hidden_size)` returning a causal torch.nn.Module with its own projections
  whose `forward(x [B, T, hidden])` returns [B, T, hidden] (or a tuple starting with it); `position_offset=` is
  optional. An implementation with `NSAAttention` gets one from it.

Optional attributes an implementation may expose besides its stages:
- NAME: a short name for the reports (default: the --impl value);
- CAPABILITIES: a Capabilities (capabilities.py): the conventions, sizes, inputs, branches and precision it
  supports; the suite draws only inside them. Without it: everything, precision detected (SHARED_KV = True, the
  older spelling of Capabilities(shared_kv=True), is still read).
An adapter raises NotCovered from a stage for an input it cannot take; the test that asked is then reported NOT
COVERED instead of FAIL. Any other exception raised inside a stage is reported as an error of the implementation
(ImplementationError: type, message, the implementation's file:line, the config and the input shapes), apart
from the suite's own assertions.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import re
import sysconfig
import traceback
from dataclasses import dataclass, field
from typing import Any

import pytest

from .capabilities import EVERYTHING, Capabilities, Sizes  # noqa: F401  (re-exported for adapters)

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
    "make_module",
)
# Where a stage may live besides the target's top level (dotted: a submodule of a module target).
STAGE_ALTERNATIVES = {"NSADecodeCache": ("decode.NSADecodeCache",)}

NOT_COVERED = "NOT COVERED"


class NotCovered(Exception):
    """Raised by an adapter's stage for an input it cannot handle; the calling test becomes NOT COVERED."""


class ImplementationError(Exception):
    """An exception raised inside the implementation under test (not an assertion of the suite)."""


def not_covered(reason: str) -> None:
    """Skip the calling test as NOT COVERED with a reason (for tests that find a stage's output lacking)."""
    pytest.skip(f"{NOT_COVERED}: {reason}")


@dataclass
class Implementation:
    name: str
    target: Any
    stages: dict[str, Any] = field(default_factory=dict)
    spec: str = ""
    caps: Capabilities = EVERYTHING

    @property
    def shared_kv(self) -> bool:
        return self.caps.shared_kv

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
            return reporting(stages[item], f"{self.__dict__.get('name')}.{item}")
        raise AttributeError(f"implementation {self.__dict__.get('name')!r} provides no {item!r}")


def reporting(fn: Any, what: str) -> Any:
    """fn, calling which turns NotCovered into a NOT COVERED skip and any other exception into an
    ImplementationError that names the exception, where in the implementation it was raised, and the call's
    config and input shapes."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except NotCovered as exc:
            not_covered(str(exc))
        except Exception as exc:
            raise ImplementationError(describe_failure(what, exc, args, kwargs)) from exc

    return call


def describe_failure(what: str, exc: BaseException, args: tuple, kwargs: dict) -> str:
    """'<what> raised <Type>: <message> at <file>:<line> (config ...; inputs ...)', one line."""
    message = " ".join(str(exc).split()) or "(no message)"
    where = raised_at(exc)
    inputs = [_shape_of(a) for a in (*args, *kwargs.values())]
    configs = [a for a in (*args, *kwargs.values()) if type(a).__name__ == "NSAConfig"]
    config = f"config {_short_config(configs[0])}; " if configs else ""
    shown = ", ".join(s for s in inputs if s)
    return f"{what} raised {type(exc).__name__}: {message} at {where} ({config}inputs {shown or '-'})"


_NOT_IMPLEMENTATION = tuple(os.path.realpath(p) for p in {sysconfig.get_paths()["stdlib"]})
_FRAMEWORK = ("/torch/", "/_pytest/", "/pluggy/", "/hypothesis/", "/einops/", "/einx/")


def raised_at(exc: BaseException) -> str:
    """The innermost frame of exc's traceback that belongs to the implementation (not Python, torch or the test
    tools), as file:line; the innermost frame if none does."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "?"
    ours = [f for f in frames if not os.path.realpath(f.filename).startswith(_NOT_IMPLEMENTATION)
            and not any(part in f.filename for part in _FRAMEWORK)]
    frame = (ours or frames)[-1]
    return f"{_relative(frame.filename)}:{frame.lineno}"


def _relative(path: str) -> str:
    real = os.path.realpath(path)
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
        if marker in real:
            return real.split(marker, 1)[1]
    try:
        return os.path.relpath(real)
    except ValueError:
        return real


def _shape_of(x: Any) -> str:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{list(x.shape)} {str(x.dtype).replace('torch.', '')}"
    if hasattr(x, "cmp") and hasattr(x, "slc"):  # BranchKV
        k, v = x.cmp
        return f"kv {list(k.shape)}/{list(v.shape)}"
    return ""


def _short_config(cfg: Any) -> str:
    return (f"l={cfg.cmp_block} d={cfg.cmp_stride} l'={cfg.sel_block} n={cfg.n_sel} init={cfg.n_init} "
            f"local={cfg.n_local} w={cfg.window} heads={cfg.n_heads}/{cfg.n_kv_heads} dk={cfg.head_dim_qk} "
            f"dv={cfg.head_dim_v} phi={cfg.phi} window_keys={cfg.window_keys} cmp_visibility={cfg.cmp_visibility} "
            f"selection_score={cfg.selection_score} group_reduce={cfg.group_reduce}")


@functools.cache
def load_impl(spec: str) -> Implementation:
    """Resolve an --impl value to an Implementation (once per process); ValueError with one line if it cannot."""
    if spec in ("reference", "optimized"):
        target = importlib.import_module(spec)
    elif ":" in spec:
        module_name, attr = spec.split(":", 1)
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:
            raise ValueError(f"--impl {spec!r}: importing {module_name!r} failed with {type(exc).__name__}: {exc} "
                             f"(it must be importable from here, e.g. installed or on PYTHONPATH)") from exc
        if not hasattr(module, attr):
            raise ValueError(f"--impl {spec!r}: module {module_name!r} has no attribute {attr!r}")
        target = getattr(module, attr)
    else:
        raise ValueError(f"--impl {spec!r}: expected 'reference', 'optimized' or 'package.module:attr'")
    stages = {}
    for name in STAGES:
        for where in (name, *STAGE_ALTERNATIVES.get(name, ())):
            found = _lookup(target, where)
            if found is not None:
                stages[name] = found
                break
    if "make_module" not in stages and "NSAAttention" in stages:
        stages["make_module"] = _module_from_nsa_attention(stages["NSAAttention"])
    if not stages:
        raise ValueError(f"--impl {spec!r} provides none of the stages the suite knows ({', '.join(STAGES)}): "
                         "see docs/adapters.md")
    caps = _capabilities_of(spec, target)
    if caps.stages is not None:
        missing = sorted(caps.stages - set(stages))
        if missing:
            raise ValueError(f"--impl {spec!r}: CAPABILITIES.stages names {missing}, which the adapter does not have")
        stages = {n: s for n, s in stages.items() if n in caps.stages}
    name = str(getattr(target, "NAME", spec))
    return Implementation(name=name, target=target, stages=stages, spec=spec, caps=caps)


def _capabilities_of(spec: str, target: Any) -> Capabilities:
    if spec in ("reference", "optimized"):
        return EVERYTHING
    caps = getattr(target, "CAPABILITIES", None)
    if caps is None:
        return Capabilities(shared_kv=bool(getattr(target, "SHARED_KV", False)), precision="detect")
    if not isinstance(caps, Capabilities):
        raise ValueError(f"--impl {spec!r}: CAPABILITIES must be a conformance.adapters.Capabilities, got "
                         f"{type(caps).__name__}")
    return caps


def _module_from_nsa_attention(cls: Any) -> Any:
    def make_module(cfg: Any, hidden_size: int) -> Any:
        return cls(hidden_size, cfg)

    return make_module


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
