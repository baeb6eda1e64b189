"""Triton selected-attention kernels (optimized/kernels) vs the naive gather oracle vs the float64 loop reference.

On a machine without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, root conftest), on tiny
fp32 shapes. Tolerance: FlashAttention's rule via helpers.error_ratio (error vs float64 <= 2 x error of the
same oracle run in fp32 + 1e-6). Outputs and workspaces are poisoned with NaN before each run, so a missed
write shows up. The GPU part lives in test_kernel_selected_attention_gpu.py.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
from triton.runtime.errors import OutOfResources

from conformance.helpers import error_ratio, rel_error
from tests.kernels.selected_kernel_inputs import Case, document_starts, random_indices, random_qkv
from optimized.kernels import selected_attention_naive, triton_selected_attention
from optimized.kernels import selected_attention_bwd as bwd_module
from optimized.kernels.selected_attention import logsumexp, selected_attention_forward
from optimized.kernels.selected_attention_index import build_inverted_index
from optimized.kernels.common import (DkdvTiling, Tiling, dkdv_tiling, dq_head_tile, dq_row_copies, dq_tiling,
                                      forward_tiling, launch_with_fallback, smaller_dkdv_tilings)
from reference.branches import selected_attention_rows
from reference.config import NSAConfig

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

CASES = {
    "group1": Case(tk=33, tq=33, n_kv_heads=2, group=1, dk=16, dv=16, sel_block=8, n_sel=3),
    "group3-dk12-dv8": Case(tk=37, tq=37, n_kv_heads=2, group=3, dk=12, dv=8, sel_block=8, n_sel=3),
    "group16": Case(tk=24, tq=24, n_kv_heads=1, group=16, dk=16, dv=8, sel_block=16, n_sel=2),
    "group6": Case(tk=24, tq=24, n_kv_heads=1, group=6, dk=16, dv=16, sel_block=8, n_sel=2),
    "decode-chunk": Case(tk=40, tq=5, n_kv_heads=2, group=2, dk=8, dv=16, sel_block=8, n_sel=4, batch=2),
    "decode-one": Case(tk=29, tq=1, n_kv_heads=2, group=5, dk=8, dv=8, sel_block=4, n_sel=3),
    "sel-block-24": Case(tk=40, tq=40, n_kv_heads=1, group=4, dk=8, dv=8, sel_block=24, n_sel=2),
    # a small group whose head dim pads past 128: the forward takes its heads as rows (common.forward_head_tile),
    # where every case above with fewer than 16 heads takes them as columns
    "group2-dk136": Case(tk=21, tq=21, n_kv_heads=1, group=2, dk=136, dv=8, sel_block=8, n_sel=2),
    # the same for the dq kernel at 6 heads (its rows layout with two copies, dq_head_tile)
    "group6-dk136": Case(tk=24, tq=24, n_kv_heads=1, group=6, dk=136, dv=8, sel_block=8, n_sel=2),
    # head dims read in two tiles (32 + 16, the second masked past 40: common.head_dim_tiles), with the heads as
    # the tiles' rows (16 heads) and as their columns (6 heads, the dq's split dS in an accumulator of its own)
    "group16-dk40": Case(tk=24, tq=24, n_kv_heads=1, group=16, dk=40, dv=8, sel_block=16, n_sel=2),
    "group6-dk40": Case(tk=24, tq=24, n_kv_heads=1, group=6, dk=40, dv=16, sel_block=8, n_sel=2),
}



def perturbed_indices(case: Case, seed: int) -> torch.Tensor:
    """Valid random indices plus edge cases: some (query, group) sets empty, some padding slots holding a
    block after the query's current block (no visible key: Eq. 12 clips it away), int32 for odd seeds."""
    idx = random_indices(case, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    empty = torch.rand(idx.shape[:3], generator=g) < 0.15
    idx[empty] = -1
    positions = torch.arange(case.tk - case.tq, case.tk).view(1, case.tq, 1)
    future = (idx[..., -1] == -1) & ~empty & (torch.rand(idx.shape[:3], generator=g) < 0.5)
    idx[..., -1] = torch.where(future, positions // case.sel_block + 1, idx[..., -1])
    return idx.to(torch.int32 if seed % 2 else torch.int64)


def reference_config(case: Case) -> NSAConfig:
    """The loop reference only reads sel_block and the head layout from the config."""
    return NSAConfig(cmp_block=case.sel_block, cmp_stride=case.sel_block, sel_block=case.sel_block,
                     n_sel=case.n_sel, n_init=0, n_local=0, window=1, n_heads=case.n_heads,
                     n_kv_heads=case.n_kv_heads, head_dim_qk=case.dk, head_dim_v=case.dv)


def loop_reference(case: Case, q, k, v, idx) -> torch.Tensor:
    positions = list(range(case.tk - case.tq, case.tk))
    return selected_attention_rows(q.cpu(), k.cpu(), v.cpu(), idx.cpu(), reference_config(case), positions)[0]


def no_visible_key(case: Case, idx: torch.Tensor) -> torch.Tensor:
    """[B, TQ, Hkv] True where no selected block has a key <= p."""
    positions = torch.arange(case.tk - case.tq, case.tk, device=idx.device).view(1, case.tq, 1, 1)
    blocks = idx.long()
    return ~((blocks >= 0) & (blocks * case.sel_block <= positions)).any(-1)


def selected_logits_oracle(case: Case, q, k, idx) -> torch.Tensor:
    """[B, TQ, Hq, TK] float64 scaled logits of visible keys (-inf elsewhere), by a loop over index sets."""
    B, TQ = q.shape[:2]
    out = torch.full((B, TQ, case.n_heads, case.tk), float("-inf"), dtype=torch.float64)
    qd, kd = q.double().cpu(), k.double().cpu()
    for b in range(B):
        for t in range(TQ):
            p = case.tk - case.tq + t
            for h in range(case.n_heads):
                g = h // case.group
                for j in idx[b, t, g].tolist():
                    for s in range(max(j, 0) * case.sel_block, (j + 1) * case.sel_block):
                        if j >= 0 and s <= p:
                            out[b, t, h, s] = (qd[b, t, h] @ kd[b, s, g]) / math.sqrt(case.dk)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_forward_matches_naive_and_float64_reference(name: str, poisoned_empty: None) -> None:
    case = CASES[name]
    q, k, v = random_qkv(case, dtype=torch.float32, device=DEVICE, seed=11)
    idx = perturbed_indices(case, seed=len(name)).to(DEVICE)
    o, stats = selected_attention_forward(q, k, v, idx, case.sel_block, 1.0 / math.sqrt(case.dk))
    assert not torch.isnan(stats).any(), "softmax stats have unwritten (NaN) elements"
    lse = logsumexp(stats)

    assert torch.isfinite(o).all(), "o has unwritten (NaN) or non-finite elements"
    empty = no_visible_key(case, idx).repeat_interleave(case.group, dim=2)
    assert torch.equal(lse == float("-inf"), empty), "lse must be -inf exactly for queries with no visible key"
    assert (o[empty] == 0).all(), "a query with no visible key must output 0"
    logits = selected_logits_oracle(case, q, k, idx)  # float64 on CPU
    lse_cpu, empty_cpu = lse.cpu(), empty.cpu()
    assert rel_error(lse_cpu[~empty_cpu], torch.logsumexp(logits, -1)[~empty_cpu]) < 1e-6

    oracle = loop_reference(case, q.double(), k.double(), v.double(), idx)
    ref_fp32 = loop_reference(case, q, k, v, idx)
    naive = selected_attention_naive(q, k, v, idx, case.sel_block)
    assert rel_error(selected_attention_naive(q.double(), k.double(), v.double(), idx, case.sel_block),
                     oracle) < 1e-12, "the naive oracle disagrees with the loop reference"
    assert rel_error(o, naive) < 1e-5
    assert error_ratio(o, ref_fp32, oracle) <= 1.0


BACKWARD_CASES = ["group1", "group3-dk12-dv8", "group16", "decode-chunk", "sel-block-24", "group16-dk40",
                  "group6-dk40"]


@pytest.mark.parametrize("name", BACKWARD_CASES)
def test_backward_matches_naive_autograd(name: str, poisoned_empty: None) -> None:
    case = CASES[name]
    q, k, v = random_qkv(case, dtype=torch.float32, device=DEVICE, seed=5)
    idx = perturbed_indices(case, seed=len(name) + 3).to(DEVICE)
    assert_backward_matches_naive(case, q, k, v, idx)


def assert_backward_matches_naive(case: Case, q, k, v, idx, **packing) -> None:
    """o, dq, dk, dv of the fp32 kernel against naive autograd in float64 (rel error < 1e-5) and the error-ratio
    rule with naive in fp32 as the baseline; every element written. packing: doc_start of a packed batch."""
    do = torch.randn((case.batch, case.tq, case.n_heads, case.dv), generator=torch.Generator().manual_seed(9))
    do = do.to(DEVICE)

    def grads(fn, dtype):
        leaves = [x.detach().to(dtype).requires_grad_(True) for x in (q, k, v)]
        out = fn(*leaves, idx, case.sel_block, **packing)
        return [out] + list(torch.autograd.grad(out, leaves, do.to(dtype)))

    kernel = grads(triton_selected_attention, torch.float32)
    fp32 = grads(selected_attention_naive, torch.float32)
    oracle = grads(selected_attention_naive, torch.float64)
    for label, got, low, exact in zip(("o", "dq", "dk", "dv"), kernel, fp32, oracle):
        assert torch.isfinite(got).all(), f"{label} has NaN/inf (unwritten element?)"
        assert rel_error(got, exact) < 1e-5, label
        assert error_ratio(got, low, exact) <= 1.0, label


@pytest.mark.parametrize("queries_per_item, launch", [
    (3, None),  # items of 3 queries: split blocks, workspace slots + ordered reduction
    (3, DkdvTiling(block_n=16, block_cols=16, num_warps=4, num_stages=1)),  # 5 queries x 3 heads per step, 1 idle
    (None, DkdvTiling(block_n=16, block_cols=16, num_warps=4, num_stages=1)),  # whole blocks, many steps each
])
def test_backward_split_blocks_match_whole_blocks(queries_per_item, launch, poisoned_empty: None) -> None:
    """Blocks cut over several dk/dv programs (workspace slots + ordered reduction), and query steps of a few
    (query, head) columns, give the same gradients."""
    case = CASES["group3-dk12-dv8"]
    q, k, v = random_qkv(case, dtype=torch.float32, device=DEVICE, seed=2)
    idx = perturbed_indices(case, seed=4).to(DEVICE)
    scale = 1.0 / math.sqrt(case.dk)
    o, stats = selected_attention_forward(q, k, v, idx, case.sel_block, scale)
    do = torch.randn_like(o)
    split = bwd_module.selected_attention_backward(q, k, v, idx, o, stats, do, case.sel_block, scale,
                                                   dkdv_launch=launch, queries_per_item=queries_per_item)
    leaves = [x.detach().double().requires_grad_(True) for x in (q, k, v)]
    exact = torch.autograd.grad(selected_attention_naive(*leaves, idx, case.sel_block), leaves, do.double())
    for label, got, ref in zip(("dq", "dk", "dv"), split, exact):
        assert torch.isfinite(got).all(), label
        assert rel_error(got, ref) < 1e-5, label


@pytest.mark.parametrize("name", ["group1", "group16"])
def test_backward_gradients_do_not_inherit_the_rounding_of_o(name: str) -> None:
    """D = sum_s P_s dP_s (softmax backward of Eq. 12). FlashAttention's shortcut D = rowsum(dO * O) inherits
    O's rounding (on the GPU O is stored in bf16, and the forward feeds P to P V in bf16), which leaves
    sum_s dS_s != 0 and a systematic dq error D_err * sum_s P_s k_s. Fed an fp32 run's o rounded to bf16,
    the fp32 backward's dq and dk (dv does not use D) must still meet the error-ratio rule (before D was made
    consistent: ratios ~1e3)."""
    case = CASES[name]
    q, k, v = random_qkv(case, dtype=torch.float32, device=DEVICE, seed=5)
    idx = perturbed_indices(case, seed=3).to(DEVICE)
    scale = 1.0 / math.sqrt(case.dk)
    o, stats = selected_attention_forward(q, k, v, idx, case.sel_block, scale)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(13)).to(DEVICE)
    got = bwd_module.selected_attention_backward(q, k, v, idx, o.bfloat16().float(), stats, do, case.sel_block,
                                                 scale)

    def grads(dtype):
        leaves = [x.detach().to(dtype).requires_grad_(True) for x in (q, k, v)]
        return torch.autograd.grad(selected_attention_naive(*leaves, idx, case.sel_block), leaves, do.to(dtype))

    for label, g, low, exact in zip(("dq", "dk"), got, grads(torch.float32), grads(torch.float64)):
        assert error_ratio(g, low, exact) <= 1.0, label


HALF_MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}


@pytest.mark.parametrize("name, dtype", [("group1", torch.bfloat16), ("group16", torch.bfloat16),
                                         ("group3-dk12-dv8", torch.bfloat16), ("group3-dk12-dv8", torch.float16),
                                         ("group6", torch.bfloat16), ("group6-dk136", torch.bfloat16),
                                         ("group16-dk40", torch.bfloat16), ("group6-dk40", torch.bfloat16)],
                         ids=["group1-bf16", "group16-bf16", "group3-bf16", "group3-fp16", "group6-bf16",
                              "group6-dk136-bf16", "group16-dk40-bf16", "group6-dk40-bf16"])
def test_half_precision_dq_is_rounded_once(name: str, dtype: torch.dtype) -> None:
    """bf16/fp16 inputs: dq is carried in fp32 and rounded once, so each element is within 1 ulp of float64
    (1 ulp, not 1/2: the interpreter's fp32 -> half casts truncate) plus 2^-(mantissa + 5) * max|dq|. Feeding dS
    to the dS K dot rounded to the input dtype (what the GPU run 1 kernel did) leaves errors of
    2^-(mantissa + 1)-relative per dS term, measured 8-16x over that slack in bf16; the hi + lo split leaves
    ~2^-16. o, dk, dv meet the error-ratio rule against the naive oracle run in the same dtype."""
    case = CASES[name]
    q, k, v = random_qkv(case, dtype=dtype, device=DEVICE, seed=5)
    idx = perturbed_indices(case, seed=3).to(DEVICE)
    do = torch.randn((case.batch, case.tq, case.n_heads, case.dv), generator=torch.Generator().manual_seed(9))
    do = do.to(DEVICE, dtype)

    def grads(fn, leaf_dtype):
        leaves = [x.detach().to(leaf_dtype).requires_grad_(True) for x in (q, k, v)]
        out = fn(*leaves, idx, case.sel_block)
        return [out] + list(torch.autograd.grad(out, leaves, do.to(leaf_dtype)))

    kernel = grads(triton_selected_attention, dtype)
    low = grads(selected_attention_naive, dtype)
    exact = grads(selected_attention_naive, torch.float64)
    bits = HALF_MANTISSA_BITS[dtype]
    dq, dq_exact = kernel[1].double().cpu(), exact[1].cpu()
    ulp = torch.exp2(torch.floor(torch.log2(dq_exact.abs().clamp_min(1e-30))) - bits)
    excess = ((dq - dq_exact).abs() - ulp).clamp_min(0).max().item()
    assert excess <= 2.0 ** -(bits + 5) * dq_exact.abs().max().item(), excess
    for label, got, lo, ex in zip(("o", "dq", "dk", "dv"), kernel, low, exact):
        assert torch.isfinite(got).all(), label
        assert error_ratio(got, lo, ex) <= 1.0, label


def test_dq_packs_the_split_into_the_free_rows_of_small_groups() -> None:
    """The dq launch's layouts: half-precision groups of 5-8 heads at head dims up to 128 as the tiles' 8 columns
    (one copy); otherwise rows, where groups up to 4 carry dS hi, dS lo and P in one dot (3 copies), up to 8 dS hi
    and lo (2), larger groups and fp32 inputs (no split) one copy of the whole tile. The half-precision dq cases
    above run each arrangement (group6: columns; group1, group3: 3 copies; group6-dk136: 2; group16: 1). A launch
    with copies or columns at d <= 64 takes three pipeline stages, as does the 16-row tile at d = 128; the others
    two."""
    assert dq_head_tile(6, True, 64) == (8, 0, 8, 1)
    assert dq_head_tile(6, True, 256) == (16, 1, 8, 2)
    assert dq_head_tile(3, True, 64) == (16, 1, 4, 3)
    assert dq_head_tile(6, False, 64) == (16, 1, 16, 1)
    assert dq_row_copies(1, True) == (1, 3)
    assert dq_row_copies(3, True) == (4, 3)
    assert dq_row_copies(6, True) == (8, 2)
    assert dq_row_copies(16, True) == (16, 1)
    assert dq_row_copies(6, False) == (16, 1)
    assert dq_tiling(6, 64, 64, 64, torch.bfloat16).num_stages == 3
    assert dq_tiling(16, 64, 64, 64, torch.bfloat16).num_stages == 2
    assert dq_tiling(6, 128, 128, 64, torch.bfloat16).num_stages == 2
    for group in (9, 16):
        assert dq_tiling(group, 128, 128, 64, torch.bfloat16) == Tiling(16, num_warps=1, num_stages=3)
    assert dq_tiling(16, 128, 128, 64, torch.float32).num_stages == 1


def test_dq_reads_two_head_dim_tiles_only_with_one_copy_of_its_rows() -> None:
    from optimized.kernels.common import dq_head_dim_tiles

    assert dq_head_dim_tiles(192, 1) == (128, 64) and dq_head_dim_tiles(40, 1) == (32, 16)
    assert dq_head_dim_tiles(192, 2) == (256, 0) and dq_head_dim_tiles(40, 3) == (64, 0)
    assert dq_head_dim_tiles(128, 1) == (128, 0)


def test_wide_heads_take_the_launches_measured_for_them() -> None:
    """Half precision at head dims padded beyond 128 (the paper's d_k = 192 pads to 256), groups of 1-32: the
    forward on 32-key tiles with 2 warps, dq on 64-key tiles with 4 warps, dk/dv on 32 keys x 64 columns with 4 warps,
    all in 2 stages (the general heuristics' 64-key, 3-stage forward and 8-warp backward launches ran 1.2x-2.5x
    slower on an H100). Groups of 64, fp32 and d <= 128 keep their own heuristics."""
    bf16, fp16 = torch.bfloat16, torch.float16
    for group in (1, 6, 16, 32):
        for dtype in (bf16, fp16):
            assert forward_tiling(group, 256, 128, 64, dtype) == Tiling(32, num_warps=2, num_stages=2)
            assert dq_tiling(group, 256, 128, 64, dtype) == Tiling(64, num_warps=4, num_stages=2)
            assert dkdv_tiling(group, 256, 128, 64, dtype) == DkdvTiling(32, 64, num_warps=4, num_stages=2)
    assert dq_tiling(16, 256, 128, 32, bf16).block_n == 32  # key tiles never span two selection blocks
    assert forward_tiling(64, 256, 128, 64, bf16) == Tiling(64, num_warps=8, num_stages=2)
    assert forward_tiling(16, 256, 128, 64, torch.float32).num_warps == 4
    assert forward_tiling(16, 128, 128, 64, bf16) == Tiling(64, num_warps=2, num_stages=2)
    assert dkdv_tiling(16, 128, 128, 64, bf16) == DkdvTiling(64, 32, num_warps=4, num_stages=2)


def test_backward_is_bitwise_deterministic() -> None:
    """dk/dv use no atomics: two runs (split path included) give identical bits."""
    case = CASES["group1"]
    q, k, v = random_qkv(case, dtype=torch.float32, device=DEVICE, seed=3)
    idx = random_indices(case, seed=8).to(DEVICE)
    scale = 1.0 / math.sqrt(case.dk)
    o, stats = selected_attention_forward(q, k, v, idx, case.sel_block, scale)
    do = torch.randn_like(o)
    runs = [bwd_module.selected_attention_backward(q, k, v, idx, o, stats, do, case.sel_block, scale,
                                                   queries_per_item=4) for _ in range(2)]
    for label, a, b in zip(("dq", "dk", "dv"), *runs):
        assert torch.equal(a, b), f"{label} differs between two identical runs"


def test_strided_and_non_contiguous_inputs() -> None:
    """Views of larger tensors (odd strides), a value tensor whose last dim is not contiguous, strided indices."""
    case = CASES["group3-dk12-dv8"]
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(case.batch, case.tq, case.n_heads, 2 * case.dk, generator=g).to(DEVICE)
    q = qkv[..., case.dk:]
    k = torch.randn(case.batch, case.n_kv_heads, case.tk, case.dk, generator=g).to(DEVICE).transpose(1, 2)
    v = torch.randn(case.batch, case.tk, case.dv, case.n_kv_heads, generator=g).to(DEVICE).transpose(2, 3)
    assert v.stride(-1) != 1 and not k.is_contiguous() and not q.is_contiguous()
    idx = random_indices(case, seed=1).to(DEVICE)[..., ::2]  # still ascending, -1 padded; stride 2
    assert not idx.is_contiguous()
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
    o = triton_selected_attention(*leaves, idx, case.sel_block)
    do = torch.randn_like(o)
    got = [o] + list(torch.autograd.grad(o, leaves, do))
    ref_leaves = [x.detach().double().requires_grad_(True) for x in (q, k, v)]
    ref_o = selected_attention_naive(*ref_leaves, idx, case.sel_block)
    ref = [ref_o] + list(torch.autograd.grad(ref_o, ref_leaves, do.double()))
    for label, a, b in zip(("o", "dq", "dk", "dv"), got, ref):
        assert rel_error(a, b) < 1e-5, label


def test_explicit_scale_is_used() -> None:
    case = CASES["decode-one"]
    q, k, v = random_qkv(case, dtype=torch.float32, device=DEVICE, seed=4)
    idx = random_indices(case, seed=4).to(DEVICE)
    o = triton_selected_attention(q, k, v, idx, case.sel_block, scale=0.37)
    ref = selected_attention_naive(q.double(), k.double(), v.double(), idx, case.sel_block, scale=0.37)
    assert rel_error(o, ref) < 1e-5
    assert rel_error(o, selected_attention_naive(q, k, v, idx, case.sel_block)) > 1e-3


def test_inverted_index_lists_every_selecting_query() -> None:
    """CSR items vs a loop over (b, t, g, slot): each (b, g, j) lists exactly the queries whose set holds j
    with a visible key, ascending; items respect queries_per_item; split blocks own contiguous slots. The sizes
    are the shape's bounds (known before any index value): the real items come first, then padding items (no
    query, the spare slot); every key is listed for the reduction, unsplit keys with an empty slot range."""
    case = Case(tk=29, tq=20, n_kv_heads=2, group=1, dk=8, dv=8, sel_block=4, n_sel=3, batch=2)
    idx = random_indices(case, seed=6)
    idx[0, 3, 1, -1] = 9  # a block after the query's position: not listed
    per_item = 3
    index = build_inverted_index(idx, case.tk, case.sel_block, queries_per_item=per_item)
    expected: dict[tuple[int, int, int], list[int]] = {}
    for b in range(case.batch):
        for t in range(case.tq):
            p = case.tk - case.tq + t
            for g in range(case.n_kv_heads):
                for j in idx[b, t, g].tolist():
                    if j >= 0 and j * case.sel_block <= p:
                        expected.setdefault((b, g, j), []).append(t)
    entries = sum(len(rows) for rows in expected.values())
    n_keys = case.batch * case.n_kv_heads * index.n_blocks
    assert index.n_items == n_keys + -(-idx.numel() // per_item)  # the bound, from the shape alone
    got: dict[tuple[int, int, int], list[int]] = {}
    slots_of: dict[int, list[int]] = {}
    spare = index.n_slots - 1
    padding = False
    for i in range(index.n_items):
        key, begin, end, slot = (int(x[i]) for x in (index.item_key, index.item_begin, index.item_end,
                                                     index.item_slot))
        if begin == end:  # padding: after every real item, writing to the spare slot only
            padding = True
            assert slot == spare and key == 0, (i, key, slot)
            continue
        assert not padding, f"real item {i} after a padding item"
        j, bg = key % index.n_blocks, key // index.n_blocks
        rows = index.query_rows[begin:end].tolist()
        assert 1 <= len(rows) <= per_item
        got.setdefault((bg // case.n_kv_heads, bg % case.n_kv_heads, j), []).extend(rows)
        if slot >= 0:
            assert slot < spare
            slots_of.setdefault(key, []).append(slot)
    assert got == expected
    assert sum(len(r) for r in got.values()) == entries
    assert index.split_key.tolist() == list(range(n_keys))
    for key, begin, end in zip(index.split_key.tolist(), index.slot_begin.tolist(), index.slot_end.tolist()):
        assert slots_of.get(key, []) == list(range(begin, end))
    assert slots_of, "no block was split: the test no longer covers the slots"


def test_inverted_index_reads_the_indices_through_their_strides() -> None:
    """The sort keys are read from the indices in place (the backward passes a row slice of them): a view whose
    rows and slots are strided gives the index of its contiguous copy, int32 or int64."""
    case = Case(tk=29, tq=20, n_kv_heads=2, group=1, dk=8, dv=8, sel_block=4, n_sel=3, batch=2)
    wide = random_indices(Case(tk=29, tq=23, n_kv_heads=2, group=1, dk=8, dv=8, sel_block=4, n_sel=6, batch=2),
                          seed=8)
    for dtype in (torch.int64, torch.int32):
        view = wide.to(dtype)[:, 3:, :, ::2]  # the last 20 rows, every other slot
        assert not view.is_contiguous()
        got = build_inverted_index(view, case.tk, case.sel_block, queries_per_item=3)
        want = build_inverted_index(view.contiguous(), case.tk, case.sel_block, queries_per_item=3)
        for name in ("query_rows", "item_key", "item_begin", "item_end", "item_slot", "slot_begin", "slot_end"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (dtype, name)
        assert int((got.item_begin != got.item_end).sum()) > 0


@pytest.mark.parametrize("n_blocks", [40, 40_000])
def test_inverted_index_lists_queries_past_int16_block_ids(n_blocks: int) -> None:
    """Block ids past int16 (the index sorts its keys in the narrowest integer type that holds them): a few queries
    at the end of a long sequence list the same blocks, with the same runs, as a loop over their selections."""
    sel_block = 4
    case = Case(tk=n_blocks * sel_block, tq=6, n_kv_heads=2, group=1, dk=8, dv=8, sel_block=sel_block, n_sel=3)
    idx = random_indices(case, seed=7)
    index = build_inverted_index(idx, case.tk, case.sel_block)
    expected: dict[int, list[int]] = {}
    for t in range(case.tq):
        for g in range(case.n_kv_heads):
            for j in idx[0, t, g].tolist():
                if j >= 0:
                    expected.setdefault(g * n_blocks + j, []).append(t)
    real = (index.item_begin != index.item_end).nonzero().flatten().tolist()
    got = {int(index.item_key[i]): index.query_rows[int(index.item_begin[i]):int(index.item_end[i])].tolist()
           for i in real}
    assert got == expected
    if n_blocks > 32_767:
        assert max(expected) > 32_767  # the case reaches the wider key type


@pytest.mark.parametrize("change, match", [
    (dict(q_heads=65 * 1, kv_heads=1), "group size"),
    (dict(dk=264), "head dims"),
    (dict(index_dtype=torch.float32), "int32 or int64"),
    (dict(tq=9), "TQ"),
    (dict(q_dtype=torch.float64), "dtype"),
    (dict(sel_block=0), "sel_block"),
    (dict(kv_heads=3), "multiple of Hkv"),
])
def test_bad_input_raises_value_error(change: dict, match: str) -> None:
    tq, tk = change.get("tq", 8), 8
    hq, hkv = change.get("q_heads", 4), change.get("kv_heads", 2)
    dk = change.get("dk", 8)
    q = torch.randn(1, tq, hq, dk, dtype=change.get("q_dtype", torch.float32))
    k = torch.randn(1, tk, hkv, dk)
    v = torch.randn(1, tk, hkv, 8)
    idx = torch.zeros(1, tq, hkv, 2, dtype=change.get("index_dtype", torch.int64))
    with pytest.raises(ValueError, match=match):
        triton_selected_attention(q, k, v, idx, change.get("sel_block", 4))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-without-interpreter message")
def test_cpu_tensors_without_interpreter_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    case = CASES["decode-one"]
    q, k, v = random_qkv(case, dtype=torch.float32, device="cpu", seed=0)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        triton_selected_attention(q, k, v, random_indices(case, seed=0), case.sel_block)


def test_launch_fallback_shrinks_tiles_on_out_of_resources() -> None:
    """A tiling the GPU cannot hold (Triton's OutOfResources at compile time) is retried with fewer stages,
    then narrower key tiles; other errors propagate."""
    tried: list[Tiling] = []

    def launch(tiling: Tiling) -> str:
        tried.append(tiling)
        if tiling.num_stages > 1 or tiling.block_n > 16:
            raise OutOfResources(300_000, 232_448, "shared memory")
        return "ran"

    assert launch_with_fallback(launch, Tiling(block_n=64, num_warps=4, num_stages=3)) == "ran"
    assert [(t.block_n, t.num_stages) for t in tried] == [(64, 3), (64, 2), (64, 1), (32, 1), (16, 1)]

    def broken(tiling: Tiling) -> None:
        raise RuntimeError("not a resource problem")

    with pytest.raises(RuntimeError, match="not a resource"):
        launch_with_fallback(broken, Tiling(block_n=64, num_warps=4, num_stages=3))


@pytest.mark.parametrize("kernel", ["range forward", "range dq", "range dk/dv", "group scores", "selected forward"])
def test_a_given_tiling_is_launched_as_given(kernel: str, monkeypatch) -> None:
    """A tiling passed to a kernel wrapper is the launch: a GPU that cannot fit it raises, with no smaller tiling
    tried (a probe timing it must not time another in its name; without one, the heuristic tiling shrinks:
    launch_with_fallback, tested above)."""
    from optimized.kernels import range_attention, range_attention_bwd, selection
    from optimized.kernels.common import RangeTiling

    launched = []

    class ShortOfMemory:  # stands in for a Triton kernel whose every launch needs more than the GPU has
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                launched.append((kwargs.get("BLOCK_M"), kwargs["BLOCK_N"], kwargs["num_stages"]))
                raise OutOfResources(247808, 232448, "shared memory")
            return run

    B, T, Hq, Hkv, d = 1, 32, 2, 1, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, h, d, generator=g) for h in (Hq, Hkv, Hkv))
    lo = torch.zeros(T, dtype=torch.int32)
    hi = torch.arange(T, dtype=torch.int32)
    o, lse2 = range_attention.range_attention_forward(q, k, v, lo, hi, 0.25)
    name = {"range forward": (range_attention, "_range_attention_fwd_kernel"),
            "range dq": (range_attention_bwd, "_range_attention_dq_kernel"),
            "range dk/dv": (range_attention_bwd, "_range_attention_dkdv_kernel"),
            "group scores": (selection, "_group_scores_kernel"),
            "selected forward": (sys.modules[selected_attention_forward.__module__],
                                 "_selected_attention_fwd_kernel")}
    monkeypatch.setattr(*name[kernel], ShortOfMemory())
    idx = torch.zeros(B, T, Hkv, 1, dtype=torch.int64)

    def call(tiling):
        if kernel == "range forward":
            return range_attention.range_attention_forward(q, k, v, lo, hi, 0.25, tiling=tiling)
        if kernel == "group scores":
            return selection.group_scores(q, k, lo, hi, lse2, T, 0.25, tiling=tiling)
        if kernel == "selected forward":
            return selected_attention_forward(q, k, v, idx, 16, 0.25, tiling=tiling)
        tilings = {"dq_tiling": tiling} if kernel == "range dq" else {"dkdv_tiling": tiling}
        return range_attention_bwd.range_attention_backward(q, k, v, lo, hi, o, lse2, torch.randn_like(o), 0.25,
                                                            **tilings)

    given = Tiling(16, 4, 2) if kernel == "selected forward" else RangeTiling(32, 16, 4, 2)
    with pytest.raises(OutOfResources):
        call(given)
    assert launched == [(given.block_m if kernel != "selected forward" else None, given.block_n, given.num_stages)]


def test_dkdv_fallback_shrinks_stages_then_columns_then_key_rows() -> None:
    """The dk/dv kernel's fallback keeps whole queries in a step (columns >= the padded group) and ends at the
    smallest tiles."""
    start = DkdvTiling(block_n=64, block_cols=64, num_warps=8, num_stages=2)
    got = [(t.block_n, t.block_cols, t.num_stages) for t in smaller_dkdv_tilings(start, min_cols=16)]
    assert got == [(64, 64, 2), (64, 64, 1), (64, 32, 1), (64, 16, 1), (32, 16, 1), (16, 16, 1)]
    got = [(t.block_n, t.block_cols) for t in smaller_dkdv_tilings(start, min_cols=64)]
    assert got == [(64, 64), (64, 64), (32, 64), (16, 64)]
    with pytest.raises(ValueError, match="block_cols"):
        DkdvTiling(block_n=16, block_cols=24, num_warps=4, num_stages=1)


# ------------------------------------------------------------------------------------------------------------
# Packed batches (cu_seqlens): doc_start [TQ] = first key of each query row's document; indices are
# document-relative (block j of a row = keys doc_start + j * l' ..). Empty documents, documents shorter than l',
# of exactly l' and l' + 1 tokens, and (decode chunk) a first row whose document starts before it.
PACKED_CASES = {
    "packed-group2": (Case(tk=36, tq=36, n_kv_heads=2, group=2, dk=8, dv=8, sel_block=4, n_sel=3),
                      [5, 0, 9, 1, 4, 17, 0]),
    "packed-group3-dk12-dv8": (Case(tk=35, tq=35, n_kv_heads=1, group=3, dk=12, dv=8, sel_block=8, n_sel=2),
                               [0, 7, 8, 9, 11]),
    "packed-decode-chunk": (Case(tk=30, tq=23, n_kv_heads=2, group=1, dk=8, dv=16, sel_block=4, n_sel=3, batch=2),
                            [10, 3, 17]),
}


def packed_inputs(name: str, seed: int):
    """q, k, v, document-relative indices (with empty sets and clipped-away padding slots, int32 for odd seeds)
    and doc_start of a packed case."""
    case, lengths = PACKED_CASES[name]
    assert sum(lengths) == case.tk
    starts = document_starts(lengths, case.tq)
    q, k, v = random_qkv(case, dtype=torch.float32, device=DEVICE, seed=seed)
    idx = random_indices(case, seed=seed + 1, doc_start=starts)
    g = torch.Generator().manual_seed(seed + 2)
    idx[torch.rand(idx.shape[:3], generator=g) < 0.15] = -1
    relative = (torch.arange(case.tk - case.tq, case.tk) - starts.long()).view(1, case.tq, 1)
    future = (idx[..., -1] == -1) & (torch.rand(idx.shape[:3], generator=g) < 0.5)
    idx[..., -1] = torch.where(future, relative // case.sel_block + 1, idx[..., -1])  # no key <= p: clipped away
    return case, lengths, q, k, v, idx.to(torch.int32 if seed % 2 else torch.int64).to(DEVICE), starts.to(DEVICE)


def packed_loop_reference(case: Case, lengths: list[int], q, k, v, idx) -> torch.Tensor:
    """float64-capable loop reference of a packed batch: each document's rows run alone through
    reference.branches.selected_attention_rows over the document's own keys at document-relative positions."""
    out = torch.zeros(case.batch, case.tq, case.n_heads, case.dv, dtype=q.dtype)
    first_row_position = case.tk - case.tq
    start = 0
    for n in lengths:
        rows = [p - first_row_position for p in range(start, start + n) if p >= first_row_position]
        if rows:
            sl = slice(rows[0], rows[-1] + 1)
            positions = [first_row_position + t - start for t in rows]
            out[:, sl] = selected_attention_rows(q[:, sl].cpu(), k[:, start:start + n].cpu(),
                                                 v[:, start:start + n].cpu(), idx[:, sl].cpu().long(),
                                                 reference_config(case), positions)[0]
        start += n
    return out


@pytest.mark.parametrize("name", list(PACKED_CASES))
def test_packed_forward_matches_naive_and_float64_reference(name: str, poisoned_empty: None) -> None:
    case, lengths, q, k, v, idx, starts = packed_inputs(name, seed=len(name))
    o, stats = selected_attention_forward(q, k, v, idx, case.sel_block, 1.0 / math.sqrt(case.dk),
                                          doc_start=starts)
    assert torch.isfinite(o).all() and not torch.isnan(stats).any(), "unwritten (NaN) output or stats"
    oracle = packed_loop_reference(case, lengths, q.double(), k.double(), v.double(), idx)
    naive64 = selected_attention_naive(q.double(), k.double(), v.double(), idx, case.sel_block, doc_start=starts)
    assert rel_error(naive64, oracle) < 1e-12, "the naive oracle with doc_start disagrees with the loop reference"
    unpacked = selected_attention_naive(q.double(), k.double(), v.double(), idx, case.sel_block)
    assert rel_error(unpacked, oracle) > 1e-3, "the case does not tell document-relative blocks from absolute ones"
    assert rel_error(o, naive64) < 1e-5
    assert error_ratio(o, packed_loop_reference(case, lengths, q, k, v, idx), oracle) <= 1.0


@pytest.mark.parametrize("name", list(PACKED_CASES))
def test_packed_backward_matches_naive_autograd(name: str, poisoned_empty: None) -> None:
    case, lengths, q, k, v, idx, starts = packed_inputs(name, seed=len(name) + 3)
    assert_backward_matches_naive(case, q, k, v, idx, doc_start=starts)


@pytest.mark.parametrize("queries_per_item", [2, None])
def test_packed_backward_split_blocks_and_document_ends(queries_per_item, poisoned_empty: None) -> None:
    """Blocks split over workspace slots, and each document's last, partial block: dk/dv of a key equal the
    oracle's, including the first keys of the next document (a program of the previous document's last block
    must not overwrite them) and keys no query selected (exactly 0); dq of a row with no visible key is exactly 0.
    (A row with ONE visible key, e.g. a document's first token, has dq = 0 only mathematically: dS = P (dP - D)
    with P = 1 cancels to a rounding residual, whose bits depend on the dot's summation order, so it is not
    asserted to be exactly 0.)"""
    case, lengths, q, k, v, idx, starts = packed_inputs("packed-group2", seed=4)
    scale = 1.0 / math.sqrt(case.dk)
    o, stats = selected_attention_forward(q, k, v, idx, case.sel_block, scale, doc_start=starts)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(5)).to(o.device)
    got = bwd_module.selected_attention_backward(q, k, v, idx, o, stats, do, case.sel_block, scale,
                                                 queries_per_item=queries_per_item, doc_start=starts)
    leaves = [x.detach().double().requires_grad_(True) for x in (q, k, v)]
    exact = torch.autograd.grad(selected_attention_naive(*leaves, idx, case.sel_block, doc_start=starts), leaves,
                                do.double())
    relative = (torch.arange(case.tk - case.tq, case.tk, device=starts.device) - starts.long()).view(1, -1, 1, 1)
    blocks = idx.long()
    empty_row = ~((blocks >= 0) & (blocks * case.sel_block <= relative)).any(-1)  # [B, TQ, Hkv]
    for label, g_, ref in zip(("dq", "dk", "dv"), got, exact):
        assert torch.isfinite(g_).all(), label
        assert rel_error(g_, ref) < 1e-5, label
    dq = got[0].view(case.batch, case.tq, case.n_kv_heads, case.group, case.dk)
    assert bool((dq[empty_row] == 0).all()), "dq: nonzero for a row with no visible key"
    for label, g_, ref in zip(("dk", "dv"), got[1:], exact[1:]):
        assert bool((g_[ref == 0] == 0).all()), f"{label}: nonzero where no query reads the key"


def test_packed_inverted_index_keys_blocks_by_document() -> None:
    """Each (b, g, document, block) lists exactly the rows of that document whose set holds the block with a
    visible key, ascending; block_base / block_end give the block's first key and its document's end."""
    case, lengths = PACKED_CASES["packed-decode-chunk"]
    starts = document_starts(lengths, case.tq)
    idx = random_indices(case, seed=6, doc_start=starts)
    index = build_inverted_index(idx, case.tk, case.sel_block, queries_per_item=3, doc_start=starts)
    ends = {0: 10, 10: 13, 13: 30}
    expected: dict[tuple[int, int, int], list[int]] = {}
    for b in range(case.batch):
        for t in range(case.tq):
            p, s = case.tk - case.tq + t, int(starts[t])
            for g in range(case.n_kv_heads):
                for j in idx[b, t, g].tolist():
                    if j >= 0 and j * case.sel_block <= p - s:
                        expected.setdefault((b, g, s + j * case.sel_block), []).append(t)
    got: dict[tuple[int, int, int], list[int]] = {}
    for i in range(index.n_items):
        key = int(index.item_key[i])
        if int(index.item_begin[i]) == int(index.item_end[i]):  # padding item (no query)
            continue
        block, bg = key % index.n_blocks, key // index.n_blocks
        base, end = int(index.block_base[block]), int(index.block_end[block])
        rows = index.query_rows[int(index.item_begin[i]):int(index.item_end[i])].tolist()
        assert 1 <= len(rows) <= 3
        assert all(int(starts[t]) <= base < end == ends[int(starts[t])] for t in rows), (base, end, rows)
        got.setdefault((bg // case.n_kv_heads, bg % case.n_kv_heads, base), []).extend(rows)
    assert got == expected


@pytest.mark.parametrize("starts, match", [
    (torch.tensor([0, 0, 0, 0, 2, 2, 2, 2]), "new document starts at its row"),  # 2 is no row's position
    (torch.tensor([0, 0, 0, 3, 3, 0, 0, 0]), "non-decreasing"),
    (torch.tensor([0, 0, 0, 3, 3, 3, 3, 8]), "<= position"),
    (torch.tensor([-1, 0, 0, 0, 0, 0, 0, 0]), "0 <= doc_start"),
    (torch.tensor([0, 0, 0, 0]), r"\[TQ\]"),
    (torch.zeros(8), "int32/int64"),
])
def test_packed_bad_doc_start_raises_value_error(starts, match: str) -> None:
    q, k, v = (torch.randn(shape).to(DEVICE) for shape in ((1, 8, 2, 4), (1, 8, 1, 4), (1, 8, 1, 4)))
    idx = torch.zeros(1, 8, 1, 2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        triton_selected_attention(q, k, v, idx, 4, doc_start=starts.to(DEVICE))


@pytest.mark.parametrize("seed", [0, 1, 2], ids=["int64", "int32", "int64-b"])
@pytest.mark.parametrize("name", ["group3-dk12-dv8", "decode-chunk", "sel-block-24"])
def test_admitted_reads_count_the_keys_each_selected_block_admits(name: str, seed: int) -> None:
    """admitted_reads (one kernel launch) against a loop over the slots: block j >= 0 admits its keys <= p, none
    past the row, -1 slots nothing; indices of either dtype, as a non-contiguous view, and document-relative
    positions that restart (a packed batch)."""
    from optimized.kernels.selected_attention import admitted_reads

    case = CASES[name]
    idx = perturbed_indices(case, seed)
    wide = torch.zeros(idx.shape[:3] + (idx.shape[3] + 2,), dtype=idx.dtype)  # block 0 beside each row
    wide[..., 1:-1] = idx
    idx = wide[..., 1:-1]  # a view with a slot stride past its width
    relative = torch.arange(case.tk - case.tq, case.tk)
    if seed == 2:
        relative = relative % 11  # documents of 11 tokens
    reads = admitted_reads(idx.to(DEVICE), relative.to(DEVICE), case.sel_block).cpu()
    expected = torch.zeros(idx.shape[:3], dtype=torch.int64)
    for b, t, g, s in torch.cartesian_prod(*(torch.arange(n) for n in idx.shape)).tolist():
        j, p = int(idx[b, t, g, s]), int(relative[t])
        if j >= 0:
            expected[b, t, g] += len([key for key in range(j * case.sel_block, (j + 1) * case.sel_block) if key <= p])
    assert reads.dtype == torch.int64 and torch.equal(reads, expected), (reads - expected).abs().max()
    assert expected.sum() > 0 and (expected == 0).any()
