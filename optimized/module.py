"""optimized.NSAAttention: reference.NSAAttention's parameters (same names, so a state_dict loads into either)
with the vectorized functional NSA."""

from __future__ import annotations

from torch import Tensor

from reference.config import NSAConfig
from reference.contract import BranchKV, NSAOutput, PhiWeights
from reference.module import NSAAttention as ReferenceNSAAttention

from .dispatch import check_backend
from .forward import BRANCHES, check_branches, nsa_forward


class NSAAttention(ReferenceNSAAttention):
    """One NSA attention layer. backend (the selected branch) and range_backend (every other stage) take
    nsa_forward's values: "auto" (the default: the Triton kernels for CUDA tensors, the torch path elsewhere;
    optimized.dispatch), "torch" or "triton". branches: the branches the layer computes (nsa_forward's)."""

    def __init__(self, hidden_size: int, cfg: NSAConfig, *, gate_hidden: int | None = None,
                 phi_hidden: int | None = None, rope_base: float = 10000.0, backend: str = "auto",
                 range_backend: str = "auto", branches: tuple[str, ...] = BRANCHES, check_finite: bool = False):
        check_backend("backend", backend)
        check_backend("range_backend", range_backend)
        branches = check_branches(branches)
        super().__init__(hidden_size, cfg, gate_hidden=gate_hidden, phi_hidden=phi_hidden, rope_base=rope_base,
                         check_finite=check_finite)
        self.backend = backend
        self.range_backend = range_backend
        self.branches = branches

    def functional_forward(self, q: Tensor, kv: BranchKV, gates: Tensor, phi: PhiWeights | None, *,
                           cu_seqlens: Tensor | None = None) -> NSAOutput:
        """The vectorized NSA; cu_seqlens: a packed batch, computed on the packed path directly (no loop over
        documents). The reference module's project() restarts RoPE positions at each document start."""
        return nsa_forward(q, kv, gates, self.cfg, phi, backend=self.backend, range_backend=self.range_backend,
                           cu_seqlens=cu_seqlens, branches=self.branches, check_finite=self.check_finite)
