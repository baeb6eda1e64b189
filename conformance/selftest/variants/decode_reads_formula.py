"""Bug: decode reads reported from the Table 4 formula (floor((s - l)/d) + 1 compressed tokens, n*l' selected,
w window) instead of counted from the index sets the step used. The totals even match Table 4 at long
contexts, which is why the formula is tempting; they are wrong for a partial current block, for fewer than
n existing blocks and for a window longer than the context.

Adapter: decode_step = optimized.decode_step with reads replaced by the formula.
Caught by: Counted reads and decode = prefill (reads differ from the sizes of the returned index sets).
"""

import dataclasses

import torch

import optimized
from reference.contract import Reads

from conformance.selftest.variants import optimized_variant


def decode_step_formula_reads(q, kv, gates, cfg, phi=None):
    out = optimized.decode_step(q, kv, gates, cfg, phi)
    B, TQ = q.shape[:2]
    TK = kv.win.k.shape[1]

    def same_for_all(value: int):
        return torch.full((B, TQ, cfg.n_kv_heads), value, dtype=torch.int64, device=q.device)

    formula = Reads(cmp=same_for_all(max(0, (TK - cfg.cmp_block) // cfg.cmp_stride + 1)),
                    slc=same_for_all(cfg.n_sel * cfg.sel_block), win=same_for_all(cfg.window_size))
    return dataclasses.replace(out, reads=formula)


IMPL = optimized_variant("decode_reads_formula", decode_step=decode_step_formula_reads)
