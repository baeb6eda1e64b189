"""Triton decode kernels (optimized/kernels/selected_decode.py, masked_decode.py) vs independent torch oracles, in
the interpreter on tiny fp32 shapes (the GPU share is tests/test_decode_gpu.py).

Oracles: the selected branch against optimized.kernels.naive.selected_attention_naive (one query row at a time, its own
position); the masked kernel against a dense softmax over an explicit score matrix. Reads are checked against
counts made here from the index rules. Outputs are poisoned with NaN first (torch.empty), so a missed write fails.
"""

from __future__ import annotations

import math

import pytest
import torch

from optimized.kernels.masked_decode import masked_decode_attention
from optimized.kernels.naive import selected_attention_naive
from optimized.kernels.selected_decode import selected_decode_attention

TOL = 1e-5


@pytest.fixture(autouse=True)
def poisoned_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    real_empty = torch.empty

    def empty(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        if out.is_floating_point():
            out.fill_(float("nan"))
        elif out.numel():
            out.fill_(-12345)
        return out

    monkeypatch.setattr(torch, "empty", empty)


def rnd(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=g)


@pytest.mark.parametrize("splits", [1, 2, 4])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_selected_decode_matches_naive_per_row(splits, index_dtype):
    g = torch.Generator().manual_seed(splits)
    B, TQ, Hkv, G, dk, dv, S, lp, n = 2, 3, 2, 3, 8, 6, 60, 8, 4
    q, k, v = rnd(g, B, TQ, Hkv * G, dk), rnd(g, B, Hkv, S, dk), rnd(g, B, Hkv, S, dv)
    positions = torch.tensor([[20, 21, 22], [55, -1, -1]])  # row 1: one real query, two padding queries
    indices = torch.randint(0, 7, (B, TQ, Hkv, n), generator=g)
    indices[0, 0, 0] = torch.tensor([0, 2, -1, -1])  # padding slots
    indices[0, 1, 1] = torch.tensor([-1, -1, -1, -1])  # nothing selected
    indices[1, 0, 0, 3] = 7  # block 7 starts at 56 > 55: clipped away entirely
    o, reads = selected_decode_attention(q, k, v, indices.to(index_dtype), positions, lp, splits=splits)
    for b in range(B):
        for t in range(TQ):
            p = int(positions[b, t])
            if p < 0:
                assert bool((o[b, t] == 0).all()) and bool((reads[b, t] == 0).all())
                continue
            want = selected_attention_naive(q[b:b + 1, t:t + 1], k[b:b + 1].transpose(1, 2),
                                            v[b:b + 1].transpose(1, 2), indices[b:b + 1, t:t + 1], lp,
                                            positions=torch.tensor([p]))
            assert (o[b, t] - want[0, 0]).abs().max() <= TOL
            for h in range(Hkv):
                counted = sum(len(range(j * lp, min((j + 1) * lp, p + 1))) for j in indices[b, t, h].tolist()
                              if j >= 0)
                assert int(reads[b, t, h]) == counted
    assert bool((o[0, 1, G:2 * G] == 0).all()) and int(reads[0, 1, 1]) == 0  # KV group 1 of (0, 1) selected nothing


def dense_masked(q, k, v, mask):
    """softmax(q.k/sqrt(dk)) over the keys mask admits, per (row, query, head); 0 where none."""
    B, TQ, Hq, dk = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    kk = k.repeat_interleave(G, dim=1)  # [B, Hq, K, dk]
    vv = v.repeat_interleave(G, dim=1)
    scores = torch.einsum("bthd,bhkd->bthk", q, kk) / math.sqrt(dk)
    allowed = mask[:, :, None, :].expand_as(scores)
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
    return torch.einsum("bthk,bhkd->bthd", probs, vv), scores


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("n_keys", [0, 5, 150])
def test_masked_decode_matches_dense_softmax(splits, n_keys):
    g = torch.Generator().manual_seed(n_keys)
    B, TQ, Hkv, G, dk, dv = 2, 2, 2, 3, 8, 6
    q, k, v = rnd(g, B, TQ, Hkv * G, dk), rnd(g, B, Hkv, n_keys, dk), rnd(g, B, Hkv, n_keys, dv)
    mask = torch.rand((B, TQ, n_keys), generator=g) < 0.6
    mask[1, 1] = False  # a query with no key
    o, logits, reads = masked_decode_attention(q, k, v, mask, want_logits=True, splits=splits)
    want, scores = dense_masked(q, k, v, mask)
    assert (o - want).abs().max() <= TOL
    assert bool((o[1, 1] == 0).all())
    assert logits.shape == (B, Hkv, TQ, G, n_keys)
    if n_keys:
        assert (logits.permute(0, 2, 1, 3, 4).reshape(B, TQ, Hkv * G, n_keys) - scores).abs().max() <= TOL
    assert reads.tolist() == mask.sum(-1)[:, :, None].expand(B, TQ, Hkv).tolist()


def test_masked_decode_without_logits_reads_only_admitted_keys():
    """Keys outside the mask may hold anything (NaN here): without want_logits they are never loaded."""
    g = torch.Generator().manual_seed(1)
    q, k, v = rnd(g, 1, 1, 4, 8), rnd(g, 1, 2, 40, 8), rnd(g, 1, 2, 40, 8)
    mask = torch.zeros((1, 1, 40), dtype=torch.bool)
    mask[..., 10:30] = True
    want, _ = dense_masked(q, k, v, mask)
    k[:, :, :10], v[:, :, 30:] = float("nan"), float("nan")
    o, logits, reads = masked_decode_attention(q, k, v, mask, want_logits=False, splits=2)
    assert logits is None and (o - want).abs().max() <= TOL and reads.tolist() == [[[20, 20]]]


def test_kernels_reject_bad_inputs():
    q, k = torch.zeros(1, 1, 4, 8), torch.zeros(1, 2, 10, 8)
    with pytest.raises(ValueError, match="mask must be bool"):
        masked_decode_attention(q, k, k, torch.ones(1, 1, 10))
    with pytest.raises(ValueError, match="positions must be int64"):
        selected_decode_attention(q, k, k, torch.zeros(1, 1, 2, 2, dtype=torch.int64), torch.zeros(1, 1), 4)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        selected_decode_attention(torch.zeros(1, 1, 3, 8), k, k, torch.zeros(1, 1, 2, 2, dtype=torch.int64),
                                  torch.zeros(1, 1, dtype=torch.int64), 4)


def crafted_scores(g: torch.Generator, R: int, NB: int) -> torch.Tensor:
    """Scores with many exact ties: small integers, +0.0 and -0.0 side by side, -inf, and rows of one value."""
    scores = torch.randint(-2, 3, (R, NB), generator=g).float()
    scores[0] = 1.0  # all equal: the lowest indices win
    scores[1, ::2] = -0.0  # -0.0 ties +0.0
    scores[1, 1::2] = 0.0
    scores[2, 5:9] = float("-inf")  # existing blocks with -inf still rank among themselves by index
    scores[3] = torch.arange(NB, 0, -1).float()  # descending, with ties below
    scores[3, 10:] = 3.0
    return scores


@pytest.mark.parametrize("n_sel, n_init, n_local", [(5, 1, 2), (4, 0, 0), (3, 2, 1), (16, 1, 2)])
@pytest.mark.parametrize("lists", [1, 3])
def test_top_n_kernel_ties_like_top_n_blocks(n_sel, n_init, n_local, lists):
    """The lean step's top-n helpers (ranked in chunks of 16 blocks, `lists` lists per row, merged) against
    masks.top_n_blocks: equal scores -> lower index, -0.0 ties +0.0, blocks after J never chosen (even with the
    highest scores), fewer existing blocks than n -> -1 padding, forced blocks whatever their scores."""
    from optimized import masks
    from optimized.kernels.top_n import top_n_blocks_triton
    from reference.config import NSAConfig

    cfg = NSAConfig(n_sel=n_sel, n_init=n_init, n_local=n_local)
    g = torch.Generator().manual_seed(n_sel + lists)
    R, NB = 10, 37
    scores = crafted_scores(g, R, NB)
    J = torch.tensor([36, 30, 12, 36, 0, 1, 2, n_sel - 2, 20, 36])
    scores[8, 21:] = 100.0  # after J: never chosen
    scores[9, :n_init] = -5.0  # forced initial blocks with the lowest scores
    scores[9, 36 - n_local + 1:] = -5.0  # forced local blocks
    want = masks.top_n_blocks(scores, J, cfg)
    got = top_n_blocks_triton(scores, J, n_sel, n_init, n_local, lists=lists, block=16)
    assert torch.equal(got, want), f"rows differ: {(got != want).any(-1).nonzero().flatten().tolist()}"
