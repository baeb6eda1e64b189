"""Environment guard policy (sentinels/launch/env.py) on injected facts: Python >= 3.11, torch >= 2.4, a visible
GPU, capability >= 8.0 on every GPU, triton importable."""

from __future__ import annotations

import dataclasses

import pytest

from sentinels.launch import cli
from sentinels.launch.env import EnvFacts, GpuFacts, check_env, format_verdict, leading_version

H100 = GpuFacts(0, "NVIDIA H100 80GB HBM3", (9, 0))
SUPPORTED = EnvFacts(python="3.11.7", torch="2.4.1+cu124", cuda="12.4", triton="3.0.0", gpus=(H100,))


def with_(**changes) -> EnvFacts:
    return dataclasses.replace(SUPPORTED, **changes)


def test_supported_combination_passes():
    verdict = check_env(SUPPORTED)
    assert verdict.ok and verdict.reasons == ()
    assert "env: SUPPORTED" in format_verdict(verdict)


@pytest.mark.parametrize("python", ["3.10.14", "3.9.0", "2.7.18"])
def test_python_older_than_3_11_is_refused(python):
    verdict = check_env(with_(python=python))
    assert not verdict.ok
    assert verdict.reasons == (f"python {python} is older than the supported minimum 3.11",)


@pytest.mark.parametrize("python", ["3.11.0", "3.12.1", "3.13.0rc1"])
def test_python_3_11_and_newer_pass(python):
    assert check_env(with_(python=python)).ok


@pytest.mark.parametrize("torch_version", ["2.3.1+cu121", "2.3.0", "1.13.1"])
def test_torch_older_than_2_4_is_refused(torch_version):
    verdict = check_env(with_(torch=torch_version))
    assert [r.split(" is older")[0] for r in verdict.reasons] == [f"torch {torch_version}"]


@pytest.mark.parametrize("torch_version", ["2.4.0", "2.6.0a0+git1234567", "2.13.0+cu130", "10.0.0"])
def test_torch_2_4_and_newer_pass(torch_version):
    assert check_env(with_(torch=torch_version)).ok


def test_unparsable_torch_version_is_refused_with_the_text():
    verdict = check_env(with_(torch="nightly"))
    assert verdict.reasons == ("torch version 'nightly' does not start with MAJOR.MINOR",)


def test_no_gpu_is_refused_and_names_the_cpu_build():
    verdict = check_env(with_(gpus=(), cuda=None, torch="2.13.0+cpu"))
    assert len(verdict.reasons) == 1
    assert "no CUDA device is visible" in verdict.reasons[0] and "CPU-only build" in verdict.reasons[0]


@pytest.mark.parametrize("capability,ok", [((7, 5), False), ((7, 0), False), ((8, 0), True), ((8, 6), True),
                                           ((9, 0), True), ((10, 0), True)])
def test_gpu_capability_threshold_is_8_0(capability, ok):
    verdict = check_env(with_(gpus=(GpuFacts(0, "some GPU", capability),)))
    assert verdict.ok is ok
    if not ok:
        assert verdict.reasons == (f"GPU 0 (some GPU) has compute capability {capability[0]}.{capability[1]}; "
                                   f"the Triton kernels need >= 8.0",)


def test_every_gpu_is_checked_not_only_the_first():
    verdict = check_env(with_(gpus=(H100, GpuFacts(1, "Tesla T4", (7, 5)))))
    assert len(verdict.reasons) == 1 and "GPU 1 (Tesla T4)" in verdict.reasons[0]


def test_missing_triton_is_refused():
    verdict = check_env(with_(triton=None))
    assert verdict.reasons == ("triton does not import: the optimized attention's Triton kernels need it",)


def test_all_reasons_are_reported_together():
    verdict = check_env(EnvFacts(python="3.10.1", torch="2.3.0", cuda=None, triton=None, gpus=()))
    assert len(verdict.reasons) == 4
    text = format_verdict(verdict)
    assert "env: UNSUPPORTED" in text and text.count("\n  - ") == 4


def test_leading_version():
    assert leading_version("2.4.1+cu124", "torch") == (2, 4)
    assert leading_version("3.11.7", "python") == (3, 11)
    with pytest.raises(ValueError, match="torch version"):
        leading_version("x.y", "torch")


def test_env_command_exit_code_follows_the_verdict(monkeypatch, capsys):
    monkeypatch.setattr(cli, "collect_env_facts", lambda: SUPPORTED)
    assert cli.main(["env"]) == 0
    assert "NVIDIA H100 80GB HBM3, capability 9.0" in capsys.readouterr().out
    monkeypatch.setattr(cli, "collect_env_facts", lambda: with_(gpus=(GpuFacts(0, "Tesla V100", (7, 0)),)))
    assert cli.main(["env"]) == 1
    assert "compute capability 7.0" in capsys.readouterr().out


def test_python_m_sentinels_env_is_the_guard():
    import subprocess
    import sys
    from pathlib import Path

    from sentinels.launch.env import collect_env_facts

    expected = 0 if check_env(collect_env_facts()).ok else 1
    done = subprocess.run([sys.executable, "-m", "sentinels", "env"], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == expected, done.stderr
    assert done.stdout.startswith("python  ") and ("env: SUPPORTED" in done.stdout) == (expected == 0)
