"""`python -m perf train` and `train-profile` on the tiny geometry (CPU): the dense model is the NSA model with causal
GQA attention and nothing else changed, every sequence length runs the same tokens per step, the reports show the
CSV, and the profile attributes backward time to the forward region that created it."""

from __future__ import annotations

import csv
import json
import math
import time
from pathlib import Path

import pytest
import torch

from perf.cli import main, parse_checkpointing
from perf.env import host_cpu
from perf.train_bench import OverBudget, StepClock, TrainRow, _carry_earlier_meta, read_rows
from perf.train_memory import saved_storages
from perf.train_report import execution_label, target_lines
from perf.train_model import DenseAttention, batch_plan, geometry, trainer_for, use_dense_attention
from reference.module import apply_rope
from sentinels.model import build_model

TINY = geometry("tiny")


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_batch_plan_keeps_tokens_per_step():
    for T in (2048, 8192, 16384, 32768, 65536):
        plan = batch_plan(T, 65536, 16384)
        assert plan.tokens == 65536 and plan.seq_len * plan.micro_batch <= max(16384, T)
    assert batch_plan(2048, 65536, 16384).micro_batch == 8 and batch_plan(65536, 65536, 16384).grad_accum == 1
    assert batch_plan(3, 12, 8).micro_batch == 2  # the largest divisor of the sequences that fits
    with pytest.raises(ValueError, match="not a multiple of seq_len"):
        batch_plan(3000, 65536, 16384)


def _reference_dense(attn: DenseAttention, x: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention with query head h reading KV head h // group, written out with explicit loops."""
    B, T, _ = x.shape
    pos = torch.arange(T)
    H, Hkv, dk, dv = attn.n_heads, attn.n_kv_heads, attn.head_dim_qk, attn.head_dim_v
    q = apply_rope(attn.q_proj(x).view(B, T, H, dk).double(), pos, attn.rope_base)
    k = apply_rope(attn.k_proj(x).view(B, T, Hkv, dk).double(), pos, attn.rope_base)
    v = attn.v_proj(x).view(B, T, Hkv, dv).double()
    o = torch.zeros(B, T, H, dv, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            g = h // (H // Hkv)
            for p in range(T):
                logits = (k[b, : p + 1, g] @ q[b, p, h]) / math.sqrt(dk)
                o[b, p, h] = torch.softmax(logits, 0) @ v[b, : p + 1, g]
    return attn.o_proj(o.reshape(B, T, -1).to(x.dtype))


def test_dense_attention_is_causal_gqa_over_the_nsa_layers_projections(tmp_path, one_thread):
    cfg = TINY.run_config(seq_len=12, micro_batch=2, grad_accum=1, steps=1, device="cpu", out_dir=tmp_path)
    model = build_model(cfg)
    nsa = model.blocks[0].attn
    dense = DenseAttention(nsa)
    assert dense.q_proj is nsa.inner.q_proj and dense.k_proj is nsa.inner.k_slc_proj
    assert dense.v_proj is nsa.inner.v_slc_proj and dense.o_proj is nsa.inner.o_proj
    x = torch.randn(2, 12, cfg.model.d_model, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(dense(x), _reference_dense(dense, x), atol=1e-5, rtol=1e-5)


def test_dense_attention_under_autocast_keeps_one_copy_of_x(tmp_path, one_thread, saved_under_bf16_autocast):
    """The dense layer casts x once for its three projections under autocast, as the NSA layer does for its one
    matmul and gate MLP: the memory comparison is between two layers that keep one low-precision copy each."""
    cfg = TINY.run_config(seq_len=12, micro_batch=1, grad_accum=1, steps=1, device="cpu", out_dir=tmp_path)
    dense = DenseAttention(build_model(cfg).blocks[0].attn)
    x = torch.randn(1, 12, cfg.model.d_model, requires_grad=True) * 1.0  # an activation, as in the model
    _, copies_of = saved_under_bf16_autocast(lambda: dense(x))
    copies = copies_of(x)
    assert len(copies) == 1, [tuple(t.shape) for t in copies]


def test_dense_trainer_holds_only_the_dense_parameters(one_thread):
    unused = ("k_cmp_proj", "v_cmp_proj", "k_win_proj", "v_win_proj", ".gate.", ".phi_")
    with trainer_for(TINY, "nsa", batch_plan(16, 32, 32), steps=1, device=torch.device("cpu")) as nsa_trainer:
        nsa_params = dict(nsa_trainer.model.named_parameters())
    with trainer_for(TINY, "dense", batch_plan(16, 32, 32), steps=1, device=torch.device("cpu")) as trainer:
        dense_params = dict(trainer.model.named_parameters())
        in_optimizer = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
        assert in_optimizer == {id(p) for p in trainer.model.parameters()}
        with pytest.raises(ValueError, match="already stepped"):
            trainer.optimizer.state[next(trainer.model.parameters())] = {"step": 1}
            use_dense_attention(trainer)
    assert {n for n in dense_params if ".attn." in n} == {f"blocks.{i}.attn.{p}_proj.weight" for i in range(2)
                                                          for p in ("q", "k", "v", "o")}
    dropped = sum(p.numel() for n, p in nsa_params.items() if any(part in n for part in unused))
    assert dropped > 0
    assert sum(p.numel() for p in dense_params.values()) == sum(p.numel() for p in nsa_params.values()) - dropped


def test_step_clock_stops_a_case_whose_timed_steps_cannot_fit():
    clock = StepClock(torch.device("cpu"), warmup=1, steps=1000, deadline=time.perf_counter() + 5.0,
                      profile_kernels=False)
    clock(None, 0)
    time.sleep(0.02)
    with pytest.raises(OverBudget, match="1000 steps of ~.* ms need"):
        clock(None, 1)  # 1000 steps of ~20 ms do not fit in 5 s


def test_train_sweep_cpu_tiny_end_to_end(tmp_path, one_thread):
    out = tmp_path / "train"
    assert main(["train", "--device", "cpu", "--geometries", "tiny", "--seq-lens", "16,32", "--tokens-per-step", "64",
                 "--micro-batch-tokens", "32", "--warmup", "1", "--steps", "2", "--out", str(out)]) == 0
    rows = read_rows(out / "train.csv")
    assert [(r.model, r.seq_len, r.micro_batch, r.grad_accum) for r in rows] == [
        ("nsa", 16, 2, 2), ("dense", 16, 2, 2), ("nsa", 32, 1, 2), ("dense", 32, 1, 2)]
    for r in rows:
        assert r.status == "ok" and r.n_steps == 2 and r.tokens_per_step == 64, r.note
        assert r.tokens_per_s == pytest.approx(64 / (r.median_step_ms / 1e3), rel=1e-4)
        assert r.min_step_ms <= r.median_step_ms and math.isfinite(r.loss_last)
    assert all("optimized" in r.attention and "NSAAttention" in r.attention for r in rows if r.model == "nsa")
    assert all("DenseAttention" in r.attention for r in rows if r.model == "dense")
    nsa, dense = rows[0], rows[1]
    assert dense.parameters < nsa.parameters

    text = (out / "train.md").read_text()
    assert f"host {host_cpu()};" in text  # the eager step's time depends on the host: the report names it
    with open(out / "train.csv", newline="") as fh:
        first = next(csv.DictReader(fh))
    ratio = float(first["tokens_per_s"]) / float(rows[1].tokens_per_s)
    assert f"| 16 | 2 x 2 | {float(first['tokens_per_s']):,.0f} | {rows[1].tokens_per_s:,.0f} | {ratio:.2f}x |" in text
    assert (out / "train.png").stat().st_size > 10_000
    (out / "train.md").write_text("tampered")
    assert main(["train-report", "--out", str(out)]) == 0
    assert (out / "train.md").read_text() == text


def test_merged_sweep_names_the_rows_and_the_machine_it_did_not_measure(tmp_path, one_thread):
    """A --merge sweep that measures part of a file's rows keeps the rest, and the report says which rows came from
    the earlier sweep and where that ran; an earlier geometry's description stays."""
    out = tmp_path / "train"
    common = ["--device", "cpu", "--geometries", "tiny", "--tokens-per-step", "64", "--micro-batch-tokens", "32",
              "--warmup", "1", "--steps", "2", "--out", str(out)]
    assert main(["train", "--seq-lens", "16,32", *common]) == 0
    first = json.loads((out / "train.json").read_text())["meta"]
    assert first["kept_rows"] == [] and "earlier sweep" not in (out / "train.md").read_text()
    assert main(["train", "--seq-lens", "16", "--merge", *common]) == 0
    meta = json.loads((out / "train.json").read_text())["meta"]
    assert meta["kept_rows"] == ["tiny nsa 32", "tiny dense 32"]
    assert meta["earlier"] == [{"env": first["env"]}]
    text = (out / "train.md").read_text()
    assert (f"come from an earlier sweep into this file ({first['env']['device']}, torch {first['env']['torch']}"
            in text and text.count("tiny nsa 32") == 1)
    carried = {"env": {"device": "now"}, "geometries": {"tiny": "t"}}
    _carry_earlier_meta(carried, {"env": {"device": "then"}, "geometries": {"paper": "p", "tiny": "old t"},
                                  "earlier": [{"env": {"device": "before"}}, {"env": {"device": "then"}}]})
    assert carried["geometries"] == {"paper": "p", "tiny": "t"}
    assert carried["earlier"] == [{"env": {"device": "before"}}, {"env": {"device": "then"}}]


def test_sweep_runs_each_model_as_told_and_the_report_says_which(tmp_path, one_thread):
    """--activation-checkpointing nsa=attention: the NSA model recomputes its attention sublayers, the dense model keeps
    every activation; the rows record it (through the CSV), the table and the target lines say it ran so."""
    out = tmp_path / "train"
    assert main(["train", "--device", "cpu", "--geometries", "tiny", "--seq-lens", "16", "--tokens-per-step", "32",
                 "--micro-batch-tokens", "32", "--warmup", "1", "--steps", "1", "--activation-checkpointing",
                 "nsa=attention", "--out", str(out)]) == 0
    rows = {r.model: r for r in read_rows(out / "train.csv")}
    assert rows["nsa"].status == rows["dense"].status == "ok"
    assert rows["nsa"].activation_checkpointing == "attention" and rows["dense"].activation_checkpointing is False
    assert "| 16 (NSA: attention recomputed) | 2 x 1 |" in (out / "train.md").read_text()

    def row(model: str, checkpointing, graphs: bool, peak: int) -> TrainRow:
        return TrainRow("prod-125m", model, 16384, 1, 4, 65536, "ok", checkpointing, graphs, median_step_ms=1.0,
                        mean_step_ms=1.0, tokens_per_s=1.0, peak_mem_bytes=peak)

    assert execution_label(row("nsa", "attention", True, 1), row("dense", False, True, 1)) == \
        "CUDA graphs, NSA: attention recomputed"
    assert execution_label(row("nsa", True, False, 1), row("dense", True, False, 1)) == "activation checkpointing"
    lines = target_lines([row("nsa", "attention", True, 2**30), row("dense", False, True, 2**31)], "prod-125m")
    assert lines[-1] == ("- NSA peak memory <= dense at every seq_len >= 8k: MET (CUDA graphs, NSA: attention "
                         "recomputed)")
    same = target_lines([row("nsa", False, True, 2**31), row("dense", False, True, 2**30)], "prod-125m")
    assert same[-1] == "- NSA peak memory <= dense at every seq_len >= 8k: NOT MET at 16k (2.0 > 1.0 GiB)"


@pytest.mark.parametrize("text, want", [
    ("attention", {"nsa": "attention", "dense": "attention"}), ("blocks", {"nsa": True, "dense": True}),
    ("nsa=attention", {"nsa": "attention"}), ("nsa=attention,dense=blocks", {"nsa": "attention", "dense": True}),
    ("off", {"nsa": False, "dense": False})])
def test_activation_checkpointing_flag(text, want):
    assert parse_checkpointing(text) == want


@pytest.mark.parametrize("text", ["sometimes", "nsa=sometimes", "mamba=attention", "nsa=", ""])
def test_activation_checkpointing_flag_refuses_in_one_line(text, capsys):
    with pytest.raises(SystemExit):
        main(["train", "--device", "cpu", "--activation-checkpointing", text])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--activation-checkpointing takes a mode of ('off', 'blocks', 'attention')" in err


def test_saved_storages_counts_each_storage_once_without_parameters():
    """The memory probe's attribution: the linear layer's input (its weight, a parameter, left out), the ReLU's
    output, and that output saved twice more by the product (one storage, counted once, where it was made)."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    x = torch.randn(4, 8, requires_grad=True)

    def forward():
        y = model(x)
        return (y * y).sum()

    rows = saved_storages(model, forward)
    assert [(r["module"], r["made_by"], r["shape"], r["bytes"]) for r in rows] == [
        ("0", "input", [4, 8], 128), ("1", "ReluBackward0", [4, 8], 128)]
    assert x.grad is not None  # the probe ran backward too


def test_train_memory_cpu_tiny(tmp_path, one_thread):
    out = tmp_path / "mem"
    assert main(["train-memory", "--device", "cpu", "--geometries", "tiny", "--seq-len", "64", "--out", str(out)]) == 0
    doc = json.loads((out / "train_memory.json").read_text())
    nsa, dense = doc["cases"][0]["models"]
    assert (nsa["model"], dense["model"]) == ("nsa", "dense")
    for m in (nsa, dense):
        assert m["kept_after_forward_bytes"] is None  # memory counters exist on CUDA only
        layer = m["first_layer_attention"]
        assert layer and all(s["module"].startswith("blocks.0.attn") and not s["module"].startswith(
            "blocks.0.attn_norm") for s in layer)
        assert m["first_layer_attention_saved_bytes"] == sum(s["bytes"] for s in layer)
        assert sum(m["saved_by_module"].values()) == m["saved_bytes"]
    assert nsa["first_layer_attention_saved_bytes"] > dense["first_layer_attention_saved_bytes"]
    assert "| nsa | 132,696 |" in (out / "train_memory.md").read_text()


def test_train_memory_with_the_nsa_attention_recomputed(tmp_path, one_thread):
    """--activation-checkpointing nsa=attention: NSA's first-layer attention saves nothing at the top level (its
    sublayer keeps only its input), so the model saves less than keeping everything; dense is measured as before,
    and the report says which model recomputed."""
    from perf.train_memory import measure

    out = tmp_path / "mem"
    assert main(["train-memory", "--device", "cpu", "--geometries", "tiny", "--seq-len", "64", "--out", str(out),
                 "--activation-checkpointing", "nsa=attention"]) == 0
    nsa, dense = json.loads((out / "train_memory.json").read_text())["cases"][0]["models"]
    assert (nsa["activation_checkpointing"], dense["activation_checkpointing"]) == ("attention", False)
    assert nsa["first_layer_attention"] == []
    keeping = measure("tiny", "nsa", 64, torch.device("cpu"))
    assert keeping["first_layer_attention_saved_bytes"] > 0 and nsa["saved_bytes"] < keeping["saved_bytes"]
    assert dense["first_layer_attention_saved_bytes"] > 0
    text = (out / "train_memory.md").read_text()
    assert "| nsa (attention recomputed) | 132,696 |" in text and "| dense | " in text


def test_train_memory_report_says_which_model_keeps_more():
    from perf.train_memory import markdown

    def model(name, kept_mib, mode=False):
        return {"model": name, "activation_checkpointing": mode, "parameters": 1, "kept_after_forward_bytes":
                kept_mib * 2**20, "peak_forward_backward_bytes": None, "saved_bytes": 0,
                "first_layer_attention_saved_bytes": 0, "first_layer_attention": [], "saved_by_module": {}}

    def sentence(*models):
        doc = {"env": {}, "cases": [{"geometry": "tiny", "seq_len": 64, "models": list(models)}]}
        return [line for line in markdown(doc).splitlines() if "after the forward." in line]

    assert sentence(model("nsa", 5), model("dense", 3)) == ["nsa keeps 2.0 MiB more than dense after the forward."]
    assert sentence(model("nsa", 1, "attention"), model("dense", 3)) == [
        "nsa (attention recomputed) keeps 2.0 MiB less than dense after the forward."]


def test_saved_storages_lists_what_the_recomputation_tape_keeps(one_thread):
    """On the kernels (Triton's interpreter here) a recomputed layer attention keeps its selection and its selected
    branch's output outside autograd (optimized.recompute.ForwardTape); the probe lists them under that layer's
    attention, made by the tape, and nothing of the kind without the recomputation."""
    from perf.train_memory import TAPE
    from sentinels.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / TINY.config)
    torch.manual_seed(0)
    model = build_model(cfg).train()
    for block in model.blocks:
        block.attn.inner.backend = block.attn.inner.range_backend = "triton"
    ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(1))
    nsa = model.blocks[0].attn.inner.cfg

    def tape_rows(mode):
        model.activation_checkpointing = mode
        return [r for r in saved_storages(model, lambda: model(ids, labels=ids)) if r["made_by"] == TAPE]

    assert tape_rows(False) == []
    rows = tape_rows("attention")
    assert {r["module"] for r in rows} == {f"blocks.{i}.attn" for i in range(len(model.blocks))}
    first = [r for r in rows if r["module"] == "blocks.0.attn"]
    assert [1, 40, nsa.n_kv_heads, nsa.n_sel] in [r["shape"] for r in first]  # Eq. 11's indices
    assert [1, 40, nsa.n_heads, nsa.head_dim_v] in [r["shape"] for r in first]  # the selected branch's output


def test_train_profile_splits_the_step_by_region(tmp_path, one_thread):
    out = tmp_path / "profile"
    assert main(["train-profile", "--device", "cpu", "--geometries", "tiny", "--models", "nsa,dense", "--seq-len",
                 "32", "--tokens-per-step", "64", "--micro-batch-tokens", "64", "--warmup", "1", "--timed", "1",
                 "--profiled", "1", "--out", str(out)]) == 0
    import json

    result = json.loads((out / "train_profile.json").read_text())
    nsa, dense = result["profiles"]
    for p in (nsa, dense):
        by = {c["category"]: c for c in p["categories"]}
        assert sum(c["total_ms"] for c in p["categories"]) == pytest.approx(p["device_ms_per_step"], rel=1e-6)
        mlp = by["MLP (SwiGLU)"]
        proj = by["attention rest: output projection"]
        # backward work lands in the region of the forward op that created it
        assert mlp["forward_ms"] > 0 and mlp["backward_ms"] > 0 and proj["backward_ms"] > 0
        assert by["optimizer (gradient clipping, AdamW)"]["outside_ms"] > 0
        assert by["optimizer (gradient clipping, AdamW)"]["forward_ms"] == 0
    nsa_by = {c["category"]: c for c in nsa["categories"]}
    assert nsa_by["attention rest: inside the NSA call (phi, scoring glue, casts)"]["backward_ms"] > 0
    assert nsa_by["attention rest: per-layer statistics"]["forward_ms"] > 0
    gates = nsa_by["attention rest: gate MLP"]
    assert gates["forward_ms"] > 0 and gates["backward_ms"] > 0
    assert "attention kernels" not in nsa_by  # the CPU path launches no Triton kernel
    dense_by = {c["category"]: c for c in dense["categories"]}
    assert dense_by["attention kernels"]["forward_ms"] > 0 and "attention rest: per-layer statistics" not in dense_by
    md = (out / "train_profile.md").read_text()
    assert "| MLP (SwiGLU) |" in md and "## dense, tiny, seq_len 32" in md
    assert "counts some device work twice" not in md

    from perf.train_profile import markdown

    nsa.update(time_unit="CUDA kernel time", device_ms_per_step=2 * nsa["step_ms_median"])  # more than the step
    assert "counts some device work twice" in markdown(result)


def test_unknown_geometry_is_one_line(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--device", "cpu", "--geometries", "huge"])
    assert "--geometries must be a comma list" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown geometry 'huge'"):
        geometry("huge")


def test_profile_attribution_on_cuda_skips_the_ranges_user_annotations():
    """On CUDA a record_function range shows up again on the GPU timeline as a user annotation spanning its kernels
    (among its CPU event's kernels, under the range's own name, and as a CUDA event): neither is device work. Stand-in
    events: a region with one launched kernel of 3 us inside a forward range; its annotation spans 10 us."""
    from types import SimpleNamespace

    from perf.train_profile import REGION, attribute

    cpu_type, cuda_type = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def span(us: float):
        return SimpleNamespace(elapsed_us=lambda: us, start=0.0)

    region = SimpleNamespace(name=REGION + "mlp", device_type=cpu_type, is_async=False, thread=1, sequence_nr=-1,
                             cpu_parent=None, time_range=span(10.0),
                             kernels=[SimpleNamespace(name=REGION + "mlp", duration=10.0),
                                      SimpleNamespace(name="gemm_kernel", duration=3.0)])
    device = [SimpleNamespace(name="gemm_kernel", device_type=cuda_type, is_async=False, is_user_annotation=False,
                              time_range=span(3.0)),
              SimpleNamespace(name=REGION + "mlp", device_type=cuda_type, is_async=False, is_user_annotation=True,
                              time_range=span(10.0))]
    times, names, total = attribute([region, *device], on_cuda=True)
    assert total == 3.0
    assert sum(times.values()) == 3.0
    assert (REGION + "mlp") not in {name for _, name in names}


def test_profile_attribution_claims_attention_kernels_no_op_launched():
    """Some Triton launches reach the GPU timeline without a CPU event listing them (the selection's scoring and
    top-n kernels): they count as attention kernels by name, in the forward when they ran inside a region's range,
    rather than left to "other". A non-attention kernel without an op stays unclaimed."""
    from types import SimpleNamespace

    from perf.train_profile import ATTENTION_KERNELS, OTHER, REGION, attribute

    cpu_type, cuda_type = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def span(start: float, us: float):
        return SimpleNamespace(elapsed_us=lambda: us, start=start, end=start + us)

    region = SimpleNamespace(name=REGION + "attention/nsa", device_type=cpu_type, is_async=False, thread=1,
                             sequence_nr=-1, cpu_parent=None, time_range=span(0.0, 20.0), kernels=[])
    device = [SimpleNamespace(name="_group_scores_kernel", device_type=cuda_type, is_async=False,
                              is_user_annotation=False, time_range=span(2.0, 4.0)),
              SimpleNamespace(name="_select_top_n_kernel", device_type=cuda_type, is_async=False,
                              is_user_annotation=False, time_range=span(30.0, 5.0)),
              SimpleNamespace(name="some_copy_kernel", device_type=cuda_type, is_async=False,
                              is_user_annotation=False, time_range=span(8.0, 1.0)),
              SimpleNamespace(name=REGION + "attention/nsa", device_type=cuda_type, is_async=False,
                              is_user_annotation=True, time_range=span(0.0, 20.0))]
    times, names, total = attribute([region, *device], on_cuda=True)
    assert total == 10.0
    assert times[(ATTENTION_KERNELS, "forward")] == 4.0  # inside the region's range
    assert times[(ATTENTION_KERNELS, "outside")] == 5.0  # after it
    assert times[(OTHER, "outside")] == 1.0
    assert names[(ATTENTION_KERNELS, "_group_scores_kernel")] == [4.0, 1]
