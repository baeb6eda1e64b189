"""The conformance harness itself: capabilities are validated, the strategies draw only inside the declared
envelope, conventions come from --preset/--set/--config with one-line errors, an exception inside an
implementation is reported with its place, and the exit status says when nothing was checked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.adapters import Capabilities, ImplementationError, Sizes, reporting
from conformance.conventions import ConventionError, checked_conventions
from conformance.strategies import CPU_SIZES, Envelope, configs
from reference.config import NSAConfig

REPO = Path(__file__).resolve().parent.parent

FLA_LIKE = Capabilities(phi={"avg"}, group_reduce={"mean"}, block_layout="equal", forced_blocks={(1, 2)},
                        group_sizes=Sizes(minimum=16, power_of_two=True), shared_kv=True, precision="float32")


@pytest.mark.parametrize("bad, field", [
    (dict(phi={"avg", "linear"}), "phi"), (dict(window_keys="w"), "window_keys"), (dict(block_layout="odd"),
                                                                                   "block_layout"),
    (dict(forced_blocks={(1,)}), "forced_blocks"), (dict(precision="float16"), "precision"),
    (dict(branches={"cmp", "dense"}), "branches"), (dict(fixed_gates=(1.0, 1.0, 2.0)), "fixed_gates"),
    (dict(branches={"cmp"}, fixed_gates=(1.0, 1.0, 0.0)), "fixed_gates"), (dict(n_sel=3), "n_sel"),
])
def test_capabilities_refuse_bad_fields(bad, field):
    with pytest.raises(ValueError, match=f"Capabilities.{field}"):
        Capabilities(**bad)


def test_sizes_rules():
    pow2 = Sizes(minimum=16, power_of_two=True)
    assert [pow2.allows(n) for n in (8, 16, 24, 32)] == [False, True, False, True]
    assert pow2.smallest(2) == [16, 32] and pow2.pick(3) == 16 and pow2.pick(20) == 32
    assert Sizes(values=(2, 5), maximum=4).smallest(3) == [2]
    assert Sizes(maximum=8).pick(12) == 8
    with pytest.raises(ValueError, match="allows no value"):
        Sizes(values=(3,), multiple_of=2)


def test_outside_names_the_first_undeclared_setting():
    cfg = NSAConfig.preset("equal_blocks_avg", group_reduce="mean", n_init=1, n_local=2, n_heads=16, n_kv_heads=1)
    assert FLA_LIKE.outside(cfg) is None
    assert "group size=8" in FLA_LIKE.outside(cfg.replace(n_heads=8))
    assert "equal blocks" in FLA_LIKE.outside(cfg.replace(cmp_block=32, cmp_stride=16))
    assert "forced blocks" in FLA_LIKE.outside(cfg.replace(n_local=1))


@settings(max_examples=40)
@given(data=st.data())
def test_configs_stay_inside_the_envelope(data):
    envelope = Envelope(NSAConfig.preset("equal_blocks_avg", group_reduce="mean"), FLA_LIKE, CPU_SIZES)
    cfg = data.draw(configs(envelope))
    assert FLA_LIKE.outside(cfg) is None, cfg


def test_fit_moves_a_fixed_config_inside():
    envelope = Envelope(NSAConfig.preset("equal_blocks_avg", group_reduce="mean"), FLA_LIKE, CPU_SIZES)
    wanted = envelope.conventions.replace(cmp_block=4, cmp_stride=2, sel_block=4, n_sel=2, n_init=1, n_local=1,
                                          window=3, n_heads=2, n_kv_heads=1, head_dim_qk=3, head_dim_v=2)
    cfg = envelope.fit(wanted, equal_block=2)
    assert (cfg.cmp_block, cfg.cmp_stride, cfg.sel_block, cfg.n_init, cfg.n_local) == (2, 2, 2, 1, 2)
    assert cfg.group_size == 16 and cfg.n_sel == 3 and FLA_LIKE.outside(cfg) is None


def test_conventions_from_preset_file_and_set(tmp_path):
    file = tmp_path / "conv.yaml"
    file.write_text("preset: equal_blocks\nphi: avg\nwindow_keys: w+1\n")
    c = checked_conventions(None, str(file), ["window_keys=w", "group_reduce=mean"])
    assert c.preset == "equal_blocks"
    assert (c.config.phi, c.config.window_keys, c.config.group_reduce) == ("avg", "w", "mean")
    assert c.config.cmp_block == c.config.sel_block == 64
    for sets, match in ((["cmp_block=8"], "only the convention switches"), (["phi=linear"], "must be one of"),
                        (["phi"], "SWITCH=VALUE")):
        with pytest.raises(ConventionError, match=match):
            checked_conventions("paper", None, sets)


def test_an_exception_inside_the_implementation_names_its_place():
    def stage(q, cfg):
        raise RuntimeError("kernel\nexploded")

    import torch

    cfg = NSAConfig.preset("paper", n_heads=2, n_kv_heads=1)
    with pytest.raises(ImplementationError) as info:
        reporting(stage, "lib.nsa_forward")(torch.zeros(1, 3, 2, 4), cfg)
    message = str(info.value)
    assert message.startswith("lib.nsa_forward raised RuntimeError: kernel exploded at ")
    assert "test_conformance_harness.py:" in message and "l=32 d=16" in message and "[1, 3, 2, 4] float32" in message


ONLY_A_MODULE = SimpleNamespace(NAME="module-only", make_module=lambda cfg, hidden: None)


def run_suite(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


def test_exit_status_when_nothing_ran_when_required_and_when_the_adapter_does_not_import():
    nothing = run_suite("conformance/test_eq9_overlap.py", "--impl", "tests.test_conformance_harness:ONLY_A_MODULE")
    assert nothing.returncode == 5 and "no test of any property ran" in nothing.stdout, nothing.stdout[-2000:]
    required = run_suite("conformance/test_eq9_overlap.py", "-k", "printed_double_sum", "--impl", "reference",
                         "--require", "eq9_overlap", "--require", "no_peeking")
    assert required.returncode == 0, required.stdout[-2000:]
    missing = run_suite("conformance/test_eq9_overlap.py", "-k", "printed_double_sum", "--impl",
                        "conformance.adapters.examples.acme_adapter:IMPL", "--require", "eq9_overlap")
    assert missing.returncode == 1 and "required property NOT COVERED: CSR overlap scoring" in missing.stdout, \
        missing.stdout[-2000:]
    broken = run_suite("conformance/test_eq9_overlap.py", "--impl", "no_such_package.adapter:IMPL")
    assert broken.returncode == 4 and "importing 'no_such_package.adapter' failed with ModuleNotFoundError" in (
        broken.stdout + broken.stderr)
