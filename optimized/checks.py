"""Input checks of the stage functions: a ValueError names the tensor and the rule it breaks."""

from __future__ import annotations

from torch import Tensor

from reference.config import NSAConfig


def check_branch_inputs(stage: str, q: Tensor, k: Tensor, v: Tensor, cfg: NSAConfig) -> None:
    """Shapes the branch stages rely on; a ValueError names the tensor and the rule."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.ndim != 4:
            raise ValueError(f"{stage}: {name} must be a 4-dim tensor [B, T, H, D]")
    if q.shape[2] != cfg.n_heads or q.shape[3] != cfg.head_dim_qk:
        raise ValueError(f"{stage}: q must be [B, T, n_heads={cfg.n_heads}, head_dim_qk={cfg.head_dim_qk}], "
                         f"got {tuple(q.shape)}")
    if k.shape[2] != cfg.n_kv_heads or k.shape[3] != cfg.head_dim_qk:
        raise ValueError(f"{stage}: k must be [B, T, n_kv_heads={cfg.n_kv_heads}, head_dim_qk={cfg.head_dim_qk}], "
                         f"got {tuple(k.shape)}")
    if tuple(v.shape[:3]) != tuple(k.shape[:3]) or v.shape[3] != cfg.head_dim_v:
        raise ValueError(f"{stage}: v must be [B, T, n_kv_heads, head_dim_v={cfg.head_dim_v}] like k, "
                         f"got {tuple(v.shape)}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"{stage}: k batch {k.shape[0]} != q batch {q.shape[0]}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{stage}: {name} is {t.dtype} on {t.device} but q is {q.dtype} on {q.device}")
