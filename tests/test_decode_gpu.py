"""GPU share of the decode tests (needs CUDA; `pytest -m gpu tests/test_decode_gpu.py`).

- decode = prefill in bf16 with the Triton decode kernels, by FlashAttention's error-ratio rule: error of the bf16
  decode vs a float64 prefill <= 2 x error of the bf16 prefill vs the same float64 prefill + 1e-6 (all three with
  the decode's own selected blocks, teacher-forced), and the decode selects the blocks the free-running bf16
  prefill selects for >= 99% of (query, group) rows (near-ties may flip under different summation orders);
- the decode kernels at the paper's head layout (16 heads per group, d = 128, l' = 64, n = 16) by the same rule
  (low precision = the same computation in bf16 torch, oracle = float64);
- DecodeGraph replays (eager stages and torch.compile'd stages) equal eager steps;
- the lean step (optimized/decode/lean.py) at the paper layout (64 heads, 4 groups, d = 128, l, d, l', n, w of
  the paper), replayed by a DecodeGraph over rows of different lengths with padding queries: = the bf16 prefill by
  the error-ratio rule (teacher-forced), >= 99% the free-running prefill's selections, and = the seam-by-seam
  kernel path (selections >= 99%, reads);
- counted reads of one step at 64k with the paper config reproduce Table 4 minus one (lean step);
- the lean step's Eq. 7 emission kernel at the paper layout (d = 128, l = 32, phi mlp, batch 16), by the same rule
  against the torch emission on the same bf16 cache (oracle: the torch emission in float64).
"""

from __future__ import annotations

import pytest
import torch

import optimized as O
from conformance.helpers import error_ratio, make_inputs
from optimized.decode import NSADecodeCache
from optimized.decode.graph import DecodeGraph
from optimized.kernels.masked_decode import masked_decode_attention
from optimized.kernels.naive import selected_attention_naive
from optimized.kernels.selected_decode import selected_decode_attention
from reference.config import NSAConfig
from reference.contract import KV, BranchKV

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CFG = NSAConfig.preset("paper", n_heads=16, n_kv_heads=2, head_dim_qk=64, head_dim_v=64, n_sel=4, window=128)


def tokens(kv: BranchKV, start: int, stop: int) -> BranchKV:
    return BranchKV(*(KV(b.k[:, start:stop], b.v[:, start:stop]) for b in (kv.cmp, kv.slc, kv.win)))


def decode_bf16(x, prompt: int, chunks: list[int]):
    B, T = x.q.shape[:2]
    cache = NSADecodeCache(CFG, B, T, dtype=torch.bfloat16, device="cuda", phi=x.phi)
    assert cache.uses_lean_step()  # the steps run the lean step, the chunks the seam-by-seam kernel path
    outs = [cache.prefill(x.q[:, :prompt], tokens(x.kv, 0, prompt), x.gates[:, :prompt])]
    t = prompt
    for chunk in chunks:
        call = cache.step if chunk == 1 else cache.extend
        outs.append(call(x.q[:, t:t + chunk], tokens(x.kv, t, t + chunk), x.gates[:, t:t + chunk]))
        t += chunk
    return t, torch.cat([o.o for o in outs], 1), torch.cat([o.indices for o in outs], 1)


def test_bf16_decode_equals_prefill_by_error_ratio():
    x64 = make_inputs(CFG, 700, B=2, seed=0, dtype=torch.float64, device="cuda")
    x16 = x64.to(dtype=torch.bfloat16)
    T, o_dec, idx_dec = decode_bf16(x16, 300, [1] * 40 + [17] * 4 + [64] * 4 + [1] * 4)
    xr = x16.to(dtype=torch.float64)  # the oracle sees the same bf16-rounded inputs
    sl = slice(0, T)
    oracle = O.nsa_forward(xr.q[:, sl], tokens(xr.kv, 0, T), xr.gates[:, sl], CFG, xr.phi, indices=idx_dec).o
    low = O.nsa_forward(x16.q[:, sl], tokens(x16.kv, 0, T), x16.gates[:, sl], CFG, x16.phi, indices=idx_dec).o
    assert error_ratio(o_dec, low, oracle) <= 1.0
    free = O.nsa_forward(x16.q[:, sl], tokens(x16.kv, 0, T), x16.gates[:, sl], CFG, x16.phi).indices
    agree = (free == idx_dec).all(-1).float().mean().item()
    assert agree >= 0.99, f"decode and prefill select the same blocks for only {agree:.1%} of (query, group) rows"


@pytest.mark.parametrize("batch, n_queries", [(1, 1), (3, 1), (2, 4)])
def test_selected_decode_kernel_paper_layout(batch, n_queries):
    g = torch.Generator(device="cuda").manual_seed(batch)
    Hkv, G, d, lp, n, S = 4, 16, 128, 64, 16, 9000
    q = torch.randn(batch, n_queries, Hkv * G, d, generator=g, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, Hkv, S, d, generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch, Hkv, S, d, generator=g, device="cuda", dtype=torch.bfloat16)
    positions = torch.randint(1000, S, (batch, 1), generator=g, device="cuda") + torch.arange(n_queries, device="cuda")
    positions = positions.clamp(max=S - 1)
    J = positions // lp
    idx = torch.sort(torch.rand(batch, n_queries, Hkv, 200, generator=g, device="cuda").argsort(-1)[..., :n], -1).values
    idx = torch.minimum(idx, J[:, :, None, None])  # blocks that exist (duplicates allowed)
    o, reads = selected_decode_attention(q, k, v, idx, positions, lp)
    for b in range(batch):
        for t in range(n_queries):
            args = (k[b:b + 1].transpose(1, 2), v[b:b + 1].transpose(1, 2), idx[b:b + 1, t:t + 1], lp)
            pos = positions[b, t:t + 1]
            oracle = selected_attention_naive(q[b:b + 1, t:t + 1].double(), *(a.double() for a in args[:2]), *args[2:],
                                              positions=pos)
            low = selected_attention_naive(q[b:b + 1, t:t + 1], *args, positions=pos)  # the same in bf16 torch
            assert error_ratio(o[b:b + 1, t:t + 1], low, oracle) <= 1.0
    tokens_ = idx[..., None] * lp + torch.arange(lp, device="cuda")
    assert torch.equal(reads, (tokens_ <= positions[:, :, None, None, None]).sum((-1, -2)))


def test_masked_decode_kernel_paper_layout():
    g = torch.Generator(device="cuda").manual_seed(7)
    B, TQ, Hkv, G, d, K = 3, 2, 4, 16, 128, 4100
    q = torch.randn(B, TQ, Hkv * G, d, generator=g, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, K, d, generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, Hkv, K, d, generator=g, device="cuda", dtype=torch.bfloat16)
    mask = torch.rand(B, TQ, K, generator=g, device="cuda") < 0.9
    o, logits, reads = masked_decode_attention(q, k, v, mask, want_logits=True)

    def dense(dtype):
        kk, vv = k.to(dtype).repeat_interleave(G, 1), v.to(dtype).repeat_interleave(G, 1)
        s = torch.einsum("bthd,bhkd->bthk", q.to(dtype), kk) / d ** 0.5
        p = torch.softmax(s.masked_fill(~mask[:, :, None], float("-inf")), -1)
        return torch.einsum("bthk,bhkd->bthd", p, vv), s

    oracle, s64 = dense(torch.float64)
    low, _ = dense(torch.bfloat16)  # the same computation in bf16 torch
    assert error_ratio(o, low, oracle) <= 1.0
    assert (logits.permute(0, 2, 1, 3, 4).reshape(B, TQ, Hkv * G, K).double() - s64).abs().max() < 1e-3
    assert torch.equal(reads, mask.sum(-1)[:, :, None].expand(B, TQ, Hkv))


@pytest.mark.parametrize("compile_stages", [False, True])
def test_graph_replays_equal_eager_steps(compile_stages):
    x = make_inputs(CFG, 420, B=2, seed=3, dtype=torch.bfloat16, device="cuda")
    caches = [NSADecodeCache(CFG, 2, 430, dtype=torch.bfloat16, device="cuda", phi=x.phi, compile_stages=c)
              for c in (False, compile_stages)]
    for cache in caches:
        cache.fill(tokens(x.kv, 0, 380), [380, 371])
    graph = DecodeGraph(caches[1], 430)
    rows = agreeing = 0
    for t in range(380, 420):
        args = (x.q[:, t:t + 1], tokens(x.kv, t, t + 1), x.gates[:, t:t + 1])
        eager = caches[0].step(*args)
        replay = graph(*args)
        same = (replay.indices == eager.indices).all(-1)  # [B, 1, Hkv]: near-ties may flip (other scan bounds)
        rows, agreeing = rows + same.numel(), agreeing + int(same.sum())
        heads = same.repeat_interleave(CFG.group_size, dim=2)[..., None]
        assert (torch.where(heads, replay.o.float() - eager.o.float(), 0.0)).abs().max() < 2e-2
        for name in ("cmp", "win"):
            assert torch.equal(getattr(replay.reads, name), getattr(eager.reads, name))
        assert torch.equal(torch.where(same, replay.reads.slc, 0), torch.where(same, eager.reads.slc, 0))
    assert agreeing >= 0.99 * rows
    assert caches[1].lengths.tolist() == [420, 411] and caches[1].device_lengths.tolist() == [420, 411]


PAPER = NSAConfig.preset("paper", head_dim_qk=128, head_dim_v=128)


def row_tokens(x, starts: list[int], counts: list[int]):
    """One token per row: row b's token starts[b] of x where counts[b] = 1, a padding token (large finite values)
    where it is 0."""
    def take(t: torch.Tensor) -> torch.Tensor:
        rows = [t[b:b + 1, s:s + 1] if n else torch.full_like(t[b:b + 1, :1], 1e3)
                for b, (s, n) in enumerate(zip(starts, counts))]
        return torch.cat(rows)

    return take(x.q), BranchKV(*(KV(take(b.k), take(b.v)) for b in (x.kv.cmp, x.kv.slc, x.kv.win))), take(x.gates)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lean_graph_paper_layout_equals_prefill_and_seam_path(dtype):
    """Two rows of 2552 and 1852 tokens (more selection blocks than n = 16), 48 steps replayed by a DecodeGraph
    (the lean step; one step in d emits a compressed token), row 1 with a padding query every fifth step, in bf16
    and fp16 (each dtype's own emission kernel). Each real step: decode vs float64 prefill <= 2 x prefill in the
    same dtype vs float64 prefill (all with the decode's blocks, the prompt's from the free-running prefill); the
    decode selects the free-running prefill's blocks for >= 99% of (query, group) rows; an eager cache on the
    seam-by-seam kernel path (lean_step=False) gives the same compressed and window reads, the same selected reads
    where the selections agree, and >= 99% of the selections."""
    T, steps = 2600, 48
    x16 = make_inputs(PAPER, T, B=2, seed=11, dtype=torch.float64, device="cuda", phi_hidden=128).to(
        dtype=dtype)
    prompt = [T - steps, T - steps - 700]
    lean, seams = (NSADecodeCache(PAPER, 2, T, dtype=dtype, device="cuda", phi=x16.phi, lean_step=lean_step)
                   for lean_step in (True, False))
    prompt_kv = BranchKV(*(KV(b.k[:, :prompt[0]], b.v[:, :prompt[0]]) for b in (x16.kv.cmp, x16.kv.slc, x16.kv.win)))
    for cache in (lean, seams):
        cache.fill(prompt_kv, prompt)
    assert lean.uses_lean_step()
    graph = DecodeGraph(lean, T)  # captures the lean step
    assert not seams.uses_lean_step()
    used, decoded, rows, agree = list(prompt), [{}, {}], 0, 0
    for i in range(steps):
        counts = [1, 0 if i % 5 == 3 else 1]
        args = row_tokens(x16, used, counts)
        out = graph(*args, lengths=counts)
        ref = seams.step(*args, lengths=counts)
        for b, n in enumerate(counts):
            if not n:
                assert bool((out.o[b] == 0).all()) and bool((out.indices[b] == -1).all())
                assert all(int(getattr(out.reads, name)[b].sum()) == 0 for name in ("cmp", "slc", "win"))
                continue
            same = (out.indices[b] == ref.indices[b]).all(-1)
            rows, agree = rows + same.numel(), agree + int(same.sum())
            for name in ("cmp", "win"):
                assert torch.equal(getattr(out.reads, name)[b], getattr(ref.reads, name)[b])
            assert torch.equal(torch.where(same, out.reads.slc[b], 0), torch.where(same, ref.reads.slc[b], 0))
            decoded[b][used[b]] = (out.o[b, 0].clone(), out.indices[b, 0].clone())
        used = [u + n for u, n in zip(used, counts)]
    assert agree >= 0.99 * rows, f"lean and seam-by-seam selections agree on {agree}/{rows} rows"
    assert lean.lengths.tolist() == used and lean.device_lengths.tolist() == used
    phi64 = x16.phi.to(dtype=torch.float64)
    for b in range(2):
        sl = slice(0, used[b])
        row16 = BranchKV(*(KV(br.k[b:b + 1, sl], br.v[b:b + 1, sl]) for br in (x16.kv.cmp, x16.kv.slc, x16.kv.win)))
        row64 = BranchKV(*(KV(br.k.double(), br.v.double()) for br in (row16.cmp, row16.slc, row16.win)))
        q16, g16 = x16.q[b:b + 1, sl], x16.gates[b:b + 1, sl]
        free = O.nsa_forward(q16, row16, g16, PAPER, x16.phi).indices
        positions = sorted(decoded[b])
        idx = free.clone()
        for t in positions:
            idx[0, t] = decoded[b][t][1]
        agree = (free[0, positions] == idx[0, positions]).all(-1).float().mean().item()
        assert agree >= 0.99, f"row {b}: decode and prefill select the same blocks for only {agree:.1%} of rows"
        oracle = O.nsa_forward(q16.double(), row64, g16.double(), PAPER, phi64, indices=idx).o[0, positions]
        low = O.nsa_forward(q16, row16, g16, PAPER, x16.phi, indices=idx).o[0, positions]
        o_dec = torch.stack([decoded[b][t][0] for t in positions])
        assert error_ratio(o_dec, low, oracle) <= 1.0


def test_step_reads_at_64k_reproduce_table_4_on_gpu():
    cfg = NSAConfig.preset("paper", head_dim_qk=128, head_dim_v=128)
    s = 65536
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(T, dim):
        return torch.randn(1, T, cfg.n_kv_heads, dim, generator=g, device="cuda", dtype=torch.bfloat16)

    from reference.contract import PhiWeights

    phi = PhiWeights.init(cfg, 128, dtype=torch.bfloat16, device="cuda")
    cache = NSADecodeCache(cfg, 1, s, dtype=torch.bfloat16, device="cuda", phi=phi)
    assert cache.uses_lean_step()
    cache.fill(BranchKV.shared(rnd(s - 1, 128), rnd(s - 1, 128)))
    new = BranchKV.shared(rnd(1, 128), rnd(1, 128))
    q = torch.randn(1, 1, cfg.n_heads, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    out = cache.step(q, new, torch.full((1, 1, cfg.n_heads, 3), 0.5, device="cuda", dtype=torch.bfloat16))
    assert out.reads.cmp.unique().tolist() == [(s - 32) // 16 + 1]
    assert out.reads.slc.unique().tolist() == [1024] and out.reads.win.unique().tolist() == [512]
    assert int(out.reads.total[0, 0, 0]) == 5632 - 1


@pytest.mark.parametrize("phi", ["mlp", "avg"])
def test_emission_kernel_paper_layout(phi):
    from optimized.decode.emission import new_compressed_blocks
    from optimized.kernels.decode_emission import emit_step_block
    from reference.contract import PhiWeights

    cfg = NSAConfig.preset("paper", phi=phi)
    B, H, l, d = 16, cfg.n_kv_heads, cfg.cmp_block, cfg.cmp_stride
    dims = (cfg.head_dim_qk, cfg.head_dim_v)  # 192 and 128: a key width that is not a power of two
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([l - 1 + d * i if i % 4 else 1000 + i for i in range(B)], device="cuda")  # 12 emit
    n_new = torch.ones(B, dtype=torch.int64, device="cuda")
    n_new[5] = 0
    phi_w = PhiWeights.init(cfg, 128, generator=g, dtype=torch.bfloat16).to(device="cuda") if phi == "mlp" else None
    raw = tuple(torch.randn(B, H, l + 1, D, generator=g).to("cuda", torch.bfloat16) for D in dims)
    new = tuple(torch.randn(B, 1, H, D, generator=g).to("cuda", torch.bfloat16) for D in dims)
    slots = 4096
    kernel = tuple(torch.full((B, H, slots + 1, D), 7.0, device="cuda", dtype=torch.bfloat16) for D in dims)
    emit_step_block(lengths, n_new, *new, raw, kernel, l, d, phi_w)

    def by_torch(dtype):
        w = phi_w.to(dtype=dtype) if phi_w is not None else None
        blocks = new_compressed_blocks(KV(*(r[:, :, :l].to(dtype) for r in raw)), lengths, n_new,
                                       *(t.to(dtype) for t in new), cfg, w, trash=slots)
        return blocks

    low, oracle = by_torch(torch.bfloat16), by_torch(torch.float64)
    emitted = low.slots[:, 0] < slots
    assert int(emitted.sum()) == 11  # rows 1-3, 5-7 minus the padding row 5, 9-11, 13-15: 11
    rows = emitted.nonzero().flatten()
    for side, (got_store, want_low, want64) in enumerate(zip(kernel, (low.k, low.v), (oracle.k, oracle.v))):
        got = torch.stack([got_store[b, :, low.slots[b, 0]] for b in rows.tolist()])  # [rows, H, D]
        stored = want_low[rows, 0].to(torch.bfloat16)  # the torch emission as the cache stores it
        assert error_ratio(got, stored, want64[rows, 0]) <= 1.0, ("k", "v")[side]
        untouched = got_store.clone()
        for b in rows.tolist():
            untouched[b, :, low.slots[b, 0]] = 7.0
        assert bool((untouched == 7.0).all()), "the kernel wrote a slot other than the completed blocks'"

