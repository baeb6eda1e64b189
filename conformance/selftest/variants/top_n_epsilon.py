"""Bug: top-n keeps only blocks whose selection probability exceeds an epsilon (1e-10), so fewer than n blocks
are read when scores underflow, although n exist: the selection shrinks exactly where the logits spread most.

Adapter: only nsa_forward (a library with one entry point), optimized's except that its selection drops the
blocks whose Eq. 8-10 probability score is <= 1e-10 (forced blocks kept), and o_slc and o are recomputed with
those indices.
Caught by: Tie-break determinism, the end-to-end size of the selection (huge scores).
"""

from types import SimpleNamespace

import torch

import optimized
from conformance.adapters import EVERYTHING
from reference.contract import NSAOutput

EPSILON = 1e-10


def nsa_forward_epsilon(q, kv, gates, cfg, phi=None):
    out = optimized.nsa_forward(q, kv, gates, cfg, phi)
    k_cmp, _ = optimized.compress(kv.cmp.k, kv.cmp.v, cfg, phi)
    scores = optimized.selection_scores(q, k_cmp, cfg.replace(selection_score="probs"))
    kept = out.indices.clone()
    for p in range(q.shape[1]):
        J = p // cfg.sel_block
        for slot in range(cfg.n_sel):
            j = out.indices[:, p, :, slot]
            forced = (j < cfg.n_init) | (j > J - cfg.n_local)
            s = scores[:, p].gather(-1, j.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            kept[:, p, :, slot] = torch.where((j >= 0) & ~forced & (s <= EPSILON), -1, j)
    kept = torch.sort(torch.where(kept < 0, torch.iinfo(torch.int64).max, kept), dim=-1).values
    kept = torch.where(kept == torch.iinfo(torch.int64).max, -1, kept)
    o_slc = optimized.selected_attention(q, kv.slc.k, kv.slc.v, kept, cfg)
    o = gates[..., 0:1] * out.o_cmp + gates[..., 1:2] * o_slc + gates[..., 2:3] * out.o_win
    return NSAOutput(o=o, indices=kept, o_cmp=out.o_cmp, o_slc=o_slc, o_win=out.o_win, reads=None)


IMPL = SimpleNamespace(NAME="optimized[top_n_epsilon]", CAPABILITIES=EVERYTHING,
                       nsa_forward=nsa_forward_epsilon)
