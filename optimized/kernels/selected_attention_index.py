"""Inverted selection index for the deterministic dk/dv backward: for each (batch, KV group, selection block),
the query rows that selected it, as CSR built with torch ops (stable sort + bincount + cumsum), split into
work items of at most `queries_per_item` queries.

A block selected by many queries (block 0 is forced for every query, Eq. 11) would make one program loop over
all TQ queries; such blocks are split over several items whose fp32 partial dk/dv go to workspace slots and
are summed afterwards in slot order. Every sum therefore runs in a fixed order: dk/dv are bitwise
reproducible without atomics.

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

    query_rows [E] int32: query rows t (ascending within a key), keys ordered by key = (b * Hkv + g) * NB + j.
    item_key / item_begin / item_end [I]: item i covers query_rows[item_begin[i]:item_end[i]] of key item_key[i].
    item_slot [I]: -1 if item i is its key's only item (writes dk/dv directly), else its workspace slot.
    split_key / slot_begin / slot_end [S]: keys cut into several items and the slot range holding their partials.
    block_base / block_end [NB] int64 (packed batch only, else None): first key of block id j and the end
    (exclusive) of its document; j counts the blocks of the rows' documents in document order.
    """

    n_blocks: int
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

    @property
    def n_slots(self) -> int:
        return int(self.slot_end[-1]) if self.split_key.numel() else 0


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
    b_ix, t_ix, g_ix, _ = kept.nonzero(as_tuple=True)  # row-major: t ascending for a fixed (b, g)
    key = (b_ix * Hkv + g_ix) * n_blocks + block_id.expand(blocks.shape)[kept]
    order = torch.sort(key, stable=True).indices
    query_rows = t_ix[order].to(torch.int32)

    n_keys = B * Hkv * n_blocks
    counts = torch.bincount(key, minlength=n_keys)
    key_end = torch.cumsum(counts, 0)
    key_begin = key_end - counts
    per_item = queries_per_item or default_queries_per_item(TQ, indices.shape[-1], n_blocks)
    items_per_key = (counts + per_item - 1) // per_item

    item_key = torch.repeat_interleave(torch.arange(n_keys, device=device), items_per_key)
    first_item = torch.cumsum(items_per_key, 0) - items_per_key
    rank = torch.arange(item_key.numel(), device=device) - first_item[item_key]
    item_begin = key_begin[item_key] + rank * per_item
    item_end = torch.minimum(item_begin + per_item, key_end[item_key])
    is_split = items_per_key[item_key] > 1
    item_slot = torch.where(is_split, torch.cumsum(is_split.long(), 0) - 1, -1)

    split_key = (items_per_key > 1).nonzero(as_tuple=True)[0]
    slot_end = torch.cumsum(items_per_key[split_key], 0)
    slot_begin = slot_end - items_per_key[split_key]
    return InvertedIndex(n_blocks, query_rows, item_key, item_begin, item_end, item_slot,
                         split_key, slot_begin, slot_end, block_base, block_end)
