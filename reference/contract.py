"""Data types of the NSA contract API, shared by the reference, the optimized path and adapters.

Tensors are sequence-first: q is [B, T, Hq, d_k]; keys [B, T, Hkv, d_k]; values [B, T, Hkv, d_v];
gates [B, T, Hq, 3] in the order (cmp, slc, win). These types hold data only: no NSA arithmetic
lives here, so sharing them does not let a bug in one implementation hide in another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from .config import NSAConfig

BRANCHES = ("cmp", "slc", "win")


class KV(NamedTuple):
    """Keys [B, T, Hkv, d_k] and values [B, T, Hkv, d_v] of one branch."""

    k: Tensor
    v: Tensor


@dataclass
class BranchKV:
    """Independent keys/values per branch (Section 3.3.3: "independent keys and values for three branches")."""

    cmp: KV
    slc: KV
    win: KV

    @classmethod
    def shared(cls, k: Tensor, v: Tensor) -> "BranchKV":
        """The same k, v for all three branches (the convention of implementations with one K/V projection)."""
        kv = KV(k, v)
        return cls(cmp=kv, slc=kv, win=kv)

    def branch(self, name: str) -> KV:
        return getattr(self, name)


@dataclass
class PhiMLPWeights:
    """Weights of one learnable compression MLP (Eq. 7 phi) for keys or for values.

    phi(block) = w2^T silu(w1^T flatten(block + pos) + b1) + b2, where block is [l, D]:
    pos [l, D] is the learned intra-block position embedding, w1 [l*D, hidden], b1 [hidden],
    w2 [hidden, D], b2 [D]. Shared by all KV heads.
    """

    pos: Tensor
    w1: Tensor
    b1: Tensor
    w2: Tensor
    b2: Tensor

    @classmethod
    def init(cls, block: int, dim: int, hidden: int, *, generator: torch.Generator | None = None,
             dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> "PhiMLPWeights":
        """Random weights with the scale of a Kaiming-uniform linear layer (for tests and fresh modules)."""

        def uniform(shape: tuple[int, ...], fan_in: int) -> Tensor:
            bound = fan_in ** -0.5
            t = torch.rand(shape, generator=generator, dtype=torch.float64) * 2 - 1
            return (t * bound).to(dtype=dtype, device=device)

        return cls(
            pos=uniform((block, dim), 1) * 0.02,
            w1=uniform((block * dim, hidden), block * dim),
            b1=uniform((hidden,), block * dim),
            w2=uniform((hidden, dim), hidden),
            b2=uniform((dim,), hidden),
        )

    def tensors(self) -> tuple[Tensor, ...]:
        return (self.pos, self.w1, self.b1, self.w2, self.b2)

    def to(self, **kwargs) -> "PhiMLPWeights":
        return PhiMLPWeights(*(t.to(**kwargs) for t in self.tensors()))


@dataclass
class PhiWeights:
    """Separate compression MLPs for keys and values (Eq. 7: f_K and f_V)."""

    k: PhiMLPWeights
    v: PhiMLPWeights

    @classmethod
    def init(cls, cfg: NSAConfig, hidden: int, **kwargs) -> "PhiWeights":
        return cls(
            k=PhiMLPWeights.init(cfg.cmp_block, cfg.head_dim_qk, hidden, **kwargs),
            v=PhiMLPWeights.init(cfg.cmp_block, cfg.head_dim_v, hidden, **kwargs),
        )

    def to(self, **kwargs) -> "PhiWeights":
        return PhiWeights(k=self.k.to(**kwargs), v=self.v.to(**kwargs))


@dataclass
class Reads:
    """Eq. 6 reads: key tokens each branch gathered, per (batch, query position, KV group), as int64 [B, T, Hkv].

    Implementations must fill these from the index sets they used, never from a closed-form formula.
    """

    cmp: Tensor
    slc: Tensor
    win: Tensor

    @property
    def total(self) -> Tensor:
        return self.cmp + self.slc + self.win


@dataclass
class NSAOutput:
    """Result of nsa_forward (prefill) or decode_step (then T = number of new queries)."""

    o: Tensor  # [B, T, Hq, d_v], Eq. 5 gated sum
    indices: Tensor  # [B, T, Hkv, n] int64, selected block indices ascending, padded with -1 (Eq. 11)
    o_cmp: Tensor  # [B, T, Hq, d_v]
    o_slc: Tensor  # [B, T, Hq, d_v]
    o_win: Tensor  # [B, T, Hq, d_v]
    reads: Reads


def check_inputs(q: Tensor, kv: BranchKV, gates: Tensor | None, cfg: NSAConfig, *,
                 n_queries: int | None = None) -> None:
    """Validate shapes and dtypes of the contract inputs; raise ValueError naming the tensor and the rule.

    n_queries: for decode, the number of new queries (q's T may be smaller than the keys' T).
    """
    if not isinstance(cfg, NSAConfig):
        raise ValueError(f"cfg must be an NSAConfig, got {type(cfg).__name__}")
    _check_branch_kv(kv)
    _check_tensor("q", q, 4)
    B, Tq, Hq, dk = q.shape
    if Hq != cfg.n_heads:
        raise ValueError(f"q has {Hq} heads but NSAConfig.n_heads = {cfg.n_heads}")
    if dk != cfg.head_dim_qk:
        raise ValueError(f"q head dim is {dk} but NSAConfig.head_dim_qk = {cfg.head_dim_qk}")
    Tk = None
    for name in BRANCHES:
        k, v = kv.branch(name)
        _check_tensor(f"kv.{name}.k", k, 4)
        _check_tensor(f"kv.{name}.v", v, 4)
        if k.shape[:3] != v.shape[:3]:
            raise ValueError(f"kv.{name}.k {tuple(k.shape)} and kv.{name}.v {tuple(v.shape)} differ in [B, T, Hkv]")
        if k.shape[0] != B:
            raise ValueError(f"kv.{name}.k batch {k.shape[0]} != q batch {B}")
        if k.shape[2] != cfg.n_kv_heads:
            raise ValueError(f"kv.{name}.k has {k.shape[2]} heads but NSAConfig.n_kv_heads = {cfg.n_kv_heads}")
        if k.shape[3] != cfg.head_dim_qk:
            raise ValueError(f"kv.{name}.k head dim {k.shape[3]} != NSAConfig.head_dim_qk = {cfg.head_dim_qk}")
        if v.shape[3] != cfg.head_dim_v:
            raise ValueError(f"kv.{name}.v head dim {v.shape[3]} != NSAConfig.head_dim_v = {cfg.head_dim_v}")
        if Tk is None:
            Tk = k.shape[1]
        elif k.shape[1] != Tk:
            raise ValueError(f"kv.{name}.k length {k.shape[1]} differs from the other branches ({Tk})")
        for t_name, t in ((f"kv.{name}.k", k), (f"kv.{name}.v", v)):
            if t.dtype != q.dtype:
                raise ValueError(f"{t_name} dtype {t.dtype} != q dtype {q.dtype}")
            if t.device != q.device:
                raise ValueError(f"{t_name} is on {t.device} but q is on {q.device}")
    expected_q = Tk if n_queries is None else n_queries
    if Tq != expected_q:
        raise ValueError(f"q length {Tq} != expected number of queries {expected_q} (keys have length {Tk})")
    if gates is not None:
        _check_tensor("gates", gates, 4)
        if tuple(gates.shape) != (B, Tq, Hq, 3):
            raise ValueError(f"gates must have shape [B, T, Hq, 3] = {(B, Tq, Hq, 3)}, got {tuple(gates.shape)}")
        if gates.dtype != q.dtype:
            raise ValueError(f"gates dtype {gates.dtype} != q dtype {q.dtype}")


def _check_branch_kv(kv: BranchKV) -> None:
    if not isinstance(kv, BranchKV):
        raise ValueError(f"kv must be a reference.contract.BranchKV (independent keys/values per branch; "
                         f"BranchKV.shared(k, v) for one k/v pair), got {type(kv).__name__}")
    for name in BRANCHES:
        if not isinstance(kv.branch(name), KV):
            raise ValueError(f"kv.{name} must be a reference.contract.KV(k, v), got {type(kv.branch(name)).__name__}")


def check_finite(**tensors: Tensor | None) -> None:
    """Raise ValueError naming the first tensor that holds NaN or +-Inf (with the count and the first index).

    Keyword names are the names the message uses, e.g. check_finite(q=q, gates=gates); None is skipped and a
    tensor passed under several names is checked once."""
    seen: set[int] = set()
    for name, t in tensors.items():
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        bad = ~torch.isfinite(t.detach())
        if bool(bad.any()):
            first = [int(i) for i in bad.nonzero()[0]]
            raise ValueError(f"{name} has {int(bad.sum())} non-finite value(s) (NaN or Inf), the first at {first}; "
                             f"pass check_finite=False to skip this check")


def check_finite_inputs(q: Tensor, kv: BranchKV, gates: Tensor | None, phi: PhiWeights | None = None) -> None:
    """check_finite over the contract inputs: q, each branch's k and v, gates and the phi weights."""
    tensors: dict[str, Tensor | None] = {"q": q}
    for name in BRANCHES:
        tensors[f"kv.{name}.k"], tensors[f"kv.{name}.v"] = kv.branch(name)
    tensors["gates"] = gates
    if phi is not None:
        for part in ("k", "v"):
            weights = getattr(phi, part)
            for field in ("pos", "w1", "b1", "w2", "b2"):
                tensors[f"phi.{part}.{field}"] = getattr(weights, field)
    check_finite(**tensors)


def _check_tensor(name: str, t: Tensor, ndim: int) -> None:
    if not isinstance(t, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dims [B, T, H, D], got shape {tuple(t.shape)}")
    if not t.is_floating_point():
        raise ValueError(f"{name} must be floating point, got {t.dtype}")
