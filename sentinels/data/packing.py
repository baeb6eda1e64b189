"""data.packing varlen: whole documents packed into one row per micro-batch, their boundaries kept (cu_seqlens).

A row holds row_len = micro_batch_size * seq_len tokens (batch size 1, as cu_seqlens requires). Documents (the
records of the source, each followed by EOS as in the contiguous stream) are laid down one after another; the
document that reaches the row's end is cut there and its remaining tokens start the next row as a document of
their own (so a document longer than a row becomes several documents, one per piece). Labels stay inside each
document (data.batch.packed_labels); attention and positions restart at each boundary (reference/packing.py).
"""

from __future__ import annotations

import torch

from reference.packing import cu_seqlens_of

from .batch import Batch


class PackedDocumentSource:
    """Packed rows of tokenized documents; state = the document source's state and the carried-over piece."""

    def __init__(self, documents, tokenizer, *, row_len: int, kind: str):
        if row_len < 1:
            raise ValueError(f"row_len must be >= 1, got {row_len}")
        self.documents, self.tokenizer = documents, tokenizer
        self.row_len, self.kind = row_len, kind
        self.carry: list[int] = []  # tokens of the document cut at the previous row's end

    def _next_document(self) -> list[int]:
        if self.carry:
            doc, self.carry = self.carry, []
            return doc
        return self.tokenizer.encode(self.documents.next_text()) + [self.tokenizer.eos_id]

    def next_batch(self) -> Batch:
        tokens: list[int] = []
        lengths: list[int] = []
        while len(tokens) < self.row_len:
            doc = self._next_document()
            take = min(len(doc), self.row_len - len(tokens))
            tokens += doc[:take]
            lengths.append(take)
            self.carry = doc[take:]
        return Batch.packed(torch.tensor(tokens, dtype=torch.long), cu_seqlens_of(lengths))

    def state_dict(self) -> dict:
        return {"kind": self.kind, "packing": "varlen", "documents": self.documents.state_dict(),
                "carry": list(self.carry)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != self.kind or state.get("packing") != "varlen":
            raise ValueError(f"data state is for a {state.get('kind')!r} source packed "
                             f"{state.get('packing', 'contiguous')!r}, not a {self.kind!r} source packed 'varlen'")
        self.documents.load_state_dict(state["documents"])
        self.carry = list(state["carry"])

    @property
    def quality(self):
        return self.documents.quality

    def describe(self) -> dict:
        return {"source": self.kind, "packing": "varlen", "row_len": self.row_len, "tokenizer": self.tokenizer.name,
                "quality": self.quality.as_dict()}
