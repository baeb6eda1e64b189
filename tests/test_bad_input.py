"""Bad input always gets a clear answer: for each case (API, run config, data, command line, launch gate), the
error has the expected type, names the field or file and the rule, is one line, and no traceback is printed.

Everything runs in-process (the command lines through their main() with stderr captured), on tiny inputs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import optimized
import reference
from conformance.helpers import make_inputs
from reference.config import NSAConfig
from reference.contract import KV, BranchKV
from sentinels.config import ConfigError, load_config
from sentinels.data.pipeline import BatchSource
from sentinels.data.sources import DataError, ShardSpec
from sentinels.data.tokenizers import TokenizerUnavailable, get_tokenizer
from sentinels.launch import policy
from sentinels.launch.code import CodeIdentity
from sentinels.launch.env import EnvFacts, GpuFacts
from sentinels.launch.gonogo import PASS, REQUIRED_GATES, GateResult, build_record, check_go_record, write_record

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "tiny-cpu.yaml"
CFG = NSAConfig(cmp_block=4, cmp_stride=2, sel_block=4, n_sel=3, window=4, n_heads=4, n_kv_heads=2,
                head_dim_qk=6, head_dim_v=4, phi="avg")


def one_line(message: str) -> str:
    assert "\n" not in message and "Traceback" not in message, message
    return message


def raises(kind: type[BaseException], field: str, call) -> None:
    with pytest.raises(kind) as err:
        call()
    assert field in one_line(str(err.value)), f"{field!r} not named in: {err.value}"


# -- API -------------------------------------------------------------------------------------------------------
def x():
    return make_inputs(CFG, 7, seed=2)


def poisoned(name: str):
    inputs = x()
    {"q": inputs.q, "kv.win.k": inputs.kv.win.k, "kv.slc.v": inputs.kv.slc.v, "gates": inputs.gates}[name][0, 3] = \
        float("nan")
    return inputs


def forward(impl, inputs, **kw):
    return lambda: impl.nsa_forward(inputs.q, inputs.kv, inputs.gates, CFG, **kw)


def with_q(q):
    inputs = x()
    return SimpleNamespace(q=q, kv=inputs.kv, gates=inputs.gates)


def with_kv(kv):
    inputs = x()
    return SimpleNamespace(q=inputs.q, kv=kv, gates=inputs.gates)


API_CASES = {
    "n_sel beyond what a forward can allocate": (lambda: NSAConfig(n_sel=10**18), "NSAConfig.n_sel"),
    "window beyond what a forward can allocate": (lambda: NSAConfig(window=2**40), "NSAConfig.window"),
    "head dim beyond a query row": (lambda: NSAConfig(head_dim_qk=2**30), "NSAConfig.head_dim_qk"),
    "heads not a multiple of groups": (lambda: NSAConfig(n_heads=6, n_kv_heads=4), "NSAConfig.n_heads"),
    "stride not dividing the block": (lambda: NSAConfig(cmp_block=24, cmp_stride=16), "NSAConfig.cmp_stride"),
    "float size": (lambda: NSAConfig(window=8.0), "NSAConfig.window"),
    "numpy float size": (lambda: NSAConfig(n_sel=np.float64(4)), "NSAConfig.n_sel"),
    "bool size": (lambda: NSAConfig(n_init=True), "NSAConfig.n_init"),
    "unknown phi": (lambda: NSAConfig(phi="max"), "NSAConfig.phi"),
    "negative forced blocks": (lambda: NSAConfig(n_local=-1), "NSAConfig.n_local"),
    "unknown field": (lambda: NSAConfig.from_dict({"cmp_blok": 32}), "cmp_blok"),
    "unknown preset": (lambda: NSAConfig.preset("fast"), "fast"),
    "kv a tuple (reference)": (forward(reference, with_kv((x().q, x().q))), "kv must be a reference.contract.BranchKV"),
    "kv a tuple (optimized)": (forward(optimized, with_kv((x().q, x().q))), "kv must be a reference.contract.BranchKV"),
    "kv a KV": (forward(reference, with_kv(x().kv.win)), "BranchKV"),
    "a branch that is no KV": (forward(reference, with_kv(BranchKV(cmp=(1, 2), slc=x().kv.slc, win=x().kv.win))),
                               "kv.cmp"),
    "NaN in q": (forward(reference, poisoned("q")), "q has"),
    "NaN in a key": (forward(reference, poisoned("kv.win.k")), "kv.win.k"),
    "NaN in a value (optimized, checked)": (forward(optimized, poisoned("kv.slc.v"), check_finite=True),
                                            "kv.slc.v"),
    "NaN in the gates": (forward(reference, poisoned("gates")), "gates has"),
    "q with 3 dims": (forward(reference, with_q(x().q[0])), "q must have 4 dims"),
    "q with other heads": (forward(reference, with_q(x().q[:, :, :2])), "NSAConfig.n_heads"),
    "q of integers": (forward(reference, with_q(x().q.long())), "q must be floating point"),
    "q not a tensor": (forward(reference, with_q([[1.0]])), "q must be a torch.Tensor"),
    "empty sequence": (forward(reference, SimpleNamespace(q=x().q[:, :0], kv=BranchKV.shared(
        x().kv.win.k[:, :0], x().kv.win.v[:, :0]), gates=x().gates[:, :0])), "q must hold at least one position"),
    "key dtype differs": (forward(reference, with_kv(BranchKV(cmp=KV(x().kv.cmp.k.float(), x().kv.cmp.v),
                                                              slc=x().kv.slc, win=x().kv.win))), "kv.cmp.k"),
    "cfg not an NSAConfig": (lambda: reference.nsa_forward(x().q, x().kv, x().gates, {"n_sel": 3}), "cfg must be"),
}


@pytest.mark.parametrize("case", sorted(API_CASES))
def test_api(case):
    call, field = API_CASES[case]
    raises(ValueError, field, call)


def test_api_module_input():
    module = reference.NSAAttention(8, CFG).double()
    inputs = torch.zeros(1, 5, 8, dtype=torch.float64)
    inputs[0, 2, 3] = float("inf")
    raises(ValueError, "x has 1 non-finite value", lambda: module(inputs))


# -- run configs -----------------------------------------------------------------------------------------------
CONFIG_CASES = {
    "empty file": ("", "{path}:1: the config file holds no settings"),
    "comments only": ("# nothing\n# here\n", "{path}:2: the config file holds no settings"),
    "duplicate key": ("train:\n  steps: 1\n  steps: 2\n", "{path}:3: duplicate key train.steps"),
    "duplicate section": ("train: {}\nmodel: {}\ntrain: {}\n", "{path}:3: duplicate key train"),
    "invalid YAML": ("train:\n  steps: [1\n", "{path}:"),
    "top level not a mapping": ("- 1\n- 2\n", "{path}:1: a run config must hold a mapping"),
    "unknown key": ("train:\n  stepz: 3\n", "train.stepz"),
    "NaN learning rate": ("train:\n  lr: .nan\n", "train.lr: must be a finite number"),
    "infinite learning rate": ("train:\n  lr: .inf\n", "train.lr: must be a finite number"),
    "fractional steps": ("train:\n  steps: 10.5\n", "train.steps: must be an integer"),
    "unknown precision": ("train:\n  precision: fp16\n", "train.precision"),
    "negative save_every": ("train:\n  save_every: -1\n", "train.save_every"),
    "jsonl without paths": ("data:\n  source: jsonl\n", "data.paths"),
    "NSA size beyond a forward": ("model:\n  nsa:\n    n_sel: 1000000000000\n", "model.nsa: NSAConfig.n_sel"),
    "a section that is a number": ("train: 5\n", "train: must be a mapping"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_config(case, tmp_path):
    text, field = CONFIG_CASES[case]
    path = tmp_path / "run.yaml"
    path.write_text(text)
    raises(ConfigError, field.format(path=path), lambda: load_config(path))


@pytest.mark.parametrize("case", ["missing", "directory", "latin-1", "override without =", "override unknown key",
                                  "override of a value as a section"])
def test_config_file_and_overrides(case, tmp_path):
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("name: caf\xe9\n".encode("latin-1"))
    call, field = {
        "missing": (lambda: load_config(tmp_path / "nope.yaml"), "nope.yaml does not exist"),
        "directory": (lambda: load_config(tmp_path), "is a directory"),
        "latin-1": (lambda: load_config(latin), "is not UTF-8 text"),
        "override without =": (lambda: load_config(TINY, ["train.steps"]), "dotted.key=value"),
        "override unknown key": (lambda: load_config(TINY, ["train.nope=1"]), "train.nope"),
        "override of a value as a section": (lambda: load_config(TINY, ["name.x=1"]), "name is not a section"),
    }[case]
    raises(ConfigError, field, call)


# -- data sources ----------------------------------------------------------------------------------------------
def data_cfg(source: str, path: Path, tokenizer: str = "byte"):
    return load_config(TINY, [f"data.source={source}", f"data.paths=[{path}]", f"data.tokenizer={tokenizer}"])


DATA_CASES = {
    "empty file": ("jsonl", b"", "is empty"),
    "binary file": ("text", b"\x7fELF\x02\x01\x01\x00\x00\x00", "holds NUL bytes"),
    "non-UTF-8 text": ("text", "na\xefve\n".encode("latin-1"), "not UTF-8 text"),
    "JSONL without text": ("jsonl", b'{"body": "x"}\n', "no string field 'text'"),
    "JSONL that is not JSON": ("jsonl", b"just words\n", "not JSON"),
    "blank lines only": ("text", b"\n \n\t\n", "holds no document"),
}


@pytest.mark.parametrize("case", sorted(DATA_CASES))
def test_data(case, tmp_path):
    source, content, rule = DATA_CASES[case]
    path = tmp_path / f"corpus.{source}"
    path.write_bytes(content)
    raises(DataError, f"data.paths[0] {path}: ", lambda: BatchSource(data_cfg(source, path), ShardSpec(0, 1),
                                                                      synthetic_on_fail=False))
    raises(DataError, rule, lambda: BatchSource(data_cfg(source, path), ShardSpec(0, 1), synthetic_on_fail=False))


@pytest.mark.parametrize("case", ["directory", "missing"])
def test_data_paths(case, tmp_path):
    path = tmp_path if case == "directory" else tmp_path / "gone.jsonl"
    rule = "is a directory, not a file" if case == "directory" else "file not found"
    raises(DataError, f"data.paths[0] {path}: {rule}",
           lambda: BatchSource(data_cfg("jsonl", path), ShardSpec(0, 1), synthetic_on_fail=False))


def test_data_tokenizer_without_regex(monkeypatch):
    get_tokenizer.cache_clear()
    monkeypatch.setitem(sys.modules, "regex", None)
    try:
        raises(TokenizerUnavailable, "data.tokenizer 'gpt2'", lambda: get_tokenizer("gpt2"))
    finally:
        get_tokenizer.cache_clear()


# -- command lines ---------------------------------------------------------------------------------------------
def run_cli(main, argv, capsys) -> str:
    """Exit code 2, exactly one stderr line (starting "error:"), no traceback; returns that line."""
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, (code, err)
    return lines[0]


def train(out, *extra):
    return ["train", "--config", str(TINY), "-o", f"train.out_dir={out}", *extra]


def cli_case(case: str, tmp: Path) -> tuple[list[str], str]:
    empty, dup, data = tmp / "empty.yaml", tmp / "dup.yaml", tmp / "empty.jsonl"
    empty.write_text("# nothing\n")
    dup.write_text("name: a\nname: b\n")
    data.write_bytes(b"")
    (tmp / "a-file").write_text("x")
    (tmp / "full").mkdir()
    (tmp / "full" / "notes.txt").write_text("x")
    return {
        "train: empty config": (["train", "--config", str(empty)], f"{empty}:1: the config file holds no settings"),
        "train: duplicate key": (["train", "--config", str(dup)], "duplicate key name"),
        "train: missing config": (["train", "--config", str(tmp / "nope.yaml")], "nope.yaml does not exist"),
        "train: unknown override": (train(tmp / "r", "-o", "train.stepz=3"), "train.stepz"),
        "train: out_dir is a file": (train(tmp / "a-file"), "train.out_dir"),
        "train: out_dir not empty": (train(tmp / "full"), "--fresh"),
        "train: resume without checkpoint": (train(tmp / "r2", "--resume"), "--resume: no checkpoint"),
        "train: resume and fresh": (train(tmp / "r3", "--resume", "--fresh"), "--resume and --fresh"),
        "train: empty data file": (train(tmp / "r4", "-o", "data.source=jsonl", "-o", f"data.paths=[{data}]"),
                                   "data.paths[0]"),
        "train: long run without GO record": (train(tmp / "r5", "-o", f"train.steps={policy.LONG_RUN_STEPS}"),
                                              "GO record"),
        "run: missing corpus": (["run", "--profile", "cpu", "--corpus", str(tmp / "nope.jsonl"), "--work-dir",
                                 str(tmp / "w")], "--corpus"),
        "launch config: empty config": (["launch:config", "--config", str(empty)], "holds no settings"),
        "launch launch: duplicate key": (["launch:launch", "--config", str(dup)], "duplicate key name"),
        "launch preflight: commit disagrees": (["launch:preflight", "--config", str(TINY), "--commit", "0" * 40],
                                               "--commit"),
    }[case]


CLI_CASES = ["train: empty config", "train: duplicate key", "train: missing config", "train: unknown override",
             "train: out_dir is a file", "train: out_dir not empty", "train: resume without checkpoint",
             "train: resume and fresh", "train: empty data file", "train: long run without GO record",
             "run: missing corpus", "launch config: empty config", "launch launch: duplicate key",
             "launch preflight: commit disagrees"]


@pytest.mark.parametrize("case", CLI_CASES)
def test_cli(case, tmp_path, capsys, single_torch_thread):
    from sentinels.cli import main as sentinels_main
    from sentinels.launch.cli import main as launch_main

    argv, field = cli_case(case, tmp_path)
    main = sentinels_main
    if argv[0].startswith("launch:"):
        main, argv = launch_main, [argv[0].split(":")[1], *argv[1:]]
    if case == "launch preflight: commit disagrees" and (REPO / ".git").exists() is False:
        pytest.skip("this checkout has no .git: --commit cannot disagree with it")
    line = run_cli(main, argv, capsys)
    assert field in line, line


def test_cli_debug_adds_the_traceback(tmp_path, capsys):
    from sentinels.cli import main

    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert main(["train", "--config", str(empty), "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "ConfigError" in err and err.rstrip().splitlines()[-1].startswith("error: ")


# -- the launch gate -------------------------------------------------------------------------------------------
NOW = 1_800_000_000.0
CODE = CodeIdentity(commit="a" * 40, commit_source="git", dirty=False, source_digest="d" * 64)
H100 = (GpuFacts(0, "NVIDIA H100", (9, 0)),)


def record(tmp_path, change=None) -> Path:
    cfg = load_config(TINY)
    gates = [GateResult(name, PASS, "ok", NOW - 100, NOW - 50,
                        **({"exit_code": 0, "reports": ["r.json"]} if "gpu" in name else {}))
             for name in REQUIRED_GATES]
    env = {"gpus": [{"index": 0, "name": "NVIDIA H100", "capability": "9.0"}]}
    path = write_record(build_record(cfg=cfg, config_path="c.yaml", overrides=[], resume=False, code=CODE, env=env,
                                     gates=gates, started_unix=NOW - 200, finished_unix=NOW, host="h"), tmp_path)
    if change is not None:
        data = json.loads(path.read_text())
        change(data)
        path.write_text(json.dumps(data))
    return path


def set_gate(i, **values):
    return lambda r: r["gates"][i].update(values)


GATE_CASES = {
    "NaN evidence time": (lambda r: r.update(evidence_since_unix=float("nan")), "evidence_since_unix"),
    "evidence time moved forward": (lambda r: r.update(evidence_since_unix=NOW), "was edited"),
    "NaN gate start": (set_gate(0, started_unix=float("nan")), "gate code started_unix must be a finite number"),
    "gate finished before it started": (set_gate(1, finished_unix=NOW - 1000), "gate env finished_unix"),
    "GPU gate without exit code": (set_gate(3, exit_code=None), "gate conformance-gpu has exit code None"),
    "GPU gate without report": (set_gate(4, reports=[]), "gate sentinels-gpu lists no report"),
    "gate dropped": (lambda r: r["gates"].pop(2), "gates ['config'] did not pass"),
    "other schema": (lambda r: r.update(schema=99), "schema 99"),
    "other GPU": (lambda r: r.update(gpus=[{"index": 0, "name": "NVIDIA A100", "capability": "8.0"}]),
                  "this host's GPU 0 NVIDIA H100 (9.0) is not among the GPUs its gates ran on"),
    "garbage": (lambda r: r.clear(), "not a readable GO record"),
}


@pytest.mark.parametrize("case", sorted(GATE_CASES))
def test_gate(case, tmp_path):
    change, field = GATE_CASES[case]
    check = check_go_record(record(tmp_path, change), config_hash=load_config(TINY).config_hash(), code=CODE,
                            gpus=H100, now_unix=NOW + 60)
    assert not check.ok and field in one_line(check.reason), check.reason


def test_gate_unchanged_record_authorizes(tmp_path):
    """The cases above fail for their edit alone: the record they start from authorizes."""
    check = check_go_record(record(tmp_path), config_hash=load_config(TINY).config_hash(), code=CODE, gpus=H100,
                            now_unix=NOW + 60)
    assert check.ok, check.reason


def test_gate_trainer_rules_name_each_rule(tmp_path):
    from sentinels.launch.gonogo import authorize_training

    cfg = load_config(TINY, [f"train.steps={policy.LONG_RUN_STEPS}", "train.save_every=0"])
    facts = EnvFacts(python="3.11.7", torch="2.4.1", cuda="12.4", triton="3.0.0", gpus=H100)
    auth = authorize_training(cfg, i_know_what_im_doing=False, records_dir=tmp_path, code=CODE, now_unix=NOW,
                              facts=facts)
    assert not auth.allowed
    for rule in ("no GO record", "[device]", "[save_every]", "[model_size]"):
        assert rule in one_line(auth.reason)
