"""optimized.decode.NSADecodeCache on CPU: decode = prefill (optimized prefill in fp32, the loop reference in
float64), counted reads reproduce Table 4, right-padded rows of different lengths, incremental compression,
the convention seams, and input validation. The Triton backend's share runs in the interpreter on tiny shapes.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import optimized as O
import reference as R
from conformance.helpers import make_inputs, max_abs_error
from conformance.rules import complete_cmp_blocks
from conformance.strategies import configs
from optimized import compression, masks
from optimized.decode import NSADecodeCache
from reference.config import PRESETS, NSAConfig
from reference.contract import KV, BranchKV, NSAOutput

TOL = 1e-5  # fp32 decode vs fp32 prefill: max abs error
SMALL = NSAConfig(cmp_block=4, cmp_stride=2, sel_block=8, n_sel=3, n_init=1, n_local=1, window=5, n_heads=4,
                  n_kv_heads=2, head_dim_qk=8, head_dim_v=6, phi="mlp")
VARIANTS = {
    "paper-conventions": SMALL,
    "phi-avg": SMALL.replace(phi="avg"),
    "window-w+1": SMALL.replace(window_keys="w+1"),
    "strict-visibility": SMALL.replace(cmp_visibility="strict"),
    "logit-scores": SMALL.replace(selection_score="logits", group_reduce="mean"),
    "equal-blocks": SMALL.replace(cmp_block=4, cmp_stride=4, sel_block=4, n_sel=4, n_init=0, n_local=2),
    "l'=3d-no-forced": SMALL.replace(cmp_block=2, cmp_stride=2, sel_block=6, n_init=0, n_local=0, window=9),
}
TABLE_4 = {8192: 2048, 16384: 2560, 32768: 3584, 65536: 5632}


pytestmark = pytest.mark.usefixtures("single_torch_thread")


def tokens(kv: BranchKV, start: int, stop: int) -> BranchKV:
    return BranchKV(*(KV(b.k[:, start:stop], b.v[:, start:stop]) for b in (kv.cmp, kv.slc, kv.win)))


def concat(outs: list[NSAOutput]) -> dict[str, torch.Tensor]:
    cat = {name: torch.cat([getattr(o, name) for o in outs], dim=1)
           for name in ("o", "o_cmp", "o_slc", "o_win", "indices")}
    for name in ("cmp", "slc", "win"):
        cat[f"reads_{name}"] = torch.cat([getattr(o.reads, name) for o in outs], dim=1)
    return cat


def as_dict(out: NSAOutput) -> dict[str, torch.Tensor]:
    return concat([out])


def decode(cfg: NSAConfig, x, prompt: int, chunk: int, *, backend: str = "torch") -> dict[str, torch.Tensor]:
    """Prefill `prompt` tokens (none: start empty), then extend by `chunk` tokens (step when chunk = 1) to T."""
    B, T = x.q.shape[:2]
    cache = NSADecodeCache(cfg, B, T + 3, dtype=x.q.dtype, phi=x.phi, backend=backend)
    outs = [cache.prefill(x.q[:, :prompt], tokens(x.kv, 0, prompt), x.gates[:, :prompt])] if prompt else []
    t = prompt
    while t < T:
        e = min(T, t + chunk)
        call = cache.step if chunk == 1 else cache.extend
        outs.append(call(x.q[:, t:e], tokens(x.kv, t, e), x.gates[:, t:e]))
        t = e
    assert cache.lengths.tolist() == [T] * B
    return concat(outs)


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float = TOL) -> None:
    for name in ("o", "o_cmp", "o_slc", "o_win"):
        err = max_abs_error(got[name], want[name])
        assert err <= tol, f"{name}: max abs error {err:.3g} > {tol}"
    for name in ("indices", "reads_cmp", "reads_slc", "reads_win"):
        diff = (got[name] != want[name]).nonzero()
        assert diff.numel() == 0, f"{name} differs at [b, t, g, ...] {diff[:4].tolist()}"


# Decode = prefill ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [1, 3, 17, 64])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_decode_equals_optimized_prefill(variant, chunk):
    """70 tokens cross many compressed-token emissions (every d = 2), selection blocks (l' = 8) and the window;
    prompts of 0 (decode from empty, T < l at first) and 3 (< l) tokens, fp32."""
    cfg = VARIANTS[variant]
    x = make_inputs(cfg, 70, B=2, seed=chunk, dtype=torch.float32)
    want = as_dict(O.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi))
    for prompt in (0, 3) if chunk < 64 else (0, 21):
        assert_same(decode(cfg, x, prompt, chunk), want)


@st.composite
def reference_cases(draw):
    preset = PRESETS[draw(st.sampled_from(sorted(PRESETS)))]
    cfg = draw(configs(preset, phi=draw(st.sampled_from(["avg", "mlp"]))))
    T = draw(st.integers(1, 28))
    return cfg, T, draw(st.integers(0, T)), draw(st.sampled_from([1, 3, 17])), draw(st.integers(0, 2**16))


@given(reference_cases())
def test_decode_equals_reference_float64(case):
    """Against the loop oracle in float64: the cache's outputs equal reference.nsa_forward at every position and
    reference.decode_step (recompute from the full cache) for the last chunk."""
    cfg, T, prompt, chunk, seed = case
    x = make_inputs(cfg, T, B=2, seed=seed, dtype=torch.float64)
    got = decode(cfg, x, prompt, chunk)
    assert_same(got, as_dict(R.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)), tol=1e-10)
    TQ = (T - prompt) % chunk or min(chunk, T - prompt)
    if T > prompt:
        last = R.decode_step(x.q[:, T - TQ:], x.kv, x.gates[:, T - TQ:], cfg, x.phi)
        assert_same({k: v[:, T - TQ:] for k, v in got.items()}, as_dict(last), tol=1e-10)


# Counted reads ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("context, table_value", sorted(TABLE_4.items()))
def test_step_reads_reproduce_table_4(context, table_value):
    """Paper config (tiny head dim, 1 head): a step at position context-1 gathers (s - l)//d + 1 compressed tokens,
    n*l' selected token slots and w window keys: Table 4 minus 1 (docs/spec.md, "Table 4 off-by-one")."""
    cfg = NSAConfig.preset("paper", n_heads=1, n_kv_heads=1, head_dim_qk=2, head_dim_v=2, phi="avg")
    g = torch.Generator().manual_seed(context)
    prompt = BranchKV.shared(torch.randn(1, context - 1, 1, 2, generator=g), torch.randn(1, context - 1, 1, 2,
                                                                                           generator=g))
    cache = NSADecodeCache(cfg, 1, context)
    cache.fill(prompt)
    new = BranchKV.shared(torch.randn(1, 1, 1, 2, generator=g), torch.randn(1, 1, 1, 2, generator=g))
    out = cache.step(torch.randn(1, 1, 1, 2, generator=g), new, torch.full((1, 1, 1, 3), 0.5))
    reads = {name: int(getattr(out.reads, name)) for name in ("cmp", "slc", "win")}
    assert reads == {"cmp": (context - 32) // 16 + 1, "slc": 16 * 64, "win": 512}
    assert abs(sum(reads.values()) - table_value) <= 2
    assert sum(reads.values()) == table_value - 1


def test_chunk_reads_equal_reference_decode_step():
    """Reads of every query of a 20-token chunk at ~300 tokens equal the loop reference's counts."""
    cfg = NSAConfig.preset("paper", n_heads=2, n_kv_heads=2, head_dim_qk=2, head_dim_v=2, phi="avg",
                           cmp_block=8, cmp_stride=4, sel_block=16, n_sel=4, window=24)
    x = make_inputs(cfg, 310, seed=3, dtype=torch.float64)
    cache = NSADecodeCache(cfg, 1, 310, dtype=torch.float64)
    cache.fill(tokens(x.kv, 0, 290))
    got = cache.extend(x.q[:, 290:], tokens(x.kv, 290, 310), x.gates[:, 290:])
    want = R.decode_step(x.q[:, 290:], x.kv, x.gates[:, 290:], cfg)
    assert_same(as_dict(got), as_dict(want), tol=1e-10)


# Batch rows of different lengths ------------------------------------------------------------------------------
def test_rows_of_different_lengths_decode_like_single_rows():
    """Three right-padded rows (prompts of 5, 0 and 13 tokens, then chunks and steps that skip some rows): each
    row's real outputs equal a batch-1 prefill of that row's own sequence; padding queries give 0, indices -1,
    0 reads; padding tokens (filled with large finite garbage) never reach the cache."""
    cfg = SMALL
    calls = [("prefill", [5, 0, 13], 13), ("extend", [3, 1, 0], 4), ("step", [1, 0, 1], 1),
             ("extend", [17, 2, 9], 17), ("step", [1, 1, 1], 1), ("extend", [0, 3, 2], 3)]
    seqs = [make_inputs(cfg, 40, seed=10 + b, dtype=torch.float32) for b in range(3)]
    cache = NSADecodeCache(cfg, 3, 40, phi=seqs[0].phi)
    used = [0, 0, 0]
    for kind, counts, width in calls:
        def batch(get):
            rows = []
            for b, n in enumerate(counts):
                real = get(seqs[b])[:, used[b]:used[b] + n]
                pad = torch.full((1, width - n, *real.shape[2:]), 1e3)
                rows.append(torch.cat([real, pad], dim=1))
            return torch.cat(rows)
        q, gates = batch(lambda s: s.q), batch(lambda s: s.gates)
        kv = BranchKV(*(KV(batch(lambda s, n=n: s.kv.branch(n).k), batch(lambda s, n=n: s.kv.branch(n).v))
                        for n in ("cmp", "slc", "win")))
        out = as_dict(getattr(cache, kind)(q, kv, gates, counts))
        for b, n in enumerate(counts):
            if n == 0:
                assert all(bool((v[b] == (-1 if k == "indices" else 0)).all()) for k, v in out.items())
                continue
            single = as_dict(O.nsa_forward(seqs[b].q[:, :used[b] + n], tokens(seqs[b].kv, 0, used[b] + n),
                                           seqs[b].gates[:, :used[b] + n], cfg, seqs[0].phi))
            assert_same({k: v[b:b + 1, :n] for k, v in out.items()},
                        {k: v[:, used[b]:used[b] + n] for k, v in single.items()})
            padding = {k: v[b, n:] for k, v in out.items()}
            assert all(bool((v == (-1 if k == "indices" else 0)).all()) for k, v in padding.items())
            used[b] += n
        assert cache.lengths.tolist() == used


# Compression: each block built once, by the call that completes it ---------------------------------------------
def test_compressed_tokens_are_emitted_once_when_their_block_completes(monkeypatch):
    cfg = SMALL
    x = make_inputs(cfg, 30, B=2, seed=4, dtype=torch.float32)
    compressed_per_call = []
    real_phi = compression.phi_mlp

    def counting_phi(blocks, w):  # blocks [B, Hkv, M, l, D]: M blocks per row and KV head
        compressed_per_call.append(blocks.shape[-3])
        return real_phi(blocks, w)

    cache = NSADecodeCache(cfg, 2, 30, phi=x.phi)
    cache.prefill(x.q[:, :6], tokens(x.kv, 0, 6), x.gates[:, :6])
    monkeypatch.setattr(compression, "phi_mlp", counting_phi)
    for t, chunk in zip(range(6, 30, 3), [3] * 8):
        compressed_per_call.clear()
        cache.extend(x.q[:, t:t + chunk], tokens(x.kv, t, t + chunk), x.gates[:, t:t + chunk])
        assert max(compressed_per_call) <= -(-chunk // cfg.cmp_stride)  # ceil(TQ / d) candidate blocks, never all
        n = complete_cmp_blocks(t + chunk, cfg)
        k_cmp, v_cmp = O.compress(x.kv.cmp.k[:, :t + chunk], x.kv.cmp.v[:, :t + chunk], cfg, x.phi)
        assert k_cmp.shape[1] == n
        assert max_abs_error(cache.compressed.k[:, :, :n].transpose(1, 2), k_cmp) <= TOL
        assert max_abs_error(cache.compressed.v[:, :, :n].transpose(1, 2), v_cmp) <= TOL


# Seams: a replaced convention changes decode exactly as it changes prefill -------------------------------------
def _strict_visibility(block_idx, pos, cfg):
    return block_idx * cfg.cmp_stride + (cfg.cmp_block - 1) < pos


def _wider_window(pos, cfg):
    return pos - cfg.window_size


def _shifted_eq9(cfg):
    band = PLANTED_ORIGINALS["eq9_pool_weights"](cfg)
    return masks.Eq9Band(band.first_offset - cfg.pieces_per_sel_block, band.weights)


def _max_over_heads(per_head, cfg):
    return per_head.amax(dim=-2)


def _no_initial_block(scores, J, cfg):
    return PLANTED_ORIGINALS["top_n_blocks"](scores, J, cfg.replace(n_init=0))


def _logit_importance(logits, visible, cfg):
    return PLANTED_ORIGINALS["cmp_importance"](logits, visible, cfg.replace(selection_score="logits"))


def _excluding_own_token(token, pos, cfg):
    return token < pos


PLANTED = {"compressed_block_visible": _strict_visibility, "window_start": _wider_window,
           "eq9_pool_weights": _shifted_eq9, "group_reduce": _max_over_heads, "top_n_blocks": _no_initial_block,
           "cmp_importance": _logit_importance, "selected_token_visible": _excluding_own_token}
PLANTED_ORIGINALS = {name: getattr(masks, name) for name in PLANTED}


@pytest.mark.parametrize("seam", sorted(PLANTED))
def test_replaced_seam_changes_decode_like_prefill(seam, monkeypatch):
    cfg = SMALL.replace(window=3)  # n = 3: one block chosen by score besides block 0 and J
    x = make_inputs(cfg, 48, seed=7, dtype=torch.float32)
    before = as_dict(O.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi))
    monkeypatch.setattr(masks, seam, PLANTED[seam])
    after = as_dict(O.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi))
    assert max_abs_error(after["o"], before["o"]) > 1e-3, "the planted seam must change the prefill"
    for prompt, chunk in ((0, 1), (5, 4)):
        assert_same(decode(cfg, x, prompt, chunk), after)


# Triton backend (interpreter) ---------------------------------------------------------------------------------
def test_triton_backend_decode_equals_prefill():
    cfg = SMALL.replace(n_heads=6)
    x = make_inputs(cfg, 14, B=2, seed=2, dtype=torch.float32)
    want = as_dict(O.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi, backend="torch"))
    cache = NSADecodeCache(cfg, 2, 16, phi=x.phi, backend="triton")
    outs = [cache.prefill(x.q[:, :9], tokens(x.kv, 0, 9), x.gates[:, :9])]
    outs.append(cache.extend(x.q[:, 9:12], tokens(x.kv, 9, 12), x.gates[:, 9:12], [3, 2]))
    outs.append(cache.step(x.q[:, 12:13], tokens(x.kv, 12, 13), x.gates[:, 12:13], [1, 0]))
    got = concat(outs)
    assert_same({k: v[:1] for k, v in got.items()}, {k: v[:1, :13] for k, v in want.items()})
    assert_same({k: v[1:, :11] for k, v in got.items()}, {k: v[1:, :11] for k, v in want.items()})
    assert all(bool((v[1, 11:] == (-1 if k == "indices" else 0)).all()) for k, v in got.items())
    assert cache.lengths.tolist() == [13, 11]


# Lean step (optimized/decode/lean.py; the kernels in the interpreter) ------------------------------------------
GARBAGE = 1e3  # padding tokens: large finite values that must never reach an output or the cache


def row_tokens(x, starts: list[int], counts: list[int], width: int):
    """q, kv, gates [B, width, ...]: row b holds its own tokens starts[b]..starts[b]+counts[b]-1 of x, right-padded
    with GARBAGE."""
    def take(t: torch.Tensor) -> torch.Tensor:
        rows = []
        for b, (start, n) in enumerate(zip(starts, counts)):
            real = t[b:b + 1, start:start + n]
            rows.append(torch.cat([real, torch.full((1, width - n, *t.shape[2:]), GARBAGE, dtype=t.dtype)], dim=1))
        return torch.cat(rows)

    kv = BranchKV(*(KV(take(b.k), take(b.v)) for b in (x.kv.cmp, x.kv.slc, x.kv.win)))
    return take(x.q), kv, take(x.gates)


def lean_run(cfg: NSAConfig, x, prompt: list[int], schedule: list[list[int]]) -> None:
    """Fill both caches with each row's first prompt[b] tokens, then step: schedule[i][b] = 1 appends row b's next
    token, 0 gives row b a padding query. Every step of the lean path (backend "triton") equals the seam-by-seam
    torch path (fp32 <= 1e-5, indices and reads identical) and optimized.nsa_forward at the row's position; padding
    queries give 0 / -1 / 0 reads; at the end every cache buffer is identical."""
    B = len(prompt)
    caches = {backend: NSADecodeCache(cfg, B, x.q.shape[1], phi=x.phi, backend=backend)
              for backend in ("triton", "torch")}
    assert caches["triton"].uses_lean_step() and not caches["torch"].uses_lean_step()
    _, kv, _ = row_tokens(x, [0] * B, prompt, max(prompt))
    for cache in caches.values():
        cache.fill(kv, prompt)
    prefill = as_dict(O.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi))  # rows are independent sequences
    used = list(prompt)
    for counts in schedule:
        args = row_tokens(x, used, counts, 1)
        lean, torch_path = (as_dict(caches[backend].step(*args, lengths=counts)) for backend in ("triton", "torch"))
        assert_same(lean, torch_path)
        for b, n in enumerate(counts):
            if n:
                assert_same({k: v[b:b + 1] for k, v in lean.items()},
                            {k: v[b:b + 1, used[b]:used[b] + 1] for k, v in prefill.items()})
            else:
                assert all(bool((v[b] == (-1 if k == "indices" else 0)).all()) for k, v in lean.items())
        used = [u + n for u, n in zip(used, counts)]
    for name in ("history", "window", "cmp_raw", "compressed"):
        for part in ("k", "v"):
            got, want = (getattr(getattr(caches[b], name).usable(), part) for b in ("triton", "torch"))
            assert torch.equal(got, want), f"{name}.{part} differs"
    assert all(c.lengths.tolist() == used and c.device_lengths.tolist() == used for c in caches.values())


STEPS_FROM_EMPTY = [[1, 1], [1, 1], [1, 0], [1, 1], [1, 1], [0, 1], [1, 1], [1, 1], [1, 0], [1, 1]]
STEPS = [[1, 1], [1, 0], [1, 1], [1, 1], [0, 1], [1, 1], [1, 1], [1, 1], [1, 0], [1, 1]]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_lean_step_equals_seam_path_and_prefill(variant):
    """Every convention variant: steps from an empty cache (T < l, the first compressed emissions and selection
    block) and after prompts of 29 and 22 tokens (more blocks than n, block boundary 32, window ring wrapped), with
    padding queries and rows of different lengths."""
    cfg = VARIANTS[variant]
    x = make_inputs(cfg, 40, B=2, seed=sorted(VARIANTS).index(variant), dtype=torch.float32)
    lean_run(cfg, x, [0, 0], STEPS_FROM_EMPTY)
    lean_run(cfg, x, [29, 22], STEPS)


@st.composite
def lean_cases(draw):
    preset = PRESETS[draw(st.sampled_from(sorted(PRESETS)))]
    cfg = draw(configs(preset, phi=draw(st.sampled_from(["avg", "mlp"]))))
    steps = draw(st.lists(st.sampled_from([[1, 1], [1, 0], [0, 1]]), min_size=1, max_size=5))
    return cfg, draw(st.integers(0, 16)), steps, draw(st.integers(0, 2**16))


@given(lean_cases())
def test_lean_step_equals_seam_path_on_small_configs(case):
    """Hypothesis over small configs of every preset (d = 1, l' = 1, odd head dims and groups included): steps after
    prompts of p and p - 3 tokens."""
    cfg, prompt, steps, seed = case
    x = make_inputs(cfg, prompt + len(steps), B=2, seed=seed, dtype=torch.float32)
    lean_run(cfg, x, [prompt, max(0, prompt - 3)], steps)


@pytest.mark.parametrize("rank_block, lists", [(64, 3), (4, 1)])
def test_lean_step_with_several_splits(rank_block, lists, monkeypatch):
    """Several compressed splits (two key tiles of 16 in the interpreter), score programs (2 blocks each, those past
    a row's last block skipped), select lists, selected splits and window splits (a 20-slot window: two key tiles)
    give the same step; the gate kernel's merges take the splits two at a time and its programs 16 output columns
    each (d_v = 40, padded to 64: four programs per row). rank_block 4 (narrower than a list's 16 slots) takes
    score_into_list's top_n_by_rank path instead of the bitonic top-k, with one list per row ranked in chunks of 4
    (up to 7 blocks for n = 5, so the ranking decides)."""
    from optimized.kernels import decode_step

    monkeypatch.setattr(decode_step, "step_splits",
                        lambda *args: decode_step.StepSplits(cmp=3, lists=lists, slc=3, win=2))
    monkeypatch.setattr(decode_step, "MERGE_CHUNK", 2)
    monkeypatch.setattr(decode_step, "GATE_TILE_DV", 16)
    monkeypatch.setattr(decode_step, "SCORE_BLOCK", 2)
    monkeypatch.setattr(decode_step, "RANK_BLOCK", rank_block)
    cfg = SMALL.replace(window=20, n_sel=5, head_dim_v=40, n_local=0)  # 3 selected splits of 2, 2, 1 blocks
    x = make_inputs(cfg, 52, B=3, seed=5, dtype=torch.float32)
    # the rows' last blocks J run 5..6, 4..5 and 2..3: score programs of 2 blocks start at J (block J's score counts
    # only when it beats others: n_local = 0 here) or past it (they skip)
    lean_run(cfg, x, [45, 38, 20], [[*step, 1] for step in STEPS[:6]])


def test_lean_step_ties_like_top_n_blocks():
    """q = 0: every compressed token gets the same probability, so the selection blocks' scores tie exactly
    (interior blocks alike, whatever the summation order) and Eq. 11's rule (equal scores -> lower index) decides."""
    cfg = SMALL.replace(n_sel=4)
    x = make_inputs(cfg, 46, B=2, seed=6, dtype=torch.float32)
    x.q.zero_()
    lean_run(cfg, x, [40, 33], STEPS[:4])


@pytest.mark.parametrize("seam", sorted(PLANTED))
def test_kernel_backend_honours_the_documented_seams(seam, monkeypatch):
    """docs/decode.md: on the kernel backend a replaced seam reaches the seam-by-seam path (lean_step=False, and
    every chunk) as it reaches the prefill, except masks.selected_token_visible, whose clip the selected-decode
    kernel computes itself; the lean step computes every rule itself, so it keeps the original conventions, and
    refuses an Eq. 9 band other than the overlap band its kernels compute."""
    cfg = SMALL.replace(window=3)
    x = make_inputs(cfg, 44, seed=11, dtype=torch.float32)  # a seed where every planted seam changes rows 41..43
    original = {k: v[:, 41:] for k, v in as_dict(O.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)).items()}
    monkeypatch.setattr(masks, seam, PLANTED[seam])
    planted = {k: v[:, 41:] for k, v in as_dict(O.nsa_forward(x.q, x.kv, x.gates, cfg, x.phi)).items()}
    assert max_abs_error(planted["o"], original["o"]) > 1e-3, "the planted seam must change these rows"

    def steps(lean_step: bool) -> dict[str, torch.Tensor]:
        cache = NSADecodeCache(cfg, 1, 44, phi=x.phi, backend="triton", lean_step=lean_step)  # after the seam:
        assert cache.uses_lean_step() == lean_step  # the window ring's capacity asks it
        cache.fill(tokens(x.kv, 0, 41))
        return concat([cache.step(x.q[:, t:t + 1], tokens(x.kv, t, t + 1), x.gates[:, t:t + 1]) for t in (41, 42, 43)])

    assert_same(steps(False), original if seam == "selected_token_visible" else planted)
    if seam == "eq9_pool_weights":
        with pytest.raises(RuntimeError, match="eq9_pool_weights"):
            steps(True)
    else:
        assert_same(steps(True), original)


def test_lean_step_applies_to_kernel_steps_only():
    cfg = SMALL.replace(phi="avg")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert NSADecodeCache(cfg, 1, 8, dtype=dtype, backend="triton").uses_lean_step()
    assert not NSADecodeCache(cfg, 1, 8, dtype=torch.float64, backend="triton").uses_lean_step()
    assert not NSADecodeCache(cfg, 1, 8, backend="torch").uses_lean_step()
    assert not NSADecodeCache(cfg, 1, 8, backend="auto").uses_lean_step()  # CPU: auto is the torch path
    assert not NSADecodeCache(cfg, 1, 8, backend="triton").uses_lean_step(n_queries=3)
    assert not NSADecodeCache(cfg, 1, 8, backend="triton", lean_step=False).uses_lean_step()


# Validation ---------------------------------------------------------------------------------------------------
def test_bad_inputs_raise_value_errors_naming_the_rule():
    cfg = SMALL.replace(phi="avg")
    x = make_inputs(cfg, 8, B=2, seed=0, dtype=torch.float32)
    with pytest.raises(ValueError, match="capacity"):
        NSADecodeCache(cfg, 2, 0)
    with pytest.raises(ValueError, match="phi"):
        NSADecodeCache(SMALL, 2, 8)
    with pytest.raises(ValueError, match="backend"):
        NSADecodeCache(cfg, 2, 8, backend="cuda")
    cache = NSADecodeCache(cfg, 2, 8)
    with pytest.raises(ValueError, match="lengths must be in 0..8"):
        cache.prefill(x.q, x.kv, x.gates, [9, 1])
    with pytest.raises(ValueError, match="one integer per batch row"):
        cache.prefill(x.q, x.kv, x.gates, [1, 2, 3])
    with pytest.raises(ValueError, match="float64 on cpu; the cache is torch.float32"):
        cache.fill(BranchKV.shared(x.kv.win.k.double(), x.kv.win.v.double()))
    cache.prefill(x.q[:, :6], tokens(x.kv, 0, 6), x.gates[:, :6])
    with pytest.raises(ValueError, match="empty cache"):
        cache.fill(tokens(x.kv, 0, 2))
    with pytest.raises(ValueError, match="one new token per row"):
        cache.step(x.q[:, :2], tokens(x.kv, 0, 2), x.gates[:, :2])
    with pytest.raises(ValueError, match="capacity"):
        cache.extend(x.q[:, :3], tokens(x.kv, 0, 3), x.gates[:, :3])
    with pytest.raises(ValueError, match="kv.slc"):
        two = tokens(x.kv, 0, 2)
        cache.extend(x.q[:, :2], BranchKV(two.cmp, KV(x.kv.slc.k[:, :3], x.kv.slc.v[:, :3]), two.win), x.gates[:, :2])
    assert cache.lengths.tolist() == [6, 6]  # failed calls change nothing


@pytest.mark.slow
def test_compiled_stages_give_the_same_decode():
    """compile_stages=True (torch.compile of the plan, selection and gate stages; ~1 min of compilation on CPU)."""
    cfg = SMALL
    x = make_inputs(cfg, 40, B=2, seed=1, dtype=torch.float32)
    results = []
    for compile_stages in (False, True):
        cache = NSADecodeCache(cfg, 2, 40, phi=x.phi, compile_stages=compile_stages)
        outs = [cache.prefill(x.q[:, :10], tokens(x.kv, 0, 10), x.gates[:, :10])]
        outs += [cache.extend(x.q[:, t:t + 3], tokens(x.kv, t, t + 3), x.gates[:, t:t + 3]) for t in range(10, 37, 3)]
        outs.append(cache.step(x.q[:, 37:38], tokens(x.kv, 37, 38), x.gates[:, 37:38]))
        results.append(concat(outs))
    assert_same(results[1], results[0])


def test_step_splits_give_the_one_warp_select_launch_four_times_the_programs(monkeypatch):
    """The split policy behind the measured H100 steps (132 SMs: 264 programs per launch): at 64k the four-warp
    launches get 264 // rows programs per row (batch 16: 4; batch 1: the sqrt cap on the compressed splits), the
    one-warp select launch four times that, capped at 16 lists per row and one list per 64 blocks."""
    from optimized.kernels import decode_step

    monkeypatch.setattr(decode_step, "program_budget", lambda device: 264)
    common = dict(n_cmp_slots=4095, n_sel=16, sel_block=64, window_slots=512, window_tiles=8, key_bytes=512,
                  partial_bytes=(16 * 128 + 2 * 16 + 1) * 4, device=torch.device("cpu"))
    assert tuple(decode_step.step_splits(rows=64, n_sel_blocks=1024, **common)) == (4, 16, 3, 1)
    assert tuple(decode_step.step_splits(rows=4, n_sel_blocks=1024, **common)) == (16, 16, 7, 3)
    assert decode_step.step_splits(rows=64, n_sel_blocks=128, **common).lists == 2
    assert decode_step.step_splits(rows=256, n_sel_blocks=1024, **common).lists == 4  # 4 x 264 // 256
