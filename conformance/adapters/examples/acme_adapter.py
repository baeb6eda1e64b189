"""Worked example (docs/adapters.md): an adapter that puts the hypothetical AcmeNSA library (acme_nsa.py) under the
contract, so the conformance suite can check it:

    python -m pytest conformance --properties-only --impl conformance.adapters.examples.acme_adapter:IMPL

What an adapter does, here:
1. Layout: the contract is sequence-first [B, T, H, D]; AcmeNSA is head-first [B, H, T, D] -> transpose in and out.
2. Names and conventions: NSAConfig fields become AcmeNSA keywords (l -> block, d -> stride, l' -> select_block,
   n -> top_n, w -> window; window_keys="w+1" is a window of w + 1 keys). Conventions AcmeNSA cannot express
   (strict visibility, logit scores) raise NotCovered: those tests are reported NOT COVERED, not FAIL.
   group_reduce="mean" ranks blocks like "sum", and AcmeNSA exposes no scores, so it is accepted.
3. Inputs it cannot take: one k/v for all branches (SHARED_KV = True tells the suite to build shared inputs;
   independent ones raise NotCovered); the learnable phi of the contract becomes AcmeNSA's pooling callable.
4. Outputs: indices sorted ascending with -1 padding last; AcmeNSA counts no reads, so reads=None and the
   read properties are NOT COVERED.
5. Stages it lacks (selection_scores, select_blocks, selected_attention, window_attention, compressed_attention,
   decode_step, NSAAttention) are simply not defined: the suite reports the tests needing them NOT COVERED.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor

from conformance.adapters import NotCovered
from reference.config import NSAConfig
from reference.contract import BranchKV, NSAOutput, PhiMLPWeights, PhiWeights

from . import acme_nsa


def _head_first(x: Tensor) -> Tensor:
    return x.transpose(1, 2)  # [B, T, H, D] <-> [B, H, T, D]


def _check_conventions(cfg: NSAConfig) -> None:
    if cfg.cmp_visibility != "inclusive":
        raise NotCovered("AcmeNSA has only inclusive compressed-block visibility (i*d + l - 1 <= p)")
    if cfg.selection_score != "probs":
        raise NotCovered("AcmeNSA ranks blocks by compression probabilities only (no logit scores)")


def _pool(w: PhiMLPWeights):
    """The contract's learnable phi (Eq. 7) as an AcmeNSA pooling callable: [..., l, D] -> [..., D]."""

    def pool(blocks: Tensor) -> Tensor:
        hidden = F.silu((blocks + w.pos).flatten(-2) @ w.w1 + w.b1)
        return hidden @ w.w2 + w.b2

    return pool


def _pools(cfg: NSAConfig, phi: PhiWeights | None) -> dict:
    if cfg.phi == "avg":
        return {}
    if phi is None:
        raise ValueError("NSAConfig.phi='mlp' needs phi weights (a PhiWeights); got phi=None")
    return {"pool_k": _pool(phi.k), "pool_v": _pool(phi.v)}


def compress(k: Tensor, v: Tensor, cfg: NSAConfig, phi: PhiWeights | None = None) -> tuple[Tensor, Tensor]:
    k_cmp, v_cmp = acme_nsa.compress_kv(_head_first(k), _head_first(v), block=cfg.cmp_block,
                                        stride=cfg.cmp_stride, **_pools(cfg, phi))
    return _head_first(k_cmp), _head_first(v_cmp)


def nsa_forward(q: Tensor, kv: BranchKV, gates: Tensor, cfg: NSAConfig, phi: PhiWeights | None = None) -> NSAOutput:
    _check_conventions(cfg)
    k, v = kv.cmp
    if any(kv.branch(b).k is not k or kv.branch(b).v is not v for b in ("slc", "win")):
        raise NotCovered("AcmeNSA takes one k/v for all three branches (independent per-branch k/v given)")
    g = _head_first(gates)  # [B, Hq, T, 3]
    result = acme_nsa.sparse_attention(
        _head_first(q), _head_first(k), _head_first(v), g[..., 0], g[..., 1], g[..., 2],
        block=cfg.cmp_block, stride=cfg.cmp_stride, select_block=cfg.sel_block, top_n=cfg.n_sel,
        n_initial=cfg.n_init, n_local=cfg.n_local, window=cfg.window_size, **_pools(cfg, phi))
    # contract: ascending block indices, -1 padding last
    idx = result.block_index
    ascending = torch.sort(torch.where(idx < 0, torch.full_like(idx, torch.iinfo(idx.dtype).max), idx), -1).values
    indices = torch.where(ascending == torch.iinfo(idx.dtype).max, torch.full_like(idx, -1), ascending)
    return NSAOutput(o=_head_first(result.out), indices=_head_first(indices),
                     o_cmp=_head_first(result.branch_out["cmp"]), o_slc=_head_first(result.branch_out["slc"]),
                     o_win=_head_first(result.branch_out["win"]), reads=None)


IMPL = SimpleNamespace(NAME="acme-nsa", SHARED_KV=True, compress=compress, nsa_forward=nsa_forward)
