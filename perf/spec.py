"""BenchSpec: what one benchmark sweep measures (shapes, NSA config, timing rules), as a validated dataclass.

Presets (PRESETS; DEFAULT_IMPLS names what each times unless --impls says otherwise):
- "paper": the H100 sweep: bf16, batch 1, 64 query heads in 4 KV groups, d_k = d_v = 128, the paper's
  l/d/l'/n/w (NSAConfig.preset("paper", head_dim_qk=128, head_dim_v=128)), T = 8k..128k; SDPA and ours, whole
  layer and every stage.
- "equal_blocks": the peer comparison: the same heads, l = d = l' = 64, n = 16, w = 512, phi = "avg" (mean
  pooling, what fla computes), T = 8k..128k, whole layer only: SDPA, ours, ours without the window branch
  (`nsa[branches=cmp+slc]`) and fla's parallel_nsa (perf/peers.py).
- "tiny": a CPU-sized sweep of the same code paths (4 heads, 2 groups, d = 32, a small config, T = 256, 512)
  that CI runs so the runner cannot rot.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from reference.config import NSAConfig

PASSES = ("fwd", "fwd_bwd")
NSA_STAGES = ("compress", "cmp_attn", "select", "selected", "window", "gate")
LAYER = "layer"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
SDPA_GQA_MODES = ("expand", "enable_gqa")


@dataclass(frozen=True)
class BenchSpec:
    """One sweep. Times are medians over `repeats` runs per round, `rounds` rounds per case (the spread
    between round medians is the measured run-to-run variation the regression threshold is built from)."""

    name: str
    cfg: NSAConfig
    seq_lens: tuple[int, ...]
    batch: int = 1
    dtype: str = "bfloat16"
    phi_hidden: int | None = None  # hidden width of the Eq. 7 phi MLP; None = d_k (NSAAttention's default)
    repeats: int = 10  # timed runs per round; the reported median is over all rounds x repeats runs (>= 20)
    warmup: int = 2  # untimed runs after the first call (compilation, autotuning, allocator warm-up)
    rounds: int = 2  # rounds per case; spread = (max - min) / min of the round medians
    flush_bytes: int = 256 * 2**20  # L2 flush buffer, zeroed before every timed run (H100 L2 = 50 MiB)
    time_budget_s: float = 450.0  # wall-clock budget of the sweep; cases that would exceed it are skipped
    case_cap_s: float | None = None  # a case whose calls would take longer than this is skipped (None: no cap), so
    #                                  one slow implementation cannot spend a short sweep's budget on its largest T
    sdpa_gqa: str = "expand"  # "expand": k/v repeated to the query heads before timing; "enable_gqa": SDPA's flag
    matmul_size: int = 8192  # the matmul ceiling multiplies two [size, size] random matrices in `dtype`
    copy_bytes: int = 2**30  # the copy ceiling copies a buffer of this many bytes device-to-device
    regression_floor: float = 0.10  # smallest regression threshold (fraction of the baseline median)
    spread_factor: float = 3.0  # threshold = max(regression_floor, spread_factor * observed spread)
    cpu_threads: int = 1  # torch threads for --device cpu (the tiny sweep checks code paths, not CPU speed)
    passes: tuple[str, ...] = PASSES
    stages: tuple[str, ...] = NSA_STAGES

    def __post_init__(self) -> None:
        if not isinstance(self.cfg, NSAConfig):
            raise ValueError(f"BenchSpec.cfg must be an NSAConfig, got {type(self.cfg).__name__}")
        if not self.seq_lens or any(not isinstance(t, int) or t <= 0 for t in self.seq_lens):
            raise ValueError(f"BenchSpec.seq_lens must be positive ints, got {self.seq_lens}")
        for name in ("batch", "repeats", "warmup", "rounds", "flush_bytes", "matmul_size", "copy_bytes",
                     "cpu_threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "warmup" else 1):
                raise ValueError(f"BenchSpec.{name} must be a {'non-negative' if name == 'warmup' else 'positive'} "
                                 f"int, got {value!r}")
        if self.phi_hidden is not None and self.phi_hidden <= 0:
            raise ValueError(f"BenchSpec.phi_hidden must be positive or None, got {self.phi_hidden}")
        if self.dtype not in DTYPES:
            raise ValueError(f"BenchSpec.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.sdpa_gqa not in SDPA_GQA_MODES:
            raise ValueError(f"BenchSpec.sdpa_gqa must be one of {SDPA_GQA_MODES}, got {self.sdpa_gqa!r}")
        if self.time_budget_s <= 0:
            raise ValueError(f"BenchSpec.time_budget_s must be > 0, got {self.time_budget_s}")
        if self.case_cap_s is not None and self.case_cap_s <= 0:
            raise ValueError(f"BenchSpec.case_cap_s must be > 0 or None, got {self.case_cap_s}")
        if not 0 < self.regression_floor < 10:
            raise ValueError(f"BenchSpec.regression_floor must be a fraction in (0, 10), got {self.regression_floor}")
        if self.spread_factor < 1:
            raise ValueError(f"BenchSpec.spread_factor must be >= 1, got {self.spread_factor}")
        bad_passes = [p for p in self.passes if p not in PASSES]
        if bad_passes or not self.passes:
            raise ValueError(f"BenchSpec.passes must be a non-empty subset of {PASSES}, got {self.passes}")
        bad_stages = [s for s in self.stages if s not in NSA_STAGES]
        if bad_stages:
            raise ValueError(f"BenchSpec.stages must be a subset of {NSA_STAGES}, got {self.stages}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def phi_width(self) -> int:
        """Hidden width of the phi MLP actually used."""
        return self.phi_hidden or self.cfg.head_dim_qk

    def replace(self, **changes: Any) -> "BenchSpec":
        return dataclasses.replace(self, **changes)

    def shape_key(self) -> dict[str, Any]:
        """What must match for two sweeps' timings to be comparable (used by the baseline gate)."""
        return {
            "name": self.name,
            "cfg": self.cfg.to_dict(),
            "batch": self.batch,
            "dtype": self.dtype,
            "phi_hidden": self.phi_width,
            "sdpa_gqa": self.sdpa_gqa,
        }

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["cfg"] = self.cfg.to_dict()
        return out


PRESETS = ("paper", "equal_blocks", "tiny")
DEFAULT_IMPLS = {"paper": "sdpa,nsa", "equal_blocks": "sdpa,nsa,nsa[branches=cmp+slc],fla", "tiny": "sdpa,nsa"}


def preset(name: str, **overrides: Any) -> BenchSpec:
    """A named sweep (see module docstring), optionally with fields overridden."""
    if name == "paper":
        base = BenchSpec(
            name="paper",
            cfg=NSAConfig.preset("paper", head_dim_qk=128, head_dim_v=128),
            seq_lens=(8192, 16384, 32768, 65536, 131072),
        )
    elif name == "equal_blocks":
        base = BenchSpec(
            name="equal_blocks",
            cfg=NSAConfig.preset("equal_blocks", head_dim_qk=128, head_dim_v=128, phi="avg"),
            seq_lens=(8192, 16384, 32768, 65536, 131072),
            stages=(),
        )
    elif name == "tiny":
        base = BenchSpec(
            name="tiny",
            cfg=NSAConfig(cmp_block=16, cmp_stride=8, sel_block=32, n_sel=4, n_init=1, n_local=2, window=64,
                          n_heads=4, n_kv_heads=2, head_dim_qk=32, head_dim_v=32, phi="mlp"),
            seq_lens=(256, 512),
            dtype="float32",
            repeats=3,
            warmup=1,
            flush_bytes=4 * 2**20,
            time_budget_s=120.0,
            matmul_size=256,
            copy_bytes=16 * 2**20,
        )
    else:
        raise ValueError(f"unknown benchmark preset {name!r}; known presets: {list(PRESETS)}")
    return base.replace(**overrides) if overrides else base
