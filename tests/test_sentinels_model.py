"""The sentinel LM: causality of the clean model, the planted leaks break it where they claim to, locals-only
has a bounded receptive field, statistics come from the implementation's counted reads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor

from reference.contract import BRANCHES
from sentinels.config import load_config
from sentinels.data.pipeline import locals_only_reach
from sentinels.model import RMSNorm, SwiGLU, _document_block_offsets, build_model, lm_head_loss, lm_loss

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


@pytest.mark.parametrize("rows_per_slice", [1024, 7, 1], ids=["one-slice", "slices-of-7", "slices-of-1"])
def test_layer_stats_count_the_distinct_selected_blocks(rows_per_slice: int, monkeypatch: pytest.MonkeyPatch):
    """distinct_blocks is the mean over (sequence, KV group) of the distinct block ids its rows selected, whatever
    the number of row slices the hit map is cut into (a block seen in one slice only still counts once, a block in
    every slice counts once); -1 slots count nothing."""
    import sentinels.model as model_module
    from reference.config import NSAConfig
    from reference.contract import NSAOutput, Reads

    monkeypatch.setattr(model_module, "HIT_MAP_ROWS", rows_per_slice)
    model_module._HIT_OFFSETS.clear()
    cfg = NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, n_sel=3, n_init=1, n_local=1, window=8, n_heads=4,
                    n_kv_heads=2, head_dim_qk=8, head_dim_v=8)
    B, T, Hkv, n = 2, 45, 2, 3
    g = torch.Generator().manual_seed(rows_per_slice)
    n_blocks = -(-T // cfg.sel_block)
    idx = torch.randint(0, n_blocks, (B, T, Hkv, n), generator=g)
    idx[torch.rand(idx.shape, generator=g) < 0.3] = -1
    idx[1, :, 1] = -1  # one (sequence, group) selected nothing
    idx[0, T - 1, 0, 0] = n_blocks - 1  # a block only the last row selects
    zeros = torch.zeros(B, T, Hkv, dtype=torch.int64)
    out = NSAOutput(o=torch.zeros(B, T, 4, 8), indices=idx, o_cmp=None, o_slc=None, o_win=None,
                    reads=Reads(cmp=zeros, slc=zeros + 2, win=zeros + 1))
    stats = model_module._layer_stats(torch.rand(B, T, 4, 3, generator=g), out, cfg, T)
    expected = sum(len({int(j) for j in idx[b, :, h].flatten() if j >= 0}) for b in range(B) for h in range(Hkv))
    assert float(stats.distinct_blocks) == pytest.approx(expected / (B * Hkv))
    assert stats.reads.tolist() == [0, 2 * B * T * Hkv, B * T * Hkv]


def test_layer_stats_keep_the_hit_offsets_of_contiguous_rows_only(monkeypatch: pytest.MonkeyPatch):
    """The hit map's offsets are kept per shape for contiguous rows; a packed batch (whose block count changes from
    batch to batch) builds its own and keeps none, and still counts its documents' blocks apart."""
    import sentinels.model as model_module
    from optimized.device_tables import DeviceTables
    from reference.config import NSAConfig
    from reference.contract import NSAOutput, Reads

    monkeypatch.setattr(model_module, "_HIT_OFFSETS", DeviceTables())
    cfg = NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, n_sel=2, n_init=1, n_local=1, window=8, n_heads=2,
                    n_kv_heads=1, head_dim_qk=8, head_dim_v=8)
    T = 20
    idx = torch.zeros(1, T, 1, 2, dtype=torch.int64)
    idx[..., 1] = -1  # every row selects its document's block 0
    zeros = torch.zeros(1, T, 1, dtype=torch.int64)
    out = NSAOutput(o=torch.zeros(1, T, 2, 8), indices=idx, o_cmp=None, o_slc=None, o_win=None,
                    reads=Reads(cmp=zeros, slc=zeros, win=zeros))
    gates = torch.rand(1, T, 2, 3)
    packed = model_module._layer_stats(gates, out, cfg, T, _document_block_offsets(torch.tensor([0, 9, T]), 8))
    assert float(packed.distinct_blocks) == 2  # block 0 of each of the two documents
    assert not model_module._HIT_OFFSETS._store
    contiguous = model_module._layer_stats(gates, out, cfg, T)
    assert float(contiguous.distinct_blocks) == 1 and len(model_module._HIT_OFFSETS._store) == 1


def test_optimized_and_reference_models_agree():
    cfg, opt = _model()
    ref_cfg, ref = _model("model.attention=reference")
    ref.load_state_dict(opt.state_dict())
    x = _tokens()
    with torch.no_grad():
        assert torch.allclose(opt(x), ref(x), atol=1e-5, rtol=1e-4)


def _twin_models(backend: str):
    """Two training models with the same weights on backend (the kernels: Triton's interpreter on a CPU host,
    compiled on a GPU host) and the tokens to train them on."""
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    _, a = _model()
    _, b = _model()
    b.load_state_dict(a.state_dict())
    for m in (a, b):
        m.train().to(device)
        for block in m.blocks:
            block.attn.inner.backend = block.attn.inner.range_backend = backend
    return a, b, _tokens().to(device)


@pytest.mark.parametrize("backend", ["auto", "triton"], ids=["cpu-default", "kernels"])
def test_activation_checkpointing_gives_the_same_gradients(backend):
    """Also on the kernels, where each layer's output projection recomputes its input in backward
    (optimized.NSAAttention.project_output) inside the checkpointed block."""
    a, b, x = _twin_models(backend)
    b.activation_checkpointing = True
    for m in (a, b):
        lm_loss(m(x[:, :-1]), x[:, 1:]).backward()
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.allclose(pa.grad, pb.grad, atol=1e-6), name


def _saved_bytes(model, x) -> tuple[Tensor, int]:
    """The loss of model on x and the bytes of the distinct storages its forward saves for backward (what autograd
    packs at the top level: a checkpointed region hands over only what its own hooks keep)."""
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = lm_loss(model(x[:, :-1]), x[:, 1:])
    return loss, sum(storages.values())


@pytest.mark.parametrize("backend", ["auto", "triton"], ids=["cpu-default", "kernels"])
def test_recomputed_attention_gives_the_same_gradients_and_statistics(backend, monkeypatch):
    """train.activation_checkpointing attention: bitwise the same loss, gradients and layer statistics as keeping
    every activation; the forward keeps less; backward runs each layer's NSA once more, its statistics not again,
    and on the kernels not its selection and selected branch either (taken back from the forward)."""
    import optimized.kernels.selected_attention as selected_kernels
    import optimized.kernels.selection as selection_kernels
    import sentinels.model as model_module

    a, b, x = _twin_models(backend)
    b.activation_checkpointing = "attention"
    stats_calls = []
    layer_stats = model_module._layer_stats
    monkeypatch.setattr(model_module, "_layer_stats", lambda *a, **k: stats_calls.append(1) or layer_stats(*a, **k))
    kernel_calls = {"selection": 0, "selected": 0}

    def counted(name, f):
        def call(*args, **kwargs):
            kernel_calls[name] += 1
            return f(*args, **kwargs)
        return call

    monkeypatch.setattr(selection_kernels, "selection_indices_rows",
                        counted("selection", selection_kernels.selection_indices_rows))
    monkeypatch.setattr(selected_kernels, "_forward", counted("selected", selected_kernels._forward))
    nsa_calls = []
    for block in b.blocks:
        inner_forward = block.attn.inner.functional_forward
        monkeypatch.setattr(block.attn.inner, "functional_forward",
                            lambda *a, f=inner_forward, **k: nsa_calls.append(1) or f(*a, **k))
    loss_a, kept_a = _saved_bytes(a, x)
    loss_b, kept_b = _saved_bytes(b, x)
    assert torch.equal(loss_a, loss_b)
    assert len(nsa_calls) == len(b.blocks)
    # each layer keeps at least its attention output (the output projection's input) and rotated q beyond its input
    n_layers, width = len(b.blocks), a.cfg.d_model
    assert kept_b <= kept_a - n_layers * 2 * (T - 1) * width * 4, (kept_a, kept_b)
    stats_after_forward = [s.gate_mean.clone() for s in b.layer_stats()]
    for loss in (loss_a, loss_b):
        loss.backward()
    assert len(nsa_calls) == 2 * len(b.blocks)  # recomputed once in backward
    on_kernels = 2 * len(b.blocks) if backend == "triton" else 0  # a's and b's forwards, not b's recomputation
    assert kernel_calls == {"selection": on_kernels, "selected": on_kernels}
    assert len(stats_calls) == 2 * len(b.blocks)  # a's and b's forwards, not b's recomputation
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa.grad, pb.grad), name
    for sa, sb, kept in zip(a.layer_stats(), b.layer_stats(), stats_after_forward):
        for field in ("gate_mean", "gate_max", "distinct_blocks", "reads"):
            assert torch.equal(getattr(sa, field), getattr(sb, field)), field
        assert torch.equal(sb.gate_mean, kept)


def test_recomputed_attention_on_packed_documents():
    """A packed batch (cu_seqlens) on the kernels: the recomputation takes back the forward's document-relative
    selection and gives the same gradients, bitwise."""
    a, b, x = _twin_models("triton")
    b.activation_checkpointing = "attention"
    cu_seqlens = torch.tensor([0, 13, 27, T - 1], dtype=torch.int32, device=x.device)
    for m in (a, b):
        lm_loss(m(x[:, :-1], cu_seqlens), x[:, 1:]).backward()
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa.grad, pb.grad), name


def test_recomputed_attention_backward_twice_with_retain_graph():
    """The recomputation runs once per backward; a second backward through a retained graph gets the same
    gradients again (the forward's kept selection is handed back twice), on the kernels."""
    device = "cuda" if torch.cuda.is_available() else "cpu"  # on CPU the kernels run in Triton's interpreter
    _, m = _model()
    m.train().to(device)
    for block in m.blocks:
        block.attn.inner.backend = block.attn.inner.range_backend = "triton"
    m.activation_checkpointing = "attention"
    x = _tokens().to(device)
    loss = lm_loss(m(x[:, :-1]), x[:, 1:])
    loss.backward(retain_graph=True)
    once = [p.grad.clone() for p in m.parameters()]
    loss.backward()
    for g, p in zip(once, m.parameters()):
        assert torch.equal(p.grad, 2 * g)


def test_recomputed_attention_leaves_evaluation_unchanged():
    """Without gradients (evaluation), attention recomputation does nothing: the same logits, and nothing to keep."""
    _, a = _model()
    a.activation_checkpointing = "attention"
    x = _tokens()
    with torch.no_grad():
        want = a(x)
        a.activation_checkpointing = False
        assert torch.equal(a(x), want)


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


@pytest.mark.parametrize("chunk_rows", [1, 3, 7, 1000])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("vocab", [11, 64, 65])  # padded for the matmuls (to 64, none, 128)
def test_chunked_head_loss_equals_the_loss_of_the_full_logits(chunk_rows, masked, vocab):
    """lm_head_loss (the trainer's loss: no full logits) = lm_loss(hidden @ W.T): value, d/dhidden, d/dW."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 9, 6, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, 6, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, vocab, (2, 9), generator=g)
    labels[0, 2] = labels[1, 5] = -100  # ignored positions (packed batches use them)
    mask = (torch.rand(2, 9, generator=g) < 0.5).double() if masked else None
    want = lm_loss(hidden @ weight.t(), labels, mask)
    want_dh, want_dw = torch.autograd.grad(3.0 * want, (hidden, weight))
    got = lm_head_loss(hidden, weight, labels, mask, chunk_rows=chunk_rows)
    got_dh, got_dw = torch.autograd.grad(3.0 * got, (hidden, weight))
    # both compute the cross-entropy on fp32 logits: they differ by fp32 summation order only
    torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_dh, want_dh, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_dw, want_dw, rtol=1e-5, atol=1e-6)
    assert got_dh.dtype == hidden.dtype and got_dw.dtype == weight.dtype


def test_the_model_loss_equals_the_loss_of_its_logits():
    """forward(labels=...) (the trainer's call) gives lm_loss(forward(x)) and the same parameter gradients, with
    and without a loss mask; with tied embeddings the head's gradient still reaches the shared weight."""
    _, a = _model()
    a.train()
    x = _tokens()
    inputs, labels = x[:, :-1], x[:, 1:]
    mask = torch.ones(labels.shape)
    mask[:, : labels.shape[1] // 3] = 0
    for loss_mask in (None, mask):
        want = lm_loss(a(inputs), labels, loss_mask)
        want_grads = torch.autograd.grad(want, list(a.parameters()))
        got = a(inputs, labels=labels, loss_mask=loss_mask)
        got_grads = torch.autograd.grad(got, list(a.parameters()))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for (name, _), gw, gg in zip(a.named_parameters(), want_grads, got_grads):
            torch.testing.assert_close(gg, gw, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_the_chunked_loss_refuses_bad_labels_and_empty_masks():
    hidden, weight = torch.randn(1, 4, 3), torch.randn(5, 3)
    with pytest.raises(ValueError, match="labels must have shape"):
        lm_head_loss(hidden, weight, torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="loss_mask selects no position"):
        lm_head_loss(hidden, weight, torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4))


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter runs on CPU hosts only (root conftest); "
                    "on a GPU host tests/gpu/test_head_loss_gpu.py checks the compiled kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [11, 64, 65])  # padded for the matmuls (to 64, none, 128)
def test_fused_head_loss_equals_the_torch_path(dtype, vocab):
    """The Triton cross-entropy of each chunk (fused=True; the interpreter here) gives the torch path's loss and
    gradients: the same fp32 math on the same rounded logits, the logsumexp summed in another order. In bf16 the
    tolerance is the torch path's own distance from the float64 loss (the interpreter's fp32 -> bf16 casts
    truncate, so the fused dlogits may round one bf16 ulp lower)."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 9, 6, generator=g).to(dtype).requires_grad_(True)
    weight = torch.randn(vocab, 6, generator=g).to(dtype).requires_grad_(True)
    labels = torch.randint(0, vocab, (2, 9), generator=g)
    labels[0, 2] = -100
    mask = (torch.rand(2, 9, generator=g) < 0.7).float()
    results = []
    for fused in (False, True):
        loss = lm_head_loss(hidden, weight, labels, mask, chunk_rows=7, fused=fused)
        results.append((loss, *torch.autograd.grad(2.0 * loss, (hidden, weight))))
    exact_h, exact_w = hidden.detach().double().requires_grad_(True), weight.detach().double().requires_grad_(True)
    exact = lm_loss(exact_h @ exact_w.t(), labels, mask.double())
    exact = (exact, *torch.autograd.grad(2.0 * exact, (exact_h, exact_w)))
    for name, torch_path, fused, want in zip(("loss", "d/dhidden", "d/dweight"), *results, exact):
        assert fused.dtype == torch_path.dtype, name
        if dtype == torch.float32:
            torch.testing.assert_close(fused, torch_path, rtol=1e-5, atol=1e-6, msg=name)
        else:
            own = (torch_path.double() - want).abs().max().item()
            assert (fused.double() - want).abs().max().item() <= 2 * own + 1e-6, name


def test_fused_head_loss_on_cpu_without_the_interpreter_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="fused=True runs Triton kernels, which need CUDA tensors"):
        lm_head_loss(torch.randn(1, 4, 3), torch.randn(5, 3), torch.zeros(1, 4, dtype=torch.long), fused=True)


def _rms_norm_by_definition(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_on_cpu_is_its_definition_bit_for_bit(dtype):
    """On CPU the model's RMSNorm (torch's rms_norm) computes x * rsqrt(mean(x^2) + eps) * weight in fp32, in that
    order, and its gradients are those of that expression: checkpoints and the CPU reports do not move."""
    norm = RMSNorm(96, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=torch.Generator().manual_seed(1)))
    x = torch.randn(2, 40, 96, generator=torch.Generator().manual_seed(2)).to(dtype).requires_grad_(True)
    grad = torch.randn(2, 40, 96, generator=torch.Generator().manual_seed(3)).to(dtype)
    got = norm(x)
    want = _rms_norm_by_definition(x, norm.weight, 1e-6)
    assert got.dtype == dtype and torch.equal(got, want)
    leaves = [x, norm.weight]
    for a, b in zip(torch.autograd.grad(got, leaves, grad), torch.autograd.grad(want, leaves, grad)):
        assert torch.equal(a, b)



def _pre_norm_logits(model, ids: Tensor) -> Tensor:
    """The pre-norm decoder written out: each block adds its attention, then its MLP, to the residual stream."""
    x = model.embed(ids)
    for block in model.blocks:
        x = x + block.attn(block.attn_norm(x))
        x = x + block.mlp(block.mlp_norm(x))
    return model.lm_head(model.final_norm(x))


def test_each_add_left_to_the_next_norm_computes_the_pre_norm_stream_bit_for_bit():
    """The blocks hand their last add to the next norm (RMSNorm with a delta); on torch's path that is the same
    add in the same order: the model's logits equal the written-out pre-norm decoder's exactly."""
    _, model = _model()
    ids = _tokens()
    with torch.no_grad():
        assert torch.equal(model(ids), _pre_norm_logits(model, ids))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter on this model's CPU tensors; on a GPU host the "
                    "graphed training tests and the kernels' tests run the fused paths")
@pytest.mark.parametrize("checkpointing", [False, True, "attention"])
def test_the_model_on_its_fused_kernels_trains_as_on_torch(checkpointing):
    """Every norm on the add + RMSNorm kernels and every MLP on its one matmul and SwiGLU kernels (Triton's
    interpreter here) give torch's loss and gradients to fp32 rounding, with and without activation checkpointing
    (whole blocks, or the attention sublayers)."""
    _, model = _model()
    model.train()
    model.activation_checkpointing = checkpointing
    ids, labels = _tokens(seed=1), _tokens(seed=2)
    params = list(model.parameters())
    switched = [m for m in model.modules() if isinstance(m, (RMSNorm, SwiGLU))]
    results = []
    for fused in (False, True):
        for module in switched:
            module.fused = fused
        loss = model(ids, labels=labels)
        results.append((loss, *torch.autograd.grad(loss, params)))
    for i, (torch_path, kernels) in enumerate(zip(*results)):
        torch.testing.assert_close(kernels, torch_path, rtol=1e-4, atol=1e-6, msg=f"output {i}")
