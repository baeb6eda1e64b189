"""BatchSource: the configured data source for one shard, with the explicit synthetic fallback.

Building it checks the source before anything else is built (the trainer builds it before the model): each local
file opens, decodes and holds a document among its first lines; fineweb needs `datasets`; the tokenizer loads."""

from __future__ import annotations

import importlib.util
import logging
from typing import Callable

from ..config import RunConfig
from .batch import Batch
from .sources import (DataError, LocalCorpus, LocalDocuments, ShardSpec, StreamingDocuments, TokenWindowSource,
                      check_local_sources, fineweb_opener)
from .packing import PackedDocumentSource
from .synthetic import SyntheticBatchSource
from .tokenizers import get_tokenizer

log = logging.getLogger("sentinels.data")


def locals_only_reach(cfg: RunConfig) -> int:
    """The smallest distance a token must lie behind a query so that no stack of sliding windows reaches it:
    each layer sees keys [p - ws + 1, p], so n_layers layers see back n_layers * (ws - 1) positions."""
    return cfg.model.n_layers * (cfg.model.nsa_config().window_size - 1) + 1


def _doc_lengths(cfg: RunConfig) -> tuple[int, int]:
    return cfg.data.synthetic.doc_len_min, cfg.data.synthetic.doc_len_max


def _primary_source(cfg: RunConfig, shard: ShardSpec, opener=None):
    data, train = cfg.data, cfg.train
    if data.source == "synthetic":
        return SyntheticBatchSource(
            data.synthetic.task, vocab_size=data.synthetic.vocab_size, seq_len=train.seq_len,
            batch_size=train.micro_batch_size, seed=data.shuffle_seed, shard=shard.index,
            n_values=data.synthetic.n_values, reach=locals_only_reach(cfg), packing=data.packing,
            doc_lengths=_doc_lengths(cfg))
    if data.source in ("jsonl", "text"):
        check_local_sources(data.paths, data.source)
    elif opener is None and importlib.util.find_spec("datasets") is None:
        raise DataError("data.source 'fineweb' needs the `datasets` package (pip install datasets); streaming also "
                        "needs network access")
    tokenizer = get_tokenizer(data.tokenizer)
    if data.source in ("jsonl", "text"):
        documents = LocalDocuments(LocalCorpus(data.paths, data.source), data.shuffle_seed, shard)
    else:  # fineweb
        fw = data.fineweb
        opener = opener or fineweb_opener(fw.name, fw.subset, fw.split, data.shuffle_seed, fw.shuffle_buffer, shard)
        documents = StreamingDocuments(opener, where=f"{fw.name}/{fw.subset}[{fw.split}] shard {shard.index}",
                                       max_retries=fw.max_retries, backoff_initial_s=fw.backoff_initial_s,
                                       backoff_max_s=fw.backoff_max_s)
    if data.packing == "varlen":
        return PackedDocumentSource(documents, tokenizer, row_len=train.micro_batch_size * train.seq_len,
                                    kind=data.source)
    return TokenWindowSource(documents, tokenizer, seq_len=train.seq_len, batch_size=train.micro_batch_size,
                             kind=data.source)


class BatchSource:
    """The configured source; on DataError switches to synthetic uniform tokens only if synthetic_on_fail (packed
    the same way as the configured source: data.packing)."""

    def __init__(self, cfg: RunConfig, shard: ShardSpec, *, synthetic_on_fail: bool,
                 on_fallback: Callable[[str], None] | None = None, opener=None):
        self.cfg, self.shard = cfg, shard
        self.synthetic_on_fail = synthetic_on_fail
        self.on_fallback = on_fallback
        self.fallback: SyntheticBatchSource | None = None
        self.fallback_reason: str | None = None
        self.primary = None
        try:
            self.primary = _primary_source(cfg, shard, opener)
        except DataError as exc:
            self._fall_back(exc)

    def _fall_back(self, exc: DataError) -> None:
        if not self.synthetic_on_fail:
            raise exc
        reason = f"{type(exc).__name__}: {exc}"
        banner = "!" * 100
        log.error("%s\nDATA SOURCE FAILED; FALLING BACK TO SYNTHETIC UNIFORM TOKENS (--synthetic-on-fail)\n%s\n%s",
                  banner, reason, banner)
        self.fallback_reason = reason
        self.fallback = SyntheticBatchSource("uniform", vocab_size=self.cfg.vocab_size(),
                                             seq_len=self.cfg.train.seq_len,
                                             batch_size=self.cfg.train.micro_batch_size,
                                             seed=self.cfg.data.shuffle_seed, shard=self.shard.index,
                                             packing=self.cfg.data.packing, doc_lengths=_doc_lengths(self.cfg))
        if self.on_fallback is not None:
            self.on_fallback(reason)

    def next_batch(self) -> Batch:
        if self.fallback is None:
            try:
                return self.primary.next_batch()
            except DataError as exc:
                self._fall_back(exc)
        return self.fallback.next_batch()

    def state_dict(self) -> dict:
        return {
            "primary": None if self.primary is None else self.primary.state_dict(),
            "fallback": None if self.fallback is None else self.fallback.state_dict(),
            "fallback_reason": self.fallback_reason,
        }

    def load_state_dict(self, state: dict) -> None:
        if state["primary"] is not None and self.primary is not None:
            self.primary.load_state_dict(state["primary"])
        if state["fallback"] is not None:
            if self.fallback is None:
                self._fall_back(DataError(f"resumed a run that had fallen back: {state['fallback_reason']}"))
            self.fallback.load_state_dict(state["fallback"])

    def describe(self) -> dict:
        out = {"shard": [self.shard.index, self.shard.count]}
        if self.primary is not None:
            out.update(self.primary.describe())
        if self.fallback is not None:
            out["fallback"] = {"active": True, "reason": self.fallback_reason}
        return out
