"""Inverted selection index for the deterministic dk/dv backward: for each (batch, KV group, selection block),
the query rows that selected it, as CSR: one kernel writes every entry's sort key, a stable torch sort orders
them, and two small kernels find each key's run in the sorted keys (binary search) and cut the runs into work items
of at most `queries_per_item` queries (binary search over the running count of items): a few launches where torch
ops took about eighty.

A block selected by many queries (block 0 is forced for every query, Eq. 11) would make one program loop over
all TQ queries; such blocks are split over several items whose fp32 partial dk/dv go to workspace slots and
are summed afterwards in slot order. Every sum therefore runs in a fixed order: dk/dv are bitwise
reproducible without atomics.

The index has a size known on the host before any index value is (no device sync, so the host keeps queueing
kernels while the GPU works): entries, work items and workspace slots are allocated at their upper bounds for the
shape. Entries that are not kept sort after every kept one; work items past the real ones are padding (key 0, no
query, writing zeros to a spare workspace slot no key reads); every key is listed for the slot reduction, with an
empty slot range when it was not split.

Packed batches (doc_start given): indices are document-relative, so a block is keyed by a global
(document, block) id; block_base / block_end give its first key and its document's end (exclusive), so the dk/dv
programs of one document's last, partial block never write keys of the next document.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

MIN_QUERIES_PER_ITEM = 64


@dataclass
class InvertedIndex:
    """CSR of (b, g, j) -> query rows, cut into work items.

    query_rows [E] int32: query rows t (ascending within a key), keys ordered by key = (b * Hkv + g) * NB + j; E =
    B * TQ * Hkv * n, the entries past the kept ones unused.
    item_key / item_begin / item_end [I]: item i covers query_rows[item_begin[i]:item_end[i]] of key item_key[i];
    I = n_keys + ceil(E / queries_per_item) (a bound of the real items, which come first; padding items have
    begin = end = 0).
    item_slot [I]: -1 if item i is its key's only item (writes dk/dv directly), else its workspace slot (padding
    items: the spare slot n_slots - 1).
    split_key / slot_begin / slot_end [n_keys]: every key and the slot range holding its partials (empty when the
    key was not split).
    n_slots: workspace slots to allocate (a bound of the real slots, plus the spare one).
    block_base / block_end [NB] int64 (packed batch only, else None): first key of block id j and the end
    (exclusive) of its document; j counts the blocks of the rows' documents in document order.
    """

    n_blocks: int
    n_slots: int
    query_rows: Tensor
    item_key: Tensor
    item_begin: Tensor
    item_end: Tensor
    item_slot: Tensor
    split_key: Tensor
    slot_begin: Tensor
    slot_end: Tensor
    block_base: Tensor | None = None
    block_end: Tensor | None = None

    @property
    def n_items(self) -> int:
        return self.item_key.numel()


def default_queries_per_item(n_queries: int, n_selected: int, n_blocks: int) -> int:
    """Twice the most entries a block's list holds on average, TQ * n / NB (a power of two, >= 64): typical blocks
    stay whole, hot blocks are split.

    A function of the shapes only, never of which blocks were chosen: the item boundaries of a block's (ascending)
    query list then do not move when later queries select differently, so dk/dv of a key are summed in the same
    order whatever the queries after a position did (the no-peeking property compares gradients bit for bit).
    """
    if n_blocks == 0:
        return MIN_QUERIES_PER_ITEM
    return max(MIN_QUERIES_PER_ITEM, triton.next_power_of_2(-(-2 * n_queries * n_selected // n_blocks)))


def _key_dtype(n_keys: int) -> torch.dtype:
    """The narrowest signed integer type holding 0 .. n_keys."""
    for dtype in (torch.int16, torch.int32):
        if n_keys <= torch.iinfo(dtype).max:
            return dtype
    return torch.int64


def build_inverted_index(indices: Tensor, n_keys_total: int, sel_block: int,
                         queries_per_item: int | None = None, doc_start: Tensor | None = None) -> InvertedIndex:
    """Invert indices [B, TQ, Hkv, n] (queries at the last TQ of n_keys_total positions).

    Only entries whose block has a visible key are kept: j >= 0 and j * sel_block <= p (Eq. 12 clip), so every
    listed query has at least one key in the block. A block listed twice by one query appears twice (the
    forward then also counts its tokens twice).
    doc_start [TQ] (packed batch): row t's document starts at key doc_start[t] and runs to the next larger
    doc_start of the rows (or n_keys_total); its block j covers keys doc_start[t] + j * sel_block .. and the
    clip is j * sel_block <= p - doc_start[t].
    """
    B, TQ, Hkv, n_sel = indices.shape
    device = indices.device
    block_base = block_end = row_start = row_first_block = None
    if doc_start is None:
        n_blocks = -(-n_keys_total // sel_block)
    else:
        starts = doc_start.long()
        doc_first, row_doc = torch.unique(starts, sorted=True, return_inverse=True)
        doc_stop = torch.cat([doc_first[1:], doc_first.new_full((1,), n_keys_total)])
        doc_blocks = (doc_stop - doc_first + sel_block - 1) // sel_block
        first_block = torch.cumsum(doc_blocks, 0) - doc_blocks
        n_blocks = int(doc_blocks.sum())
        row_start, row_first_block = starts.contiguous(), first_block[row_doc].contiguous()
        block_doc = torch.repeat_interleave(torch.arange(doc_first.numel(), device=device), doc_blocks)
        block_base = doc_first[block_doc] + (torch.arange(n_blocks, device=device) - first_block[block_doc]) * sel_block
        block_end = doc_stop[block_doc]
    n_keys = B * Hkv * n_blocks
    n_entries = indices.numel()
    # every entry, kept or not, in row-major order (t ascending for a fixed (b, g)); the others sort last.
    # Keys 0 .. n_keys in the narrowest integer type: a radix sort makes one pass per key byte
    key = torch.empty(n_entries, dtype=_key_dtype(n_keys), device=device)
    if n_entries:
        packed = row_start is not None
        _entry_keys_kernel[(triton.cdiv(n_entries, KEY_BLOCK),)](
            indices, *indices.stride(), row_start if packed else key, row_first_block if packed else key, key,
            TQ, Hkv, n_sel, n_keys_total - TQ, sel_block, n_blocks, n_keys, n_entries, PACKED=packed,
            BLOCK=KEY_BLOCK)
    sorted_key, order = torch.sort(key, stable=True)
    t_ix = torch.arange(TQ, device=device, dtype=torch.int32).view(1, TQ, 1, 1).expand(indices.shape).reshape(-1)
    query_rows = t_ix[order]

    per_item = queries_per_item or default_queries_per_item(TQ, indices.shape[-1], n_blocks)
    # sum_k ceil(c_k / per_item) <= n_keys + E / per_item; a split key (c > per_item) has fewer than
    # 2 c / per_item items, so the split keys' slots number fewer than 2 E / per_item
    n_items = n_keys + -(-n_entries // per_item)
    n_slots = min(n_items, -(-2 * n_entries // per_item)) + 1  # + the spare slot of the padding items
    item_key, item_begin, item_end, item_slot, split_key, slot_begin, slot_end = _work_items(
        sorted_key, n_keys, n_items, n_slots, per_item)

    return InvertedIndex(n_blocks, n_slots, query_rows, item_key, item_begin, item_end, item_slot,
                         split_key, slot_begin, slot_end, block_base, block_end)


KEY_BLOCK = 1024  # keys (first kernel) or work items (second) per program


@triton.jit
def _entry_keys_kernel(IDX, stride_b, stride_t, stride_g, stride_s, ROW_START, ROW_FIRST_BLOCK, KEY,
                       n_queries, n_kv_heads, n_sel, first_position, sel_block, n_blocks, n_keys, n_entries,
                       PACKED: tl.constexpr, BLOCK: tl.constexpr):
    """The sort key of every entry (b, t, g, slot) of the indices, in row-major order: (b * Hkv + g) * NB + block id
    where the entry's block j has a visible key (j >= 0 and j * sel_block <= p, p = first_position + t, measured
    from the document start in a packed batch, whose block ids start at the row's document's first block), else
    n_keys (sorts after every kept entry)."""
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = e < n_entries
    slot = e % n_sel
    row = e // n_sel
    g = row % n_kv_heads
    t = (row // n_kv_heads) % n_queries
    b = row // n_kv_heads // n_queries
    j = tl.load(IDX + b * stride_b + t * stride_t + g * stride_g + slot * stride_s, mask=valid, other=-1)
    j = j.to(tl.int64)
    p = first_position + t
    if PACKED:
        p -= tl.load(ROW_START + t, mask=valid, other=0)
        block_id = tl.load(ROW_FIRST_BLOCK + t, mask=valid, other=0) + j
    else:
        block_id = j
    kept = (j >= 0) & (j * sel_block <= p)
    key = tl.where(kept, (b * n_kv_heads + g) * n_blocks + block_id, n_keys)
    tl.store(KEY + e, key.to(KEY.dtype.element_ty), mask=valid)


@triton.jit
def _halve(SORTED, target, lo, hi, valid, UPPER: tl.constexpr):
    """One step of a binary search of target in the ascending SORTED, per lane, over [lo, hi): after enough steps
    (_halvings) lo is the first position whose value is above target (UPPER) or at least target (a lower bound)."""
    mid = (lo + hi) // 2
    open_ = lo < hi
    value = tl.load(SORTED + mid, mask=valid & open_, other=0).to(tl.int64)
    if UPPER:
        right = open_ & (value <= target)
    else:
        right = open_ & (value < target)
    return tl.where(right, mid + 1, lo), tl.where(open_ & ~right, mid, hi)


@triton.jit
def _key_runs_kernel(SORTED, n_entries, n_keys, per_item, steps, BEGIN, END, COUNTS, BLOCK: tl.constexpr):
    """For keys k of this program's block: their run [BEGIN[k], END[k]) in the sorted keys (lower and upper bound,
    `steps` halvings of [0, n_entries]), the run's work items COUNTS[0, k] = ceil(run / per_item) and, for a split
    key (more than one item), its workspace slots COUNTS[1, k] (0 otherwise)."""
    k = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = k < n_keys
    lo_b = tl.zeros([BLOCK], dtype=tl.int64)
    hi_b = tl.zeros([BLOCK], dtype=tl.int64) + n_entries
    lo_e = tl.zeros([BLOCK], dtype=tl.int64)
    hi_e = tl.zeros([BLOCK], dtype=tl.int64) + n_entries
    for _ in range(steps):  # both searches in one loop: their loads overlap
        lo_b, hi_b = _halve(SORTED, k, lo_b, hi_b, valid, UPPER=False)
        lo_e, hi_e = _halve(SORTED, k, lo_e, hi_e, valid, UPPER=True)
    items = (lo_e - lo_b + per_item - 1) // per_item
    tl.store(BEGIN + k, lo_b, mask=valid)
    tl.store(END + k, lo_e, mask=valid)
    tl.store(COUNTS + k, items, mask=valid)
    tl.store(COUNTS + n_keys + k, tl.where(items > 1, items, 0), mask=valid)


@triton.jit
def _work_items_kernel(BEGIN, END, COUNTS, TOTALS, n_keys, n_items, per_item, spare_slot, steps,
                       ITEM_KEY, ITEM_BEGIN, ITEM_END, ITEM_SLOT, SPLIT_KEY, SLOT_BEGIN, BLOCK: tl.constexpr):
    """Work item i of this program's block: its key is the first whose running item total TOTALS[0, k] (inclusive)
    exceeds i, its rank r = i - the items before that key; it covers the key's run from BEGIN + r * per_item, at
    most per_item rows, and writes to workspace slot (slots before the key) + r when the key is split, else -1.
    Items past every key's are padding (key 0, no rows, the spare slot). The program's block of keys also gets
    SPLIT_KEY = k and SLOT_BEGIN = its first slot (TOTALS[1] holds the slot ends)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = i < n_items
    lo = tl.zeros([BLOCK], dtype=tl.int64)
    hi = tl.zeros([BLOCK], dtype=tl.int64) + n_keys
    for _ in range(steps):
        lo, hi = _halve(TOTALS, i, lo, hi, valid, UPPER=True)
    padding = lo >= n_keys
    key = tl.where(padding, 0, lo)
    real = valid & ~padding
    items = tl.load(COUNTS + key, mask=real, other=0)
    slots = tl.load(COUNTS + n_keys + key, mask=real, other=0)
    rank = i - (tl.load(TOTALS + key, mask=real, other=0) - items)
    begin = tl.load(BEGIN + key, mask=real, other=0) + rank * per_item
    end = tl.minimum(begin + per_item, tl.load(END + key, mask=real, other=0))
    first_slot = tl.load(TOTALS + n_keys + key, mask=real, other=0) - slots
    slot = tl.where(items > 1, first_slot + rank, -1)
    tl.store(ITEM_KEY + i, key, mask=valid)
    tl.store(ITEM_BEGIN + i, tl.where(padding, 0, begin), mask=valid)
    tl.store(ITEM_END + i, tl.where(padding, 0, end), mask=valid)
    tl.store(ITEM_SLOT + i, tl.where(padding, spare_slot, slot), mask=valid)
    own = i < n_keys
    tl.store(SPLIT_KEY + i, i, mask=own)
    own_slots = tl.load(COUNTS + n_keys + i, mask=own, other=0)
    tl.store(SLOT_BEGIN + i, tl.load(TOTALS + n_keys + i, mask=own, other=0) - own_slots, mask=own)


def _halvings(n: int) -> int:
    """Binary-search steps that shrink any interval of [0, n] to a point."""
    return max(1, int(n).bit_length() + 1)


def _work_items(sorted_key: Tensor, n_keys: int, n_items: int, n_slots: int, per_item: int) -> tuple[Tensor, ...]:
    """(item_key, item_begin, item_end, item_slot, split_key, slot_begin, slot_end), int64, of the InvertedIndex
    over the stably sorted entry keys (keys 0 .. n_keys - 1 kept, n_keys for entries not kept)."""
    device = sorted_key.device
    n_entries = sorted_key.numel()
    begin = torch.empty(n_keys, dtype=torch.int64, device=device)
    end = torch.empty_like(begin)
    counts = torch.empty((2, n_keys), dtype=torch.int64, device=device)  # items of each key, slots of each key
    if n_keys:
        _key_runs_kernel[(triton.cdiv(n_keys, KEY_BLOCK),)](sorted_key, n_entries, n_keys, per_item,
                                                            _halvings(n_entries), begin, end, counts,
                                                            BLOCK=KEY_BLOCK)
    totals = torch.cumsum(counts, dim=1)  # running items (row 0) and slot ends (row 1)
    item_key, item_begin, item_end, item_slot = (torch.empty(n_items, dtype=torch.int64, device=device)
                                                 for _ in range(4))
    split_key = torch.empty(n_keys, dtype=torch.int64, device=device)
    slot_begin = torch.empty_like(split_key)
    if n_items:
        _work_items_kernel[(triton.cdiv(max(n_items, n_keys), KEY_BLOCK),)](
            begin, end, counts, totals, n_keys, n_items, per_item, n_slots - 1, _halvings(n_keys),
            item_key, item_begin, item_end, item_slot, split_key, slot_begin, BLOCK=KEY_BLOCK)
    return item_key, item_begin, item_end, item_slot, split_key, slot_begin, totals[1]
