"""The lean decode step (docs/decode.md, "Lean step"): a step (one token per row) on the kernel path in five Triton
launches (optimized/kernels/decode_step.py) instead of the ~30 small kernels of NSADecodeCache.advance.

The kernels compute every convention themselves from the config's switches (window_keys, cmp_visibility,
selection_score, group_reduce, l, d, l', n, n_init, n_local, w), so the lean step honours none of the convention
seams of optimized.masks except masks.eq9_pool_weights, whose band it checks against the overlap band its kernels
compute (a RuntimeError otherwise). The Eq. 7 emission of a step that completes a compressed block is one or two
more launches in half precision (optimized/kernels/decode_emission.py: phi avg or mlp in fp32, the compute dtype of
optimized.compression's torch phi, whose seams it does not read); an fp32 cache computes phi in float64 and keeps
the torch emission (which honours those seams). A replaced seam changes decode on the torch backend
(docs/decode.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

from reference.config import NSAConfig
from reference.contract import BranchKV, NSAOutput, Reads

from .. import masks
from ..dispatch import compute_dtype


def step_rules(cfg: NSAConfig):
    """The kernels' StepRules for cfg."""
    from optimized.kernels.decode_step import StepRules

    band = masks.eq9_pool_weights(cfg)
    l, d, lp = cfg.cmp_block, cfg.cmp_stride, cfg.sel_block
    overlap = tuple(float(min(r * d + l, lp) - max(r * d, 0)) / d
                    for r in range(band.first_offset, band.first_offset + len(band.weights)))
    if overlap != tuple(band.weights):  # the kernels recompute the weights from l, d, l' (decode_step_cmp._eq9_term)
        raise RuntimeError(f"masks.eq9_pool_weights gives {band} for {cfg}, not the overlap band {overlap} the lean "
                           "kernels compute")
    return StepRules(cmp_block=cfg.cmp_block, cmp_stride=cfg.cmp_stride, sel_block=cfg.sel_block, n_sel=cfg.n_sel,
                     n_init=cfg.n_init, n_local=cfg.n_local, window_size=cfg.window_size,
                     strict_visibility=cfg.cmp_visibility == "strict", logit_scores=cfg.selection_score == "logits",
                     mean_reduce=cfg.group_reduce == "mean", eq9_first_offset=band.first_offset,
                     eq9_band=len(band.weights))


def lean_step(cache, q: Tensor, kv: BranchKV, gates: Tensor, n_new: Tensor, bound: int) -> NSAOutput:
    """Append one token per row of `cache` (an NSADecodeCache; n_new [B] in {0, 1} on its device) and return the
    step's NSAOutput; advances cache.device_lengths. bound: a static upper bound on every row's length after the
    step (sizes the compressed tokens and selection blocks the kernels may scan)."""
    from optimized.kernels.decode_step import lean_decode_step

    cfg = cache.cfg
    new = (kv.cmp.k, kv.cmp.v, kv.slc.k, kv.slc.v, kv.win.k, kv.win.v)
    out = lean_decode_step(q, gates, new, cache.device_lengths, n_new, (cache.compressed.k, cache.compressed.v),
                           (cache.cmp_raw.k, cache.cmp_raw.v), (cache.history.k, cache.history.v),
                           (cache.window.k, cache.window.v), step_rules(cfg), masks.compressed_block_count(bound, cfg),
                           masks.sel_block_count(bound, cfg))
    return NSAOutput(o=out.o, indices=out.indices, o_cmp=out.o_cmp, o_slc=out.o_slc, o_win=out.o_win,
                     reads=Reads(cmp=out.reads_cmp, slc=out.reads_slc, win=out.reads_win))


def emits_in_kernel(dtype: torch.dtype) -> bool:
    """Whether the lean step's Eq. 7 emission runs on the kernel: caches whose phi computes in fp32
    (optimized.dispatch.compute_dtype), i.e. bf16 and fp16."""
    return compute_dtype(dtype) == torch.float32


def lean_emit(cache, kv: BranchKV, n_new: Tensor) -> None:
    """Eq. 7 on the lean step: write the compressed token each row's step completes into cache.compressed, from the
    raw ring before the step's append (one launch for mean pooling, two for the MLP; rows that complete no block
    write nothing)."""
    from optimized.kernels.decode_emission import emit_step_block

    cfg = cache.cfg
    k_new, v_new = (t.to(cache.dtype).contiguous() for t in (kv.cmp.k, kv.cmp.v))
    emit_step_block(cache.device_lengths, n_new, k_new, v_new, (cache.cmp_raw.k, cache.cmp_raw.v),
                    (cache.compressed.k, cache.compressed.v), cfg.cmp_block, cfg.cmp_stride,
                    cache.phi if cfg.phi == "mlp" else None)
