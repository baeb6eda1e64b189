"""The benchmark runner (perf/) on CPU-sized shapes: key counts against the reference's loops, the regression
gate's rule, and one end-to-end tiny sweep through CSV, plots, README section and baseline compare."""

from __future__ import annotations

import csv
import json
from types import SimpleNamespace

import pytest
import torch

import optimized
from perf import baseline as gate
from perf.cli import main
from perf.flops import StageWork, compressed_pairs, selected_token_count, window_pairs
from perf.implementations import NSAImplementation, parse_impls
from perf.report import markers
from perf.results import ERROR, OK, OOM, SKIPPED, Row, read_rows
from perf.runner import Runner
from perf.spec import LAYER, NSA_STAGES, PASSES, preset
from reference.branches import selected_tokens, window_tokens
from reference.compression import compressed_block_count, visible_compressed_blocks
from reference.config import NSAConfig

SMALL = NSAConfig(cmp_block=8, cmp_stride=4, sel_block=16, n_sel=3, n_init=1, n_local=1, window=10,
                  n_heads=4, n_kv_heads=2, head_dim_qk=16, head_dim_v=8, phi="avg")


@pytest.fixture
def one_thread():
    """The runner sets torch's CPU threads for --device cpu; restore them for the other tests."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


# Key counts: closed forms and index counting against the reference's literal loops ----------------------

@pytest.mark.parametrize("cfg", [SMALL, SMALL.replace(cmp_visibility="strict"), SMALL.replace(window_keys="w+1")])
@pytest.mark.parametrize("T", [1, 7, 8, 9, 40, 57])
def test_key_counts_match_reference_loops(cfg, T):
    n_blocks = compressed_block_count(T, cfg)
    assert compressed_pairs(T, cfg) == sum(len(visible_compressed_blocks(p, n_blocks, cfg)) for p in range(T))
    assert window_pairs(T, cfg) == sum(len(window_tokens(p, cfg)) for p in range(T))


def test_selected_token_count_matches_reference_loops():
    gen = torch.Generator().manual_seed(3)
    T, H = 70, SMALL.n_kv_heads
    indices = torch.full((2, T, H, SMALL.n_sel), -1, dtype=torch.int64)
    for b in range(2):
        for p in range(T):
            J = p // SMALL.sel_block
            for g in range(H):
                chosen = torch.randperm(J + 1, generator=gen)[: SMALL.n_sel - 1].sort().values  # leave a -1 pad
                indices[b, p, g, : len(chosen)] = chosen
    expected = sum(len(selected_tokens(p, [int(j) for j in indices[b, p, g]], SMALL))
                   for b in range(2) for p in range(T) for g in range(H))
    assert selected_token_count(indices, SMALL.sel_block) == expected


def test_sdpa_flops_count_the_causal_mask():
    T = 37
    work = StageWork(T, SMALL, batch=1, elem_bytes=2, phi_hidden=16)
    pairs = int(torch.ones(T, T).tril().sum())
    per_pair = 2 * (SMALL.head_dim_qk + SMALL.head_dim_v) * SMALL.n_heads
    assert work.sdpa().flops("fwd") == per_pair * pairs
    assert work.sdpa().flops("fwd_bwd") == pytest.approx(3.5 * per_pair * pairs)


# Regression gate -------------------------------------------------------------------------------------------

def _row(median, spread=0.01, status=OK, T=1024, stage=LAYER):
    return Row(seq_len=T, impl="nsa", stage=stage, pass_name="fwd", status=status, median_ms=median, spread=spread,
               n_runs=40)


def _baseline(rows, shape_key):
    return {"shape_key": shape_key, "cases": {r.key: {"status": r.status, "median_ms": r.median_ms,
                                                      "spread": r.spread} for r in rows}}


@pytest.mark.parametrize("now, spread, verdict", [
    (10.9, 0.01, "ok"),  # +9%: inside the 10% floor
    (11.2, 0.01, "regression"),  # +12% with 1% spread: threshold max(10%, 3%) = 10%
    (11.2, 0.05, "ok"),  # +12% with 5% spread: threshold 15%
    (11.6, 0.05, "regression"),  # +16% with 5% spread
    (8.0, 0.01, "improved"),
])
def test_gate_threshold_is_max_of_floor_and_three_spreads(now, spread, verdict):
    key = {"name": "x"}
    base = _baseline([_row(10.0, spread=0.01)], key)
    (c,) = gate.compare([_row(now, spread=spread)], base, key, floor=0.10, factor=3.0)
    assert c.verdict == verdict


def test_gate_failures_skips_and_shape_mismatch():
    key = {"name": "x"}
    base = _baseline([_row(10.0), _row(5.0, T=2048)], key)
    verdicts = {c.key: c.verdict for c in gate.compare([_row(None, status=OOM), _row(None, status=SKIPPED, T=2048)],
                                                         base, key, 0.10, 3.0)}
    assert verdicts == {_row(0).key: "regression", _row(0, T=2048).key: "not compared"}
    with pytest.raises(ValueError, match="different shapes"):
        gate.compare([_row(10.0)], base, {"name": "y"}, 0.10, 3.0)


# Implementations and error handling ------------------------------------------------------------------------

def test_parse_impls_variants_and_errors():
    with_sdpa, variants, peers = parse_impls("sdpa,nsa,nsa[backend=torch,chunk_size=64]", "optimized")
    assert with_sdpa and [v.label for v in variants] == ["nsa", "nsa[backend=torch,chunk_size=64]"] and not peers
    assert variants[1].kwargs == {"backend": "torch", "chunk_size": 64}
    with pytest.raises(ValueError, match="no stage function accepts keyword 'colour'"):
        parse_impls("nsa[colour=red]", "optimized")
    with pytest.raises(ValueError, match="must be 'sdpa', 'nsa'"):
        parse_impls("flash", "optimized")
    with pytest.raises(ValueError, match="lacks contract function"):
        parse_impls("nsa", "perf.spec")


def test_oom_and_errors_are_recorded_per_case_and_the_sweep_goes_on(one_thread):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")

    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    stages = {name: getattr(optimized, name) for name in
              ("compress", "compressed_attention", "selection_scores", "select_blocks", "selected_attention",
               "window_attention", "nsa_forward")}
    stages.update(selected_attention=out_of_memory, window_attention=broken)
    impl = NSAImplementation("nsa", SimpleNamespace(**stages))
    spec = preset("tiny", seq_lens=(64,), repeats=1, rounds=1, warmup=0, stages=("selected", "window", "gate"),
                  passes=("fwd",))
    rows = Runner(spec, torch.device("cpu"), with_sdpa=False, variants=[impl], log=lambda s: None).run()
    status = {r.stage: r.status for r in rows}
    assert status == {LAYER: OK, "selected": OOM, "window": ERROR, "gate": OK}
    assert "kernel exploded" in next(r.note for r in rows if r.stage == "window")


def test_cuda_requested_without_gpu_fails_fast(capsys, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert main(["run", "--device", "cuda", "--out", str(tmp_path)]) == 2
    assert "no CUDA GPU is visible" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


# End to end --------------------------------------------------------------------------------------------------

def test_tiny_sweep_end_to_end(tmp_path, one_thread, capsys):
    out, base_dir, readme = tmp_path / "perf", tmp_path / "baselines", tmp_path / "README.md"
    rc = main(["run", "--device", "cpu", "--preset", "tiny", "--seq-lens", "64,160", "--repeats", "2",
               "--rounds", "2", "--warmup", "0", "--out", str(out), "--readme", str(readme),
               "--update-baseline", "--baseline-dir", str(base_dir)])
    assert rc == 0, capsys.readouterr().out

    rows = read_rows(out / "results.csv")
    expected = {(T, "sdpa", LAYER, p) for T in (64, 160) for p in PASSES}
    expected |= {(T, "nsa", s, p) for T in (64, 160) for s in (*NSA_STAGES, LAYER) for p in PASSES}
    assert {(r.seq_len, r.impl, r.stage, r.pass_name) for r in rows} == expected
    assert all(r.status == OK and r.n_runs == 4 and r.median_ms > 0 for r in rows), [r.note for r in rows]

    # Selected tokens recorded for T=160 (every query past block n-1 reads n-1 full blocks and its partial
    # current block, whatever the scores) against the reference's Eq. 12 token lists.
    cfg = preset("tiny").cfg
    def recent_blocks(p):
        J = p // cfg.sel_block
        return list(range(max(0, J - cfg.n_sel + 1), J + 1))
    expected_tokens = cfg.n_kv_heads * sum(len(selected_tokens(p, recent_blocks(p), cfg)) for p in range(160))
    for r in rows:
        if r.seq_len == 160 and r.impl == "nsa" and r.stage in ("selected", LAYER):
            assert r.selected_tokens == expected_tokens

    for name in ("time_vs_T.png", "speedup.png", "stages.png", "tflops_vs_floor.png", "memory.png"):
        assert (out / name).stat().st_size > 10_000
    meta = json.loads((out / "results.json").read_text())["meta"]
    assert meta["ceilings"]["matmul_tflops"] > 0 and meta["ceilings"]["copy_gbps"] > 0

    # The README table shows the CSV's medians; `report` regenerates the same section from the CSV alone.
    BEGIN, END = markers("tiny")
    text = readme.read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1
    with open(out / "results.csv", newline="") as fh:
        sdpa_fwd = next(r for r in csv.DictReader(fh) if r["impl"] == "sdpa" and r["pass_name"] == "fwd"
                        and r["seq_len"] == "160")
    assert f"| 160 | fwd | {float(sdpa_fwd['median_ms']):.3f} |" in text
    readme.write_text("# kept header\n\n" + text.replace("| 160 | fwd |", "| tampered |"))
    assert main(["report", "--results", str(out / "results.csv"), "--readme", str(readme)]) == 0
    regenerated = readme.read_text()
    assert regenerated.startswith("# kept header") and "tampered" not in regenerated
    assert regenerated.split(BEGIN)[1] == text.split(BEGIN)[1]

    # Gate: the sweep against its own baseline passes; against a baseline twice as fast it fails.
    (baseline_file,) = base_dir.iterdir()
    assert main(["compare", "--results", str(out / "results.csv"), "--baseline", str(baseline_file)]) == 0
    data = json.loads(baseline_file.read_text())
    for case in data["cases"].values():
        case["median_ms"] /= 2
    faster = tmp_path / "faster.json"
    faster.write_text(json.dumps(data))
    assert main(["compare", "--results", str(out / "results.csv"), "--baseline", str(faster)]) == 1
    assert "regression" in capsys.readouterr().out


def test_time_budget_skips_cases_and_resume_measures_them(tmp_path, one_thread):
    out = tmp_path / "perf"
    args = ["run", "--device", "cpu", "--preset", "tiny", "--seq-lens", "64", "--stages", "gate", "--passes", "fwd",
            "--repeats", "2", "--out", str(out)]
    assert main(args + ["--time-budget", "1e-9"]) == 0
    rows = read_rows(out / "results.csv")
    assert len(rows) == 3 and all(r.status == SKIPPED and "budget" in r.note and r.median_ms is None for r in rows)

    assert main(args + ["--resume"]) == 0
    resumed = read_rows(out / "results.csv")
    assert sorted(r.key for r in resumed) == sorted(r.key for r in rows)
    assert all(r.status == OK for r in resumed)
    first = {r.key: r.median_ms for r in resumed}
    assert main(args + ["--resume", "--stages", "gate,window"]) == 0  # only the window case is new
    again = read_rows(out / "results.csv")
    assert len(again) == 4 and all(first[r.key] == r.median_ms for r in again if r.key in first)


def test_merge_keeps_measured_rows_over_time_skips_and_the_gate_compares_only_this_sweep(tmp_path, one_thread,
                                                                                       capsys):
    """A --merge sweep whose cases are skipped for time measured nothing: the results keep the earlier measured rows
    (a skip used to overwrite them), and --compare-baseline reports those cases as not compared, not as passing."""
    out, base_dir = tmp_path / "perf", tmp_path / "baselines"
    args = ["run", "--device", "cpu", "--preset", "tiny", "--seq-lens", "64", "--stages", "gate", "--passes", "fwd",
            "--repeats", "2", "--out", str(out)]
    assert main(args + ["--update-baseline", "--baseline-dir", str(base_dir)]) == 0
    measured = {r.key: r.median_ms for r in read_rows(out / "results.csv")}
    assert len(measured) == 3 and all(v is not None for v in measured.values())
    (baseline_file,) = base_dir.iterdir()
    capsys.readouterr()
    assert main(args + ["--merge", "--time-budget", "1e-9", "--compare-baseline", "--baseline",
                        str(baseline_file)]) == 0
    printed = capsys.readouterr().out
    kept = read_rows(out / "results.csv")
    assert {r.key: r.median_ms for r in kept} == measured and all(r.status == OK for r in kept)
    assert printed.count("not compared") >= 3 and "skipped: " in printed


# Packed workload: documents of mixed lengths in one row ----------------------------------------------------

def test_packed_document_lengths_fill_the_row_with_mixed_documents():
    from perf.cases import PACKED_MIN_DOCUMENT, packed_document_lengths

    for T in (300, 4096, 65536):
        lengths = packed_document_lengths(T, seed=T)
        assert sum(lengths) == T and min(lengths) >= 1
        assert lengths == packed_document_lengths(T, seed=T)  # the same documents in every sweep
        assert all(n >= PACKED_MIN_DOCUMENT for n in lengths[:-1]) and max(lengths) <= max(PACKED_MIN_DOCUMENT, T // 4)
    assert len(set(packed_document_lengths(65536, seed=1))) > 5


def test_packed_inputs_need_batch_one():
    from perf.cases import packed_inputs

    with pytest.raises(ValueError, match="BenchSpec.batch must be 1"):
        packed_inputs(preset("tiny", batch=2), 64, torch.device("cpu"), seed=0)


@pytest.mark.parametrize("cfg", [SMALL, SMALL.replace(cmp_visibility="strict")])
def test_packed_work_counts_each_document_alone(cfg):
    lengths = (7, 0, 40, 1, 57)
    T = sum(lengths)
    packed = StageWork(T, cfg, batch=1, elem_bytes=2, phi_hidden=16, lengths=lengths)
    per_pair = 2 * (cfg.head_dim_qk + cfg.head_dim_v) * cfg.n_heads
    cmp_pairs = sum(len(visible_compressed_blocks(p, compressed_block_count(n, cfg), cfg))
                    for n in lengths for p in range(n))
    win_pairs = sum(len(window_tokens(p, cfg)) for n in lengths for p in range(n))
    assert packed.cmp_attn().flops("fwd") == per_pair * cmp_pairs
    assert packed.window().flops("fwd") == per_pair * win_pairs
    assert packed.sdpa().flops("fwd") == per_pair * sum(n * (n + 1) // 2 for n in lengths)
    assert packed.n_cmp_blocks == sum(compressed_block_count(n, cfg) for n in lengths)
    assert packed.sdpa().flops("fwd") < StageWork(T, cfg, 1, 2, 16).sdpa().flops("fwd")
    with pytest.raises(ValueError, match="sum to T"):
        StageWork(T + 1, cfg, batch=1, elem_bytes=2, phi_hidden=16, lengths=lengths)


def test_selected_token_count_uses_document_relative_positions():
    lengths = [20, 45]
    doc_start = torch.tensor([0] * 20 + [20] * 45)
    gen = torch.Generator().manual_seed(5)
    T, H = sum(lengths), SMALL.n_kv_heads
    indices = torch.full((1, T, H, SMALL.n_sel), -1, dtype=torch.int64)
    expected = 0
    for p in range(T):
        rel = p - int(doc_start[p])
        for g in range(H):
            chosen = torch.randperm(rel // SMALL.sel_block + 1, generator=gen)[: SMALL.n_sel].sort().values
            indices[0, p, g, : len(chosen)] = chosen
            expected += len(selected_tokens(rel, [int(j) for j in chosen], SMALL))
    assert selected_token_count(indices, SMALL.sel_block, doc_start) == expected
    assert selected_token_count(indices, SMALL.sel_block) != expected  # absolute positions count other tokens


def test_packed_workload_needs_cu_seqlens_in_every_stage(one_thread):
    stages = {name: getattr(optimized, name) for name in
              ("compress", "compressed_attention", "selection_scores", "select_blocks", "selected_attention",
               "window_attention")}
    stages["nsa_forward"] = lambda q, kv, gates, cfg, phi=None: optimized.nsa_forward(q, kv, gates, cfg, phi)
    impl = NSAImplementation("nsa", SimpleNamespace(**stages))
    spec = preset("tiny", seq_lens=(256,), repeats=1, rounds=1, warmup=0, stages=("window",), passes=("fwd",))
    rows = Runner(spec, torch.device("cpu"), with_sdpa=False, variants=[impl], log=lambda s: None,
                  workload="packed").run()
    layer = next(r for r in rows if r.stage == LAYER)
    assert layer.status == ERROR and "nsa_forward takes no 'cu_seqlens'" in layer.note
    assert next(r for r in rows if r.stage == "window").status == OK


def test_tiny_packed_sweep_merges_next_to_the_single_sequence(tmp_path, one_thread, capsys):
    from perf.cases import packed_document_lengths

    out, readme = tmp_path / "perf", tmp_path / "README.md"
    common = ["run", "--device", "cpu", "--preset", "tiny", "--seq-lens", "1024", "--repeats", "2", "--rounds", "1",
              "--warmup", "0", "--out", str(out), "--readme", str(readme), "--stages", "selected,window"]
    assert main(common) == 0, capsys.readouterr().out
    assert main(common + ["--workload", "packed", "--merge"]) == 0, capsys.readouterr().out
    rows = read_rows(out / "results.csv")
    assert {r.workload for r in rows} == {"single", "packed"}
    assert all(r.status == OK for r in rows), [(r.key, r.note) for r in rows if r.status != OK]
    lengths = packed_document_lengths(1024, seed=1024)
    packed = [r for r in rows if r.workload == "packed"]
    assert len(packed) == len([r for r in rows if r.workload == "single"])
    assert all(r.documents == len(lengths) for r in packed) and len(set(lengths)) > 1

    # every query reads the n most recent blocks of its own document (n-1 full, the current one partial)
    cfg = preset("tiny").cfg

    def recent_blocks(p):
        J = p // cfg.sel_block
        return list(range(max(0, J - cfg.n_sel + 1), J + 1))
    expected_tokens = cfg.n_kv_heads * sum(len(selected_tokens(p, recent_blocks(p), cfg))
                                           for n in lengths for p in range(n))
    for r in packed:
        if r.impl == "nsa" and r.stage in ("selected", LAYER):
            assert r.selected_tokens == expected_tokens
    sdpa_packed = next(r for r in packed if r.impl == "sdpa" and r.pass_name == "fwd")
    packed_flops = StageWork(1024, cfg, 1, 4, spec_phi_width(), lengths).sdpa().flops("fwd")
    assert sdpa_packed.flops == pytest.approx(packed_flops, rel=1e-5)  # the CSV keeps 6 significant digits
    assert "one causal call per document" in sdpa_packed.note

    text = readme.read_text()
    assert "### Packed documents (cu_seqlens)" in text
    assert f"| 1k | {len(lengths)} | fwd | {sdpa_packed.median_ms:.3f} |" in text


def spec_phi_width() -> int:
    return preset("tiny").phi_width


def test_case_cap_skips_slow_cases_and_says_so(tmp_path, one_thread):
    out = tmp_path / "perf"
    assert main(["run", "--device", "cpu", "--preset", "tiny", "--seq-lens", "64", "--stages", "gate", "--passes",
                 "fwd", "--repeats", "2", "--out", str(out), "--case-cap", "1e-9"]) == 0
    rows = read_rows(out / "results.csv")
    assert rows and all(r.status == SKIPPED and "per-case cap" in r.note for r in rows)
    with pytest.raises(ValueError, match="case_cap_s"):
        preset("tiny", case_cap_s=0)


def _slow_first_runs(monkeypatch, seconds: float, runs: int = 0) -> None:
    """SDPA cases whose build (which makes the first call) and first `runs` calls after it each take `seconds`
    longer, as compiling or autotuning does (a library may autotune its backward again on the first call after
    the build); the calls after them are as fast as ever."""
    import time as time_module

    import perf.runner as runner_module

    real_build = runner_module.build_sdpa_case

    def slow_build(pass_name, inputs, spec, seed):
        prepared = real_build(pass_name, inputs, spec, seed)
        time_module.sleep(seconds)
        warm_run, calls = prepared.run, []

        def run():
            calls.append(1)
            if len(calls) <= runs:
                time_module.sleep(seconds)
            return warm_run()

        prepared.run = run
        return prepared

    monkeypatch.setattr(runner_module, "build_sdpa_case", slow_build)


def _sdpa_statuses(**spec_changes) -> list[str]:
    spec = preset("tiny", seq_lens=(64,), passes=("fwd",), stages=(), **spec_changes)
    rows = Runner(spec, torch.device("cpu"), with_sdpa=True, variants=[], log=lambda s: None).run()
    return [(r.status, r.note) for r in rows]


def test_case_cap_judges_warm_calls_not_the_compiling_first_call(one_thread, monkeypatch):
    """A first call that is slow because it compiles must not get the case skipped by the cap: the cap is applied
    to the time of a warm call."""
    _slow_first_runs(monkeypatch, 0.5)  # the "compile": 0.5 s x 3 calls would pass the 1 s cap, a warm call does not
    statuses = _sdpa_statuses(repeats=2, rounds=1, warmup=1, case_cap_s=1.0)
    assert [status for status, _ in statuses] == [OK], statuses


def test_time_budget_judges_warm_calls_not_the_autotuning_first_call(one_thread, monkeypatch):
    """A build whose first call autotunes (slow) must not get the case skipped by the time budget when one warm-up
    fits: the calls left are judged at a warm call's time (a library autotuning its kernels took 27 s for a call
    of milliseconds)."""
    _slow_first_runs(monkeypatch, 0.5)  # the "autotuning": 22 more calls of 0.5 s would not fit, warm ones do
    statuses = _sdpa_statuses(repeats=10, rounds=2, warmup=2, time_budget_s=3.0)
    assert [status for status, _ in statuses] == [OK], statuses


def test_time_budget_judges_warm_calls_not_a_slow_first_warm_up(one_thread, monkeypatch):
    """The build and the first warm-up both autotune (slow): the case is still measured when the warm-ups fit,
    because the calls left are judged at the last warm-up's time, not the first one's (fla's backward autotuned
    for 37 s on the first warm-up, and 21 more calls at that time were taken to need 777 s)."""
    _slow_first_runs(monkeypatch, 0.5, runs=1)  # 21 more calls of 0.5 s would not fit in 3 s, warm ones do
    statuses = _sdpa_statuses(repeats=10, rounds=2, warmup=3, time_budget_s=3.0)
    assert [status for status, _ in statuses] == [OK], statuses


def test_layer_profile_head_dims_option_names_the_rule(capsys):
    """--head-dims takes DK,DV (the paper's own 192,128 beside the sweep's 128,128); anything else is one line naming
    the option and the rule, before any GPU work."""
    from perf import layer_profile

    assert layer_profile.head_dims_arg("192,128") == (192, 128)
    for bad in ("192", "192,x", "0,128"):
        with pytest.raises(SystemExit):
            layer_profile.main(["--head-dims", bad])
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert "--head-dims must be" in err, err
