"""The implementations a sweep times: SDPA causal full attention, and NSA through a contract implementation.

An NSA implementation is any module exposing the contract's stage functions under their contract names
(docs/api.md): by default `optimized`, i.e. whatever the optimized package dispatches to (Triton kernels on
CUDA, the vectorized path on CPU), so the runner measures the kernels as they improve without changes here.
`--impls` names it `nsa`; `nsa[backend=torch,chunk_size=4096]` passes keyword arguments to every stage
function whose signature accepts them (e.g. to time the vectorized path on the GPU next to the kernels); a value
with `+` is a tuple: `nsa[branches=cmp+slc]` is `nsa_forward(..., branches=("cmp", "slc"))`, the layer without its
window branch. `fla` is fla-core's parallel_nsa (perf/peers.py), timed on the whole layer only.
"""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from reference.forward import gated_sum as reference_gated_sum

NSA_FUNCTIONS = ("compress", "compressed_attention", "selection_scores", "select_blocks", "selected_attention",
                 "window_attention", "nsa_forward")
SDPA = "sdpa"
NSA = "nsa"
_LABEL = re.compile(r"^(?P<kind>[a-z]+)(\[(?P<kwargs>[^\]]*)\])?$")


def resolve_target(spec: str) -> Any:
    """`optimized`, `reference`, or `package.module:attr` -> the object holding the stage functions."""
    module_name, _, attr = spec.partition(":")
    try:
        target = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"--nsa-impl {spec!r}: cannot import {module_name!r} ({exc})") from exc
    if attr:
        if not hasattr(target, attr):
            raise ValueError(f"--nsa-impl {spec!r}: {module_name} has no attribute {attr!r}")
        target = getattr(target, attr)
    return target


def _parse_value(text: str) -> Any:
    if "+" in text:
        return tuple(_parse_value(part.strip()) for part in text.split("+"))
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


@dataclass
class NSAImplementation:
    """Stage functions of one contract implementation plus the keyword arguments this variant passes."""

    label: str
    target: Any
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        missing = [name for name in NSA_FUNCTIONS if not callable(getattr(self.target, name, None))]
        if missing:
            raise ValueError(f"implementation {self.label!r} lacks contract function(s) {missing} "
                             f"(the benchmark times every NSA stage and nsa_forward)")
        for key in self.kwargs:
            if not any(self._accepts(name, key) for name in NSA_FUNCTIONS):
                raise ValueError(f"implementation {self.label!r}: no stage function accepts keyword {key!r}")

    def _accepts(self, name: str, key: str) -> bool:
        try:
            params = inspect.signature(getattr(self.target, name)).parameters
        except (TypeError, ValueError):
            return False
        return key in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

    def call(self, name: str, *args: Any, **required: Any) -> Any:
        """target.name(*args) with this variant's keyword arguments that the function accepts, plus `required`
        keywords (the packed workload's cu_seqlens), which it must accept (ValueError naming both otherwise)."""
        for key in required:
            if not self._accepts(name, key):
                raise ValueError(f"implementation {self.label!r}: {name} takes no {key!r} keyword, which this "
                                 f"workload needs")
        kwargs = {k: v for k, v in self.kwargs.items() if self._accepts(name, k)}
        return getattr(self.target, name)(*args, **kwargs, **required)

    def select(self, q, k_cmp, cfg, **required: Any):
        """Eq. 8-11 as the implementation's layer runs it: its fused `selection_indices(q, k_cmp, cfg)` when it
        has one (no [T, T/l'] score tensor), else the contract's selection_scores then select_blocks."""
        if callable(getattr(self.target, "selection_indices", None)):
            return self.call("selection_indices", q, k_cmp, cfg, **required)
        return self.call("select_blocks", self.call("selection_scores", q, k_cmp, cfg, **required), cfg, **required)

    @property
    def select_source(self) -> str:
        if callable(getattr(self.target, "selection_indices", None)):
            return "selection_indices (fused Eq. 8-11)"
        return "selection_scores + select_blocks"

    def gated_sum(self, gates, o_cmp, o_slc, o_win):
        """Eq. 5 via the implementation's own gated_sum when it has one, else the reference's (elementwise)."""
        fn = getattr(self.target, "gated_sum", None)
        return (fn or reference_gated_sum)(gates, o_cmp, o_slc, o_win)

    @property
    def gate_source(self) -> str:
        return "own gated_sum" if callable(getattr(self.target, "gated_sum", None)) else "reference.forward.gated_sum"


class Impls(NamedTuple):
    with_sdpa: bool
    variants: list[NSAImplementation]
    peers: list[Any]  # other libraries (perf.peers.FlaNSA)


def parse_impls(text: str, nsa_target: str) -> Impls:
    """`sdpa,nsa,nsa[backend=torch],fla` -> whether SDPA is timed, the NSA variants, the other libraries."""
    from .peers import FLA, FlaNSA

    labels = [part.strip() for part in re.split(r",(?![^\[]*\])", text) if part.strip()]
    if not labels:
        raise ValueError("--impls must name at least one implementation (sdpa, nsa, nsa[key=value,...], fla)")
    with_sdpa = False
    variants: list[NSAImplementation] = []
    peers: list[Any] = []
    target = None
    for label in labels:
        match = _LABEL.match(label)
        if not match or match["kind"] not in (SDPA, NSA, FLA):
            raise ValueError(f"--impls entry {label!r} must be 'sdpa', 'nsa', 'nsa[key=value,...]' or 'fla'")
        if match["kind"] in (SDPA, FLA):
            if match["kwargs"] is not None:
                raise ValueError(f"--impls entry {label!r}: {match['kind']} takes no arguments")
            if match["kind"] == SDPA:
                with_sdpa = True
            elif not any(p.label == FLA for p in peers):
                peers.append(FlaNSA.load())
            continue
        kwargs = {}
        for item in filter(None, (match["kwargs"] or "").split(",")):
            key, eq, value = item.partition("=")
            if not eq or not key.strip():
                raise ValueError(f"--impls entry {label!r}: arguments must be key=value, got {item!r}")
            kwargs[key.strip()] = _parse_value(value.strip())
        target = target if target is not None else resolve_target(nsa_target)
        variants.append(NSAImplementation(label=label, target=target, kwargs=kwargs))
    if len({v.label for v in variants}) != len(variants):
        raise ValueError(f"--impls names the same NSA variant twice: {[v.label for v in variants]}")
    return Impls(with_sdpa, variants, peers)
