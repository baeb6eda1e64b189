"""Triton range-attention and group-scores kernels (optimized/kernels) vs their dense oracle, the float64
loop reference, and the torch path of the optimized implementation.

On a machine without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, root conftest), on tiny
fp32 shapes; with CUDA the same tests run compiled (test_kernel_range_attention_gpu.py adds half precision and
large shapes). Tolerance: FlashAttention's rule via helpers.error_ratio. Outputs are poisoned with NaN before
each run, so a missed write shows up.
"""

from __future__ import annotations

import math

import pytest
import torch

import optimized as O
from conformance.helpers import error_ratio, make_inputs, rel_error
from tests.kernels.parity import low_precision_example
from optimized import masks
from optimized.documents import documents, visible_compressed
from optimized.kernels import range_attention_lse2, range_attention_naive, range_logsumexp2, triton_range_attention
from optimized.kernels.range_attention_bwd import (MIN_CHUNK_ROWS, SHORT_RUN_DKDV_PROGRAMS, dkdv_chunks, dkdv_parts,
                                                   dkdv_split, range_attention_backward, range_attention_delta,
                                                   reading_rows, rows_shared_in_l2, sum_parts)
from optimized.kernels.common import RangeTiling
from optimized.kernels.range_attention import compressed_ranges, range_attention_forward, range_reads, window_ranges
from reference.config import NSAConfig
from reference.packing import cu_seqlens_of

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

CFG = NSAConfig(cmp_block=8, cmp_stride=4, sel_block=16, n_sel=3, n_init=1, n_local=1, window=10, n_heads=6,
                n_kv_heads=2, head_dim_qk=12, head_dim_v=8, phi="avg")



def ranges_of(kind: str, T: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(lo, hi, n_keys) of one test layout: the window, the compressed branch, or both over packed documents; or
    ranges wide enough that whole key tiles lie inside every row of a tile (the tiles the kernels read unmasked):
    a window of 40 keys, and prefixes [0, p - 8] (empty for the first 8 rows)."""
    positions = torch.arange(T)
    if kind == "wide-window":
        return (positions - 39).clamp(min=0), positions, T
    if kind == "wide-prefix":
        return torch.zeros_like(positions), (positions - 8).clamp(min=-1), T
    if kind == "window":
        lo, hi = window_ranges(positions, CFG)
        return lo, hi, T
    if kind == "window-packed":
        docs = documents(torch.tensor([0, 3, 3, 21, T]), T, 1, CFG, "cpu")
        lo, hi = window_ranges(positions, CFG, docs)
        return lo, hi, T
    n_cmp = masks.compressed_block_count(T, CFG)
    if kind == "compressed":
        lo, hi = compressed_ranges(positions, n_cmp, CFG)
        return lo, hi, n_cmp
    docs = documents(torch.tensor([0, 7, 7, 30, T]), T, 1, CFG, "cpu")
    lo, hi = compressed_ranges(positions, docs.n_compressed, CFG, docs)
    return lo, hi, docs.n_compressed


def random_inputs(B: int, TQ: int, TK: int, Hq: int, Hkv: int, dk: int, dv: int, seed: int,
                  dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(shape, generator=g).to(device=DEVICE, dtype=dtype)

    return rnd(B, TQ, Hq, dk), rnd(B, TK, Hkv, dk), rnd(B, TK, Hkv, dv)


LAYOUTS = ["window", "window-packed", "compressed", "compressed-packed", "wide-window", "wide-prefix"]


# Ranges from the convention seams ------------------------------------------------------------------------------
@pytest.mark.parametrize("switch", [{}, {"window_keys": "w+1"}, {"cmp_visibility": "strict"},
                                    {"cmp_block": 6, "cmp_stride": 3, "sel_block": 6}])
def test_ranges_are_exactly_the_torch_path_masks(switch) -> None:
    """window_ranges / compressed_ranges cover exactly the keys masks.window_key_visible and
    documents.visible_compressed allow (the masks of the torch path), single sequence and packed."""
    cfg = CFG.replace(**switch)
    T = 61
    positions = torch.arange(T)
    keys = torch.arange(T)
    lo, hi = window_ranges(positions, cfg)
    dense = masks.window_key_visible(keys[None, :], positions[:, None], cfg) & (keys[None, :] >= 0)
    assert torch.equal((keys[None, :] >= lo[:, None]) & (keys[None, :] <= hi[:, None]), dense)
    n_cmp = masks.compressed_block_count(T, cfg)
    lo, hi = compressed_ranges(positions, n_cmp, cfg)
    blocks = torch.arange(n_cmp)
    dense = masks.compressed_block_visible(blocks[None, :], positions[:, None], cfg)
    assert torch.equal((blocks[None, :] >= lo[:, None]) & (blocks[None, :] <= hi[:, None]), dense)

    docs = documents(torch.tensor([0, 5, 5, 33, 34, T]), T, 1, cfg, "cpu")
    lo, hi = compressed_ranges(positions, docs.n_compressed, cfg, docs)
    tokens = torch.arange(docs.n_compressed)
    dense = visible_compressed(docs, tokens, positions, cfg)
    assert torch.equal((tokens[None, :] >= lo[:, None]) & (tokens[None, :] <= hi[:, None]), dense)
    lo, hi = window_ranges(positions, cfg, docs)
    rel = docs.relative(positions)
    key_rel = keys[None, :] - docs.token_start[positions][:, None]
    dense = (key_rel >= 0) & masks.window_key_visible(key_rel, rel[:, None], cfg)
    assert torch.equal((keys[None, :] >= lo[:, None]) & (keys[None, :] <= hi[:, None]), dense)
    for a in (lo, hi):
        assert bool((a[1:] >= a[:-1]).all()), "ranges must be non-decreasing (the dk/dv kernel relies on it)"


def test_reads_count_the_range() -> None:
    lo, hi = torch.tensor([0, 0, 2, 5]), torch.tensor([-1, 3, 2, 4])
    assert range_reads(lo, hi, 2, 3).tolist() == [[[0] * 3, [4] * 3, [1] * 3, [0] * 3]] * 2


def test_reading_rows_are_the_rows_that_can_read_each_key_tile() -> None:
    lo, hi, n_keys = ranges_of("compressed-packed", 50)
    first, last = reading_rows(lo, hi, n_keys, 4)
    for tile in range(first.shape[0]):
        k0, k1 = 4 * tile, min(4 * tile + 4, n_keys) - 1
        readers = [t for t in range(50) if lo[t] <= k1 and hi[t] >= k0 and hi[t] >= lo[t]]
        if readers:
            assert int(first[tile]) <= readers[0] and int(last[tile]) >= readers[-1]
        rows = range(int(first[tile]), int(last[tile]) + 1)
        assert all(hi[t] >= k0 and lo[t] <= k1 for t in rows)


def test_cached_reading_rows_are_reused_only_for_the_same_unchanged_ranges(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dk/dv launch's reading rows are searched once per (lo, hi) pair of tensors: a second backward over the
    same ranges reuses them; another hi, another tile size, or an in-place change of lo or hi searches again, and
    each answer is reading_rows' own."""
    import optimized.kernels.range_attention_bwd as bwd

    searches = []
    monkeypatch.setattr(bwd, "reading_rows", lambda *a: searches.append(a[2:]) or reading_rows(*a))
    lo, hi, n_keys = ranges_of("compressed", 50)
    lo, hi = lo.to(torch.int32), hi.to(torch.int32)

    def check(lo, hi, block_n, searched):
        before = len(searches)
        first, last = bwd.cached_reading_rows(lo, hi, n_keys, block_n)
        expected = reading_rows(lo, hi, n_keys, block_n)
        assert torch.equal(first, expected[0]) and torch.equal(last, expected[1])
        assert len(searches) - before == searched

    check(lo, hi, 4, 1)
    check(lo, hi, 4, 0)  # the same tensors, unchanged
    check(lo, hi, 8, 1)  # another tile size
    other_hi = hi.clone()
    check(lo, other_hi, 4, 1)  # equal values, another tensor
    hi[:10] = -1  # the first rows read nothing now (hi stays non-decreasing)
    check(lo, hi, 4, 1)  # hi changed in place
    lo.add_(0)
    check(lo, hi, 4, 1)  # lo's version moved
    check(lo, hi, 4, 0)


# The kernels against the dense oracle ------------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("heads", [(6, 2), (4, 4), (3, 1)], ids=["group3", "group1", "group3-one-kv-head"])
# padded head dims, whole ones, and a d_k read in two tiles (32 + 16, the second padded: common.head_dim_tiles)
@pytest.mark.parametrize("dims", [(12, 8), (16, 16), (40, 8)], ids=["d12-8", "d16", "d40-8-two-tiles"])
def test_forward_matches_the_dense_oracle(layout: str, heads, dims, poisoned_empty: None) -> None:
    T = 45
    lo, hi, n_keys = ranges_of(layout, T)
    B = 1 if layout.endswith("packed") else 2
    q, k, v = random_inputs(B, T, n_keys, heads[0], heads[1], *dims, seed=len(layout) + heads[0])
    o, lse = triton_range_attention(q, k, v, lo.to(DEVICE), hi.to(DEVICE))
    empty = (hi < lo).to(DEVICE)
    assert torch.isfinite(o).all(), "o has unwritten (NaN) elements"
    assert torch.equal(torch.isneginf(lse), empty[None, :, None].expand_as(lse)), "lse is -inf exactly when empty"
    assert (o[:, empty] == 0).all(), "a row with an empty range outputs 0"
    o64, lse64 = range_attention_naive(q.double(), k.double(), v.double(), lo, hi)
    o32, _ = range_attention_naive(q, k, v, lo, hi)
    assert error_ratio(o, o32, o64) <= 1.0
    reading = ~empty
    assert rel_error(lse[:, reading], lse64[:, reading]) < 1e-6
    _, lse2 = range_attention_lse2(q, k, v, lo.to(DEVICE), hi.to(DEVICE))
    assert torch.equal(range_logsumexp2(q, k, lo.to(DEVICE), hi.to(DEVICE)), lse2), "lse-only pass differs"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dims", [(12, 8), (16, 16), (40, 8)], ids=["d12-8", "d16", "d40-8-two-tiles"])
def test_backward_matches_the_dense_oracle(layout: str, dims, poisoned_empty: None) -> None:
    T = 45
    lo, hi, n_keys = ranges_of(layout, T)
    q, k, v = random_inputs(1, T, n_keys, 6, 2, *dims, seed=3)
    do = torch.randn((1, T, 6, dims[1]), generator=torch.Generator().manual_seed(4)).to(DEVICE)

    def grads(fn, dtype):
        leaves = [x.detach().to(dtype).requires_grad_(True) for x in (q, k, v)]
        out = fn(*leaves, lo.to(DEVICE), hi.to(DEVICE))[0]
        return [out] + list(torch.autograd.grad(out, leaves, do.to(dtype)))

    kernel = grads(triton_range_attention, torch.float32)
    low = grads(range_attention_naive, torch.float32)
    exact = grads(range_attention_naive, torch.float64)
    for label, got, lo_ref, ref in zip(("o", "dq", "dk", "dv"), kernel, low, exact):
        assert torch.isfinite(got).all(), f"{label} has NaN/inf (unwritten element?)"
        assert error_ratio(got, lo_ref, ref) <= 1.0, label
        if label in ("dk", "dv"):
            unread = ref.abs().amax(dim=(0, 2, 3)) == 0
            assert (got[:, unread] == 0).all(), f"{label}: nonzero where no row reads the key"


def test_backward_is_bitwise_deterministic() -> None:
    lo, hi, n_keys = ranges_of("window", 40)
    q, k, v = random_inputs(1, 40, n_keys, 4, 2, 8, 8, seed=6)
    o, lse2 = range_attention_forward(q, k, v, lo.to(torch.int32).to(DEVICE), hi.to(torch.int32).to(DEVICE), 0.3)
    do = torch.randn_like(o)
    runs = [range_attention_backward(q, k, v, lo.to(torch.int32).to(DEVICE), hi.to(torch.int32).to(DEVICE), o, lse2,
                                     do, 0.3) for _ in range(2)]
    for label, a, b in zip(("dq", "dk", "dv"), *runs):
        assert torch.equal(a, b), f"{label} differs between two identical runs"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_delta_is_the_row_sum_of_do_times_o(dtype) -> None:
    """D0 = rowsum(dO * O) in fp32 (the backward's D in FlashAttention-2 form, kept for consistent_d=False and the
    consistent D's start) against an fp64 sum of the same values: [B, TQ, Hq, dv] with dv = 40 (padded lanes), rows
    not a multiple of a program's, and o a strided view."""
    g = torch.Generator().manual_seed(11)
    do = (torch.randn((2, 37, 3, 40), generator=g) * 3).to(DEVICE, dtype)
    o = (torch.randn((2, 3, 37, 40), generator=g) * 3).to(DEVICE, dtype).transpose(1, 2)
    got = range_attention_delta(do, o)
    want = (do.double() * o.double()).sum(-1)
    assert got.dtype == torch.float32 and got.shape == (2, 37, 3) and got.is_contiguous()
    assert (got.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_decode_rows_and_strided_inputs() -> None:
    """A few query rows at the end of a longer key axis (decode-like), from non-contiguous views."""
    T, TQ = 40, 3
    positions = torch.arange(T - TQ, T)
    lo, hi = window_ranges(positions, CFG)
    g = torch.Generator().manual_seed(8)
    q = torch.randn(1, TQ, 4, 16, generator=g).to(DEVICE)[..., ::2]
    k = torch.randn(1, 2, T, 8, generator=g).to(DEVICE).transpose(1, 2)
    v = torch.randn(1, T, 8, 2, generator=g).to(DEVICE).transpose(2, 3)
    o, _ = triton_range_attention(q, k, v, lo.to(DEVICE), hi.to(DEVICE))
    o64, _ = range_attention_naive(q.double(), k.double(), v.double(), lo, hi)
    assert rel_error(o, o64) < 1e-5


@pytest.mark.parametrize("lo, hi, match", [
    ([0, 2, 1], [0, 2, 2], "non-decreasing"),
    ([0, 0, 0], [0, 2, 1], "non-decreasing"),
    ([-1, 0, 0], [0, 0, 0], "0 <= lo"),
    ([0, 0, 0], [0, 0, 5], "hi < TK"),
])
def test_bad_ranges_raise_value_error(lo, hi, match) -> None:
    q, k, v = random_inputs(1, 3, 4, 2, 1, 4, 4, seed=0)
    with pytest.raises(ValueError, match=match):
        triton_range_attention(q, k, v, torch.tensor(lo).to(DEVICE), torch.tensor(hi).to(DEVICE))
    with pytest.raises(ValueError, match=r"lo must be an int32/int64 tensor \[TQ\]"):
        triton_range_attention(q, k, v, torch.zeros(2, dtype=torch.int64).to(DEVICE), torch.zeros(3).to(DEVICE))
    with pytest.raises(ValueError, match="multiple of Hkv"):
        triton_range_attention(q[:, :, :1].expand(1, 3, 3, 4), torch.randn(1, 4, 2, 4).to(DEVICE),
                               torch.randn(1, 4, 2, 4).to(DEVICE), torch.tensor(lo).to(DEVICE),
                               torch.tensor(hi).to(DEVICE))


# Scoring (Eq. 8 + 10 fused) and the whole layer against the torch path and the loop reference ---------------------
@pytest.mark.parametrize("switch", [{}, {"selection_score": "logits"}, {"group_reduce": "mean"},
                                    {"cmp_visibility": "strict"}, {"head_dim_qk": 48}])
@pytest.mark.parametrize("packed", [False, True], ids=["single", "packed"])
def test_group_scores_equal_the_torch_scores(switch, packed: bool) -> None:
    cfg = CFG.replace(**switch)
    T = 70
    x = make_inputs(cfg, T, B=1 if packed else 2, seed=4, dtype=torch.float32, device=DEVICE)
    cu = torch.tensor([0, 5, 30, 30, T], dtype=torch.int32, device=DEVICE) if packed else None
    k_cmp, _ = O.compress(x.kv.cmp.k, x.kv.cmp.v, cfg, x.phi, cu_seqlens=cu)
    torch_scores = O.selection_scores(x.q, k_cmp, cfg, cu_seqlens=cu, range_backend="torch")
    kernel_scores = O.selection_scores(x.q, k_cmp, cfg, cu_seqlens=cu, range_backend="triton")
    exact = O.selection_scores(x.q.double(), k_cmp.double(), cfg, cu_seqlens=cu)
    finite = torch.isfinite(exact)
    assert torch.equal(torch.isfinite(kernel_scores), finite) and torch.equal(torch.isneginf(kernel_scores), ~finite)
    low = O.selection_scores(x.q, k_cmp, cfg, cu_seqlens=cu, range_backend="triton", chunk_size=9)
    assert torch.equal(low, kernel_scores), "the kernel scores depend on the chunking"
    assert rel_error(kernel_scores[finite], exact[finite]) < 1e-5
    assert rel_error(torch_scores[finite], exact[finite]) < 1e-12  # the torch path scores fp32 inputs in fp64
    indices = O.selection_indices(x.q, k_cmp, cfg, cu_seqlens=cu, range_backend="triton", chunk_size=11)
    assert torch.equal(indices, O.select_blocks(kernel_scores, cfg, cu_seqlens=cu))


@pytest.mark.parametrize("preset", ["paper", "window_w_plus_1", "strict_cmp_visibility", "logit_scores",
                                    "mean_group_reduce", "equal_blocks"])
def test_layer_on_the_range_kernels_vs_loop_reference(preset: str) -> None:
    """nsa_forward(range_backend="triton") in fp32 meets the error-ratio rule against the float64 loop reference
    (outputs and every gradient, teacher-forced selection), and its free selection agrees tie-aware."""
    cfg = NSAConfig.preset(preset, n_heads=4, n_kv_heads=2, head_dim_qk=8, head_dim_v=6, window=12, n_sel=3)
    cfg = cfg.replace(cmp_block=4, cmp_stride=4, sel_block=4) if preset == "equal_blocks" else \
        cfg.replace(cmp_block=4, cmp_stride=2, sel_block=8)
    result = low_precision_example(cfg, 37, torch.float32, seed=5, device=DEVICE, range_backend="triton")
    name = max(result.ratios, key=result.ratios.get)
    assert result.ratios[name] <= 1.0, f"{name}: error ratio {result.ratios[name]:.3f} ({result.ratios})"
    assert result.neg_inf_pattern_equal
    assert result.score_ratio <= 1.0
    assert not result.selection, result.selection[:3]


def test_layer_on_the_range_kernels_packed_equals_documents_alone() -> None:
    cfg = CFG.replace(phi="mlp")
    lengths = [9, 0, 30, 1, 21]
    T = sum(lengths)
    x = make_inputs(cfg, T, seed=2, dtype=torch.float32, device=DEVICE, phi_hidden=5)
    bounds = cu_seqlens_of(lengths, DEVICE)
    packed = O.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi, cu_seqlens=bounds, range_backend="triton")
    start = 0
    for n in lengths:
        if n:
            part = [t[:, start:start + n] for t in (x.q, x.gates)]
            kv = type(x.kv)(*(type(b)(b.k[:, start:start + n], b.v[:, start:start + n])
                              for b in (x.kv.cmp, x.kv.slc, x.kv.win)))
            alone = O.nsa_forward(part[0], kv, part[1], cfg, x.phi, range_backend="triton")
            assert torch.equal(alone.indices, packed.indices[:, start:start + n])
            assert rel_error(packed.o[:, start:start + n], alone.o) < 1e-6
            for name in ("cmp", "slc", "win"):
                assert torch.equal(getattr(packed.reads, name)[:, start:start + n], getattr(alone.reads, name))
        start += n


def test_range_backend_argument_is_validated() -> None:
    x = make_inputs(CFG, 8, dtype=torch.float64, device=DEVICE)
    with pytest.raises(ValueError, match="range_backend must be one of"):
        O.nsa_forward(x.q, x.kv, x.gates, CFG, range_backend="cuda")
    with pytest.raises(ValueError, match="fp32/bf16/fp16"):
        O.window_attention(x.q, x.kv.win.k, x.kv.win.v, CFG, range_backend="triton")


def test_head_dims_are_read_in_one_padded_tile_or_two_exact_ones() -> None:
    from optimized.kernels.common import head_dim_tiles

    # (first tile, second tile or 0): two where they are narrower than the one padded tile, each >= 16
    expected = {192: (128, 64), 96: (64, 32), 48: (32, 16), 40: (32, 16), 80: (64, 16), 160: (128, 32),
                128: (128, 0), 64: (64, 0), 200: (256, 0), 100: (128, 0), 24: (32, 0), 9: (16, 0), 16: (16, 0)}
    assert {d: head_dim_tiles(d) for d in expected} == expected


def test_scale_default_is_one_over_sqrt_dk() -> None:
    lo, hi, n_keys = ranges_of("window", 20)
    q, k, v = random_inputs(1, 20, n_keys, 2, 1, 9, 4, seed=1)
    a, _ = triton_range_attention(q, k, v, lo.to(DEVICE), hi.to(DEVICE))
    b, _ = triton_range_attention(q, k, v, lo.to(DEVICE), hi.to(DEVICE), scale=1.0 / math.sqrt(9))
    assert torch.equal(a, b)


def test_gpu_launch_table_covers_every_kernel_and_width(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled-GPU launch heuristic (not the interpreter's 16 x 16) gives a valid tiling for every kernel,
    dtype and padded head width the kernels accept."""
    from optimized.kernels.common import RANGE_KINDS, range_tiling

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for kind in RANGE_KINDS:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for block_dk in (16, 32, 64, 128, 256):
                for block_dv in (16, 64, 128, 256):
                    t = range_tiling(block_dk, block_dv, dtype, kind)
                    assert t.block_m >= 16 and t.block_n >= 16 and t.num_stages >= 1
    with pytest.raises(ValueError, match="kind"):
        range_tiling(64, 64, torch.bfloat16, "backward")


@pytest.mark.parametrize("layout", ["compressed-packed", "wide-prefix", "window"])
@pytest.mark.parametrize("split, consistent_d", [(1, False), (2, True), (5, True), (5, False)])
@pytest.mark.parametrize("row_chunks", [False, True], ids=["own-parts", "shared-chunks"])
def test_dkdv_split_over_rows_matches_the_oracle(layout: str, split: int, consistent_d: bool, row_chunks: bool,
                                                 poisoned_empty: None) -> None:
    """Key tiles split their reading rows over several programs (fp32 workspace, summed in a fixed order), either
    each tile's own run into equal parts or the query rows into chunks every tile shares (split 5 leaves chunks
    that some tiles, or all, do not read: those programs write zeros): the same gradients as the dense oracle,
    every key written, deterministic; with D from rowsum(dO * O) (half precision's) or made consistent in the dq
    pass (fp32's)."""
    lo, hi, n_keys = ranges_of(layout, 45)
    lo32, hi32 = lo.to(torch.int32).to(DEVICE), hi.to(torch.int32).to(DEVICE)
    q, k, v = random_inputs(1, 45, n_keys, 6, 2, 12, 8, seed=9)
    o, lse2 = range_attention_forward(q, k, v, lo32, hi32, 0.25)
    do = torch.randn_like(o)
    runs = [range_attention_backward(q, k, v, lo32, hi32, o, lse2, do, 0.25, split=split, row_chunks=row_chunks,
                                     consistent_d=consistent_d) for _ in range(2)]
    check_backward_runs(runs, q, k, v, lo, hi, do, scale=0.25)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else []))
def test_split_parts_are_summed_in_order_into_a_strided_gradient(dtype: torch.dtype) -> None:
    """The split dk/dv's partial sums: fp32 parts added in part order and rounded once, bitwise the sequential torch
    sum, written into a gradient whose rows are not contiguous (a slice of a wider tensor); the columns beside the
    slice are left alone. (bf16 on CUDA only: Triton's interpreter truncates fp32 -> bf16 casts.)"""
    g = torch.Generator().manual_seed(3)
    parts = torch.randn(3, 2, 5, 3, 12, generator=g).to(DEVICE)
    wide = torch.full((2, 5, 3, 20), 7.0, dtype=dtype, device=DEVICE)
    out = wide[..., 4:16]
    sum_parts(parts, out)
    expected = parts[0].clone()
    for part in parts[1:]:
        expected = expected + part
    assert torch.equal(out, expected.to(dtype))
    assert (wide[..., :4] == 7).all() and (wide[..., 16:] == 7).all()


def test_shared_row_chunks_are_taken_for_long_runs_of_rows_past_the_l2_cache() -> None:
    """The default dk/dv split: shared row chunks only when there are fewer keys than query rows and one sequence's
    q and dO exceed twice the L2 cache (50 MiB off CUDA); their count gives ~4x the programs of the equal parts, or
    chunks of ~4096 rows where that is more, at least MIN_CHUNK_ROWS rows each, within the workspace budget."""
    def q_of(T, Hq=64, d=128, dtype=torch.bfloat16):
        return torch.empty((1, T, Hq, d), device="meta", dtype=dtype)

    assert rows_shared_in_l2(q_of(65536), 128, n_keys=4095)  # paper layout, compressed keys: 2 GiB of q and dO
    assert not rows_shared_in_l2(q_of(65536), 128, n_keys=65536)  # the window: as many keys as rows
    assert not rows_shared_in_l2(q_of(16384, Hq=12, d=64), 64, n_keys=1023)  # 48 MiB: stays in L2
    assert not rows_shared_in_l2(q_of(32768, Hq=12, d=64), 64, n_keys=2047)  # 96 MiB
    assert rows_shared_in_l2(q_of(32768, Hq=12, d=64, dtype=torch.float32), 64, n_keys=2047)  # 192 MiB
    paper = 4 * 256 * 4  # workspace bytes per key and chunk: 4 KV heads, d_k + d_v = 256, fp32
    assert dkdv_chunks(64, 4, 1, 65536, 4096 * paper) == 4 * dkdv_split(64, 4, 1, 65536, 2) == 16
    assert dkdv_chunks(8, 4, 1, 8192, 512 * paper) == 8192 // MIN_CHUNK_ROWS  # 64 rows would be too few
    assert dkdv_chunks(16, 4, 1, 16384, 1024 * paper) == 64  # the program count
    assert dkdv_chunks(128, 4, 1, 131072, 8192 * paper) == 16  # 32 chunks of 4096 rows: 1 GiB of workspace
    assert dkdv_chunks(1, 1, 1, 100, 1) == 1
    # equal parts: the window (short runs) fills the GPU at 512 programs, the compressed branch at 1024
    assert dkdv_split(256, 2, 1, 16384, 32, SHORT_RUN_DKDV_PROGRAMS) == 1 and dkdv_split(256, 2, 1, 16384, 32) == 2
    assert dkdv_split(16, 2, 1, 1024, 32, SHORT_RUN_DKDV_PROGRAMS) == 16
    # the launch's default count picks among them by layout: window-like, compressed-like, shared chunks
    assert dkdv_parts(False, 256, 2, 1, 16384, 16384, 32, 128) == 1
    assert dkdv_parts(False, 16, 2, 1, 16384, 1023, 32, 128) == 32
    assert dkdv_parts(True, 64, 4, 1, 65536, 4096, 2, 256) == 16


def check_backward_runs(runs, q, k, v, lo, hi, do, scale: float) -> None:
    """Two identical backward runs (dq, dk, dv): finite, bitwise equal, and the float64 oracle's gradients."""
    leaves = [x.detach().double().requires_grad_(True) for x in (q, k, v)]
    exact = torch.autograd.grad(range_attention_naive(*leaves, lo, hi, scale=scale)[0], leaves, do.double())
    for label, got, again, ref in zip(("dq", "dk", "dv"), *runs, exact):
        assert torch.isfinite(got).all(), label
        assert torch.equal(got, again), f"{label} differs between two identical runs"
        assert rel_error(got, ref) < 1e-5, label


@pytest.mark.parametrize("layout, heads, split", [("compressed-packed", 2, 1), ("compressed-packed", 4, 3),
                                                  ("window", 4, 1), ("window-packed", 16, 2), ("wide-window", 4, 1),
                                                  ("wide-prefix", 2, 3)])
def test_heads_packed_in_a_step_match_the_oracle(layout: str, heads: int, split: int,
                                                 poisoned_empty: None) -> None:
    """dk/dv steps over (query row, head) columns of several heads of the group at once (RangeTiling.heads: 2
    takes a group of 3 heads in two passes, the second with one padded head; 4 takes it in one, with the padded
    head masked; 16, more than the group pads to, falls back to one head per step): the gradients of the dense
    oracle, deterministic, every key written. The forward and dq kernels with (query row, head) tiles of the same
    heads compute what their one-head tiles do (up to fp32 summation order)."""
    lo, hi, n_keys = ranges_of(layout, 45)
    lo32, hi32 = lo.to(torch.int32).to(DEVICE), hi.to(torch.int32).to(DEVICE)
    q, k, v = random_inputs(1, 45, n_keys, 6, 2, 12, 8, seed=11)
    o, lse2 = range_attention_forward(q, k, v, lo32, hi32, 0.25)
    do = torch.randn_like(o)
    tiling = RangeTiling(block_m=16, block_n=16, num_warps=4, num_stages=1, heads=heads)
    packed_o, packed_lse2 = range_attention_forward(q, k, v, lo32, hi32, 0.25, tiling=tiling)
    assert torch.allclose(packed_o, o, rtol=1e-5, atol=1e-6) and torch.equal(packed_lse2.isneginf(), lse2.isneginf())
    assert torch.allclose(packed_lse2, lse2, rtol=1e-6, atol=1e-6)
    runs = [range_attention_backward(q, k, v, lo32, hi32, o, lse2, do, 0.25, dq_tiling=tiling, dkdv_tiling=tiling,
                                     split=split) for _ in range(2)]
    check_backward_runs(runs, q, k, v, lo, hi, do, scale=0.25)


def test_range_forward_tile_follows_the_longest_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled-GPU forward at d = 128 in half precision: ranges of at most 512 keys on 64 x 32 tiles, of at
    least 2048 on 128 x 64 tiles on 8 warps, anything between or unknown on the table's 64 x 64 entry; other head
    dims, fp32 and the other kernels do not look at the width."""
    from optimized.kernels.common import LONG_RANGE, SHORT_RANGE, range_tiling

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    entry = RangeTiling(64, 64, 4, 3, 16)
    for dtype in (torch.bfloat16, torch.float16):
        assert range_tiling(128, 128, dtype, "forward") == entry
        assert range_tiling(128, 128, dtype, "forward", SHORT_RANGE) == RangeTiling(64, 32, 4, 3, 16)
        assert range_tiling(128, 128, dtype, "forward", 1) == RangeTiling(64, 32, 4, 3, 16)
        assert range_tiling(128, 128, dtype, "forward", SHORT_RANGE + 1) == entry
        assert range_tiling(128, 128, dtype, "forward", LONG_RANGE - 1) == entry
        assert range_tiling(128, 128, dtype, "forward", LONG_RANGE) == RangeTiling(128, 64, 8, 3, 16)
        for width in (1, LONG_RANGE):
            assert range_tiling(64, 64, dtype, "forward", width) == range_tiling(64, 64, dtype, "forward")
            assert range_tiling(256, 128, dtype, "forward", width) == range_tiling(256, 128, dtype, "forward")
            assert range_tiling(128, 128, dtype, "lse", width) == range_tiling(128, 128, dtype, "lse")
    assert range_tiling(128, 128, torch.float32, "forward", 1) == range_tiling(128, 128, torch.float32, "forward")


def test_branches_hand_the_forward_their_longest_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """nsa_forward on the kernels tells each branch's forward launch the most keys a row reads: for one sequence
    the compressed branch's visible tokens at the last row (Eq. 7: floor((T - l) / d) + 1) and the window's
    min(T, w); a packed batch's compressed ranges stay on the device (no width: the table's entry) and its window
    holds at most w keys."""
    from optimized.kernels import range_attention

    seen = []
    forward = range_attention.range_attention_forward

    def recording(*args, max_width=None, **kwargs):
        seen.append(max_width)
        return forward(*args, max_width=max_width, **kwargs)

    monkeypatch.setattr(range_attention, "range_attention_forward", recording)
    cfg = CFG.replace(phi="avg")
    T = 40
    x = make_inputs(cfg, T, seed=3, dtype=torch.float32, device=DEVICE)
    O.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi, range_backend="triton")
    assert seen == [(T - cfg.cmp_block) // cfg.cmp_stride + 1, min(T, cfg.window)]
    seen.clear()
    O.nsa_forward(x.q[:, :7], type(x.kv)(*(type(b)(b.k[:, :7], b.v[:, :7]) for b in (x.kv.cmp, x.kv.slc, x.kv.win))),
                  x.gates[:, :7], cfg, x.phi, range_backend="triton")
    assert seen == [0, 7]  # no complete compressed block yet: every range empty
    seen.clear()
    O.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi, cu_seqlens=cu_seqlens_of([25, 15], DEVICE), range_backend="triton")
    assert seen == [None, cfg.window]


def test_range_tiling_heads_must_fit_the_step() -> None:
    with pytest.raises(ValueError, match="RangeTiling.heads must be a power of two"):
        RangeTiling(block_m=16, block_n=16, num_warps=4, num_stages=1, heads=3)
    with pytest.raises(ValueError, match="RangeTiling.heads must be a power of two"):
        RangeTiling(block_m=16, block_n=16, num_warps=4, num_stages=1, heads=32)
