"""Document sources and the token-window batch source.

Local files: JSONL in the FineWeb-Edu format (one {"text": ...} object per line) or plain text (one document
per line). Files are indexed by line offset; every epoch visits the records in a permutation seeded by
(shuffle_seed, epoch), and shard s of S takes every S-th record of it (shard = rank * workers + worker).

Streaming: FineWeb-Edu through `datasets` (imported lazily), shuffled with a seeded buffer and split by shard;
failures are retried with exponential backoff, reopening the stream after the documents already consumed.

Bad records (malformed JSON, no "text" string, empty text, non-UTF-8 bytes) are counted and skipped with a
warning; a pass over the data that yields no document at all raises DataError.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from ..errors import InputError
from .batch import Batch

log = logging.getLogger("sentinels.data")

BAD_KINDS = ("malformed_json", "missing_text", "empty_doc", "non_utf8")


class DataError(InputError, RuntimeError):
    """The data source cannot deliver documents (everything dropped, files missing, stream dead)."""


@dataclass(frozen=True)
class ShardSpec:
    """This reader's share of the data: shard `index` of `count` (index = rank * workers + worker)."""

    index: int
    count: int

    @classmethod
    def for_rank(cls, rank: int, world_size: int, worker: int = 0, workers: int = 1) -> "ShardSpec":
        if not (0 <= rank < world_size and 0 <= worker < workers):
            raise ValueError(f"bad shard: rank {rank} of {world_size}, worker {worker} of {workers}")
        return cls(index=rank * workers + worker, count=world_size * workers)


class DataQuality:
    """Counts of good and skipped records; warns on the first bad record of each kind and every 1000th."""

    def __init__(self, where: str):
        self.where = where
        self.counts: Counter[str] = Counter()

    def good(self) -> None:
        self.counts["ok"] += 1

    def bad(self, kind: str, detail: str) -> None:
        assert kind in BAD_KINDS, kind
        self.counts[kind] += 1
        n = self.counts[kind]
        if n == 1 or n % 1000 == 0:
            log.warning("data: skipped %s record #%d in %s: %s", kind, n, self.where, detail)

    @property
    def skipped(self) -> int:
        return sum(self.counts[k] for k in BAD_KINDS)

    def as_dict(self) -> dict[str, int]:
        return {k: int(self.counts[k]) for k in ("ok", *BAD_KINDS)}


def record_text(raw: bytes, fmt: str) -> tuple[str | None, str | None, str]:
    """(text, None, "") for a good raw line, else (None, kind, why) with kind one of BAD_KINDS."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, "non_utf8", f"not UTF-8 text ({exc.reason} at byte {exc.start})"
    if fmt == "jsonl":
        if not line.strip():
            return None, "empty_doc", "blank line"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            return None, "malformed_json", f"not JSON ({exc.msg} at column {exc.colno})"
        text = obj.get("text") if isinstance(obj, dict) else None
        if not isinstance(text, str):
            return None, "missing_text", "no string field 'text'"
    else:
        text = line.rstrip("\r\n")
    if not text.strip():
        return None, "empty_doc", "empty text"
    return text, None, ""


def parse_record(raw: bytes, fmt: str, quality: DataQuality, where: str) -> str | None:
    """The text of one raw line, or None (counted in quality) when it is bad."""
    text, kind, why = record_text(raw, fmt)
    if text is None:
        quality.bad(kind, f"{where}: {why}")
        return None
    quality.good()
    return text


CHECK_LINES = 1000  # check_local_sources reads at most this many lines of a file looking for one document


def check_local_sources(paths: list[str], fmt: str) -> None:
    """Before anything is built: every data.paths entry is a readable file holding at least one document among
    its first CHECK_LINES lines (UTF-8; JSONL: an object with a string "text"). DataError names the entry and
    the rule; a file whose first lines are all bad reports the first line's problem."""
    for i, name in enumerate(paths):
        where = f"data.paths[{i}] {name}"
        path = Path(name)
        if path.is_dir():
            raise DataError(f"{where}: is a directory, not a file ({fmt} source: one file per entry)")
        if not path.is_file():
            raise DataError(f"{where}: file not found")
        try:
            with path.open("rb") as fh:
                lines = [raw.rstrip(b"\n") for _, raw in zip(range(CHECK_LINES), fh)]
        except OSError as exc:
            raise DataError(f"{where}: cannot be read ({exc.strerror or exc})") from None
        if not lines:
            raise DataError(f"{where}: is empty")
        binary = next((number for number, raw in enumerate(lines, 1) if b"\0" in raw), None)
        if binary is not None:
            raise DataError(f"{where}: line {binary} holds NUL bytes: a binary file, not {fmt} text")
        first_problem = None
        for number, raw in enumerate(lines, 1):
            text, kind, why = record_text(raw, fmt)
            if text is not None:
                break
            first_problem = first_problem or f"line {number}: {why}"
        else:
            shown = f"its first {len(lines)} lines" if len(lines) == CHECK_LINES else f"its {len(lines)} line(s)"
            expected = 'a JSON object with a string field "text"' if fmt == "jsonl" else "a non-empty line"
            raise DataError(f"{where}: holds no document in {shown} (each must be {expected}; {first_problem})")


class LocalCorpus:
    """Records of local JSONL/text files, addressed by (file, byte offset) of each line."""

    def __init__(self, paths: list[str], fmt: str):
        if fmt not in ("jsonl", "text"):
            raise ValueError(f"local corpus format must be 'jsonl' or 'text', got {fmt!r}")
        self.fmt = fmt
        self.paths = [Path(p) for p in paths]
        missing = [str(p) for p in self.paths if not p.is_file()]
        if missing:
            raise DataError(f"data.paths: file(s) not found: {missing}")
        self.index: list[tuple[int, int]] = []
        for file_no, path in enumerate(self.paths):
            offset = 0
            with path.open("rb") as fh:
                for raw in fh:
                    self.index.append((file_no, offset))
                    offset += len(raw)
        if not self.index:
            raise DataError(f"data.paths: the files {[str(p) for p in self.paths]} hold no lines")
        self._handles: dict[int, object] = {}

    def __len__(self) -> int:
        return len(self.index)

    def read(self, record: int) -> tuple[bytes, str]:
        file_no, offset = self.index[record]
        fh = self._handles.get(file_no)
        if fh is None:
            fh = self._handles[file_no] = self.paths[file_no].open("rb")
        fh.seek(offset)
        return fh.readline().rstrip(b"\n"), f"{self.paths[file_no]}:{offset}"

    def epoch_order(self, seed: int, epoch: int, shard: ShardSpec) -> list[int]:
        order = list(range(len(self.index)))
        random.Random(f"{seed}/{epoch}").shuffle(order)
        return order[shard.index :: shard.count]


class LocalDocuments:
    """Endless documents of a local corpus for one shard; state = (epoch, cursor)."""

    def __init__(self, corpus: LocalCorpus, seed: int, shard: ShardSpec):
        self.corpus, self.seed, self.shard = corpus, seed, shard
        self.quality = DataQuality(", ".join(str(p) for p in corpus.paths))
        self.epoch, self.cursor = 0, 0
        self._order = corpus.epoch_order(seed, 0, shard)
        if not self._order:
            raise DataError(f"shard {shard.index} of {shard.count} is empty: only {len(corpus)} records")
        self._good_this_epoch = 0

    def next_text(self) -> str:
        while True:
            if self.cursor >= len(self._order):
                if self._good_this_epoch == 0:
                    raise DataError(f"every record of {self.quality.where} (shard {self.shard.index}) was dropped "
                                    f"as bad data: {self.quality.as_dict()}")
                self.epoch, self.cursor, self._good_this_epoch = self.epoch + 1, 0, 0
                self._order = self.corpus.epoch_order(self.seed, self.epoch, self.shard)
            raw, where = self.corpus.read(self._order[self.cursor])
            self.cursor += 1
            text = parse_record(raw, self.corpus.fmt, self.quality, where)
            if text is not None:
                self._good_this_epoch += 1
                return text

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "good_this_epoch": self._good_this_epoch}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._good_this_epoch = int(state["good_this_epoch"])
        self._order = self.corpus.epoch_order(self.seed, self.epoch, self.shard)


StreamOpener = Callable[[int], Iterator[dict]]  # skip -> iterator over records after the first `skip`


class StreamingDocuments:
    """Documents of a remote stream with retries: on an error, wait backoff_initial_s * 2^k (capped at
    backoff_max_s) and reopen after the documents already consumed; give up after max_retries in a row."""

    def __init__(self, open_stream: StreamOpener, *, where: str, max_retries: int, backoff_initial_s: float,
                 backoff_max_s: float, sleep: Callable[[float], None] = time.sleep):
        self.open_stream, self.where = open_stream, where
        self.max_retries, self.backoff_initial_s, self.backoff_max_s = max_retries, backoff_initial_s, backoff_max_s
        self.sleep = sleep
        self.quality = DataQuality(where)
        self.consumed = 0  # records taken from the stream (good or bad)
        self.retries_total = 0
        self._it: Iterator[dict] | None = None

    def _fetch_record(self) -> dict:
        failures = 0
        while True:
            try:
                if self._it is None:
                    self._it = iter(self.open_stream(self.consumed))
                record = next(self._it)
                self.consumed += 1
                return record
            except StopIteration:
                raise DataError(f"stream {self.where} ended after {self.consumed} records") from None
            except Exception as exc:  # network errors come in many types; every one is retried
                self._it = None
                if failures >= self.max_retries:
                    raise DataError(f"stream {self.where} failed {failures + 1} times in a row "
                                    f"(after {self.consumed} records): {type(exc).__name__}: {exc}") from exc
                delay = min(self.backoff_max_s, self.backoff_initial_s * 2 ** failures)
                failures += 1
                self.retries_total += 1
                log.warning("data: %s failed (%s: %s); retry %d/%d in %.1f s", self.where, type(exc).__name__,
                            exc, failures, self.max_retries, delay)
                self.sleep(delay)

    def next_text(self) -> str:
        empty_run = 0
        while True:
            record = self._fetch_record()
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                self.quality.bad("missing_text", f"{self.where} record {self.consumed - 1}")
            elif not text.strip():
                self.quality.bad("empty_doc", f"{self.where} record {self.consumed - 1}")
            else:
                self.quality.good()
                return text
            empty_run += 1
            if empty_run >= 10_000 and self.quality.counts["ok"] == 0:
                raise DataError(f"the first {empty_run} records of {self.where} were all bad: "
                                f"{self.quality.as_dict()}")

    def state_dict(self) -> dict:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.consumed = int(state["consumed"])
        self._it = None


def fineweb_opener(name: str, subset: str, split: str, seed: int, shuffle_buffer: int,
                   shard: ShardSpec) -> StreamOpener:
    """Opens FineWeb-Edu with `datasets` streaming: seeded shuffle buffer, split by shard, skip consumed."""

    def open_stream(skip: int) -> Iterator[dict]:
        try:
            import datasets
            from datasets.distributed import split_dataset_by_node
        except ImportError as exc:
            raise DataError("data.source 'fineweb' needs the `datasets` package (pip install datasets)") from exc
        ds = datasets.load_dataset(name, subset, split=split, streaming=True)
        ds = ds.shuffle(seed=seed, buffer_size=shuffle_buffer)
        ds = split_dataset_by_node(ds, rank=shard.index, world_size=shard.count)
        return iter(ds.skip(skip) if skip else ds)

    return open_stream


class TokenWindowSource:
    """Batches of contiguous token windows from documents (EOS after each document).

    Window k of the token stream covers tokens [k*T, k*T + T] (T+1 tokens; consecutive windows share one
    token), giving inputs = window[:-1], labels = window[1:]."""

    def __init__(self, documents, tokenizer, *, seq_len: int, batch_size: int, kind: str):
        self.documents, self.tokenizer = documents, tokenizer
        self.seq_len, self.batch_size, self.kind = seq_len, batch_size, kind
        self.buffer: list[int] = []

    def _window(self) -> list[int]:
        need = self.seq_len + 1
        while len(self.buffer) < need:
            self.buffer.extend(self.tokenizer.encode(self.documents.next_text()))
            self.buffer.append(self.tokenizer.eos_id)
        window = self.buffer[:need]
        del self.buffer[: self.seq_len]
        return window

    def next_batch(self) -> Batch:
        return Batch.from_windows(torch.tensor([self._window() for _ in range(self.batch_size)], dtype=torch.long))

    def state_dict(self) -> dict:
        return {"kind": self.kind, "documents": self.documents.state_dict(), "buffer": list(self.buffer)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != self.kind:
            raise ValueError(f"data state is for a {state.get('kind')!r} source, not {self.kind!r}")
        self.documents.load_state_dict(state["documents"])
        self.buffer = list(state["buffer"])

    @property
    def quality(self) -> DataQuality:
        return self.documents.quality

    def describe(self) -> dict:
        return {"source": self.kind, "packing": "contiguous", "tokenizer": self.tokenizer.name,
                "quality": self.quality.as_dict()}
