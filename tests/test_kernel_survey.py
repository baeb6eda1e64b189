"""perf/kernel_survey.py: the lean decode step's gate, score and select kernels, the prefill range and
selected-attention kernels' launches and Eq. 7's and the gate MLP's kernels compile for sm_90 without spilling
beyond what was measured acceptable, and the pipelined launches load every tile in their loops asynchronously (no
GPU needed: Triton's own ptxas and cuobjdump). An earlier gate kernel spilled kilobytes per thread at 16-32
compressed splits and ran several times slower, and an earlier selected dq kernel's key-tile load was left
synchronous and ran 1.3x-1.5x slower (perf/NOTES.md); this keeps both from coming back unseen."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="this triton build ships no cuobjdump")
def test_kernels_compile_for_sm90_without_spills_and_with_pipelined_loads():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the survey compiles real kernels
    run = subprocess.run([sys.executable, "-m", "perf.kernel_survey", "--require-no-spill", "--require-pipelined"],
                         env=env, capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [line for line in run.stdout.splitlines() if line.startswith(("gate", "score", "select ("))]
    assert len(rows) == 7 and all(line.endswith("    0 B stack") for line in rows), run.stdout
    prefill = [line for line in run.stdout.splitlines() if line.startswith("prefill")]
    assert len(prefill) == 14, run.stdout  # the forward at d = 128 also on its short- and long-range tiles
    spilling = [line for line in prefill if not line.endswith("    0 B stack")]
    # the launches measured fastest with a spill (optimized/kernels/common.py's range table)
    assert all(("G=16 d=128 range dk/dv" in line and line.endswith("    8 B stack"))
               or ("G=16 d_k=192 d_v=128 range dk/dv" in line and line.endswith("    8 B stack"))
               or ("G=16 d_k=192 d_v=128 range dq" in line and line.endswith("   48 B stack"))
               for line in spilling), run.stdout
    selected = [line for line in run.stdout.splitlines() if line.startswith("selected")]
    assert len(selected) == 9, run.stdout
    mlp = [line for line in run.stdout.splitlines() if line.startswith("mlp")]  # Eq. 7's and the gate MLP's kernels
    assert len(mlp) == 5 and all(line.endswith("    0 B stack") for line in mlp), run.stdout
    assert "synchronous tile loads" not in run.stdout, run.stdout
