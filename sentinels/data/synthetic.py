"""Synthetic token tasks. Each batch is a pure function of (seed, shard, batch counter): resuming is exact.

uniform: i.i.d. uniform tokens in [0, V). A causal model cannot beat ln(V) nats on them.

needle_recall: a long-range recall task. Token ids: values 0..n_values-1, filler n_values..V-3, BOS = V-2,
QUERY = V-1. A window of T+1 tokens is
    BOS, VALUE, filler ..., QUERY, VALUE, filler ..., QUERY, VALUE, ...
with one random VALUE per row and every QUERY at least `reach` positions after the previous VALUE, where
reach = n_layers * (window_size - 1) + 1 (data.pipeline.locals_only_reach): no stack of sliding windows
(layer after layer) lets a QUERY position see a VALUE. The loss counts only the QUERY
positions, whose label is the VALUE: chance is ln(n_values) nats, and only attention that reaches beyond the
window (the compressed or selected branch) can do better.

packing "varlen" (uniform task only): each batch is one packed row of batch_size * seq_len i.i.d. uniform tokens
cut into documents whose lengths are drawn uniformly from [doc_len_min, doc_len_max] (the last one cut at the
row's end), with those boundaries as cu_seqlens.
"""

from __future__ import annotations

import hashlib

import torch

from reference.packing import cu_seqlens_of

from .batch import Batch


def counter_generator(seed: int, shard: int, counter: int) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{shard}/{counter}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def uniform_windows(gen: torch.Generator, batch: int, seq_len: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq_len + 1), generator=gen)


def needle_recall_batch(gen: torch.Generator, batch: int, seq_len: int, vocab: int, n_values: int,
                        reach: int) -> Batch:
    """Each row: BOS, VALUE, then repeatedly filler and QUERY, VALUE with the QUERY at a random distance in
    [reach, reach + reach // 4] after the previous VALUE."""
    bos, query = vocab - 2, vocab - 1
    n_filler = vocab - 2 - n_values
    if seq_len < reach + 2 or n_filler < 1 or reach < 1:
        raise ValueError(f"needle_recall needs seq_len ({seq_len}) >= reach ({reach}) + 2 >= 3 and a filler "
                         f"token (vocab {vocab}, n_values {n_values})")
    windows = n_values + torch.randint(0, n_filler, (batch, seq_len + 1), generator=gen)
    loss_mask = torch.zeros(batch, seq_len, dtype=torch.float32)
    values = torch.randint(0, n_values, (batch,), generator=gen)
    windows[:, 0] = bos
    jitter = reach // 4
    for row in range(batch):
        value = int(values[row])
        windows[row, 1] = value
        last_value = 1
        while True:
            q = last_value + reach + int(torch.randint(0, jitter + 1, (1,), generator=gen))
            if q + 1 > seq_len:
                break
            windows[row, q] = query
            windows[row, q + 1] = value
            loss_mask[row, q] = 1.0  # input QUERY -> label VALUE
            last_value = q + 1
    return Batch.from_windows(windows, loss_mask=loss_mask)


def uniform_documents_row(gen: torch.Generator, row_len: int, vocab: int, doc_len_min: int,
                          doc_len_max: int) -> Batch:
    """One packed row of uniform tokens; document lengths uniform in [doc_len_min, doc_len_max]."""
    lengths: list[int] = []
    filled = 0
    while filled < row_len:
        length = min(int(torch.randint(doc_len_min, doc_len_max + 1, (1,), generator=gen)), row_len - filled)
        lengths.append(length)
        filled += length
    tokens = torch.randint(0, vocab, (row_len,), generator=gen)
    return Batch.packed(tokens, cu_seqlens_of(lengths))


class SyntheticBatchSource:
    """Batches of a synthetic task; state = the number of batches drawn."""

    def __init__(self, task: str, *, vocab_size: int, seq_len: int, batch_size: int, seed: int, shard: int,
                 n_values: int = 16, reach: int = 0, packing: str = "contiguous",
                 doc_lengths: tuple[int, int] = (8, 96)):
        if task not in ("uniform", "needle_recall"):
            raise ValueError(f"data.synthetic.task must be 'uniform' or 'needle_recall', got {task!r}")
        if packing not in ("contiguous", "varlen") or (packing == "varlen" and task != "uniform"):
            raise ValueError(f"data.packing {packing!r} with synthetic task {task!r}: varlen packs the uniform "
                             f"task only")
        if not 1 <= doc_lengths[0] <= doc_lengths[1]:
            raise ValueError(f"synthetic document lengths need 1 <= doc_len_min <= doc_len_max, got {doc_lengths}")
        self.task, self.vocab_size, self.seq_len, self.batch_size = task, vocab_size, seq_len, batch_size
        self.seed, self.shard, self.n_values, self.reach = seed, shard, n_values, reach
        self.packing, self.doc_lengths = packing, doc_lengths
        self.counter = 0

    def next_batch(self) -> Batch:
        gen = counter_generator(self.seed, self.shard, self.counter)
        self.counter += 1
        if self.packing == "varlen":
            return uniform_documents_row(gen, self.batch_size * self.seq_len, self.vocab_size, *self.doc_lengths)
        if self.task == "uniform":
            return Batch.from_windows(uniform_windows(gen, self.batch_size, self.seq_len, self.vocab_size))
        return needle_recall_batch(gen, self.batch_size, self.seq_len, self.vocab_size, self.n_values, self.reach)

    def state_dict(self) -> dict:
        return {"kind": "synthetic", "counter": self.counter}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "synthetic":
            raise ValueError(f"data state is for a {state.get('kind')!r} source, not synthetic")
        self.counter = int(state["counter"])

    def describe(self) -> dict:
        out = {"source": "synthetic", "task": self.task, "vocab_size": self.vocab_size, "packing": self.packing}
        if self.packing == "varlen":
            out["doc_lengths"] = list(self.doc_lengths)
        return out
