"""Bug: forced blocks are given a finite score (1.0, "the largest probability") and ranked with the free ones
instead of being selected outright, so a free block whose probability saturates to 1.0, or an exact tie at 1.0,
can push a forced block out (ties go to the lower index here, so the current block J loses first).

Adapter: select_blocks = scores with the forced blocks set to 1.0, then the n highest by (-score, index).
Caught by: Tie-break determinism, forced blocks under saturated and tied scores.
"""

import torch

from conformance.selftest.variants import optimized_variant


def select_blocks_forced_as_one(scores, cfg, **kwargs):
    B, T, H, NB = scores.shape
    out = torch.full((B, T, H, cfg.n_sel), -1, dtype=torch.int64, device=scores.device)
    for p in range(T):
        J = p // cfg.sel_block
        forced = [j for j in range(J + 1) if j < cfg.n_init or j > J - cfg.n_local]
        s = scores[:, p, :, : J + 1].clone()
        s[..., forced] = 1.0
        order = torch.sort(-s, dim=-1, stable=True).indices[..., : cfg.n_sel]  # ties: lower index first
        chosen = torch.sort(order, dim=-1).values
        out[:, p, :, : chosen.shape[-1]] = chosen
    return out


IMPL = optimized_variant("forced_finite_score", select_blocks=select_blocks_forced_as_one)
