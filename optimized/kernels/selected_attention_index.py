"""Inverted selection index for the deterministic dk/dv backward: for each (batch, KV group, selection block),
the query rows that selected it, as CSR built with torch ops (stable sort + binary searches), split into
work items of at most `queries_per_item` queries.

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
    B, TQ, Hkv, _ = indices.shape
    device = indices.device
    blocks = indices.long()
    positions = torch.arange(n_keys_total - TQ, n_keys_total, device=device).view(1, TQ, 1, 1)
    block_base = block_end = None
    if doc_start is None:
        n_blocks = -(-n_keys_total // sel_block)
        kept = (blocks >= 0) & (blocks * sel_block <= positions)
        block_id = blocks
    else:
        starts = doc_start.long()
        doc_first, row_doc = torch.unique(starts, sorted=True, return_inverse=True)
        doc_stop = torch.cat([doc_first[1:], doc_first.new_full((1,), n_keys_total)])
        doc_blocks = (doc_stop - doc_first + sel_block - 1) // sel_block
        first_block = torch.cumsum(doc_blocks, 0) - doc_blocks
        n_blocks = int(doc_blocks.sum())
        kept = (blocks >= 0) & (blocks * sel_block <= positions - starts.view(1, TQ, 1, 1))
        block_id = first_block[row_doc].view(1, TQ, 1, 1) + blocks
        block_doc = torch.repeat_interleave(torch.arange(doc_first.numel(), device=device), doc_blocks)
        block_base = doc_first[block_doc] + (torch.arange(n_blocks, device=device) - first_block[block_doc]) * sel_block
        block_end = doc_stop[block_doc]
    n_keys = B * Hkv * n_blocks
    n_entries = kept.numel()
    # every entry, kept or not, in row-major order (t ascending for a fixed (b, g)); the others sort last
    b_ix = torch.arange(B, device=device).view(B, 1, 1, 1)
    g_ix = torch.arange(Hkv, device=device).view(1, 1, Hkv, 1)
    # keys 0 .. n_keys in the narrowest integer type: a radix sort makes one pass per key byte
    key_dtype = _key_dtype(n_keys)
    key = torch.where(kept, (b_ix * Hkv + g_ix) * n_blocks + block_id, n_keys).reshape(-1).to(key_dtype)
    sorted_key, order = torch.sort(key, stable=True)
    t_ix = torch.arange(TQ, device=device, dtype=torch.int32).view(1, TQ, 1, 1).expand(blocks.shape).reshape(-1)
    query_rows = t_ix[order]

    # each key's run in the sorted keys (binary searches: no atomics on the blocks every query selects, and no
    # torch.bincount, which reads the largest key back to the host on CUDA)
    key_ids = torch.arange(n_keys, device=device, dtype=key_dtype)
    key_begin = torch.searchsorted(sorted_key, key_ids)
    key_end = torch.searchsorted(sorted_key, key_ids, right=True)
    counts = key_end - key_begin
    per_item = queries_per_item or default_queries_per_item(TQ, indices.shape[-1], n_blocks)
    items_per_key = (counts + per_item - 1) // per_item

    # sum_k ceil(c_k / per_item) <= n_keys + E / per_item; a split key (c > per_item) has fewer than
    # 2 c / per_item items, so the split keys' slots number fewer than 2 E / per_item
    n_items = n_keys + -(-n_entries // per_item)
    n_slots = min(n_items, -(-2 * n_entries // per_item)) + 1  # + the spare slot of the padding items
    padding = n_items - items_per_key.sum(0, keepdim=True)
    item_key = torch.repeat_interleave(torch.arange(n_keys + 1, device=device),
                                       torch.cat([items_per_key, padding]), output_size=n_items)
    is_padding = item_key == n_keys
    item_key = item_key.masked_fill(is_padding, 0)
    first_item = torch.cumsum(items_per_key, 0) - items_per_key
    rank = torch.arange(n_items, device=device) - first_item[item_key]
    item_begin = (key_begin[item_key] + rank * per_item).masked_fill(is_padding, 0)
    item_end = torch.minimum(item_begin + per_item, key_end[item_key]).masked_fill(is_padding, 0)
    is_split = (items_per_key[item_key] > 1) & ~is_padding
    item_slot = torch.where(is_split, torch.cumsum(is_split.long(), 0) - 1, -1).masked_fill(is_padding, n_slots - 1)

    split_key = torch.arange(n_keys, device=device)
    split_items = torch.where(items_per_key > 1, items_per_key, 0)
    slot_end = torch.cumsum(split_items, 0)
    slot_begin = slot_end - split_items
    return InvertedIndex(n_blocks, n_slots, query_rows, item_key, item_begin, item_end, item_slot,
                         split_key, slot_begin, slot_end, block_base, block_end)
