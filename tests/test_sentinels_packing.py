"""data.packing varlen: packed rows keep document boundaries; labels never cross them (checked
per document, loudly); the LM on a packed row computes what each document alone would; training resumes bit for
bit; the trainer CLI's --packing flag; telemetry and metadata record the packing mode."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from sentinels.config import ConfigError, from_dict, load_config
from sentinels.data.batch import IGNORE_INDEX, Batch, LabelShiftError, check_packed_alignment
from reference.packing import cu_seqlens_of
from sentinels.data.packing import PackedDocumentSource
from sentinels.data.pipeline import BatchSource
from sentinels.data.sources import LocalCorpus, LocalDocuments, ShardSpec
from sentinels.data.synthetic import SyntheticBatchSource
from sentinels.data.tokenizers import ByteTokenizer
from sentinels.model import build_model, lm_loss, packs_documents
from sentinels.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny-cpu.yaml"

pytestmark = pytest.mark.usefixtures("single_torch_thread")


# The attention every trainer test here runs: the optimized module when its seams take cu_seqlens, else the
# reference.
PACKED_ATTENTION = "optimized" if packs_documents("optimized") else "reference"


# ---------------------------------------------------------------------------------------------- labels
def _packed(lengths, seed=0):
    tokens = torch.randint(0, 50, (sum(lengths),), generator=torch.Generator().manual_seed(seed))
    return Batch.packed(tokens, cu_seqlens_of(lengths))


def test_packed_labels_shift_inside_each_document_and_ignore_its_last_token():
    batch = _packed([3, 1, 4, 0, 2])
    x, y = batch.inputs[0].tolist(), batch.labels[0].tolist()
    assert batch.cu_seqlens.tolist() == [0, 3, 4, 8, 8, 10] and batch.cu_seqlens.dtype == torch.int32
    assert y == [x[1], x[2], IGNORE_INDEX, IGNORE_INDEX, x[5], x[6], x[7], IGNORE_INDEX, x[9], IGNORE_INDEX]
    assert batch.loss_mask[0].tolist() == [float(v != IGNORE_INDEX) for v in y]
    assert batch.n_documents == 5 and batch.n_tokens == 10


def test_a_label_across_a_boundary_fails_loudly():
    batch = _packed([3, 4, 3])
    contiguous = torch.cat([batch.inputs[:, 1:], batch.inputs[:, :1]], dim=1)  # the plain stream's labels
    with pytest.raises(LabelShiftError, match=r"crosses a document boundary: the last position 2 of document 0"):
        check_packed_alignment(batch.inputs, contiguous, batch.cu_seqlens)
    wrong = batch.labels.clone()
    wrong[0, 4] = (wrong[0, 4] + 1) % 50
    with pytest.raises(LabelShiftError, match=r"misalignment in document 1 \[3, 7\).*position 4"):
        Batch(inputs=batch.inputs, labels=wrong, loss_mask=batch.loss_mask, cu_seqlens=batch.cu_seqlens)
    with pytest.raises(LabelShiftError, match=r"cu_seqlens\[-1\] must equal the number of tokens"):
        check_packed_alignment(batch.inputs, batch.labels, torch.tensor([0, 3, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match="loss_mask that is 0 at every ignore-label position"):
        Batch(inputs=batch.inputs, labels=batch.labels, loss_mask=None, cu_seqlens=batch.cu_seqlens)


def test_the_loss_counts_only_positions_with_a_label():
    batch = _packed([2, 5])
    logits = torch.randn(1, 7, 50, generator=torch.Generator().manual_seed(1))
    keep = batch.labels[0] != IGNORE_INDEX
    want = torch.nn.functional.cross_entropy(logits[0, keep], batch.labels[0, keep])
    assert lm_loss(logits, batch.labels, batch.loss_mask).item() == pytest.approx(want.item(), rel=1e-6)


# ---------------------------------------------------------------------------------------------- sources
def _corpus(tmp_path, lengths=(5, 40, 3, 12, 90, 7, 1, 20)):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": chr(97 + i) * n}) + "\n" for i, n in enumerate(lengths)))
    return LocalCorpus([str(path)], "jsonl")


def test_local_documents_are_packed_whole_and_cut_only_at_row_ends(tmp_path):
    corpus, tok = _corpus(tmp_path), ByteTokenizer()
    source = PackedDocumentSource(LocalDocuments(corpus, 0, ShardSpec(0, 1)), tok, row_len=32, kind="jsonl")
    reference_docs = LocalDocuments(corpus, 0, ShardSpec(0, 1))
    stream, starts = [], [0]
    while len(stream) < 6 * 32:
        stream += tok.encode(reference_docs.next_text()) + [tok.eos_id]
        starts.append(len(stream))
    for row in range(6):
        batch = source.next_batch()
        assert batch.inputs.shape == (1, 32)
        assert batch.inputs[0].tolist() == stream[row * 32 : (row + 1) * 32]  # nothing dropped, nothing padded
        # boundaries: the documents' own ends inside the row, plus the row's ends (a cut document's pieces)
        want = sorted({0, 32} | {s - row * 32 for s in starts if row * 32 < s < (row + 1) * 32})
        assert batch.cu_seqlens.tolist() == want


def test_packed_local_and_synthetic_sources_resume_exactly(tmp_path):
    corpus = _corpus(tmp_path)

    def local():
        return PackedDocumentSource(LocalDocuments(corpus, 2, ShardSpec(0, 1)), ByteTokenizer(), row_len=24,
                                    kind="jsonl")

    def synthetic():
        return SyntheticBatchSource("uniform", vocab_size=40, seq_len=8, batch_size=4, seed=3, shard=0,
                                    packing="varlen", doc_lengths=(2, 9))

    for make in (local, synthetic):
        a = make()
        for _ in range(9):  # past one epoch of the corpus
            a.next_batch()
        state = json.loads(json.dumps(a.state_dict()))
        expected = [a.next_batch() for _ in range(4)]
        b = make()
        b.load_state_dict(state)
        for want in expected:
            got = b.next_batch()
            assert torch.equal(got.inputs, want.inputs) and torch.equal(got.cu_seqlens, want.cu_seqlens)
    with pytest.raises(ValueError, match="packed 'contiguous', not a 'jsonl' source packed 'varlen'"):
        local().load_state_dict({"kind": "jsonl", "documents": {}, "buffer": []})


def test_synthetic_documents_follow_the_length_distribution():
    source = SyntheticBatchSource("uniform", vocab_size=40, seq_len=64, batch_size=4, seed=0, shard=0,
                                  packing="varlen", doc_lengths=(5, 12))
    lengths = []
    for _ in range(20):
        batch = source.next_batch()
        assert batch.inputs.shape == (1, 256) and int(batch.inputs.max()) < 40
        row = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()
        assert all(5 <= n <= 12 for n in row[:-1]) and 1 <= row[-1] <= 12  # only the row's last one is cut
        lengths += row[:-1]
    assert set(lengths) == set(range(5, 13))


def test_streaming_source_is_packed_by_documents():
    from tests.test_sentinels_data import FlakyStream

    cfg = from_dict({"data": {"source": "fineweb", "tokenizer": "byte", "packing": "varlen",
                              "fineweb": {"max_retries": 1, "backoff_initial_s": 0.001, "backoff_max_s": 0.001}},
                     "train": {"seq_len": 8, "micro_batch_size": 2}})
    source = BatchSource(cfg, ShardSpec(0, 1), synthetic_on_fail=False, opener=FlakyStream())
    batch = source.next_batch()
    tok = ByteTokenizer()
    # records "doc 1", "doc 2", ... (every 5th is empty and skipped), each + EOS = 6 tokens
    assert batch.inputs.shape == (1, 16) and batch.cu_seqlens.tolist() == [0, 6, 12, 16]
    assert tok.decode(batch.inputs[0, :5].tolist()) == "doc 1" and int(batch.inputs[0, 5]) == tok.eos_id
    assert source.describe()["packing"] == "varlen"
    fallback = BatchSource(cfg, ShardSpec(0, 1), synthetic_on_fail=True, opener=FlakyStream(fail_opens=10**6))
    assert fallback.next_batch().cu_seqlens is not None  # the synthetic fallback is packed too


@pytest.mark.parametrize("overrides, key", [
    ({"data": {"packing": "padded"}}, r"data\.packing: must be one of"),
    ({"data": {"packing": "varlen", "synthetic": {"task": "needle_recall"}}}, r"data\.synthetic\.task"),
    ({"data": {"synthetic": {"doc_len_min": 9, "doc_len_max": 4}}}, r"data\.synthetic\.doc_len_max"),
    ({"model": {"debug": {"leak": "cross_document"}}}, r"model\.debug\.leak: cross_document drops"),
])
def test_packing_config_errors_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key):
        from_dict(overrides)


# ---------------------------------------------------------------------------------------------- model
def _lm(attention, *overrides):
    cfg = load_config(TINY, [f"model.attention={attention}", *overrides])
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    with torch.no_grad():  # gates start at exactly 0.5; randomise them so every branch matters
        for block in model.blocks:
            block.attn.inner.gate[-1].weight.normal_(0, 0.5)
    return model


LENGTHS = [5, 17, 1, 0, 30, 11]  # shorter than l, one token, empty, longer than l' and the window


@pytest.mark.parametrize("attention", ["reference", "optimized"])
def test_a_packed_row_computes_what_each_document_alone_does(attention):
    if not packs_documents(attention):
        pytest.skip(f"{attention}.NSAAttention's seams do not take cu_seqlens yet")
    model = _lm(attention)
    tokens = torch.randint(0, 64, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(2))
    cu = cu_seqlens_of(LENGTHS)
    with torch.no_grad():
        packed = model(tokens, cu)
        start = 0
        for n in LENGTHS:
            if n:
                alone = model(tokens[:, start : start + n])
                torch.testing.assert_close(packed[:, start : start + n], alone, rtol=1e-5, atol=1e-5)
            start += n
        # the row-wide statistics count each document's selection blocks apart: 1+3+1+0+4+2 blocks of l' = 8
        model(tokens, cu)
    blocks = [s.distinct_blocks.item() for s in model.layer_stats()]
    assert all(b <= 11 for b in blocks) and max(blocks) > 4  # more than the longest document alone has


def test_the_planted_cross_document_leak_lets_a_document_see_the_one_before():
    tokens = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(3))
    perturbed = tokens.clone()
    perturbed[0, 2] = (perturbed[0, 2] + 1) % 64  # a token of document 0
    cu = cu_seqlens_of([8, 16])
    for leak, crosses in (("none", False), ("cross_document", True)):
        model = _lm("reference", "data.packing=varlen", f"model.debug.leak={leak}")
        with torch.no_grad():
            diff = (model(tokens, cu) - model(perturbed, cu)).abs().amax(-1)[0]
        assert bool(diff[2:8].gt(0).all())  # inside document 0, causally after the change
        assert bool(diff[8:].gt(1e-6).any()) == crosses, leak


# ---------------------------------------------------------------------------------------------- trainer
def _cfg(out_dir, *overrides):
    return load_config(TINY, [f"train.out_dir={out_dir}", "train.seq_len=16", "train.micro_batch_size=2",
                              "train.steps=6", "train.warmup_steps=2", "data.packing=varlen",
                              f"model.attention={PACKED_ATTENTION}", *overrides])


def _train(cfg, **kwargs):
    trainer = Trainer(cfg, console=False, **kwargs)
    try:
        return trainer, trainer.train()
    finally:
        trainer.close()


def test_varlen_resume_continues_bit_for_bit_and_records_the_packing(tmp_path):
    corpus = _corpus(tmp_path).paths[0]
    overrides = ("data.source=jsonl", f"data.paths=[{corpus}]", "train.grad_accum=2", "train.save_every=3")
    _, full = _train(_cfg(tmp_path / "a", *overrides))
    assert full.status == "completed" and full.steps_done == 6

    def stop_after_2(trainer, step):
        if step == 2:
            trainer.request_stop("test interruption")

    _, first = _train(_cfg(tmp_path / "b", *overrides), step_hook=stop_after_2)
    assert first.steps_done == 3
    _, second = _train(_cfg(tmp_path / "b", *overrides), resume=True)
    for key in ("loss", "grad_norm", "documents"):
        assert [r[key] for r in second.records] == [r[key] for r in full.records[3:]], key
    rows = list(csv.DictReader((tmp_path / "a" / "metrics.csv").open()))
    assert all(int(r["documents"]) >= 2 and int(r["tokens"]) == 2 * 2 * 16 for r in rows)  # 2 micro-steps
    meta = json.loads((tmp_path / "a" / "metadata.json").read_text())
    assert meta["packing"] == "varlen" and meta["data"]["packing"] == "varlen"
    assert meta["config"]["data"]["packing"] == "varlen"


def test_trainer_cli_packing_flag(tmp_path, capfd):
    from sentinels.cli import main

    out = tmp_path / "run"
    assert main(["train", "--config", str(TINY), "--packing", "varlen", "-o", f"train.out_dir={out}",
                 "-o", "train.steps=2", "-o", "train.warmup_steps=1", "-o", "train.seq_len=16",
                 "-o", f"model.attention={PACKED_ATTENTION}"]) == 0
    assert json.loads(capfd.readouterr().out.strip().splitlines()[-1])["status"] == "completed"
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["packing"] == "varlen" and "data.packing=varlen" in meta["overrides"]
    assert meta["data"] == {**meta["data"], "source": "synthetic", "packing": "varlen"}
