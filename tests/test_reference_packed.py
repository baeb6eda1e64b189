"""reference with packed documents (cu_seqlens): the rules of a valid cu_seqlens, packed == each document
run alone for every stage, nsa_forward and NSAAttention, and the packed layout checked against closed forms
(compressed-token packing, -inf score columns, document-relative indices, windows and blocks that restart at each
document start, per-document reads), on edge shapes: empty documents, documents shorter than l, exactly l, l', w."""

import math

import pytest
import torch

import reference as R
from conformance.helpers import make_inputs, select_rows
from conformance.rules import causal_mask, dense_attention
from reference.packing import check_cu_seqlens, compressed_cu_seqlens, cu_seqlens_of, n_compressed_tokens

# l = 4, d = 2, l' = 8, w = 5: every edge length below differs from the others.
CFG = R.NSAConfig(cmp_block=4, cmp_stride=2, sel_block=8, n_sel=3, n_init=1, n_local=1, window=5, n_heads=2,
                  n_kv_heads=1, head_dim_qk=4, head_dim_v=3, phi="avg")
L, LP, W = CFG.cmp_block, CFG.sel_block, CFG.window
# Empty documents first, inside and last; shorter than l; exactly l, l', w; longer than two selection blocks.
LENGTHS = [0, L - 1, L, 0, LP, W, 1, 2 * LP + 3, 0]


def cu(lengths: list[int]) -> torch.Tensor:
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return torch.tensor(bounds, dtype=torch.int32)


def spans(lengths: list[int]) -> list[tuple[int, int]]:
    b = cu(lengths).tolist()
    return list(zip(b, b[1:]))


def documents(lengths: list[int]):
    """(start, end) of the non-empty documents."""
    return [(s, e) for s, e in spans(lengths) if e > s]


@pytest.fixture(scope="module")
def packed():
    cfg = CFG.replace(phi="mlp")
    x = make_inputs(cfg, sum(LENGTHS), seed=7, phi_hidden=3)
    return cfg, x, cu(LENGTHS)


# ---------------------------------------------------------------------------------------- bad cu_seqlens
T_BAD = 6
BAD_CU_SEQLENS = {
    "not a tensor": [0, 3, T_BAD],
    "float dtype": torch.tensor([0.0, 3.0, T_BAD]),
    "2-D": torch.tensor([[0, 3, T_BAD]]),
    "one entry": torch.tensor([0]),
    "first entry not 0": torch.tensor([1, 3, T_BAD]),
    "last entry not T": torch.tensor([0, 3, T_BAD - 1]),
    "decreasing": torch.tensor([0, 4, 3, T_BAD]),
}


def stage_calls(B: int):
    """Each stage (and the module) on valid inputs of batch B and T_BAD tokens, as call(cu_seqlens)."""
    x = make_inputs(CFG, T_BAD, B=B, seed=1)
    k_cmp = torch.randn(B, 2, CFG.n_kv_heads, CFG.head_dim_qk, dtype=torch.float64)
    scores = torch.zeros(B, T_BAD, CFG.n_kv_heads, 1, dtype=torch.float64)
    indices = torch.zeros(B, T_BAD, CFG.n_kv_heads, CFG.n_sel, dtype=torch.int64)
    torch.manual_seed(0)
    module = R.NSAAttention(8, CFG).double()
    hidden = torch.randn(B, T_BAD, 8, dtype=torch.float64)
    return {
        "compress": lambda c: R.compress(*x.kv.cmp, CFG, cu_seqlens=c),
        "compressed_attention": lambda c: R.compressed_attention(x.q, k_cmp, k_cmp[..., :3], CFG, cu_seqlens=c),
        "selection_scores": lambda c: R.selection_scores(x.q, k_cmp, CFG, cu_seqlens=c),
        "select_blocks": lambda c: R.select_blocks(scores, CFG, cu_seqlens=c),
        "selected_attention": lambda c: R.selected_attention(x.q, *x.kv.slc, indices, CFG, cu_seqlens=c),
        "window_attention": lambda c: R.window_attention(x.q, *x.kv.win, CFG, cu_seqlens=c),
        "nsa_forward": lambda c: R.nsa_forward(x.q, x.kv, x.gates, CFG, cu_seqlens=c),
        "NSAAttention": lambda c: module(hidden, cu_seqlens=c),
    }


STAGES = sorted(stage_calls(1))


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("case", sorted(BAD_CU_SEQLENS))
def test_bad_cu_seqlens_raises_naming_it(stage, case):
    with pytest.raises(ValueError, match="cu_seqlens"):
        stage_calls(1)[stage](BAD_CU_SEQLENS[case])


@pytest.mark.parametrize("stage", STAGES)
def test_packed_batch_must_have_batch_size_one(stage):
    with pytest.raises(ValueError, match="cu_seqlens needs batch size 1"):
        stage_calls(2)[stage](torch.tensor([0, 3, T_BAD]))


def test_packed_inputs_that_disagree_with_cu_seqlens_are_named():
    x = make_inputs(CFG, 10, seed=2)
    c = cu([4, 6])  # compressed tokens: 1 (L = 4) + 2 (L = 6) = 3; unpacked, the 10 tokens hold 4
    with pytest.raises(ValueError, match="k_cmp/v_cmp .* N = 3"):
        R.compressed_attention(x.q, *R.compress(*x.kv.cmp, CFG), CFG, cu_seqlens=c)  # unpacked: 4 tokens
    with pytest.raises(ValueError, match="k_cmp/v_cmp .* N = 3"):
        R.selection_scores(x.q, R.compress(*x.kv.cmp, CFG)[0], CFG, cu_seqlens=c)
    with pytest.raises(ValueError, match="scores .* NB >= 1"):
        R.select_blocks(torch.zeros(1, 10, 1, 0, dtype=torch.float64), CFG, cu_seqlens=c)
    with pytest.raises(ValueError, match="^k must hold the same"):
        R.window_attention(x.q, x.kv.win.k[:, :9], x.kv.win.v, CFG, cu_seqlens=c)
    with pytest.raises(ValueError, match="^indices must hold the same"):
        R.selected_attention(x.q, *x.kv.slc, torch.zeros(1, 9, 1, 3, dtype=torch.int64), CFG, cu_seqlens=c)


def test_module_position_offset_must_be_zero_when_packed():
    torch.manual_seed(0)
    module = R.NSAAttention(8, CFG).double()
    with pytest.raises(ValueError, match="position_offset must be 0 when cu_seqlens is given"):
        module(torch.randn(1, 6, 8, dtype=torch.float64), position_offset=3, cu_seqlens=cu([2, 4]))


# ------------------------------------------------------------------------------- packed == each document alone
def test_compress_packs_each_documents_compressed_tokens_in_order(packed):
    cfg, x, c = packed
    k_cmp, v_cmp = R.compress(*x.kv.cmp, cfg, x.phi, cu_seqlens=c)
    offsets = compressed_cu_seqlens(c, cfg).tolist()
    assert k_cmp.shape[1] == v_cmp.shape[1] == offsets[-1] == sum(n_compressed_tokens(n, cfg) for n in LENGTHS)
    for i, (s, e) in enumerate(spans(LENGTHS)):
        alone_k, alone_v = R.compress(x.kv.cmp.k[:, s:e], x.kv.cmp.v[:, s:e], cfg, x.phi)
        assert alone_k.shape[1] == offsets[i + 1] - offsets[i]
        assert torch.equal(k_cmp[:, offsets[i]: offsets[i + 1]], alone_k)
        assert torch.equal(v_cmp[:, offsets[i]: offsets[i + 1]], alone_v)


def test_no_compressed_block_straddles_a_boundary():
    """phi = mean: document i's compressed token j is the mean of its own keys s + j*d .. s + j*d + l - 1 (Eq. 7)."""
    x = make_inputs(CFG, sum(LENGTHS), seed=3)
    k_cmp, _ = R.compress(*x.kv.cmp, CFG, cu_seqlens=cu(LENGTHS))
    row = 0
    for s, e in spans(LENGTHS):
        for j in range(n_compressed_tokens(e - s, CFG)):
            first = s + j * CFG.cmp_stride
            assert first + CFG.cmp_block <= e
            torch.testing.assert_close(k_cmp[0, row], x.kv.cmp.k[0, first: first + CFG.cmp_block].mean(0),
                                       rtol=1e-14, atol=1e-14)
            row += 1
    assert row == k_cmp.shape[1]


def test_branch_stages_equal_each_document_alone(packed):
    cfg, x, c = packed
    k_cmp, v_cmp = R.compress(*x.kv.cmp, cfg, x.phi, cu_seqlens=c)
    o_cmp = R.compressed_attention(x.q, k_cmp, v_cmp, cfg, cu_seqlens=c)
    scores = R.selection_scores(x.q, k_cmp, cfg, cu_seqlens=c)
    indices = R.select_blocks(scores, cfg, cu_seqlens=c)
    o_slc = R.selected_attention(x.q, *x.kv.slc, indices, cfg, cu_seqlens=c)
    o_win = R.window_attention(x.q, *x.kv.win, cfg, cu_seqlens=c)
    T = sum(LENGTHS)
    assert o_cmp.shape == o_slc.shape == o_win.shape == (1, T, cfg.n_heads, cfg.head_dim_v)
    assert scores.shape == (1, T, cfg.n_kv_heads, max(math.ceil(n / LP) for n in LENGTHS))
    assert indices.shape == (1, T, cfg.n_kv_heads, cfg.n_sel)
    for s, e in documents(LENGTHS):
        y = select_rows(x, time=slice(s, e))
        kc, vc = R.compress(*y.kv.cmp, cfg, y.phi)
        own_scores = R.selection_scores(y.q, kc, cfg)
        own_indices = R.select_blocks(own_scores, cfg)
        n_own = own_scores.shape[-1]
        assert torch.equal(o_cmp[:, s:e], R.compressed_attention(y.q, kc, vc, cfg))
        assert torch.equal(scores[:, s:e, :, :n_own], own_scores)
        assert bool((scores[:, s:e, :, n_own:] == -math.inf).all()), "columns past the document must be -inf"
        assert torch.equal(indices[:, s:e], own_indices)
        assert torch.equal(o_slc[:, s:e], R.selected_attention(y.q, *y.kv.slc, own_indices, cfg))
        assert torch.equal(o_win[:, s:e], R.window_attention(y.q, *y.kv.win, cfg))


def test_nsa_forward_equals_each_document_alone_with_gradients(packed):
    cfg, x, c = packed
    weights = torch.randn(1, sum(LENGTHS), cfg.n_heads, cfg.head_dim_v, dtype=torch.float64,
                          generator=torch.Generator().manual_seed(5))

    def run(packed_call: bool):
        xg = x.to(requires_grad=True)
        if packed_call:
            outs = [R.nsa_forward(xg.q, xg.kv, xg.gates, cfg, xg.phi, cu_seqlens=c)]
            loss = (outs[0].o * weights).sum()
        else:
            outs, loss = [], 0
            for s, e in documents(LENGTHS):
                y = select_rows(xg, time=slice(s, e))
                outs.append(R.nsa_forward(y.q, y.kv, y.gates, cfg, y.phi))
                loss = loss + (outs[-1].o * weights[:, s:e]).sum()
        leaves = xg.tensors()
        return outs, torch.autograd.grad(loss, leaves)

    (whole,), g_packed = run(True)
    alone, g_alone = run(False)
    for field in ("o", "o_cmp", "o_slc", "o_win", "indices"):
        assert torch.equal(getattr(whole, field), torch.cat([getattr(a, field) for a in alone], dim=1)), field
    for branch in ("cmp", "slc", "win"):
        assert torch.equal(getattr(whole.reads, branch), torch.cat([getattr(a.reads, branch) for a in alone], 1))
    for a, b in zip(g_packed, g_alone):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-15)  # the phi gradients sum over the documents


def test_one_document_is_the_unpacked_call():
    x = make_inputs(CFG, 21, seed=4)
    a = R.nsa_forward(x.q, x.kv, x.gates, CFG, cu_seqlens=torch.tensor([0, 21]))
    b = R.nsa_forward(x.q, x.kv, x.gates, CFG)
    for field in ("o", "o_cmp", "o_slc", "o_win", "indices"):
        assert torch.equal(getattr(a, field), getattr(b, field))


# ------------------------------------------------------------------- the packed layout against closed forms
def test_indices_are_document_relative_with_forced_blocks(packed):
    cfg, x, c = packed
    out = R.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi, cu_seqlens=c)
    for s, e in documents(LENGTHS):
        for p in range(s, e):
            J = (p - s) // LP
            chosen = [j for j in out.indices[0, p, 0].tolist() if j >= 0]
            assert chosen == sorted(chosen) and all(0 <= j <= J for j in chosen), (p, chosen)
            forced = {j for j in range(J + 1) if j < cfg.n_init or j > J - cfg.n_local}
            assert forced <= set(chosen) and len(chosen) == min(J + 1, cfg.n_sel), (p, chosen)
            # Eq. 12 reads: the chosen blocks' tokens clipped to the query's own position in its document
            assert out.reads.slc[0, p, 0] == sum(min(LP, p - s - j * LP + 1) for j in chosen)
            # window reads restart at the document start; compressed reads count the document's own blocks
            assert out.reads.win[0, p, 0] == min(p - s + 1, W)
            assert out.reads.cmp[0, p, 0] == max(0, (p - s + 1 - L) // CFG.cmp_stride + 1)


def block_diagonal(lengths: list[int], mask_of_length) -> torch.Tensor:
    """allowed [T, T]: mask_of_length(L_i) on each document's diagonal block, nothing across documents."""
    T = sum(lengths)
    allowed = torch.zeros(T, T, dtype=torch.bool)
    for s, e in spans(lengths):
        allowed[s:e, s:e] = mask_of_length(e - s)
    return allowed


@pytest.mark.parametrize("window_keys", ["w", "w+1"])
def test_packed_window_is_block_diagonal_banded_dense_attention(window_keys):
    cfg = CFG.replace(window_keys=window_keys)
    x = make_inputs(cfg, sum(LENGTHS), seed=6)
    got = R.window_attention(x.q, *x.kv.win, cfg, cu_seqlens=cu(LENGTHS))
    allowed = block_diagonal(LENGTHS, lambda n: causal_mask(n, window=cfg.window_size))
    torch.testing.assert_close(got, dense_attention(x.q, *x.kv.win, allowed), rtol=1e-12, atol=1e-12)


def test_packed_selection_of_every_block_is_block_diagonal_causal_dense_attention():
    T = sum(LENGTHS)
    x = make_inputs(CFG, T, seed=8)
    indices = torch.full((1, T, 1, CFG.n_sel), -1, dtype=torch.int64)
    for s, e in spans(LENGTHS):
        for p in range(s, e):
            indices[0, p, 0, : (p - s) // LP + 1] = torch.arange((p - s) // LP + 1)  # 3 >= ceil(19 / 8) blocks
    got = R.selected_attention(x.q, *x.kv.slc, indices, CFG, cu_seqlens=cu(LENGTHS))
    torch.testing.assert_close(got, dense_attention(x.q, *x.kv.slc, block_diagonal(LENGTHS, causal_mask)),
                               rtol=1e-12, atol=1e-12)


def test_packed_unit_compressed_blocks_are_block_diagonal_causal_dense_attention():
    cfg = CFG.replace(cmp_block=1, cmp_stride=1)  # mean of one key = the key: compressed attention = attention
    x = make_inputs(cfg, sum(LENGTHS), seed=9)
    c = cu(LENGTHS)
    got = R.compressed_attention(x.q, *R.compress(*x.kv.cmp, cfg, cu_seqlens=c), cfg, cu_seqlens=c)
    torch.testing.assert_close(got, dense_attention(x.q, *x.kv.cmp, block_diagonal(LENGTHS, causal_mask)),
                               rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------------- edge shapes
def test_no_tokens_at_all_gives_empty_stage_results():
    x = make_inputs(CFG, 0, seed=1)
    c = torch.tensor([0, 0, 0])
    k_cmp, v_cmp = R.compress(*x.kv.cmp, CFG, cu_seqlens=c)
    assert k_cmp.shape == (1, 0, 1, 4) and v_cmp.shape == (1, 0, 1, 3)
    assert R.compressed_attention(x.q, k_cmp, v_cmp, CFG, cu_seqlens=c).shape == (1, 0, 2, 3)
    scores = R.selection_scores(x.q, k_cmp, CFG, cu_seqlens=c)
    assert scores.shape == (1, 0, 1, 0)  # NB = max ceil(L_i / l') = 0 only when T = 0
    assert R.select_blocks(scores, CFG, cu_seqlens=c).shape == (1, 0, 1, CFG.n_sel)
    assert R.window_attention(x.q, *x.kv.win, CFG, cu_seqlens=c).shape == (1, 0, 2, 3)
    with pytest.raises(ValueError, match="T >= 1"):
        R.nsa_forward(x.q, x.kv, x.gates, CFG, cu_seqlens=c)


@pytest.mark.parametrize("length", [1, L - 1, L, LP, W, LP + 1])
def test_single_edge_length_document_between_others(length):
    """A document of an edge length squeezed between two others computes what it computes alone."""
    lengths = [3, length, LP + 2]
    x = make_inputs(CFG, sum(lengths), seed=length)
    out = R.nsa_forward(x.q, x.kv, x.gates, CFG, cu_seqlens=cu(lengths))
    y = select_rows(x, time=slice(3, 3 + length))
    alone = R.nsa_forward(y.q, y.kv, y.gates, CFG)
    for field in ("o", "o_cmp", "o_slc", "o_win", "indices"):
        assert torch.equal(getattr(out, field)[:, 3: 3 + length], getattr(alone, field)), field


def test_module_restarts_rope_positions_at_each_document():
    torch.manual_seed(0)
    module = R.NSAAttention(8, CFG.replace(phi="mlp")).double()
    x = torch.randn(1, sum(LENGTHS), 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    c = cu(LENGTHS)
    q, kv, _ = module.project(x, cu_seqlens=c)
    y = module(x, cu_seqlens=c)
    for s, e in documents(LENGTHS):
        q_alone, kv_alone, _ = module.project(x[:, s:e])
        torch.testing.assert_close(q[:, s:e], q_alone, rtol=1e-13, atol=1e-14)
        torch.testing.assert_close(kv.slc.k[:, s:e], kv_alone.slc.k, rtol=1e-13, atol=1e-14)
        torch.testing.assert_close(y[:, s:e], module(x[:, s:e]), rtol=1e-12, atol=1e-14)


def test_cu_seqlens_of_lengths():
    cu = cu_seqlens_of([3, 0, 2])
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 3, 5]
    assert check_cu_seqlens(cu, 5, 1) == [(0, 3), (3, 3), (3, 5)]
    assert cu_seqlens_of([]).tolist() == [0]
