"""optimized.NSAAttention: reference.NSAAttention's parameters (same names, so a state_dict loads into either)
with the vectorized functional NSA."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from reference.config import NSAConfig
from reference.contract import KV, BranchKV, NSAOutput, PhiWeights
from reference.module import NSAAttention as ReferenceNSAAttention
from reference.module import apply_rope, token_positions

from .dispatch import check_backend, gate_mlp_on_kernels, in_autocast_dtype, rope_on_kernels, triton_imports
from .forward import BRANCHES, check_branches, nsa_forward


def cast_once_for_autocast(x: Tensor) -> Tensor:
    """x in the autocast dtype when autocast is on for its device (what each matmul would cast it to), else x:
    matmuls that share an input then share one low-precision copy of it, and backward keeps that copy once."""
    if torch.is_autocast_enabled(x.device.type) and x.is_floating_point():
        return x.to(torch.get_autocast_dtype(x.device.type))
    return x


def projected_heads(y: Tensor, rotated: tuple[int, ...], dk: int, plain: tuple[int, ...], dv: int, base: float,
                    position_offset: int = 0, cu_seqlens: Tensor | None = None,
                    range_backend: str = "auto") -> tuple[Tensor, ...]:
    """The heads of a fused q/k/v projection's output y [B, T, N]: parts of `rotated` heads of dk with RoPE
    (reference.module.apply_rope at the tokens' positions, bitwise), then parts of `plain` heads of dv copied out of
    y (so backward keeps them alone, not all of y). Where dispatch.rope_on_kernels says so, kernels.rope.project_heads
    in one Triton launch each way (the parts' gradients written straight into y's; RoPE's tables of a contiguous run
    of positions built once and kept); else torch.split (backward concatenates the parts' gradients into one
    tensor, where each slice would zero-fill a gradient of the whole tensor and the parts would then be added) and
    the torch expression."""
    B, T, _ = y.shape
    if rope_on_kernels(y.device, y.dtype, range_backend):
        from .kernels.rope import contiguous_rope_tables, project_heads, rope_tables

        tables = (contiguous_rope_tables(T, position_offset, dk, base, y.dtype, y.device) if cu_seqlens is None else
                  rope_tables(token_positions(T, position_offset, cu_seqlens, B, y.device), dk, base, y.dtype))
        return project_heads(y, tables, rotated, dk, plain, dv)
    positions = token_positions(T, position_offset, cu_seqlens, B, y.device)
    y_qk, y_v = y.split([sum(rotated) * dk, sum(plain) * dv], dim=-1)
    qk = apply_rope(y_qk.view(B, T, sum(rotated), dk), positions, base)
    v = y_v.contiguous().view(B, T, sum(plain), dv)
    return (*qk.split(list(rotated), dim=2), *v.split(list(plain), dim=2))


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

    def project(self, x: Tensor, position_offset: int = 0, *,
                cu_seqlens: Tensor | None = None) -> tuple[Tensor, BranchKV, Tensor]:
        """reference.NSAAttention.project with fewer kernels: q and the three branches' k and v come from one
        matmul over the concatenated weights, and RoPE rotates q and the three k in one call (its angles
        computed once), the parts taken apart by projected_heads (on the kernel path one Triton launch forward,
        and backward writes the parts' gradients straight into the matmul's output gradient). Under autocast x is
        cast once, for that matmul and the gate MLP, so backward keeps one low-precision copy of x instead of one
        per matmul, and the gate MLP's hidden activations are recomputed in backward (gates). q and k are views of
        RoPE's output; v is copied out of the matmul's output, so what backward keeps of it is v alone (the
        pre-RoPE q and k are not kept alive through views). The same parameters and the same function; only the
        matmul's blocking may round differently."""
        B, T, _ = x.shape
        cfg = self.cfg
        Hq, Hkv, dk, dv = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim_qk, cfg.head_dim_v
        x = cast_once_for_autocast(x)
        weight = torch.cat([self.q_proj.weight, *(getattr(self, f"k_{b}_proj").weight for b in BRANCHES),
                            *(getattr(self, f"v_{b}_proj").weight for b in BRANCHES)])
        y = F.linear(x, weight)
        q, *ks_vs = projected_heads(y, (Hq,) + (Hkv,) * len(BRANCHES), dk, (Hkv,) * len(BRANCHES), dv,
                                    self.rope_base, position_offset, cu_seqlens, self.range_backend)
        ks, vs = ks_vs[:len(BRANCHES)], ks_vs[len(BRANCHES):]
        kv = BranchKV(**{b: KV(ks[i], vs[i]) for i, b in enumerate(BRANCHES)})
        return q, kv, self.gates(x).view(B, T, Hq, 3)

    def gates(self, x: Tensor) -> Tensor:
        """sigmoid(self.gate(x)) [..., Hq * 3], without keeping the gate MLP's hidden activations (2 x d_model
        values per token, a third of what the layer would otherwise keep beyond dense) for backward: at half
        precision on the kernel path (dispatch.gate_mlp_on_kernels) through kernels/gate_mlp.py (the forward the
        expression's own ops; backward recomputes the first layer and forms the hidden gradient in one Triton
        launch between the matmuls); elsewhere the torch expression under torch.utils.checkpoint. The MLP draws no
        random numbers, so no RNG state is saved for its recomputation (reading it is not allowed while a CUDA graph
        records the step)."""
        first, act, last = self.gate
        if isinstance(act, torch.nn.SiLU) and gate_mlp_on_kernels(x.device, x.dtype, self.range_backend):
            from .kernels.gate_mlp import gate_mlp_kernel

            return gate_mlp_kernel(x, first.weight, first.bias, last.weight, last.bias)
        logits = (checkpoint(self.gate, x, use_reentrant=False, preserve_rng_state=False)
                  if torch.is_grad_enabled() else self.gate(x))
        return torch.sigmoid(logits)

    def forward(self, x: Tensor, position_offset: int = 0, *, cu_seqlens: Tensor | None = None) -> Tensor:
        """reference.NSAAttention.forward, with the output projection of project_output."""
        return self.project_output(self.attention(x, position_offset, cu_seqlens=cu_seqlens).o)

    def project_output(self, o: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """o_proj over the heads of the attention output o [B, T, Hq, d_v] (cast to dtype first, if given), without
        keeping o for backward where Eq. 5's kernel made it: backward recomputes it, bitwise, with one more pass of
        that kernel over the gates and branch outputs it keeps anyway (kernels.gated_sum.recomputed_in_backward),
        T * Hq * d_v values fewer kept per layer. Under autocast, an o already in the autocast dtype goes to the
        matmul as it is (a cast to dtype would only be cast back, two copies and their gradients)."""
        B, T = o.shape[:2]
        flat = o.reshape(B, T, -1)
        if dtype is not None and not in_autocast_dtype(o):
            flat = flat.to(dtype)
        if not triton_imports():  # no Triton: o came from the torch path and is kept as usual
            return self.o_proj(flat)
        from .kernels.gated_sum import recomputed_in_backward

        with recomputed_in_backward(o):
            return self.o_proj(flat)

    def functional_forward(self, q: Tensor, kv: BranchKV, gates: Tensor, phi: PhiWeights | None, *,
                           cu_seqlens: Tensor | None = None, indices: Tensor | None = None) -> NSAOutput:
        """The vectorized NSA; cu_seqlens: a packed batch, computed on the packed path directly (no loop over
        documents). The reference module's project() restarts RoPE positions at each document start. indices:
        teacher-forced selection [B, T, Hkv, n] in place of Eq. 8-11 (nsa_forward's)."""
        return nsa_forward(q, kv, gates, self.cfg, phi, backend=self.backend, range_backend=self.range_backend,
                           cu_seqlens=cu_seqlens, indices=indices, branches=self.branches,
                           check_finite=self.check_finite)
