"""Every planted leak of the sentinel self-test is a real leak: changing token t moves a logit at some p < t.

Each check is a direct comparison of two forwards of the tiny model (fp32), independent of the causal-isolation
sentinel's own sweep; the (p, t) pairs follow from the plant's definition (l = 8, d = 4, l' = 8, w = 8).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sentinels.config import load_config
from sentinels.model import build_model
from sentinels.plants import PLANTS

TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny-cpu.yaml"

pytestmark = pytest.mark.usefixtures("single_torch_thread")

# plant -> (t, p): changing token t moves the logits at p < t
WITNESS = {
    "kv_next_token": (1, 0),
    "cmp_block_early": (8, 7),  # block 0 holds tokens 4..11 and is visible at p = 7
    "cmp_one_early": (8, 7),  # block 0 holds tokens 1..8 and is visible at p = 7
    "cmp_visible_early": (7, 6),  # block 0 (tokens 0..7) is visible at p = 6
    "cmp_visible_early_last_layer": (7, 6),
    "window_next_key": (1, 0),
    "win_next_token_last_layer": (1, 0),
    "win_next_token_one_head": (1, 0),
    "slc_values_next_token": (1, 0),  # block 0 is always selected; p = 0 reads the value of token 1
    "sel_block_unclipped": (1, 0),  # block 0 is read whole by p = 0
    "sel_next_block": (8, 0),  # block J + 1 = 1 is forced for p = 0 and not clipped
    "sel_block_end_kv": (7, 0),  # token 0 carries the keys/values of token 7, the end of block 0
}


def _model(plant_name: str | None, *, sharpen: float = 1.0):
    cfg = load_config(TINY)
    if plant_name is not None:
        cfg = cfg.replace(**PLANTS[plant_name].overrides)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    if sharpen != 1.0:  # larger q and compressed-key weights: peaked attention, as after training
        with torch.no_grad():
            for block in model.blocks:
                block.attn.inner.q_proj.weight.mul_(sharpen)
                block.attn.inner.k_cmp_proj.weight.mul_(sharpen)
    return model


def _moved(model, tokens: torch.Tensor, t: int) -> torch.Tensor:
    """Per position p < t: whether changing token t moved the logits at p."""
    changed = tokens.clone()
    changed[0, t] = (changed[0, t] + 1) % 64
    with torch.no_grad():
        return (model(changed)[0, :t] != model(tokens)[0, :t]).any(-1)


TOKENS = torch.randint(0, 64, (1, 64), generator=torch.Generator().manual_seed(1))


def test_every_plant_has_a_witness():
    assert set(WITNESS) | {"sel_score_all_blocks", "sel_scores_next_block"} == set(PLANTS)


@pytest.mark.parametrize("name", sorted(WITNESS))
def test_plant_is_a_real_leak(name):
    t, p = WITNESS[name]
    plant = PLANTS[name]
    model = _model(name)
    clean = _model(None)
    assert not _moved(clean, TOKENS, t).any()  # the same pair is clean without the plant
    with plant.installed(model) as handle:
        moved = _moved(model, TOKENS, t)
    assert bool(moved[p]), f"{name}: changing token {t} did not move position {p}"
    assert handle.reached


def test_selection_only_leak_is_real():
    """Eq. 8 over every compressed block changes only which blocks are picked: on a model with peaked attention
    some token t then moves an earlier logit (on the untrained tiny model the scores are too flat to flip)."""
    model = _model(None, sharpen=3.0)
    with PLANTS["sel_score_all_blocks"].installed(model) as handle:
        leaking = [t for t in range(33, 64) if _moved(model, TOKENS, t).any()]
    assert leaking and handle.calls > 0
    assert not any(_moved(_model(None, sharpen=3.0), TOKENS, t).any() for t in leaking[:3])


def test_selection_from_shifted_scores_is_a_selection_only_leak():
    """sel_scores_next_block picks blocks on keys that read up to d tokens ahead and attends with the clean keys:
    some token t moves an earlier logit, and the clean model with the same pair does not move."""
    model = _model("sel_scores_next_block")
    leaking = [t for t in range(33, 64) if _moved(model, TOKENS, t).any()]
    assert leaking
    assert not any(_moved(_model(None), TOKENS, t).any() for t in leaking[:3])


def test_selection_only_plant_leaves_the_attention_clean():
    """The planted layer is the clean layer's attention under the blocks picked on the shifted keys: its output
    equals the clean layer's forward with those indices teacher-forced (so the leak is in the selection alone)."""
    leaky, clean = _model("sel_scores_next_block"), _model(None)
    layer_leaky, layer_clean = leaky.blocks[0].attn, clean.blocks[0].attn
    inner = layer_clean.inner
    h = torch.randn(1, 64, inner.q_proj.in_features, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        q, kv, gates = inner.project(h)
        picked = inner.functional_forward(q, layer_leaky._leaky_kv(kv), gates, inner.phi_weights()).indices
        free = inner.functional_forward(q, kv, gates, inner.phi_weights())
        forced = inner.functional_forward(q, kv, gates, inner.phi_weights(), indices=picked)
        assert not torch.equal(picked, free.indices)  # the shifted scores pick other blocks ...
        assert torch.equal(layer_leaky(h), inner.o_proj(forced.o.reshape(1, 64, -1)))  # ... attended cleanly
        assert not torch.equal(layer_leaky(h), layer_clean(h))


def test_a_plant_of_two_seams_needs_both_called():
    from sentinels.plants import PlantHandle

    handle = PlantHandle(PLANTS["sel_next_block"])
    handle.counted("current_sel_block", lambda *a: 0, lambda *a: 1)()
    assert handle.calls == 1 and not handle.reached and handle.uncalled == ["selected_token_visible"]
    handle.counted("selected_token_visible", lambda *a: 0, lambda *a: 1)()
    assert handle.reached and handle.uncalled == []


def test_last_layer_plant_touches_only_the_last_layer():
    model = _model(None)
    calls_per_layer = []
    with PLANTS["cmp_visible_early_last_layer"].installed(model) as handle:
        for block in model.blocks:
            before = handle.calls
            with torch.no_grad():
                block(torch.zeros(1, 16, 64))
            calls_per_layer.append(handle.calls - before)
    assert calls_per_layer[-1] > 0 and calls_per_layer[:-1] == [0] * (len(model.blocks) - 1)


def test_seams_are_restored():
    from optimized import masks

    before = {name: getattr(masks, name) for name in ("compressed_block_visible", "current_sel_block",
                                                      "selected_token_visible")}
    with PLANTS["sel_next_block"].installed(_model(None)):
        assert masks.current_sel_block is not before["current_sel_block"]
    assert {name: getattr(masks, name) for name in before} == before
