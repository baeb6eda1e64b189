"""NSAConfig validation: every rule raises ValueError naming the field."""

import pytest

from reference.config import PRESETS, NSAConfig


def test_defaults_are_the_paper_section_4_1_values():
    cfg = NSAConfig()
    assert (cfg.cmp_block, cfg.cmp_stride, cfg.sel_block, cfg.n_sel, cfg.window) == (32, 16, 64, 16, 512)
    assert (cfg.n_init, cfg.n_local) == (1, 2)
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.group_size) == (64, 4, 16)
    assert NSAConfig.preset("paper") == cfg


def test_equal_blocks_preset():
    cfg = NSAConfig.preset("equal_blocks")
    assert cfg.cmp_block == cfg.cmp_stride == cfg.sel_block == 64


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_are_valid_and_overridable(name):
    cfg = NSAConfig.preset(name, n_heads=8, n_kv_heads=2)
    assert (cfg.n_heads, cfg.n_kv_heads) == (8, 2)


@pytest.mark.parametrize(
    "changes, field, rule",
    [
        (dict(cmp_block=24, cmp_stride=16), "cmp_stride", "divide cmp_block"),
        (dict(cmp_block=32, cmp_stride=16, sel_block=72), "cmp_stride", "divide sel_block"),
        (dict(cmp_block=128, cmp_stride=16, sel_block=64), "cmp_block", "<= sel_block"),
        (dict(n_sel=2, n_init=1, n_local=2), "n_sel", ">= n_init + n_local"),
        (dict(n_heads=6, n_kv_heads=4), "n_heads", "multiple of n_kv_heads"),
        (dict(window=0), "window", "positive"),
        (dict(cmp_block=0), "cmp_block", "positive"),
        (dict(cmp_stride=-16), "cmp_stride", "positive"),
        (dict(sel_block=0), "sel_block", "positive"),
        (dict(n_sel=0, n_init=0, n_local=0), "n_sel", "positive"),
        (dict(n_heads=0), "n_heads", "positive"),
        (dict(n_kv_heads=0), "n_kv_heads", "positive"),
        (dict(head_dim_qk=0), "head_dim_qk", "positive"),
        (dict(head_dim_v=-1), "head_dim_v", "positive"),
        (dict(n_init=-1), "n_init", ">= 0"),
        (dict(n_local=-1), "n_local", ">= 0"),
        (dict(window=8.0), "window", "must be an int"),
        (dict(n_sel=True), "n_sel", "must be an int"),
        (dict(phi="max"), "phi", "one of"),
        (dict(window_keys="w-1"), "window_keys", "one of"),
        (dict(cmp_visibility="early"), "cmp_visibility", "one of"),
        (dict(selection_score="softmax"), "selection_score", "one of"),
        (dict(group_reduce="max"), "group_reduce", "one of"),
    ],
)
def test_bad_values_raise_naming_field_and_rule(changes, field, rule):
    with pytest.raises(ValueError) as err:
        NSAConfig(**changes)
    assert f"NSAConfig.{field}" in str(err.value)
    assert rule in str(err.value)


def test_replace_revalidates():
    with pytest.raises(ValueError, match="NSAConfig.cmp_stride"):
        NSAConfig().replace(cmp_stride=24)


def test_unknown_preset_and_unknown_field():
    with pytest.raises(ValueError, match="unknown NSAConfig preset 'nope'"):
        NSAConfig.preset("nope")
    with pytest.raises(ValueError, match="no field"):
        NSAConfig.from_dict({"cmp_blok": 32})
    assert NSAConfig.from_dict(NSAConfig().to_dict()) == NSAConfig()
