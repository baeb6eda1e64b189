"""Nox sessions: how users run the harness. `python -m nox -l` lists them; `python -m nox --usage SESSION` shows a
session's whole docstring.

CPU sessions (tests, conformance, sentinels, perf-cpu, lint) build a virtualenv under .nox/ and install the project
into it with the pins of constraints-cpu.txt. The first install downloads and unpacks torch (pip's progress is
shown); later runs reuse the virtualenv and pip only brings it up to date. `python -m nox -R -s SESSION` skips the
install altogether; `--reuse-venv=no` rebuilds the virtualenv. On Linux the install adds PyTorch's CPU wheel index
when it answers, so pip takes the CPU build of torch; otherwise pip uses the indexes it is configured with (see
install_cpu).

GPU sessions (conformance-gpu, sentinels-gpu, perf, preflight, launch) install nothing: they run in the interpreter
that runs nox, which must have torch with CUDA.
"""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "virtualenv"
nox.options.sessions = ["tests"]
nox.options.reuse_venv = "yes"  # pip reconciles a reused virtualenv with pyproject.toml and the pins on every run

CPU_CONSTRAINTS = "constraints-cpu.txt"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
INDEX_PROBE_TIMEOUT_S = 3.0


def torch_cpu_index(session: nox.Session) -> list[str]:
    """`--extra-index-url` of PyTorch's CPU wheels on Linux when that index answers within a few seconds, else
    nothing.

    constraints-cpu.txt pins torch==2.13.0 without a local version, so pip takes the highest build it can see:
    2.13.0+cpu when the CPU index is one of its indexes (or a local wheel it is configured to find), else PyPI's
    2.13.0, which on Linux is the CUDA build with about 15 nvidia-* packages (it runs on CPU too, but is a far larger
    download). PyPI's macOS and Windows wheels are CPU builds already. An index that does not answer is left out,
    so the install never waits on it."""
    import sys
    import urllib.error
    import urllib.request

    if not sys.platform.startswith("linux"):
        return []
    try:
        urllib.request.urlopen(urllib.request.Request(f"{TORCH_CPU_INDEX}/torch/", method="HEAD"),
                               timeout=INDEX_PROBE_TIMEOUT_S).close()
    except urllib.error.HTTPError:
        pass  # the index answered (with a status other than 200): pip can use it
    except (OSError, ValueError) as exc:
        session.log(f"{TORCH_CPU_INDEX} does not answer ({exc}); pip takes torch from the indexes it is configured "
                    f"with (from PyPI alone on Linux: the CUDA build and its nvidia-* packages)")
        return []
    return ["--extra-index-url", TORCH_CPU_INDEX]


def install_cpu(session: nox.Session, extras: str = "dev,triton") -> None:
    """Editable install of the project with the pins of constraints-cpu.txt and the CPU build of torch where pip
    can get it (torch_cpu_index), showing pip's progress."""
    session.log(f"pip install of .[{extras}] pinned by {CPU_CONSTRAINTS}: up to minutes in a new virtualenv (torch "
                f"is downloaded and unpacked), seconds in a reused one; `nox -R` skips it")
    session.install(*torch_cpu_index(session), "-c", CPU_CONSTRAINTS, "-e", f".[{extras}]", silent=False)


@nox.session
def tests(session: nox.Session) -> None:
    """Unit tests and the conformance suite on CPU (the CI command): everything not marked slow (the reference as
    the suite's implementation, our kernels in Triton's interpreter (tests/kernels), the self-test), then the
    conformance properties against optimized with the baseline comparison, then the CPU report cards of the public
    NSA libraries (the `thirdparty` extra), each compared with its committed baseline entry (a lost test fails).
    The unit tests run on one pytest-xdist worker per core (at most 4; `-- -n N` chooses)."""
    install_cpu(session, extras="dev,triton,data,plots,thirdparty")
    single_thread = {"OMP_NUM_THREADS": "1"}  # tiny tensors: intra-op threads only add overhead on 2 cores
    session.run("pytest", "-q", "-m", "not slow",
                *xdist_workers(session.posargs, cores_per_worker=1, most=4, installed=True),
                *session.posargs, env=single_thread)
    session.run("pytest", "-q", "conformance", "--properties-only", "--impl", "optimized", env=single_thread)
    session.run("python", "-m", "conformance.cards", "--check", "--jobs", "2", "--out",
                f"{session.create_tmp()}/cards", env=single_thread)


CONFORMANCE_REPORTS = "reports/conformance"  # the committed verdicts
LOCAL_CONFORMANCE_REPORTS = "reports/conformance/local"  # git-ignored: a run leaves the checkout as it was


def conformance_report_dir(posargs: list[str]) -> list[str]:
    """The `--report-dir` the main job adds to its posargs: none when they name one; the committed
    reports/conformance with `--update-baseline` (the committed report and baseline change together); otherwise the
    git-ignored reports/conformance/local."""
    if any(a == "--report-dir" or a.startswith("--report-dir=") for a in posargs):
        return []
    return ["--report-dir", CONFORMANCE_REPORTS if "--update-baseline" in posargs else LOCAL_CONFORMANCE_REPORTS]


@nox.session
def conformance(session: nox.Session) -> None:
    """Main job: the conformance properties against an NSA implementation on CPU (default `--impl optimized`):
    prints the PASS / FAIL / NOT COVERED table, writes <impl>-cpu.json and .md to reports/conformance/local/
    (git-ignored), compares metrics with reports/baselines/conformance.json; exit 1 on any FAIL. Posargs go to
    pytest, e.g. `-- --impl reference`, `-- --impl mypkg.adapter:IMPL` (docs/adapters.md), `-- --preset
    equal_blocks --set phi=avg`, `-- --report-dir DIR`; `-- --update-baseline` rewrites the committed baseline
    entry and writes the committed reports/conformance/<impl>-cpu.*."""
    install_cpu(session)
    session.run("pytest", "-q", "conformance", "--properties-only", "--impl", "optimized",
                *conformance_report_dir(session.posargs), *session.posargs,
                env={"OMP_NUM_THREADS": "1"})  # tiny tensors: intra-op threads only add overhead


def xdist_workers(posargs: list[str], *, cores_per_worker: int, most: int, installed: bool = False) -> list[str]:
    """`-n N` for pytest-xdist when it is there and posargs do not choose: one worker per `cores_per_worker` CPU
    cores, at most `most`. The CPU tests are single-threaded (one worker per core); the GPU suites spend their time
    compiling Triton kernels on the host while the GPU holds every worker's small tests (one worker per two cores).
    `installed`: the session's own venv has pytest-xdist (the dev extra declares it); otherwise the interpreter
    running nox is asked, which is the one a `venv_backend="none"` session runs pytest with."""
    import importlib.util
    import os

    if "-n" in posargs or any(a.startswith("--numprocesses") for a in posargs):
        return []
    if not installed and importlib.util.find_spec("xdist") is None:
        return []
    return ["-n", str(max(1, min(most, (os.cpu_count() or 2) // cores_per_worker)))]


@nox.session(name="conformance-gpu", venv_backend="none")
def conformance_gpu(session: nox.Session) -> None:
    """The conformance properties on CUDA tensors in the current interpreter (nothing installed; fails fast
    without a GPU), in float32 and in bfloat16 (the precision of the error-ratio checks; float64 checks run in
    both). Default `--impl optimized`; reports <impl>-cuda.json/.md (float32) and <impl>-cuda-bfloat16.json/.md go
    to reports/conformance/ (`-- --report-dir DIR` elsewhere). Posargs go to both pytest runs, e.g.
    `-- --update-baseline` or `-- --baseline PATH`. Our own kernel and parity GPU tests are `pytest tests/gpu`
    (tests/gpu/conftest.py)."""
    import sys

    require_gpu(session)
    for dtype in ("float32", "bfloat16"):
        session.run(sys.executable, "-m", "pytest", "-q", "conformance", "--properties-only", "--impl", "optimized",
                    "--device", "cuda", "--dtype", dtype, "--report-dir", "reports/conformance",
                    *xdist_workers(session.posargs, cores_per_worker=2, most=6), *session.posargs, external=True)


@nox.session(venv_backend="none")
def perf(session: nox.Session) -> None:
    """GPU benchmark of the NSA stages and the whole layer against SDPA full attention at 8k-128k tokens.

    Runs in the interpreter running nox (nothing installed). Writes CSV/JSON/plots to reports/perf/ (or `--out DIR`)
    and gates on reports/baselines/perf-<gpu>.json: exit 1 on a regression. Posargs go to `python -m perf run`,
    e.g. `-- --seq-lens 64k`, `-- --out DIR`, `-- --update-baseline` or `-- --preset equal_blocks` (fla's
    parallel_nsa beside ours, with fla-core installed: the `fla` extra)."""
    import sys

    session.run(sys.executable, "-m", "perf", "run", "--device", "cuda", "--compare-baseline", *session.posargs,
                external=True)


@nox.session(name="perf-train", venv_backend="none")
def perf_train(session: nox.Session) -> None:
    """GPU training throughput of the NSA model against the same model with dense attention (causal SDPA, GQA).

    Runs in the interpreter running nox (nothing installed): full trainer steps on prod-125m and the paper's attention
    geometry, seq_len 2k-64k at equal tokens per step; tokens/s and peak memory in reports/perf/train/ (about 8
    minutes on one H100, inside `--budget-s`). Posargs go to `python -m perf train`, e.g.
    `-- --geometries paper --seq-lens 64k`."""
    import sys

    session.run(sys.executable, "-m", "perf", "train", "--device", "cuda", *session.posargs, external=True)


@nox.session(name="perf-cpu")
def perf_cpu(session: nox.Session) -> None:
    """The benchmark runners end to end on tiny CPU shapes, so that they cannot rot.

    Runs `perf run` (sweep, CSV/plots/README, baseline write + compare), `perf train` and `perf train-profile` on the
    tiny geometry; writes only under the session's tmp folder."""
    install_cpu(session, "dev,triton,plots")
    tmp = session.create_tmp()
    session.run("python", "-m", "perf", "run", "--device", "cpu", "--preset", "tiny", "--out", f"{tmp}/perf",
                "--readme", f"{tmp}/README.md", "--update-baseline", "--baseline-dir", f"{tmp}/baselines",
                *session.posargs)
    session.run("python", "-m", "perf", "compare", "--results", f"{tmp}/perf/results.csv", "--baseline",
                f"{tmp}/baselines")
    tiny_train = ["--device", "cpu", "--geometries", "tiny", "--tokens-per-step", "128", "--micro-batch-tokens", "64",
                  "--warmup", "1"]
    session.run("python", "-m", "perf", "train", *tiny_train, "--seq-lens", "32,64", "--steps", "3", "--out",
                f"{tmp}/train")
    session.run("python", "-m", "perf", "train-profile", *tiny_train, "--seq-len", "64", "--models", "nsa,dense",
                "--timed", "2", "--profiled", "1", "--out", f"{tmp}/train_profile")


# ------------------------------------------------------------------------------------------ launch gate
def require_gpu(session: nox.Session) -> None:
    """Fail fast in a session that runs in the current interpreter: torch must import there and see a GPU."""
    import subprocess
    import sys

    probe = ("import torch, sys; n = torch.cuda.device_count() if torch.cuda.is_available() else 0; "
             "print(f'{torch.__version__} cuda={torch.version.cuda} gpus={n}'); sys.exit(0 if n else 3)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    if done.returncode == 3:
        session.error(f"no GPU visible to {sys.executable} (torch {done.stdout.strip()}): nox -s {session.name} "
                      f"needs a CUDA device; run it on a GPU machine (docs/runbook.md)")
    if done.returncode != 0:
        session.error(f"torch does not import in {sys.executable}, the interpreter running nox (GPU sessions use "
                      f"it, nothing is installed): {done.stderr.strip().splitlines()[-1:]}")


@nox.session(venv_backend="none")
def preflight(session: nox.Session) -> None:
    """GPU launch gate: env, config preflight, conformance-gpu, sentinels-gpu -> reports/preflight/<hash>.json.

    Runs in the current interpreter (nothing installed) on the GPU host; GO only if every gate passed.
    `-- --config configs/X.yaml [-o key=value ...] [--resume] [--commit SHA]` (docs/runbook.md)."""
    import sys

    require_gpu(session)
    session.run(sys.executable, "-m", "sentinels.launch", "preflight", *session.posargs, external=True)


@nox.session(venv_backend="none")
def launch(session: nox.Session) -> None:
    """Start the trainer with torchrun, only if a GO record (< 24 h old) names this commit and this config.

    Runs in the current interpreter on the GPU host.
    `-- --config configs/X.yaml [--nproc N] [-o key=value ...] [--resume] [--commit SHA]` (docs/runbook.md)."""
    import sys

    require_gpu(session)
    session.run(sys.executable, "-m", "sentinels.launch", "launch", *session.posargs, external=True)


RUFF = "ruff==0.17.6"


@nox.session
def lint(session: nox.Session) -> None:
    """Ruff (pinned) with the conservative rule set of pyproject.toml [tool.ruff] (pyflakes, E4/E7/E9).

    Syntax errors, undefined names, unused imports and variables, bad comparisons. Posargs go to `ruff check`."""
    session.install(RUFF, silent=False)
    session.run("ruff", "check", *session.posargs, ".")


# ------------------------------------------------------------------------------------------ sentinels
@nox.session
def sentinels(session: nox.Session) -> None:
    """Sentinel suite, CPU profile: short training runs that must trip on leaks and collapse (about 2 min on 2 cores).

    Label shift, random label vs ln V, long-range recall (full NSA vs locals-only), loss floor / gate collapse /
    watchdog on real text, and the planted-fault self-test (leaks, misaligned labels, saturated gates, NaN, slow
    data) that must trip them. Prints the verdict table, writes reports/sentinels/cpu-cpu.json and one PNG per
    sentinel; exit 1 unless PASS. Posargs go to `python -m sentinels run`, e.g. `-- --config configs/X.yaml` or
    `-- --out DIR` (docs/sentinels.md)."""
    install_cpu(session, "dev,triton,data,plots")
    session.run("python", "-m", "sentinels", "run", "--profile", "cpu", *session.posargs,
                env={"OMP_NUM_THREADS": "1"})


@nox.session(name="sentinels-gpu", venv_backend="none")
def sentinels_gpu(session: nox.Session) -> None:
    """Sentinel suite, GPU profile: the same sentinels and planted faults on a CUDA GPU (under 10 min on one H100).

    Runs in the interpreter running nox (nothing installed) and fails fast without a GPU. The learned sentinels use
    the probe model of configs/gpu-smoke.yaml; the real-text sentinels use `--config` (default
    configs/prod-125m.yaml). Writes reports/sentinels/gpu-<gpu>.json (or under `--out DIR`); exit 1 unless PASS.
    Posargs go to `python -m sentinels run`."""
    import sys

    require_gpu(session)
    session.run(sys.executable, "-m", "sentinels", "run", "--profile", "gpu", *session.posargs, external=True)
