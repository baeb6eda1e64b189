"""Causal isolation: nothing at position t may move a logit at a position p < t.

A deterministic check on the model itself, no training: for a set of positions t, each probe changes one thing at
t and compares the logits at every p < t with those of the unchanged input.

  token          token t replaced by another token id (every layer and branch sees another input at t)
  cmp, slc, win  only that branch's keys and values at t, in every layer, moved by BRANCH_SCALE times the tensor's
                 standard deviation: a large change, so that a leak through the selection scores (a future block
                 that may not be read but is scored) changes which blocks are picked

Positions t: every position of short rows; otherwise the block edges of every size (the last token of a block and
the first of the next, for blocks of l, d and l' tokens: Eq. 7 makes compressed block i visible at the query
i*d + l - 1), the window edge, the end of the selection budget (n*l' + w), the last tokens and a few random others.

CPU: fp32 with TF32 off; the bound is 0 (bitwise). CUDA: the model's training precision (bf16 autocast, so NSA runs
its bf16 kernel path); every forward also holds a control row (a copy of the unchanged input) and the bound is
CUDA_NOISE_FACTOR times the largest difference between the control row and the unchanged row: 0, so bitwise too,
when the forward is deterministic (`python -m sentinels determinism` measures it on the target GPU).
"""

from __future__ import annotations

import contextlib
import random
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import Tensor

from reference.config import NSAConfig
from reference.contract import KV, BranchKV

from . import thresholds

BRANCHES = ("cmp", "slc", "win")
PROBE_KINDS = ("token", *BRANCHES)
BRANCH_SCALE = 100.0  # a branch probe adds BRANCH_SCALE * std(k) * N(0, 1) to k[t] (and the same to v[t])
ALL_POSITIONS_UP_TO = 256  # rows of at most this many tokens probe every position


def isolation_length(nsa: NSAConfig, seq_len: int) -> int:
    """The row length of the check: the run's seq_len when it exceeds n*l' + w (then selection really selects
    and the window does not cover the row), else the first multiple of l' past n*l' + w + l'."""
    budget = nsa.n_sel * nsa.sel_block + nsa.window_size
    if seq_len > budget:
        return seq_len
    return (budget // nsa.sel_block + 2) * nsa.sel_block


def probe_positions(nsa: NSAConfig, T: int, *, n_random: int = 16, seed: int = 0) -> list[int]:
    """The positions t to change (1 <= t < T; changing token 0 has no earlier position to move)."""
    if T <= ALL_POSITIONS_UP_TO:
        return list(range(1, T))
    chosen: set[int] = set()
    for size in {nsa.cmp_block, nsa.cmp_stride, nsa.sel_block}:
        for edge in range(size, T + 1, size):
            chosen.update((edge - 1, edge))  # the last token of a block, the first of the next
    for edge in range(nsa.sel_block, T, nsa.sel_block):
        chosen.add(edge + 1)
    w, budget = nsa.window_size, nsa.n_sel * nsa.sel_block + nsa.window_size
    chosen.update((w - 2, w - 1, w, w + 1, budget - 1, budget, budget + 1, T - 2, T - 1))
    rng = random.Random(seed)
    chosen.update(rng.randrange(1, T) for _ in range(n_random))
    return sorted(t for t in chosen if 1 <= t < T)


def probes_for(positions: Iterable[int], kinds: Iterable[str] = PROBE_KINDS) -> list[tuple[int, str]]:
    return [(t, kind) for t in positions for kind in kinds]


@dataclass
class IsolationOutcome:
    T: int
    documents: list[int] | None  # packed document lengths, None for one contiguous row
    probes_total: int
    probes_run: int = 0
    forwards: int = 0
    moved: list[dict[str, Any]] = field(default_factory=list)  # one entry per probe that moved an earlier logit
    positions_moved: set[int] = field(default_factory=set)  # the positions p whose logits moved
    inert_token_probes: int = 0  # token probes that moved nothing at all (then the check sees nothing)
    noise_rel: float = 0.0  # largest difference between the control row and the unchanged row (rel. max |logit|)
    repeat_rel: float = 0.0  # largest difference of the unchanged row between forwards (informative)
    bound_rel: float = 0.0
    scale: float = 0.0  # max |logit| of the unchanged input
    nonfinite: bool = False
    stopped_early: bool = False
    wall_s: float = 0.0

    @property
    def first(self) -> dict[str, Any] | None:
        """The first (p, t) that moved: the smallest t, then the smallest p."""
        return min(self.moved, key=lambda m: (m["t"], m["p"]), default=None)

    @property
    def leaked(self) -> bool:
        return bool(self.moved) or self.nonfinite

    def as_dict(self) -> dict[str, Any]:
        kinds = sorted({m["kind"] for m in self.moved})
        return {"T": self.T, "documents": self.documents, "probes_total": self.probes_total,
                "probes_run": self.probes_run, "forwards": self.forwards, "probes_moved": len(self.moved),
                "moved_by_kind": {k: sum(m["kind"] == k for m in self.moved) for k in kinds},
                "first": self.first, "positions_moved": len(self.positions_moved),
                "positions_moved_list": sorted(self.positions_moved)[:64],
                "inert_token_probes": self.inert_token_probes, "noise_rel": self.noise_rel,
                "repeat_rel": self.repeat_rel, "bound_rel": self.bound_rel, "logit_scale": self.scale,
                "nonfinite": self.nonfinite, "stopped_early": self.stopped_early, "wall_s": self.wall_s}


class BranchProbe:
    """kv_perturbation of every layer (sentinels.model.NSALayerAttention): for each (row, t, branch) in `edits`,
    k[row, t] and v[row, t] of that branch += BRANCH_SCALE * std * noise, the noise drawn from a generator seeded
    by (layer, t, branch), so a probe changes the same values whatever row or batch it runs in."""

    def __init__(self) -> None:
        self.edits: list[tuple[int, int, str]] = []

    def __call__(self, layer: int, kv: BranchKV) -> BranchKV:
        if not self.edits:
            return kv
        parts = {b: getattr(kv, b) for b in BRANCHES}
        for branch in BRANCHES:
            mine = [(row, t) for row, t, b in self.edits if b == branch]
            if not mine:
                continue
            k, v = parts[branch]
            k_std, v_std = _std(k), _std(v)
            k, v = k.clone(), v.clone()
            for row, t in mine:
                gen = torch.Generator().manual_seed(1_000_003 * layer + 7919 * t + BRANCHES.index(branch))
                k[row, t] += _noise(k, k_std, gen)
                v[row, t] += _noise(v, v_std, gen)
            parts[branch] = KV(k, v)
        return BranchKV(**parts)


def _std(x: Tensor) -> float:
    """The standard deviation of one row (row 0 is the unchanged input), so it does not depend on the others."""
    return float(x[0].detach().float().std()) or 1.0


def _noise(x: Tensor, std: float, gen: torch.Generator) -> Tensor:
    return (BRANCH_SCALE * std * torch.randn(x.shape[2:], generator=gen)).to(x.device, x.dtype)


class no_tf32:
    """fp32 matmuls without TF32 (the trainer turns it on for CUDA) while a check runs."""

    def __enter__(self):
        self.saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self.saved


def autocast_for(device: torch.device, precision: str):
    """The training precision: bf16 autocast on CUDA (the trainer's), fp32 otherwise."""
    if device.type == "cuda" and precision == "bf16":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def logits_of(model: torch.nn.Module, tokens: Tensor, cu_seqlens: Tensor | None, precision: str) -> Tensor:
    """fp32 logits of one forward, as the check computes them (eval, no grad, TF32 off, training precision)."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), no_tf32(), autocast_for(tokens.device, precision):
            return model(tokens, cu_seqlens).float()
    finally:
        model.train(was_training)


def other_token(token: int, t: int, vocab: int) -> int:
    """A token id != token, varying with t."""
    return (token + 1 + (7 * t) % (vocab - 1)) % vocab


@contextlib.contextmanager
def _probe_installed(model: torch.nn.Module, probe: BranchProbe):
    layers = [block.attn for block in model.blocks]
    saved = [layer.kv_perturbation for layer in layers]
    for layer in layers:
        layer.kv_perturbation = probe
    try:
        yield
    finally:
        for layer, before in zip(layers, saved):
            layer.kv_perturbation = before


def check_causal_isolation(model: torch.nn.Module, tokens: Tensor, *, probes: list[tuple[int, str]],
                           vocab: int, precision: str = "fp32", cu_seqlens: Tensor | None = None,
                           rows_per_forward: int = 8, stop_at_first: bool = False,
                           deadline: float | None = None) -> IsolationOutcome:
    """Run `probes` [(t, kind)] on tokens [1, T] (cu_seqlens: a packed row of documents, one probe per forward)
    and collect every probe that moved a logit at p < t by more than the bound."""
    t0 = time.monotonic()
    device = tokens.device
    T = tokens.shape[1]
    docs = None if cu_seqlens is None else [int(b - a) for a, b in zip(cu_seqlens[:-1].tolist(),
                                                                        cu_seqlens[1:].tolist())]
    out = IsolationOutcome(T=T, documents=docs, probes_total=len(probes))
    probes = sorted(probes)
    factor = thresholds.CAUSAL_ISOLATION_CUDA_NOISE_FACTOR if device.type == "cuda" else 0.0
    branch_probe = BranchProbe()
    per_forward = 1 if cu_seqlens is not None else max(1, rows_per_forward - 2)
    was_training = model.training
    model.eval()
    first_base: Tensor | None = None
    pending: list[tuple[dict, Tensor]] = []  # (probe, its differences at p < t) until judged
    try:
        with torch.no_grad(), no_tf32(), autocast_for(device, precision), _probe_installed(model, branch_probe):
            for start in range(0, len(probes), per_forward):
                if deadline is not None and time.monotonic() > deadline and out.probes_run:
                    out.stopped_early = True
                    break
                chunk = probes[start:start + per_forward]
                if cu_seqlens is None:  # rows: unchanged, the probes, control (= unchanged)
                    rows = tokens.repeat(len(chunk) + 2, 1)
                    branch_probe.edits = []
                    for i, (t, kind) in enumerate(chunk, start=1):
                        if kind == "token":
                            rows[i, t] = other_token(int(tokens[0, t]), t, vocab)
                        else:
                            branch_probe.edits.append((i, t, kind))
                    logits = model(rows)  # in the model's dtype: [rows, T, V] in fp32 would be 3 GB at 2048 x 50257
                    out.forwards += 1
                    base, probed, control = logits[0], logits[1:-1], logits[-1]
                else:  # batch 1: the unchanged row, then each probe, then the control
                    branch_probe.edits = []
                    base = model(tokens, cu_seqlens)[0]
                    probed_rows = []
                    for t, kind in chunk:
                        row = tokens.clone()
                        if kind == "token":
                            row[0, t] = other_token(int(tokens[0, t]), t, vocab)
                        else:
                            branch_probe.edits = [(0, t, kind)]
                        probed_rows.append(model(row, cu_seqlens)[0])
                        branch_probe.edits = []
                    control = model(tokens, cu_seqlens)[0]
                    probed = torch.stack(probed_rows)
                    out.forwards += len(chunk) + 2
                if not (torch.isfinite(base).all() and torch.isfinite(probed).all()):
                    out.nonfinite = True
                    break
                if first_base is None:
                    first_base = base
                    out.scale = float(base.abs().max().float().clamp(min=1e-30))
                scale = out.scale
                # differences in the logits' dtype: a difference of two unequal values is never 0
                out.noise_rel = max(out.noise_rel, float((control - base).abs().max()) / scale)
                out.repeat_rel = max(out.repeat_rel, float((base - first_base).abs().max()) / scale)
                diff = (probed - base).abs().amax(-1).float() / scale  # [probes, T]
                for (t, kind), d in zip(chunk, diff):
                    out.probes_run += 1
                    if kind == "token" and not bool((d[t:] > 0).any()):
                        out.inert_token_probes += 1
                    pending.append(({"t": t, "kind": kind}, d[:t].cpu()))
                out.bound_rel = factor * out.noise_rel
                moved_now = _collect(pending, out)
                if moved_now and stop_at_first:
                    out.stopped_early = start + per_forward < len(probes)
                    break
            # the bound may have grown with later control rows: re-judge what was kept
            out.bound_rel = factor * out.noise_rel
            _rejudge(out)
    finally:
        model.train(was_training)
        branch_probe.edits = []
    out.wall_s = time.monotonic() - t0
    return out


def _collect(pending: list, out: IsolationOutcome) -> bool:
    """Move every pending probe whose earlier logits moved by more than the bound into out.moved (with its
    differences, so a bound that grows with later control rows can re-judge it)."""
    moved_any = False
    for probe, before in pending:
        hit = (before > out.bound_rel).nonzero().flatten()
        if hit.numel():
            moved_any = True
            out.moved.append({**probe, "p": int(hit[0]), "n_positions": int(hit.numel()),
                              "max_rel": float(before.max()), "_before": before})
            out.positions_moved.update(int(p) for p in hit)
    pending[:] = []
    return moved_any


def _rejudge(out: IsolationOutcome) -> None:
    still, out.positions_moved = [], set()
    for m in out.moved:
        before = m.pop("_before")
        hit = (before > out.bound_rel).nonzero().flatten()
        if hit.numel():
            still.append({**m, "p": int(hit[0]), "n_positions": int(hit.numel())})
            out.positions_moved.update(int(p) for p in hit)
    out.moved = still


def summarize(out: IsolationOutcome) -> str:
    where = f"{out.T} tokens" if out.documents is None else f"{len(out.documents)} packed documents {out.documents}"
    bound = "bitwise" if out.bound_rel == 0 else f"bound {out.bound_rel:.2e} (noise {out.noise_rel:.2e})"
    text = (f"{out.probes_run}/{out.probes_total} probes on {where}, {bound}")
    if out.nonfinite:
        return text + " - non-finite logits: the check cannot judge this model"
    first = out.first
    if first is not None:
        kinds = ", ".join(m["kind"] for m in out.moved if m["t"] == first["t"])
        head = (text + f" - changing t={first['t']} moved the logits at p={first['p']} < t (probes: {kinds}; max "
                f"{first['max_rel']:.2e} of max |logit|)")
        if out.stopped_early:
            return head + "; stopped at the first forward that moved"
        return head + (f"; {len(out.moved)} probes moved earlier logits, {len(out.positions_moved)}/{out.T} "
                       "positions saw the future")
    if out.inert_token_probes:
        return text + f" - {out.inert_token_probes} token probes moved no logit at all: the check saw nothing"
    return text + " - no earlier logit moved"


def measure_determinism(model: torch.nn.Module, tokens: Tensor, *, vocab: int, precision: str, repeats: int,
                        rows: int) -> dict[str, Any]:
    """Run-to-run determinism of the forward the check relies on, each figure relative to max |logit|:
    repeat    the same one-row input `repeats` times against the first run (largest difference, and how many runs
              differed at all)
    in_batch  `rows` copies of the input in one batch against row 0, `repeats` times (what the control row sees)
    batch_mix row 0 of a batch whose other rows hold other tokens against the one-row run (informative only: the
              check never compares rows across batch shapes)."""
    model.eval()
    device = tokens.device
    with torch.no_grad(), no_tf32(), autocast_for(device, precision):
        first = model(tokens).float()
        scale = float(first.abs().max().clamp(min=1e-30))
        repeat, repeat_runs = 0.0, 0
        in_batch, in_batch_runs = 0.0, 0
        for _ in range(repeats):
            diff = float((model(tokens).float() - first).abs().max()) / scale
            repeat, repeat_runs = max(repeat, diff), repeat_runs + (diff > 0)
            batch = model(tokens.repeat(rows, 1)).float()
            diff = float((batch[1:] - batch[:1]).abs().max()) / scale
            in_batch, in_batch_runs = max(in_batch, diff), in_batch_runs + (diff > 0)
        mixed = tokens.repeat(rows, 1)
        gen = torch.Generator().manual_seed(1)
        mixed[1:] = torch.randint(0, vocab, mixed[1:].shape, generator=gen).to(device)
        batch_mix = float((model(mixed).float()[0] - first[0]).abs().max()) / scale
    if device.type == "cuda":
        torch.cuda.synchronize()
    return {"repeats": repeats, "rows": rows, "logit_scale": scale, "repeat_max_rel": repeat,
            "repeat_runs_that_differed": repeat_runs, "in_batch_max_rel": in_batch,
            "in_batch_runs_that_differed": in_batch_runs, "batch_mix_max_rel": batch_mix,
            "bound_rel": thresholds.CAUSAL_ISOLATION_CUDA_NOISE_FACTOR * in_batch if device.type == "cuda" else 0.0}
