"""The fused Eq. 9-11 top-n kernel (optimized/kernels/selection.py) against the torch code it replaces
on the same group scores P: scoring.pool_eq9, the masked_fill past J and scoring.select_blocks_rows. The indices
must be IDENTICAL (bitwise): ties, signed zeros, rows with fewer blocks than n, forced blocks overlapping,
every preset, packed documents. Then selection_indices(range_backend="triton"), which runs the kernel, against
select_blocks on the same call's materialized scores (the torch code of Eq. 9-11).

On a machine without CUDA the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, root conftest) on tiny
shapes; test_kernel_select_top_n_gpu.py runs it compiled at the paper's sizes. P entries past each row's range
are NaN here: the kernel must never read them (group_scores leaves them unwritten on this path).
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

import optimized as O
from conformance.helpers import make_inputs
from optimized import masks
from optimized.documents import documents
from optimized.kernels import selection as top_n_module
from optimized.kernels.range_attention import compressed_ranges
from optimized.kernels.selection import select_top_n
from optimized.masks import sel_block_count
from optimized.scoring import pool_eq9, select_blocks_rows
from reference.config import NSAConfig
from reference.packing import cu_seqlens_of

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

SMALL = NSAConfig(cmp_block=8, cmp_stride=4, sel_block=16, n_sel=3, n_init=1, n_local=1, window=10, n_heads=6,
                  n_kv_heads=2, head_dim_qk=12, head_dim_v=8, phi="avg")
PRESETS = ["paper", "equal_blocks", "window_w_plus_1", "strict_cmp_visibility", "logit_scores", "mean_group_reduce"]
# (l, d, l', n, n_init, n_local): bands of 1 to 11 terms, strides 1 to 8, no forced blocks, only initial, only local,
# n = n_init + n_local (no free pick), n larger than the blocks of every row
BLOCK_LAYOUTS = [(8, 4, 16, 3, 1, 1), (4, 2, 8, 4, 0, 0), (4, 4, 4, 2, 0, 2), (6, 3, 12, 5, 2, 0),
                 (16, 4, 32, 6, 1, 2), (12, 4, 24, 3, 1, 2), (2, 1, 2, 16, 1, 2), (8, 2, 8, 7, 3, 3)]
TIE_PALETTE = [0.0, -0.0, 0.25, 0.5, 1.0 / 3.0, 1e-30, 2.0**-24]


def eq9_zero_based_band(cfg: NSAConfig) -> masks.Eq9Band:
    """The self-test's planted Eq. 9 (conformance/selftest/variants/eq9_zero_based.py, which patches on import):
    the literal 0-based index (l'/d) j - m - n, offsets -(l'/d - 1) - (l/d - 1) .. 0."""
    per_sel, per_cmp = cfg.pieces_per_sel_block, cfg.pieces_per_cmp_block
    reach = [sum(1 for m in range(per_sel) for n in range(per_cmp) if -m - n == r)
             for r in range(-(per_sel - 1) - (per_cmp - 1), 1)]
    return masks.Eq9Band(-(per_sel - 1) - (per_cmp - 1), tuple(float(c) for c in reach))


def layout_cfg(layout, **extra) -> NSAConfig:
    l, d, lp, n, n_init, n_local = layout
    return SMALL.replace(cmp_block=l, cmp_stride=d, sel_block=lp, n_sel=n, n_init=n_init, n_local=n_local, **extra)


@contextmanager
def seam_replaced(name: str, replacement=None):
    """masks.<name> replaced (by default with a wrapper around the original that behaves the same), restored on
    exit."""
    original = getattr(masks, name)
    setattr(masks, name, replacement or (lambda *args: original(*args)))
    try:
        yield
    finally:
        setattr(masks, name, original)


def rows_of(cfg: NSAConfig, positions: torch.Tensor, n_keys: int, docs=None):
    """(lo, hi int32, J, NB) of query rows at these positions: the compressed ranges the scorer gives the
    group-scores kernel, and J of the document-relative position."""
    n_cmp = masks.compressed_block_count(n_keys, cfg) if docs is None else docs.n_compressed
    lo, hi = compressed_ranges(positions, n_cmp, cfg, docs)
    relative = positions if docs is None else docs.relative(positions)
    n_blocks = sel_block_count(n_keys, cfg) if docs is None else docs.n_sel_blocks
    return lo.to(torch.int32), hi.to(torch.int32), masks.current_sel_block(relative, cfg), n_blocks


def group_scores_like(B: int, lo, hi, cfg: NSAConfig, seed: int, palette=None, signed: bool = False):
    """P [B, TQ, Hkv, width] as group_scores leaves it on the fused path: values in each row's range (random, or
    drawn from a palette for exact ties), NaN past it."""
    widths = torch.clamp(hi.long() - lo.long() + 1, min=0)
    width = int(widths.max()) if widths.numel() else 0
    shape = (B, lo.shape[0], cfg.n_kv_heads, width)
    g = torch.Generator().manual_seed(seed)
    if palette is None:
        p = torch.randn(shape, generator=g)
        p = p if signed else p.abs()
    else:
        values = torch.tensor(palette)
        p = values[torch.randint(len(values), shape, generator=g)]
    inside = torch.arange(width)[None, :] < widths[:, None]
    return torch.where(inside[None, :, None, :], p, float("nan"))


def torch_path(p, lo, hi, positions, n_blocks, cfg, docs=None):
    """What the scorer's torch code selects on this P: zeros past each row's range (group_scores' zero fill), the
    "mean" division, Eq. 9 (pool_eq9), -inf after J, Eq. 11 (select_blocks_rows)."""
    width = p.shape[-1]
    inside = torch.arange(width)[None, :] < (hi.long() - lo.long() + 1)[:, None]
    p = torch.where(inside[None, :, None, :], p, torch.zeros(()))
    if cfg.group_reduce == "mean":
        p = p / cfg.group_size
    scores = pool_eq9(p, n_blocks, cfg)
    relative = positions if docs is None else docs.relative(positions)
    after = torch.arange(n_blocks)[None, :] > masks.current_sel_block(relative, cfg)[:, None]
    scores = scores.masked_fill(after[None, :, None, :], float("-inf"))
    return select_blocks_rows(scores, cfg, positions, docs)


def kernel(p, lo, hi, J, n_blocks, cfg):
    return select_top_n(p.to(DEVICE), lo.to(DEVICE), hi.to(DEVICE), J.to(DEVICE), n_blocks, cfg).cpu()


# The kernel on a given P --------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", BLOCK_LAYOUTS, ids=lambda t: "l{}-d{}-lp{}-n{}-init{}-local{}".format(*t))
@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_indices_equal_the_torch_path_on_random_scores(layout, reduce: str) -> None:
    cfg = layout_cfg(layout, group_reduce=reduce)
    T = 9 * cfg.sel_block + 5  # rows with J < n and rows with more blocks than n
    positions = torch.arange(T)
    lo, hi, J, n_blocks = rows_of(cfg, positions, T)
    p = group_scores_like(2, lo, hi, cfg, seed=sum(layout))
    assert torch.equal(kernel(p, lo, hi, J, n_blocks, cfg), torch_path(p, lo, hi, positions, n_blocks, cfg))


@pytest.mark.parametrize("preset", PRESETS)
def test_indices_equal_the_torch_path_for_every_preset(preset: str) -> None:
    """The presets' own l, d, l', n (paper: 32, 16, 64, 16; equal_blocks: 64, 64, 64) over 20 selection blocks."""
    cfg = NSAConfig.preset(preset, n_heads=6, n_kv_heads=2, head_dim_qk=8, head_dim_v=8)
    T = 20 * cfg.sel_block
    positions = torch.arange(0, T, 3)
    lo, hi, J, n_blocks = rows_of(cfg, positions, T)
    p = group_scores_like(1, lo, hi, cfg, seed=len(preset), signed=cfg.selection_score == "logits")
    assert torch.equal(kernel(p, lo, hi, J, n_blocks, cfg), torch_path(p, lo, hi, positions, n_blocks, cfg))


@pytest.mark.parametrize("layout", [(8, 4, 16, 3, 1, 1), (4, 2, 8, 4, 0, 0), (4, 4, 4, 2, 0, 2), (8, 2, 8, 7, 3, 3),
                                    (2, 1, 2, 16, 1, 2)],
                         ids=lambda t: "l{}-d{}-lp{}-n{}-init{}-local{}".format(*t))
@pytest.mark.parametrize("signed", [False, True], ids=["probs", "logits"])
def test_exact_ties_signed_zeros_and_empty_rows(layout, signed: bool) -> None:
    """Scores from a few values (equal pooled scores everywhere, +0.0 and -0.0, all-zero rows); signed: the
    negated values too, as the "logits" score gives."""
    cfg = layout_cfg(layout, selection_score="logits" if signed else "probs")
    T = 12 * cfg.sel_block
    positions = torch.arange(T)
    lo, hi, J, n_blocks = rows_of(cfg, positions, T)
    palette = TIE_PALETTE + [-v for v in TIE_PALETTE] if signed else TIE_PALETTE
    p = group_scores_like(2, lo, hi, cfg, seed=7, palette=palette)
    p[:, ::5] = torch.where(torch.isnan(p[:, ::5]), p[:, ::5], torch.zeros(()))  # every 5th row all zero
    p[:, 1::7] = torch.where(torch.isnan(p[:, 1::7]), p[:, 1::7], torch.full((), -0.0))  # all -0.0
    assert torch.equal(kernel(p, lo, hi, J, n_blocks, cfg), torch_path(p, lo, hi, positions, n_blocks, cfg))


@pytest.mark.parametrize("n_blocks", [1, 2, 5])
def test_fewer_blocks_than_n(n_blocks: int) -> None:
    """NB < n: only min(n, NB) blocks can be ranked; the other slots are -1."""
    cfg = layout_cfg((4, 2, 8, 6, 1, 1))
    positions = torch.arange(n_blocks * cfg.sel_block)
    lo, hi, J, _ = rows_of(cfg, positions, positions.shape[0])
    p = group_scores_like(1, lo, hi, cfg, seed=n_blocks)
    got = kernel(p, lo, hi, J, n_blocks, cfg)
    assert torch.equal(got, torch_path(p, lo, hi, positions, n_blocks, cfg))
    assert (got[..., n_blocks:] == -1).all()


def test_pooling_adds_terms_in_pool_eq9_order() -> None:
    """Eq. 9's terms are added first to last as pool_eq9 does: block 2's terms 0 + 2 * 0.5 + 2 * 2^-25 + 2 * 2^-25
    + 0 round to exactly 1.0 in that order (1 + 2^-24 ties to even), to 1 + 2^-23 added last to first; block 1 is
    2 * 0.5 = 1.0, so the order decides the tie (the lower block wins)."""
    cfg = layout_cfg((8, 4, 16, 1, 0, 0))
    assert masks.eq9_pool_weights(cfg) == masks.Eq9Band(-1, (1.0, 2.0, 2.0, 2.0, 1.0))
    positions = torch.tensor([47])  # J = 2, compressed tokens 0..10
    lo, hi, J, n_blocks = rows_of(cfg, positions, 48)
    p = torch.zeros((1, 1, cfg.n_kv_heads, 11))
    p[..., 4] = 0.5  # block 1: columns 3..7
    p[..., 8], p[..., 9], p[..., 10] = 0.5, 2.0**-25, 2.0**-25  # block 2: columns 7..11
    got = kernel(p, lo, hi, J, n_blocks, cfg)
    assert torch.equal(got, torch_path(p, lo, hi, positions, n_blocks, cfg))
    assert got.flatten().tolist() == [1, 1]


def test_mean_divides_correctly_rounded() -> None:
    """group_reduce="mean" divides P by the group size with IEEE rounding, as torch does: 1.5000001 / 3 and
    1.5000002 / 3 round to the same float32 (a tie: the lower block wins), while multiplying by a rounded 1/3
    would rank the second higher."""
    cfg = layout_cfg((4, 4, 4, 1, 0, 0), group_reduce="mean")
    assert cfg.group_size == 3
    y, x = torch.tensor([1.5000001, 1.5000002], dtype=torch.float32)
    assert y / 3 == x / 3 and y * (1 / torch.tensor(3.0)) < x * (1 / torch.tensor(3.0))
    positions = torch.tensor([15])
    lo, hi, J, n_blocks = rows_of(cfg, positions, 16)
    p = torch.zeros((1, 1, cfg.n_kv_heads, 4))
    p[..., 1], p[..., 2] = y, x
    got = kernel(p, lo, hi, J, n_blocks, cfg)
    assert torch.equal(got, torch_path(p, lo, hi, positions, n_blocks, cfg))
    assert got.flatten().tolist() == [1, 1]


def test_arbitrary_current_blocks_and_ranges() -> None:
    """J and the ranges as data (a replaced current_sel_block seam may give any J): J = -1 (no block exists),
    J past NB (every block exists), ranges wider than P's width are cut at it; against masks.top_n_blocks."""
    cfg = layout_cfg((8, 4, 16, 4, 1, 2))
    C, width, n_blocks = 40, 23, 6
    g = torch.Generator().manual_seed(3)
    J = torch.randint(-1, n_blocks + 3, (C,), generator=g)
    lo = torch.randint(0, 5, (C,), generator=g).to(torch.int32)
    hi = (lo + torch.randint(-1, width + 4, (C,), generator=g)).to(torch.int32)
    p = torch.rand((2, C, cfg.n_kv_heads, width), generator=g)
    got = kernel(p, lo, hi, J, n_blocks, cfg)
    inside = torch.arange(width)[None, :] < (hi.long() - lo.long() + 1)[:, None]
    scores = pool_eq9(torch.where(inside[None, :, None, :], p, torch.zeros(())), n_blocks, cfg)
    scores = scores.masked_fill((torch.arange(n_blocks)[None, :] > J[:, None])[None, :, None, :], float("-inf"))
    assert torch.equal(got, masks.top_n_blocks(scores, J[None, :, None].expand(scores.shape[:3]), cfg))


def test_many_blocks_several_rows_per_program() -> None:
    """NB = 300 (a 512-key tile, 4 rows a program) with rows at scattered positions, one group per KV head."""
    cfg = layout_cfg((4, 2, 4, 16, 1, 2))
    T = 1200
    positions = torch.tensor(sorted(set(torch.randint(0, T, (70,), generator=torch.Generator().manual_seed(1))
                                        .tolist())))
    lo, hi, J, n_blocks = rows_of(cfg, positions, T)
    assert n_blocks == 300
    p = group_scores_like(1, lo, hi, cfg, seed=11, palette=TIE_PALETTE + [0.75, 1.0])
    assert torch.equal(kernel(p, lo, hi, J, n_blocks, cfg), torch_path(p, lo, hi, positions, n_blocks, cfg))


@pytest.mark.parametrize("layout", [(8, 4, 16, 3, 1, 1), (4, 2, 8, 4, 2, 1)],
                         ids=lambda t: "l{}-d{}-lp{}-n{}-init{}-local{}".format(*t))
def test_packed_rows_use_document_relative_blocks(layout) -> None:
    cfg = layout_cfg(layout)
    lengths = [9, 0, 70, 1, 33, 50]
    T = sum(lengths)
    docs = documents(cu_seqlens_of(lengths, "cpu"), T, 1, cfg, "cpu")
    positions = torch.arange(T)
    lo, hi, J, n_blocks = rows_of(cfg, positions, T, docs)
    p = group_scores_like(1, lo, hi, cfg, seed=5, palette=TIE_PALETTE + [0.75])
    assert torch.equal(kernel(p, lo, hi, J, n_blocks, cfg), torch_path(p, lo, hi, positions, n_blocks, cfg, docs))


def test_bad_inputs_raise_value_errors() -> None:
    cfg = SMALL
    lo, hi = torch.zeros(4, dtype=torch.int32), torch.full((4,), 3, dtype=torch.int32)
    J = torch.zeros(4, dtype=torch.int64)
    p = torch.zeros((1, 4, 2, 4))
    with pytest.raises(ValueError, match="p must be a float32 tensor"):
        select_top_n(p.double(), lo, hi, J, 3, cfg)
    with pytest.raises(ValueError, match="p must be a float32 tensor"):
        select_top_n(p.transpose(2, 3), lo, hi, J, 3, cfg)
    with pytest.raises(ValueError, match=r"lo must be a contiguous torch.int32 tensor \[C\] = \[4\]"):
        select_top_n(p, lo.long(), hi, J, 3, cfg)
    with pytest.raises(ValueError, match=r"current must be a contiguous"):
        select_top_n(p, lo, hi, J[:3], 3, cfg)
    with pytest.raises(ValueError, match="n_blocks must be a non-negative int"):
        select_top_n(p, lo, hi, J, -1, cfg)
    with pytest.raises(ValueError, match="n_kv_heads = 2"):
        select_top_n(p[:, :, :1], lo, hi, J, 3, cfg)
    with pytest.raises(ValueError, match=r"out must be an int64 tensor \[B, C, Hkv, n\]"):
        select_top_n(p, lo, hi, J, 3, cfg, out=torch.zeros((1, 4, 2, 4), dtype=torch.int64))


# selection_indices on the kernels: the fused path vs the torch code of Eq. 9-11 on the kernel's scores -----------
def selection(x, k_cmp, cfg, cu=None, **kwargs):
    return O.selection_indices(x.q, k_cmp, cfg, cu_seqlens=cu, range_backend="triton", **kwargs)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("packed", [False, True], ids=["single", "packed"])
def test_selection_indices_fused_equal_the_torch_code(preset: str, packed: bool) -> None:
    cfg = NSAConfig.preset(preset, n_heads=6, n_kv_heads=2, head_dim_qk=8, head_dim_v=6, window=12, n_sel=3)
    cfg = cfg.replace(cmp_block=4, cmp_stride=4, sel_block=4) if preset == "equal_blocks" else \
        cfg.replace(cmp_block=4, cmp_stride=2, sel_block=8)
    T = 75
    x = make_inputs(cfg, T, B=1 if packed else 2, seed=3, dtype=torch.float32, device=DEVICE)
    cu = cu_seqlens_of([5, 0, 40, 30], DEVICE) if packed else None
    k_cmp = O.compress(x.kv.cmp.k, x.kv.cmp.v, cfg, x.phi, cu_seqlens=cu)[0]
    fused = selection(x, k_cmp, cfg, cu)
    assert torch.equal(selection(x, k_cmp, cfg, cu, chunk_size=7), fused), "depends on the chunking"
    scores = O.selection_scores(x.q, k_cmp, cfg, cu_seqlens=cu, range_backend="triton", chunk_size=11)
    assert torch.equal(O.select_blocks(scores, cfg, cu_seqlens=cu), fused)


@pytest.mark.parametrize("T", [1, 7, 9])
def test_selection_before_the_first_compressed_block(T: int) -> None:
    """T < l (no compressed token: P has no column, the kernel reads nothing) and T just past l."""
    x = make_inputs(SMALL, T, B=2, seed=T, dtype=torch.float32, device=DEVICE)
    k_cmp = O.compress(x.kv.cmp.k, x.kv.cmp.v, SMALL)[0]
    fused = selection(x, k_cmp, SMALL)
    with seam_replaced("top_n_blocks"):
        assert torch.equal(selection(x, k_cmp, SMALL), fused)
    assert (fused[..., 0] == 0).all() and (fused[..., 1:] == -1).all(), "only the forced block 0 exists"


def test_selection_with_budget_sized_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default chunks (kernel_chunks) with a tiny P budget: many chunks of different row counts, the same
    indices as one chunk."""
    x = make_inputs(SMALL, 90, B=2, seed=8, dtype=torch.float32, device=DEVICE)
    k_cmp = O.compress(x.kv.cmp.k, x.kv.cmp.v, SMALL)[0]
    whole = selection(x, k_cmp, SMALL, chunk_size=90)
    calls = []
    real = top_n_module.select_top_n
    monkeypatch.setattr(top_n_module, "select_top_n", lambda p, *a, **k: calls.append(p.shape) or real(p, *a, **k))
    monkeypatch.setattr(top_n_module, "KERNEL_CHUNK_P_BYTES", 2 * 2 * 4 * 40)  # 40 row-columns per chunk
    assert torch.equal(selection(x, k_cmp, SMALL), whole)
    assert len(calls) > 5 and len({shape[1] for shape in calls}) > 2, calls
    assert all(shape[1] * max(shape[3], 1) <= 40 or shape[1] == 1 for shape in calls), calls


def test_a_chunk_is_two_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per chunk: group_scores writing P without a zero fill, then the top-n kernel writing the chunk's rows of the
    result (no copy)."""
    group_scores_module = top_n_module

    x = make_inputs(SMALL, 60, seed=2, dtype=torch.float32, device=DEVICE)
    k_cmp = O.compress(x.kv.cmp.k, x.kv.cmp.v, SMALL)[0]
    events = []
    real_scores, real_top_n = group_scores_module.group_scores, top_n_module.select_top_n
    monkeypatch.setattr(group_scores_module, "group_scores",
                        lambda *a, **k: events.append(("scores", k["out"] is not None)) or real_scores(*a, **k))
    monkeypatch.setattr(top_n_module, "select_top_n",
                        lambda *a, **k: events.append(("top_n", k["out"].data_ptr())) or real_top_n(*a, **k))
    out = selection(x, k_cmp, SMALL, chunk_size=16)
    starts = [out[:, q0:].data_ptr() for q0 in range(0, 60, 16)]
    assert events == [e for q0 in starts for e in (("scores", True), ("top_n", q0))]


@pytest.mark.parametrize("seam", ["forced_blocks", "top_n_blocks", "ranked_blocks"])
def test_the_kernels_compute_the_top_n_rules_themselves(seam: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel path computes Eq. 11 itself (optimized/kernels/selection.py says which seams it honours): with a
    top-n seam replaced, the kernels still run and never ask it, while the torch path does."""
    x = make_inputs(SMALL, 50, seed=4, dtype=torch.float32, device=DEVICE)
    k_cmp = O.compress(x.kv.cmp.k, x.kv.cmp.v, SMALL)[0]
    fused = selection(x, k_cmp, SMALL)
    kernel_calls, seam_calls = [], []
    real = top_n_module.select_top_n
    monkeypatch.setattr(top_n_module, "select_top_n", lambda *a, **k: kernel_calls.append(1) or real(*a, **k))
    original = getattr(masks, seam)
    with seam_replaced(seam, lambda *args: seam_calls.append(1) or original(*args)):
        replaced = selection(x, k_cmp, SMALL)
        assert kernel_calls and not seam_calls, f"kernel calls {len(kernel_calls)}, {seam} calls {len(seam_calls)}"
        O.selection_indices(x.q, k_cmp, SMALL, range_backend="torch")
    assert seam_calls, f"the torch path must ask masks.{seam}"
    assert torch.equal(replaced, fused)


def test_the_kernel_takes_the_band_and_j_from_their_seams() -> None:
    """masks.eq9_pool_weights and masks.current_sel_block are read at call time, so a replaced band (the self-test's
    0-based Eq. 9) or J reaches the kernel: it selects what the torch code selects under the same replacement."""
    x = make_inputs(SMALL, 80, B=2, seed=6, dtype=torch.float32, device=DEVICE)
    k_cmp = O.compress(x.kv.cmp.k, x.kv.cmp.v, SMALL)[0]
    plain = selection(x, k_cmp, SMALL)

    def shifted_current(pos, cfg):
        return torch.div(pos + cfg.sel_block // 2, cfg.sel_block, rounding_mode="floor")

    for seam, replacement in (("eq9_pool_weights", eq9_zero_based_band), ("current_sel_block", shifted_current)):
        with seam_replaced(seam, replacement):
            fused = selection(x, k_cmp, SMALL)
            torch_code = O.select_blocks(O.selection_scores(x.q, k_cmp, SMALL, range_backend="triton"), SMALL)
        assert not torch.equal(fused, plain), f"replacing {seam} must matter for this input"
        assert torch.equal(fused, torch_code), seam


def test_kernel_chunks_keep_p_within_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(top_n_module, "KERNEL_CHUNK_P_BYTES", 1000 * 16)
    single = torch.clamp((torch.arange(5000) - 31) // 16 + 1, min=0)  # one sequence at the paper's l, d
    packed = torch.cat([single[:700], single[:3000], single[:1300]])  # widths restart at each document
    for widths in (single, packed):
        chunks = top_n_module.kernel_chunks(widths, 16, None)
        assert chunks[0][0] == 0 and chunks[-1][1] == widths.shape[0]
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:])), "chunks must tile the rows"
        for q0, q1 in chunks:
            assert q1 > q0 and ((q1 - q0) * max(1, int(widths[q0:q1].max())) <= 1000 or q1 - q0 == 1)
    chunks = top_n_module.kernel_chunks(single, 16, None)
    assert chunks[0] == (0, 142), "the first rows read few columns: 142 rows x 7 columns"
    assert chunks[-1][1] - chunks[-1][0] <= 3, "the last rows read 311 columns: 3 rows per chunk"
    assert top_n_module.kernel_chunks(single, 16, 700) == [(q, min(q + 700, 5000)) for q in range(0, 5000, 700)]
    assert top_n_module.kernel_chunks(single[:0], 16, None) == []


def test_width_segments_tile_the_rows_by_padded_width() -> None:
    current = torch.arange(0, 5000) // 16  # J of one sequence at l' = 16
    segments = top_n_module.width_segments(current, 100, 4900, 300)
    assert segments[0][0] == 100 and segments[-1][1] == 4900
    assert all(a[1] == b[0] for a, b in zip(segments, segments[1:])), "segments must tile the rows"
    assert [s[2] for s in segments] == [128, 256, 300], segments  # rows up to J = 127, 255, then capped at NB
    assert segments[0][1] == 128 * 16 and segments[1][1] == 256 * 16
    for s0, s1, blocks in segments:
        assert int(current[s0:s1].max()) + 1 == min(blocks, 300) or blocks == 300
    assert top_n_module.width_segments(None, 0, 50, 300) == [(0, 50, 300)], "no host J: one segment"
    assert top_n_module.width_segments(current, 0, 5000, 128) == [(0, 5000, 128)], "nothing narrower to take"
    unsorted = torch.tensor([200, 3, 3, 700, 130])
    assert top_n_module.width_segments(unsorted, 0, 5, 1000) == [(0, 1, 201), (1, 3, 4), (2 + 1, 4, 701),
                                                                (4, 5, 131)]


def test_width_segments_give_the_indices_of_one_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """One sequence, segments forced down to one block (MIN_SEGMENT_BLOCKS = 1): each segment's launch ranks only
    its rows' J + 1 blocks, and the indices equal one launch over every block (a segment one block too narrow
    would drop the row's own block J, a forced block)."""
    cfg = SMALL.replace(n_sel=4)
    x = make_inputs(cfg, 90, B=2, seed=12, dtype=torch.float32, device=DEVICE)
    k_cmp = O.compress(x.kv.cmp.k, x.kv.cmp.v, cfg)[0]
    whole = selection(x, k_cmp, cfg)
    blocks = []
    real = top_n_module.select_top_n
    monkeypatch.setattr(top_n_module, "select_top_n", lambda p, lo, hi, cur, nb, *a, **k:
                        blocks.append((p.shape[1], nb)) or real(p, lo, hi, cur, nb, *a, **k))
    monkeypatch.setattr(top_n_module, "MIN_SEGMENT_BLOCKS", 1)
    assert torch.equal(selection(x, k_cmp, cfg), whole)
    assert blocks == [(16, 1), (16, 2), (32, 4), (26, 6)], blocks  # rows 0-15: J = 0; 16-31: 1; 32-63: 2-3; 64-89
    blocks.clear()
    assert torch.equal(selection(x, k_cmp, cfg, chunk_size=10), whole), "chunks cutting the segments"
    assert blocks[:3] == [(10, 1), (6, 1), (4, 2)] and sum(rows for rows, _ in blocks) == 90, blocks
