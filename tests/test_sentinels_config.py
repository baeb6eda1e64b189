"""Run configs: every shipped YAML parses; unknown or bad keys are errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from sentinels.config import ConfigError, RunConfig, from_dict, load_config

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
CONFIGS = sorted(CONFIG_DIR.glob("*.yaml"))
TINY = CONFIG_DIR / "tiny-cpu.yaml"


def test_shipped_configs_exist():
    names = {p.stem for p in CONFIGS}
    assert {"tiny-cpu", "gpu-smoke", "prod-125m"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_shipped_config_parses(path):
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)
    assert cfg.model.debug.leak == "none" and cfg.model.debug.gate_override == "none"


def test_prod_config_is_about_125m_parameters():
    summary = load_config(CONFIG_DIR / "prod-125m.yaml").summary()
    assert 100e6 <= summary["parameters"] <= 160e6, summary["parameters"]
    assert summary["precision"] == "bf16" and summary["tokenizer"] == "gpt2"
    assert summary["seq_len"] % summary["sel_block"] == 0


def _write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_unknown_key_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.stpes"):
        load_config(_write(tmp_path, "train:\n  stpes: 10\n"))
    with pytest.raises(ConfigError, match=r"unknown config key\(s\) modle"):
        load_config(_write(tmp_path, "modle: {}\n"))
    with pytest.raises(ConfigError, match=r"model\.debug\.lek"):
        load_config(_write(tmp_path, "model:\n  debug:\n    lek: none\n"))


@pytest.mark.parametrize("text, key", [
    ("train:\n  lr: fast\n", r"train\.lr: must be a number"),
    ("train:\n  steps: 10.5\n", r"train\.steps: must be an integer"),
    ("train:\n  steps: true\n", r"train\.steps: must be an integer"),
    ("train:\n  precision: fp16\n", r"train\.precision: must be one of"),
    ("train:\n  steps: 10\n  warmup_steps: 20\n", r"train\.warmup_steps"),
    ("train:\n  save_every: -1\n", r"train\.save_every"),
    ("data:\n  source: jsonl\n", r"data\.paths"),
    ("data:\n  paths: notalist\n", r"data\.paths: must be a list"),
    ("model:\n  attention: flash\n", r"model\.attention"),
    ("model:\n  tie_embeddings: 1\n", r"model\.tie_embeddings: must be true or false"),
    ("model:\n  nsa:\n    cmp_block: 24\n    cmp_stride: 16\n", r"model\.nsa: .*cmp_stride"),
    ("model:\n  nsa:\n    window_size: 4\n", r"model\.nsa: NSAConfig has no field"),
    ("monitors:\n  gate_collapse:\n    low: 0.9\n    high: 0.5\n", r"monitors\.gate_collapse"),
    ("train: 5\n", r"train: must be a mapping"),
    ("train:\n  cuda_graphs: true\n  device: cpu\n", r"train\.cuda_graphs: needs train\.device cuda or auto"),
    ("train:\n  cuda_graphs: true\n  activation_checkpointing: true\n",
     r"train\.cuda_graphs: is not combined with train\.activation_checkpointing true"),
    ("train:\n  activation_checkpointing: sometimes\n",
     r"train\.activation_checkpointing: must be one of \[false, true, 'attention'\], got 'sometimes'$"),
    ("train:\n  cuda_graphs: true\ndata:\n  packing: varlen\n", r"train\.cuda_graphs: replays one batch shape"),
    ("train:\n  cuda_graphs: 1\n", r"train\.cuda_graphs: must be one of \['auto', true, false\], got 1$"),
    ("train:\n  cuda_graphs: always\n", r"train\.cuda_graphs: must be one of \['auto', true, false\], got 'always'"),
])
def test_bad_values_name_the_key(tmp_path, text, key):
    with pytest.raises(ConfigError, match=key):
        load_config(_write(tmp_path, text))


def test_cuda_graphs_default_to_auto_which_any_setup_accepts(tmp_path):
    """auto is the default and is never refused: the trainer turns graphs on only where true would be accepted
    (tests/test_sentinels_trainer.py, tests/gpu/test_train_cuda_graphs.py)."""
    assert load_config(TINY).train.cuda_graphs == "auto"
    for text in ("train:\n  device: cpu\n", "train:\n  activation_checkpointing: true\n",
                 "data:\n  packing: varlen\n"):
        assert load_config(_write(tmp_path, text)).train.cuda_graphs == "auto"
    assert load_config(TINY, ["train.cuda_graphs=false"]).train.cuda_graphs is False


def test_attention_recomputation_combines_with_cuda_graphs(tmp_path):
    cfg = load_config(_write(tmp_path, "train:\n  cuda_graphs: true\n  activation_checkpointing: attention\n"))
    assert cfg.train.activation_checkpointing == "attention" and cfg.train.cuda_graphs is True
    with pytest.raises(ConfigError, match=r"train\.activation_checkpointing: must be one of"):
        cfg.replace(**{"train.activation_checkpointing": "blocks"})


def test_overrides_and_replace():
    cfg = load_config(TINY, ["train.steps=7", "model.debug.leak=kv_next_token"])
    assert cfg.train.steps == 7 and cfg.model.debug.leak == "kv_next_token"
    again = cfg.replace(**{"train.steps": 9})
    assert again.train.steps == 9 and cfg.train.steps == 7
    with pytest.raises(ConfigError, match=r"train\.nope"):
        cfg.replace(**{"train.nope": 1})


def test_hash_is_stable_and_sensitive():
    a = from_dict({"train": {"steps": 10}})
    b = from_dict({"train": {"steps": 10}})
    c = from_dict({"train": {"steps": 11}})
    assert a.config_hash() == b.config_hash() != c.config_hash()


def test_summary_has_the_preflight_fields():
    summary = load_config(TINY).summary()
    for key in ("precision", "save_every", "steps", "out_dir", "parameters", "tokenizer", "seq_len", "sel_block",
                "config_hash"):
        assert key in summary


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n# and another\n", "---\n", "~\n"])
def test_empty_or_comment_only_file_is_refused(tmp_path, text):
    """An empty config would silently start a default run: refused, naming the file and its last line."""
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError, match=rf"^{path}:\d+: the config file holds no settings"):
        load_config(path)


@pytest.mark.parametrize("text, line, key, first", [
    ("train:\n  steps: 10\n  lr: 0.1\n  steps: 20\n", 4, "train.steps", 2),
    ("name: a\nmodel:\n  d_model: 64\nname: b\n", 4, "name", 1),
    ("model:\n  nsa:\n    n_sel: 4\n    window: 8\n    n_sel: 8\n", 5, "model.nsa.n_sel", 3),
])
def test_duplicate_keys_are_refused_with_both_lines(tmp_path, text, line, key, first):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}:{line}: duplicate key {key} (first set on line {first}): YAML keeps only the " \
                             f"last value, so one of them would be silently ignored"


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = _write(tmp_path, "train:\n  steps: 10\n  lr: [0.1\n")
    with pytest.raises(ConfigError, match=rf"^{path}:\d+: not valid YAML: "):
        load_config(path)


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
def test_non_finite_numbers_are_refused(tmp_path, value):
    with pytest.raises(ConfigError, match=r"train\.lr: must be a finite number"):
        load_config(_write(tmp_path, f"train:\n  lr: {value}\n"))


@pytest.mark.parametrize("path_kind", ["missing", "directory"])
def test_config_path_that_is_not_a_file_is_named(tmp_path, path_kind):
    path = tmp_path / "nope.yaml" if path_kind == "missing" else tmp_path
    with pytest.raises(ConfigError, match=rf"config file {path} (does not exist|is a directory)"):
        load_config(path)
