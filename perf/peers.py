"""Other NSA libraries timed beside ours in the same sweep: fla's `parallel_nsa` (fla-core, `fla.ops.nsa`; the
optional extra `fla`: `pip install '.[fla]'`).

fla computes the compressed and selected branches (and a sliding window only through flash-attn, which it does
not depend on, so the window is off): q [B, T, HQ, K]; one k, v [B, T, H, K|V] shared by its branches; mean
pooling over blocks of `block_size` tokens as the compression (our phi = "avg" with l = d = l' = block_size);
`block_counts` selected blocks per (query, group), the first block and the two most recent always among them;
gates g_cmp, g_slc [B, T, HQ]; GQA groups of a power-of-2 size >= 16. Its Triton kernels run on CUDA only; the
tests drive the same plumbing on CPU with a stand-in of the same signature.

The case gives fla the sweep's own inputs: q, the selection branch's k / v (the key / value SDPA gets too) and
the first two gates, so fla's rows and ours differ only in the implementation (and in ours reading an independent
k / v per branch).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .cases import Inputs, Prepared, _forward_backward, _forward_only, _leaf
from .spec import BenchSpec

FLA = "fla"
FLA_FUNCTION = "fla.ops.nsa:parallel_nsa"
FLA_NOTE = ("fla parallel_nsa: compressed (mean pooling) + selected branches, no window; one k/v shared by its "
            "branches")


def load_function(target: str) -> Callable:
    """`package.module:attr` -> the callable, or one ValueError line naming what is missing."""
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - an ImportError, or the package failing while it imports
        raise ValueError(f"--impls {FLA}: cannot import {module_name} ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''}); install the optional extra: "
                         f"pip install '.[fla]'") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"--impls {FLA}: {module_name} has no callable {attr!r} (fla-core 0.6.0 has "
                         f"fla.ops.nsa.parallel_nsa)")
    return fn


@dataclass
class FlaNSA:
    """fla's parallel_nsa (or a stand-in with its signature, for CPU tests) as one implementation of a sweep."""

    fn: Callable
    label: str = FLA
    needs_cuda: bool = True

    @classmethod
    def load(cls, target: str | None = None) -> "FlaNSA":
        return cls(fn=load_function(target or FLA_FUNCTION))

    def check(self, spec: BenchSpec, device: torch.device) -> None:
        """One ValueError line when fla cannot run this sweep's configuration."""
        cfg = spec.cfg
        rules = [
            (cfg.cmp_block == cfg.cmp_stride == cfg.sel_block, f"l = d = l' (one block size; got l={cfg.cmp_block}, "
                                                               f"d={cfg.cmp_stride}, l'={cfg.sel_block})"),
            (cfg.phi == "avg", f"phi = 'avg' (fla compresses by mean pooling; got {cfg.phi!r})"),
            (cfg.group_size >= 16 and cfg.group_size & (cfg.group_size - 1) == 0,
             f"a power-of-2 group size >= 16 (got {cfg.group_size})"),
            (cfg.head_dim_qk <= 256, f"d_k <= 256 (got {cfg.head_dim_qk})"),
        ]
        broken = [rule for ok, rule in rules if not ok]
        hint = f" (sweep {spec.name!r}; --preset equal_blocks has a configuration fla runs)" if broken else ""
        if device.type != "cuda" and self.needs_cuda:
            broken.append(f"CUDA (its kernels are Triton; got {device.type})")
        if broken:
            raise ValueError(f"--impls {self.label} needs " + "; ".join(broken) + hint)

    def build_case(self, pass_name: str, inputs: Inputs, spec: BenchSpec, seed: int) -> Prepared:
        """The callable of one pass over the sweep's inputs; the first forward runs here."""
        if inputs.cu_seqlens is not None:
            raise ValueError(f"{self.label}: the packed workload is not wired for fla (single sequences only)")
        cfg = spec.cfg
        train = pass_name == "fwd_bwd"
        q, (k, v) = inputs.q, inputs.kv.slc
        g_cmp, g_slc = inputs.gates[..., 0].contiguous(), inputs.gates[..., 1].contiguous()
        if train:
            q, k, v, g_cmp, g_slc = (_leaf(t) for t in (q, k, v, g_cmp, g_slc))

        def forward():
            return self.fn(q, k, v, g_cmp=g_cmp, g_slc=g_slc, block_counts=cfg.n_sel, block_size=cfg.sel_block,
                           window_size=0)

        if train:
            return Prepared(_forward_backward(forward, [q, k, v, g_cmp, g_slc], seed, forward()), None, FLA_NOTE)
        run = _forward_only(forward)
        run()
        return Prepared(run, None, FLA_NOTE)
