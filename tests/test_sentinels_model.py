"""The sentinel LM: causality of the clean model, the planted leaks break it where they claim to, locals-only
has a bounded receptive field, statistics come from the implementation's counted reads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from reference.contract import BRANCHES
from sentinels.config import load_config
from sentinels.data.pipeline import locals_only_reach
from sentinels.model import build_model, lm_loss

TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny-cpu.yaml"
T = 40


pytestmark = pytest.mark.usefixtures("single_torch_thread")


def _model(*overrides, seed=0):
    cfg = load_config(TINY, list(overrides))
    torch.manual_seed(seed)
    model = build_model(cfg).eval()
    # Gates start at exactly 0.5 (zero-initialised last layer); randomise them so every branch matters.
    with torch.no_grad():
        for block in model.blocks:
            block.attn.inner.gate[-1].weight.normal_(0, 0.5)
    return cfg, model


def _tokens(seed=1, vocab=64):
    return torch.randint(0, vocab, (1, T), generator=torch.Generator().manual_seed(seed))


def _changed_positions(model, x, position, new_token):
    y = x.clone()
    y[0, position] = new_token if new_token != int(x[0, position]) else (new_token + 1) % 64
    with torch.no_grad():
        diff = (model(x) - model(y)).abs().amax(-1)[0]
    return [p for p in range(T) if diff[p] > 1e-6]


def test_clean_model_is_causal():
    _, model = _model()
    x = _tokens()
    for position in (5, 17, 30):
        changed = _changed_positions(model, x, position, 3)
        assert changed and min(changed) == position


def test_kv_next_token_leak_lets_position_p_see_p_plus_1():
    _, model = _model("model.debug.leak=kv_next_token")
    changed = _changed_positions(model, _tokens(), 20, 3)
    assert 19 in changed and min(changed) <= 19


def test_cmp_block_early_leak_shows_future_tokens_through_the_compressed_branch():
    cfg, model = _model("model.debug.leak=cmp_block_early")
    nsa = cfg.model.nsa_config()
    # Compressed block 0 (tokens 0..l-1) becomes visible at p = l-1; shifted by d it holds tokens d..l-1+d.
    future = nsa.cmp_block - 1 + nsa.cmp_stride
    changed = _changed_positions(model, _tokens(), future, 3)
    assert min(changed) == nsa.cmp_block - 1 < future


def test_locals_only_has_a_bounded_receptive_field():
    cfg, local = _model("model.debug.gate_override=locals_only")
    reach = locals_only_reach(cfg)
    x = _tokens()
    far = T - 1 - reach
    assert far >= 0
    assert (T - 1) not in _changed_positions(local, x, far, 5)
    assert (T - 1) in _changed_positions(local, x, far + 1, 5)  # the bound is tight
    _, full = _model()
    assert (T - 1) in _changed_positions(full, x, 0, 5)  # full NSA reaches back to token 0


def test_layer_stats_are_the_implementations_counted_reads():
    _, model = _model()
    x = _tokens()
    with torch.no_grad():
        model(x)
    stats = model.layer_stats()
    block = model.blocks[0]
    with torch.no_grad():
        out = block.attn.inner.attention(block.attn_norm(model.embed(x)))
    for i, name in enumerate(BRANCHES):
        assert int(stats[0].reads[i]) == int(getattr(out.reads, name).sum())
    assert torch.all((stats[0].gate_mean >= 0) & (stats[0].gate_mean <= stats[0].gate_max))
    distinct = len({int(j) for j in out.indices[0, :, 0].flatten() if j >= 0})
    distinct += len({int(j) for j in out.indices[0, :, 1].flatten() if j >= 0})
    assert float(stats[0].distinct_blocks) == pytest.approx(distinct / 2)


def test_optimized_and_reference_models_agree():
    cfg, opt = _model()
    ref_cfg, ref = _model("model.attention=reference")
    ref.load_state_dict(opt.state_dict())
    x = _tokens()
    with torch.no_grad():
        assert torch.allclose(opt(x), ref(x), atol=1e-5, rtol=1e-4)


def test_activation_checkpointing_gives_the_same_gradients():
    _, a = _model()
    _, b = _model()
    b.load_state_dict(a.state_dict())
    a.train()
    b.train()
    b.activation_checkpointing = True
    x = _tokens()
    for m in (a, b):
        lm_loss(m(x[:, :-1]), x[:, 1:]).backward()
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.allclose(pa.grad, pb.grad, atol=1e-6), name


def test_tied_embeddings_share_the_weight():
    _, tied = _model()
    assert tied.lm_head.weight is tied.embed.weight
    _, untied = _model("model.tie_embeddings=false")
    assert untied.lm_head.weight is not untied.embed.weight


def test_loss_mask_counts_only_masked_positions():
    logits = torch.randn(2, 5, 7)
    labels = torch.randint(0, 7, (2, 5))
    mask = torch.zeros(2, 5)
    mask[1, 3] = 1
    want = torch.nn.functional.cross_entropy(logits[1, 3][None], labels[1, 3][None])
    assert torch.allclose(lm_loss(logits, labels, mask), want)
