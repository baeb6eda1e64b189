"""The launch policy: every number the launch gate applies, in one place (docs/runbook.md states each one)."""

from __future__ import annotations

# Environment guard (sentinels/launch/env.py).
MIN_PYTHON = (3, 11)
MIN_TORCH = (2, 4)
MIN_GPU_CAPABILITY = (8, 0)  # the Triton kernels (optimized/kernels) are built and tested for sm_80 and newer

# Config preflight (sentinels/launch/preflight.py).
LONG_RUN_STEPS = 5000  # a run of this many optimizer steps or more is a "long run"
MIN_CHECKPOINTS_PER_LONG_RUN = 10  # long runs need save_every in [1, steps / 10]: at most a tenth of the run lost
TOY_MODEL_MAX_PARAMETERS = 20_000_000  # a long run of a model with fewer parameters than this is refused as a toy

# GO/NO-GO records (sentinels/launch/gonogo.py).
GO_RECORD_MAX_AGE_S = 24 * 3600  # the launcher and the trainer accept a GO record younger than this
GO_RECORD_MAX_CLOCK_SKEW_S = 300  # a record dated further in the future than this is refused (clock skew)
RECORD_SCHEMA = 1
