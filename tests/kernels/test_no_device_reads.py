"""The kernel path plans its launches on the host: the per-layer steps that used to read a value back from the
device (and so made the host wait for every kernel queued before) now compute it on the host or leave the check
to the device.

- the selection's per-row range widths (its chunk plan and each chunk's width) come from the same seam evaluated on
  host integers (range_attention.sequence_ranges), equal to the device's hi - lo + 1, cached per shape, config and
  seam functions;
- the ranges nsa_forward builds are checked by a device-side assertion (check_range_inputs(sync=False)), which
  still stops a broken range with the rules in its message;
- the compressed ranges' binary search takes its step count from a host bound;
- the selected-attention backward's inverted index (dk/dv work items) has sizes bounded from the shape, so
  building it reads nothing back (a packed batch still reads its document count).

On CPU a read-back cannot be told from a host computation, so these tests check the pieces (no `.cpu()`, no
scalar read); tests/gpu/test_no_host_sync.py runs the whole forward under torch.cuda.set_sync_debug_mode.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from optimized import masks
from optimized.kernels import selection
from optimized.kernels.selected_attention_index import build_inverted_index
from optimized.kernels.range_attention import (check_range_inputs, compressed_branch, compressed_ranges,
                                               sequence_ranges, visible_block_count, window_branch, window_ranges)
from reference.config import NSAConfig

CFG = NSAConfig(cmp_block=8, cmp_stride=4, sel_block=16, n_sel=3, n_init=1, n_local=1, window=10, n_heads=4,
                n_kv_heads=2, head_dim_qk=8, head_dim_v=8, phi="avg")


class ScalarReads(TorchDispatchMode):
    """Records every op that turns a tensor element into a Python number (.item(), int(), bool(): on CUDA each
    one waits for the device)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        sized_by_values = name.startswith("aten.repeat_interleave") and (kwargs or {}).get("output_size") is None
        if func is torch.ops.aten._local_scalar_dense.default or "nonzero" in name or "bincount" in name \
                or "unique" in name or sized_by_values:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def device_widths(first: int, n_rows: int, n_compressed: int, cfg: NSAConfig) -> torch.Tensor:
    lo, hi = compressed_ranges(torch.arange(first, first + n_rows), n_compressed, cfg)
    return torch.clamp(hi - lo + 1, min=0)


@pytest.mark.parametrize("visibility", ["inclusive", "strict"])
@pytest.mark.parametrize("first, n_rows", [(0, 1), (0, 70), (37, 20), (0, 129)])
def test_host_widths_equal_the_device_ranges(visibility, first, n_rows):
    cfg = CFG.replace(cmp_visibility=visibility)
    n_compressed = masks.compressed_block_count(first + n_rows, cfg)
    got = sequence_ranges("cmp", first, n_rows, n_compressed, cfg, torch.device("cpu")).widths
    assert torch.equal(got, device_widths(first, n_rows, n_compressed, cfg))
    assert got.device.type == "cpu"


def test_a_replaced_seam_gets_its_own_host_widths(monkeypatch):
    """A planted visibility bug (a block visible one token early) reaches the host widths as it reaches the
    device ranges: the cache is keyed by the seam function."""
    n_rows = 64
    n_compressed = masks.compressed_block_count(n_rows, CFG)
    clean = sequence_ranges("cmp", 0, n_rows, n_compressed, CFG, torch.device("cpu")).widths
    original = masks.compressed_block_visible
    monkeypatch.setattr(masks, "compressed_block_visible", lambda i, pos, cfg: original(i, pos + 1, cfg))
    planted = sequence_ranges("cmp", 0, n_rows, n_compressed, CFG, torch.device("cpu")).widths
    assert torch.equal(planted, device_widths(0, n_rows, n_compressed, CFG))
    assert not torch.equal(planted, clean)


def test_selection_rows_with_a_known_first_position_copy_nothing_back(monkeypatch):
    g = torch.Generator().manual_seed(0)
    T = 48
    q = torch.randn(1, T, CFG.n_heads, CFG.head_dim_qk, generator=g)
    n_compressed = masks.compressed_block_count(T, CFG)
    k_cmp = torch.randn(1, n_compressed, CFG.n_kv_heads, CFG.head_dim_qk, generator=g)
    positions = torch.arange(T)
    _, softmax, _ = compressed_branch(q, k_cmp, None, CFG, positions)
    copied = []
    real_cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: copied.append(self.shape) or real_cpu(self, *a,
                                                                                                         **k))
    rows = selection.selection_rows(q, k_cmp, CFG, positions, None, softmax, first_position=0)
    assert not copied, f"selection_rows copied tensors of shapes {copied} back to the host"
    assert torch.equal(rows.widths, torch.clamp(softmax.hi.long() - softmax.lo.long() + 1, min=0))
    selection.selection_rows(q, k_cmp, CFG, positions, None, softmax)  # without it: one copy, as before
    assert copied


def test_the_device_side_range_check_reads_nothing_and_still_refuses_a_broken_range():
    T = 40
    q = torch.randn(1, T, CFG.n_heads, CFG.head_dim_qk)
    k = v = torch.randn(1, T, CFG.n_kv_heads, CFG.head_dim_qk)
    lo, hi = window_ranges(torch.arange(T), CFG)
    with ScalarReads() as mode:
        check_range_inputs(q, k, v, lo, hi, sync=False)
    assert not mode.reads, mode.reads
    broken = hi.clone()
    broken[5] = T  # past the last key
    with pytest.raises(RuntimeError, match="breaks the rules 0 <= lo <= TK"):
        check_range_inputs(q, k, v, lo, broken, sync=False)
    with pytest.raises(ValueError, match="the range of row 5"):
        check_range_inputs(q, k, v, lo, broken)


def test_the_visible_block_search_reads_nothing():
    rel = torch.arange(100)
    with ScalarReads() as mode:
        count = visible_block_count(rel, 23, CFG, 23)
    assert not mode.reads, mode.reads
    want = masks.compressed_block_visible(torch.arange(23)[None, :], rel[:, None], CFG).sum(1)
    assert torch.equal(count, want)


def test_the_inverted_index_reads_nothing():
    g = torch.Generator().manual_seed(2)
    B, TQ, Hkv, n, sel_block = 2, 30, 2, 3, 4
    indices = torch.randint(-1, 8, (B, TQ, Hkv, n), generator=g)
    with ScalarReads() as mode:
        index = build_inverted_index(indices, TQ, sel_block, queries_per_item=2)
    assert not mode.reads, mode.reads
    assert index.n_items == B * Hkv * -(-TQ // sel_block) + -(-indices.numel() // 2)


class OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("branch", ["cmp", "win"])
def test_sequence_ranges_equal_the_ranges_and_are_built_once(branch, monkeypatch):
    """The cached ranges of one sequence equal compressed_ranges / window_ranges (as int32, with their read
    counts and the longest range); a second layer asking for them costs no op; a replaced seam gets its own
    ranges."""
    first, n_rows = 3, 45
    n_keys = masks.compressed_block_count(first + n_rows, CFG) if branch == "cmp" else first + n_rows

    def fresh():
        positions = torch.arange(first, first + n_rows)
        return compressed_ranges(positions, n_keys, CFG) if branch == "cmp" else window_ranges(positions, CFG)

    def cached():
        return sequence_ranges(branch, first, n_rows, n_keys, CFG, torch.device("cpu"))

    lo, hi, reads, _, max_width = cached()
    want_lo, want_hi = fresh()
    assert lo.dtype == hi.dtype == torch.int32
    assert torch.equal(lo.long(), want_lo) and torch.equal(hi.long(), want_hi)
    assert torch.equal(reads.long(), torch.clamp(want_hi - want_lo + 1, min=0))
    assert max_width == int((want_hi - want_lo + 1).max()) and max_width > 0
    with OpCount() as ops:
        again = cached()
    assert ops.n == 0 and again[0] is lo
    seam = "compressed_block_visible" if branch == "cmp" else "window_start"
    original = getattr(masks, seam)
    monkeypatch.setattr(masks, seam, lambda a, b, *rest: original(a, b + 1, *rest) if branch == "cmp"
                        else original(a - 1, b, *rest))
    planted_lo, planted_hi, *_ = cached()
    want_lo, want_hi = fresh()
    assert torch.equal(planted_lo.long(), want_lo) and torch.equal(planted_hi.long(), want_hi)
    assert not (torch.equal(planted_lo, lo) and torch.equal(planted_hi, hi))


def test_the_branches_of_one_sequence_use_the_cached_ranges():
    """compressed_branch / window_branch with first_position give what they give without it (outputs and reads),
    and build no ranges on the second call."""
    g = torch.Generator().manual_seed(4)
    T = 40
    q = torch.randn(1, T, CFG.n_heads, CFG.head_dim_qk, generator=g)
    k = torch.randn(1, T, CFG.n_kv_heads, CFG.head_dim_qk, generator=g)
    v = torch.randn(1, T, CFG.n_kv_heads, CFG.head_dim_v, generator=g)
    n_compressed = masks.compressed_block_count(T, CFG)
    k_cmp = torch.randn(1, n_compressed, CFG.n_kv_heads, CFG.head_dim_qk, generator=g)
    v_cmp = torch.randn(1, n_compressed, CFG.n_kv_heads, CFG.head_dim_v, generator=g)
    positions = torch.arange(T)
    o, softmax, reads = compressed_branch(q, k_cmp, v_cmp, CFG, positions)
    o_c, softmax_c, reads_c = compressed_branch(q, k_cmp, v_cmp, CFG, positions, first_position=0)
    assert torch.equal(o, o_c) and torch.equal(reads, reads_c) and reads.dtype == reads_c.dtype
    assert torch.equal(softmax.lo, softmax_c.lo) and torch.equal(softmax.hi, softmax_c.hi)
    o_w, reads_w = window_branch(q, k, v, CFG, positions)
    o_wc, reads_wc = window_branch(q, k, v, CFG, positions, first_position=0)
    assert torch.equal(o_w, o_wc) and torch.equal(reads_w, reads_wc) and reads_w.dtype == reads_wc.dtype
    with OpCount() as cold:
        compressed_branch(q, k_cmp, v_cmp, CFG, positions)
    with OpCount() as warm:
        compressed_branch(q, k_cmp, v_cmp, CFG, positions, first_position=0)
    assert warm.n < cold.n, (warm.n, cold.n)
