"""reference.NSAAttention: projections, RoPE on q and k (never v), the gate MLP, phi parameters, and
the functional reference. optimized.NSAAttention has the same parameter names (state_dicts load
into either)."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor

from .config import NSAConfig
from .contract import KV, BRANCHES, BranchKV, NSAOutput, PhiMLPWeights, PhiWeights, check_finite
from .forward import nsa_forward
from .packing import check_cu_seqlens


def rope_angles(positions: Tensor, dim: int, base: float) -> tuple[Tensor, Tensor]:
    """cos, sin [T, dim/2] for rotary embeddings at the given absolute positions."""
    inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, positions: Tensor, base: float = 10000.0) -> Tensor:
    """Rotate pairs (x[..., i], x[..., i + D/2]) of x [B, T, H, D] by position-dependent angles."""
    dim = x.shape[-1]
    if dim % 2:
        raise ValueError(f"RoPE needs an even head dim, got {dim}")
    cos, sin = rope_angles(positions, dim, base)
    cos = cos.to(x.dtype)[None, :, None, :]
    sin = sin.to(x.dtype)[None, :, None, :]
    x1, x2 = x.split(dim // 2, dim=-1)  # backward concatenates the halves' gradients (no zero-filled copies)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def token_positions(n_tokens: int, position_offset: int, cu_seqlens: Tensor | None, batch: int,
                    device: torch.device) -> Tensor:
    """RoPE position of every token [T]: position_offset + t, or, in a packed batch (cu_seqlens), t - start of
    its document (positions restart at each document start; position_offset must then be 0)."""
    if cu_seqlens is None:
        return torch.arange(position_offset, position_offset + n_tokens, device=device)
    if position_offset != 0:
        raise ValueError(f"position_offset must be 0 when cu_seqlens is given (positions restart at each document "
                         f"start), got {position_offset}")
    positions: list[int] = []
    for start, end in check_cu_seqlens(cu_seqlens, n_tokens, batch):
        positions.extend(range(end - start))
    return torch.tensor(positions, dtype=torch.int64, device=device)


class PhiMLP(nn.Module):
    """Learnable compression MLP (Eq. 7 phi) as parameters; see contract.PhiMLPWeights."""

    def __init__(self, block: int, dim: int, hidden: int):
        super().__init__()
        w = PhiMLPWeights.init(block, dim, hidden)
        self.pos = nn.Parameter(w.pos)
        self.w1 = nn.Parameter(w.w1)
        self.b1 = nn.Parameter(w.b1)
        self.w2 = nn.Parameter(w.w2)
        self.b2 = nn.Parameter(w.b2)

    def weights(self) -> PhiMLPWeights:
        return PhiMLPWeights(self.pos, self.w1, self.b1, self.w2, self.b2)


class NSAAttention(nn.Module):
    """One NSA attention layer over hidden states x [B, T, hidden_size].

    q: one projection shared by the branches; k/v: independent projections per branch (Section 3.3.3);
    RoPE rotates q and every branch's k before compression, never v; gates: sigmoid(MLP(x)) per query
    head and branch, the MLP's last layer zero-initialised (every gate starts at exactly 0.5).
    check_finite (attribute and keyword; default on here, off in optimized.NSAAttention): refuse NaN/Inf in x and
    in the functional NSA's inputs with a ValueError naming the tensor.
    """

    def __init__(self, hidden_size: int, cfg: NSAConfig, *, gate_hidden: int | None = None,
                 phi_hidden: int | None = None, rope_base: float = 10000.0, check_finite: bool = True):
        super().__init__()
        self.cfg = cfg
        self.check_finite = check_finite
        self.hidden_size = hidden_size
        self.rope_base = rope_base
        Hq, Hkv, dk, dv = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim_qk, cfg.head_dim_v
        self.q_proj = nn.Linear(hidden_size, Hq * dk, bias=False)
        for branch in BRANCHES:
            setattr(self, f"k_{branch}_proj", nn.Linear(hidden_size, Hkv * dk, bias=False))
            setattr(self, f"v_{branch}_proj", nn.Linear(hidden_size, Hkv * dv, bias=False))
        gate_hidden = gate_hidden or hidden_size
        self.gate = nn.Sequential(nn.Linear(hidden_size, gate_hidden), nn.SiLU(), nn.Linear(gate_hidden, Hq * 3))
        nn.init.zeros_(self.gate[-1].weight)
        nn.init.zeros_(self.gate[-1].bias)
        if cfg.phi == "mlp":
            phi_hidden = phi_hidden or dk
            self.phi_k = PhiMLP(cfg.cmp_block, dk, phi_hidden)
            self.phi_v = PhiMLP(cfg.cmp_block, dv, phi_hidden)
        self.o_proj = nn.Linear(Hq * dv, hidden_size, bias=False)

    # The functional NSA this module calls; optimized.NSAAttention overrides it.
    def functional_forward(self, q: Tensor, kv: BranchKV, gates: Tensor, phi: PhiWeights | None, *,
                           cu_seqlens: Tensor | None = None) -> NSAOutput:
        return nsa_forward(q, kv, gates, self.cfg, phi, cu_seqlens=cu_seqlens, check_finite=self.check_finite)

    def phi_weights(self) -> PhiWeights | None:
        if self.cfg.phi != "mlp":
            return None
        return PhiWeights(k=self.phi_k.weights(), v=self.phi_v.weights())

    def project(self, x: Tensor, position_offset: int = 0, *,
                cu_seqlens: Tensor | None = None) -> tuple[Tensor, BranchKV, Tensor]:
        """q [B,T,Hq,dk] (rotated), kv per branch (k rotated, v not), gates [B,T,Hq,3] in [0, 1].
        Packed (cu_seqlens, B = 1): RoPE positions restart at each document start."""
        B, T, _ = x.shape
        cfg = self.cfg
        positions = token_positions(T, position_offset, cu_seqlens, B, x.device)
        q = apply_rope(self.q_proj(x).view(B, T, cfg.n_heads, cfg.head_dim_qk), positions, self.rope_base)
        kvs = {}
        for branch in BRANCHES:
            k = getattr(self, f"k_{branch}_proj")(x).view(B, T, cfg.n_kv_heads, cfg.head_dim_qk)
            v = getattr(self, f"v_{branch}_proj")(x).view(B, T, cfg.n_kv_heads, cfg.head_dim_v)
            kvs[branch] = KV(apply_rope(k, positions, self.rope_base), v)
        gates = torch.sigmoid(self.gate(x)).view(B, T, cfg.n_heads, 3)
        return q, BranchKV(**kvs), gates

    def attention(self, x: Tensor, position_offset: int = 0, *, cu_seqlens: Tensor | None = None) -> NSAOutput:
        """The NSA output object (branch outputs, indices, reads) before the output projection."""
        if self.check_finite:
            check_finite(x=x)
        if cu_seqlens is None:  # a subclass whose seams predate packing (no cu_seqlens) still runs unpacked input
            q, kv, gates = self.project(x, position_offset)
            return self.functional_forward(q, kv, gates, self.phi_weights())
        q, kv, gates = self.project(x, position_offset, cu_seqlens=cu_seqlens)
        return self.functional_forward(q, kv, gates, self.phi_weights(), cu_seqlens=cu_seqlens)

    def forward(self, x: Tensor, position_offset: int = 0, *, cu_seqlens: Tensor | None = None) -> Tensor:
        """x [B, T, hidden] -> [B, T, hidden]; packed documents (cu_seqlens, B = 1) never attend to each other."""
        B, T, _ = x.shape
        o = self.attention(x, position_offset, cu_seqlens=cu_seqlens).o
        return self.o_proj(o.reshape(B, T, -1))
