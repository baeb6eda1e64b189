"""Rows whose selection has no choice (J + 1 <= n: Eq. 11 takes every block 0..J) read one contiguous run of keys,
and on the kernel path the selected branch attends to it with the range kernels instead of gathering it block by
block (kernels/selected_attention.full_selection_ranges). Checked here in Triton's interpreter on tiny shapes:

- the runs: each row's run is the keys <= p of blocks 0..J, counted key by key here, for the paper's J and for a
  replaced current_sel_block seam; rows after the first one with a choice are not in it;
- nsa_forward with its own selection (some rows on the range kernels, the rest gathered) against the torch path
  and against the same call teacher-forced on the same indices (every row gathered), outputs and gradients;
- the split happens: the range kernels see exactly the leading rows.
"""

from __future__ import annotations

import pytest
import torch

import optimized
from conformance.helpers import make_inputs, max_abs_error
from optimized import masks
from optimized.kernels import selected_attention, selected_attention_bwd
from reference.config import NSAConfig

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on CPU the kernels run in Triton's interpreter
CFG = NSAConfig(cmp_block=4, cmp_stride=2, sel_block=8, n_sel=3, window=5, n_heads=4, n_kv_heads=2, head_dim_qk=16,
                head_dim_v=16, phi="avg")
LEAVES = ("q", "cmp.k", "cmp.v", "slc.k", "slc.v", "win.k", "win.v", "gates")


def expected_runs(first: int, n_rows: int, cfg: NSAConfig) -> list[tuple[int, int]]:
    """(lo, hi) of the leading rows whose J + 1 <= n, from the keys themselves: every key <= p whose block is
    among 0..J, which must be one run starting at key 0."""
    runs = []
    for p in range(first, first + n_rows):
        last = int(masks.current_sel_block(torch.tensor(p), cfg))
        if last + 1 > cfg.n_sel:
            break
        keys = [key for key in range(p + 1) if key // cfg.sel_block <= last]
        assert keys == list(range(len(keys)))
        runs.append((0, len(keys) - 1))
    return runs


def runs_of(first: int, n_rows: int, cfg: NSAConfig) -> list[tuple[int, int]]:
    got = selected_attention.full_selection_ranges(first, n_rows, cfg, torch.device("cpu"))
    return [] if got is None else list(zip(got[0].tolist(), got[1].tolist()))


@pytest.mark.parametrize("first, n_rows", [(0, 40), (0, 10), (20, 9), (24, 5)])
def test_the_runs_are_the_keys_of_every_block_up_to_the_row(first, n_rows):
    runs = runs_of(first, n_rows, CFG)
    assert runs == expected_runs(first, n_rows, CFG)
    assert len(runs) == max(0, min(n_rows, CFG.n_sel * CFG.sel_block - first))


def test_the_runs_follow_a_replaced_current_block_seam(monkeypatch):
    paper = masks.current_sel_block
    monkeypatch.setattr(masks, "current_sel_block", lambda pos, cfg: paper(pos, cfg) - 1)
    runs = runs_of(0, 40, CFG)
    assert runs == expected_runs(0, 40, CFG)
    assert len(runs) == 32 and runs[0] == (0, -1) and runs[9] == (0, 7)  # J = -1 reads nothing; J = 0 block 0


def kernel_call(x, indices=None):
    out = optimized.nsa_forward(x.q, x.kv, x.gates, CFG, backend="triton", range_backend="triton",
                                indices=indices)
    return out


def torch_call(x, indices=None):
    return optimized.nsa_forward(x.q, x.kv, x.gates, CFG, backend="torch", range_backend="torch", indices=indices)


def grads(out, x, weight):
    leaves = [x.q, x.kv.cmp.k, x.kv.cmp.v, x.kv.slc.k, x.kv.slc.v, x.kv.win.k, x.kv.win.v, x.gates]
    return torch.autograd.grad((out.o * weight).sum(), leaves)


@pytest.mark.parametrize("T, batch", [(40, 2), (20, 1)], ids=["split", "all-rows"])
def test_own_selection_on_the_range_kernels_matches_the_gathered_rows(T, batch, monkeypatch):
    x = make_inputs(CFG, T, B=batch, seed=T, dtype=torch.float32, device=DEVICE).to(requires_grad=True)
    seen = []
    forward = selected_attention.range_attention_forward
    backward_dq = selected_attention_bwd.range_attention_backward_dq

    def spy_forward(q, *args, **kwargs):
        seen.append(("forward", q.shape[1]))
        return forward(q, *args, **kwargs)

    def spy_dq(q, *args, **kwargs):
        seen.append(("dq", q.shape[1]))
        return backward_dq(q, *args, **kwargs)

    monkeypatch.setattr(selected_attention, "range_attention_forward", spy_forward)
    monkeypatch.setattr(selected_attention_bwd, "range_attention_backward_dq", spy_dq)
    weight = torch.randn((batch, T, CFG.n_heads, CFG.head_dim_v), generator=torch.Generator().manual_seed(1)).to(DEVICE)

    own = kernel_call(x)
    own_grads = grads(own, x, weight)
    rows = CFG.n_sel * CFG.sel_block
    assert seen == [("forward", min(T, rows)), ("dq", min(T, rows))]

    seen.clear()
    gathered = kernel_call(x, indices=own.indices)  # teacher-forced: every row gathered
    gathered_grads = grads(gathered, x, weight)
    assert seen == []
    want = torch_call(x, indices=own.indices)
    want_grads = grads(want, x, weight)

    assert torch.equal(own.indices, want.indices) and torch.equal(own.reads.slc, gathered.reads.slc)
    for name in ("o", "o_slc"):
        assert max_abs_error(getattr(own, name), getattr(want, name)) < 1e-5, name
        assert max_abs_error(getattr(own, name), getattr(gathered, name)) < 1e-5, name
    for name, g_own, g_gathered, g_want in zip(LEAVES, own_grads, gathered_grads, want_grads):
        assert max_abs_error(g_own, g_want) < 5e-5, f"gradient of {name}"
        assert max_abs_error(g_own, g_gathered) < 5e-5, f"gradient of {name}"
