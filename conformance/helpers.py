"""Shared test helpers: random contract inputs, an independent dense attention, error measures."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from reference.config import NSAConfig
from reference.contract import BRANCHES, KV, BranchKV, NSAOutput, PhiWeights

from conformance.precision import logit_rounding_floor


@dataclass
class Inputs:
    q: Tensor
    kv: BranchKV
    gates: Tensor
    phi: PhiWeights | None

    def tensors(self) -> list[Tensor]:
        out = [self.q, self.gates]
        for br in (self.kv.cmp, self.kv.slc, self.kv.win):
            for t in br:
                if all(t is not o for o in out):
                    out.append(t)
        if self.phi is not None:
            out += list(self.phi.k.tensors()) + list(self.phi.v.tensors())
        return out

    def to(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None,
           requires_grad: bool = False) -> "Inputs":
        """A detached copy (optionally re-cast/moved; leaves require grad if asked)."""
        memo: dict[int, Tensor] = {}

        def conv(t: Tensor) -> Tensor:
            if id(t) not in memo:
                c = t.detach().to(dtype=dtype or t.dtype, device=device or t.device).clone()
                memo[id(t)] = c.requires_grad_(requires_grad)
            return memo[id(t)]

        kv = BranchKV(*(KV(conv(b.k), conv(b.v)) for b in (self.kv.cmp, self.kv.slc, self.kv.win)))
        phi = None
        if self.phi is not None:
            phi = PhiWeights(k=type(self.phi.k)(*(conv(t) for t in self.phi.k.tensors())),
                             v=type(self.phi.v)(*(conv(t) for t in self.phi.v.tensors())))
        return Inputs(conv(self.q), kv, conv(self.gates), phi)


def select_rows(x: Inputs, batch: slice = slice(None), time: slice = slice(None)) -> Inputs:
    """x restricted to some batch rows and sequence positions (views); a k/v shared by branches stays shared,
    phi weights are kept whole."""
    memo: dict[int, Tensor] = {}

    def part(t: Tensor) -> Tensor:
        if id(t) not in memo:
            memo[id(t)] = t[batch, time]
        return memo[id(t)]

    kv = BranchKV(*(KV(part(b.k), part(b.v)) for b in (x.kv.cmp, x.kv.slc, x.kv.win)))
    return Inputs(part(x.q), kv, part(x.gates), x.phi)


def make_inputs(cfg: NSAConfig, T: int, *, B: int = 1, seed: int = 0, dtype: torch.dtype = torch.float64,
                device: torch.device | str = "cpu", shared_kv: bool = False, scale: float = 1.0,
                phi_hidden: int = 8) -> Inputs:
    """Random q, independent (or shared) per-branch k/v, gates in [0, 1], and phi weights if cfg.phi='mlp'."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> Tensor:
        return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype=dtype, device=device)

    q = rnd(B, T, cfg.n_heads, cfg.head_dim_qk)
    if shared_kv:
        kv = BranchKV.shared(rnd(B, T, cfg.n_kv_heads, cfg.head_dim_qk), rnd(B, T, cfg.n_kv_heads, cfg.head_dim_v))
    else:
        kv = BranchKV(*(KV(rnd(B, T, cfg.n_kv_heads, cfg.head_dim_qk), rnd(B, T, cfg.n_kv_heads, cfg.head_dim_v))
                        for _ in range(3)))
    gates = torch.rand((B, T, cfg.n_heads, 3), generator=g, dtype=torch.float64).to(dtype=dtype, device=device)
    phi = PhiWeights.init(cfg, phi_hidden, generator=g, dtype=dtype, device=device) if cfg.phi == "mlp" else None
    return Inputs(q, kv, gates, phi)


def inputs_for(impl, cfg: NSAConfig, T: int, **kwargs) -> Inputs:
    """make_inputs for the implementation under test: its shared or independent k/v, and gates it can take
    (its fixed gates, or 0 for a branch it does not compute; conformance/adapters/capabilities.py)."""
    x = make_inputs(cfg, T, shared_kv=impl.shared_kv, **kwargs)
    conform_gates(x.gates, impl.caps)
    return x


def conform_gates(gates: Tensor, caps) -> Tensor:
    """gates [..., 3] changed in place to what caps can take: the fixed gates, or 0 for the branches it lacks."""
    with torch.no_grad():
        if caps.fixed_gates is not None:
            gates.copy_(torch.tensor(caps.fixed_gates, dtype=gates.dtype).to(gates.device).expand_as(gates))
        for i, branch in enumerate(BRANCHES):
            if branch not in caps.branches:
                gates[..., i] = 0
    return gates


LARGE_LOGIT = 1e5  # |logits| of large_logit_inputs


def large_logit_inputs(cfg, T: int, seed: int, sign: float, device, shared_kv: bool = False, caps=None) -> Inputs:
    """q = a u_g + noise and every branch's k = sign * a u_g + noise per KV group g (u_g a unit vector), with
    a^2 / sqrt(d_k) = 1e5: every logit is about sign * 1e5 (compressed keys too: they pool such keys). Gates as
    `caps` can take them."""
    x = make_inputs(cfg, T, seed=seed, device=device, shared_kv=shared_kv)
    if caps is not None:
        conform_gates(x.gates, caps)
    g = torch.Generator().manual_seed(seed + 7)
    u = torch.nn.functional.normalize(torch.randn(cfg.n_kv_heads, cfg.head_dim_qk, generator=g, dtype=torch.float64),
                                      dim=-1).to(device)
    a = math.sqrt(LARGE_LOGIT * math.sqrt(cfg.head_dim_qk))
    with torch.no_grad():
        x.q.copy_(a * u.repeat_interleave(cfg.group_size, 0) + 0.1 * x.q)
        for k in {id(x.kv.branch(b).k): x.kv.branch(b).k for b in ("cmp", "slc", "win")}.values():
            k.copy_(sign * a * u + 0.1 * k)
    return x


def large_logit_floor(x: Inputs, field: str, dtype: torch.dtype) -> float:
    """The error that rounding logits near 1e5 to `dtype` causes in `field` (precision.logit_rounding_floor) for
    an implementation judged in a lower precision: per branch from its keys and values (a compressed key is a mean
    of keys, no longer than the longest), for o the branches' floors weighted by their largest gate."""
    if dtype == torch.float64:
        return 0.0
    if field != "o":
        return logit_rounding_floor(x.q, *x.kv.branch(field[2:]), dtype)
    return sum(logit_rounding_floor(x.q, *x.kv.branch(b), dtype) * float(x.gates[..., i].abs().max())
               for i, b in enumerate(BRANCHES))


BLACK_BOX_HIDDEN = 16  # hidden size of the modules the black-box tests build


def black_box_module(impl, cfg: NSAConfig, device, seed: int, hidden: int = BLACK_BOX_HIDDEN):
    """impl.make_module(cfg, hidden) in float64 on device, with its own initialisation under a fixed seed."""
    torch.manual_seed(seed)
    module = impl.make_module(cfg, hidden)
    return module.to(device=device, dtype=torch.float64)


def call_module(impl, module, x: Tensor, **kwargs) -> Tensor:
    """module(x, **kwargs)'s output tensor (the first item of a tuple); an exception it raises is reported as the
    implementation's (conformance.adapters.ImplementationError)."""
    from conformance.adapters import reporting

    def forward() -> Tensor:
        out = module(x, **kwargs)
        return out[0] if isinstance(out, (tuple, list)) else out

    return reporting(forward, f"{impl.name} module forward")()


def dense_causal_attention(q: Tensor, k: Tensor, v: Tensor, window: int | None = None) -> Tensor:
    """Plain causal GQA attention with an explicit masked score matrix and softmax (no SDPA, no is_causal).

    window: if given, query p sees keys p-window+1..p only."""
    B, T, Hq, dk = q.shape
    G = Hq // k.shape[2]
    kk = k.repeat_interleave(G, dim=2)
    vv = v.repeat_interleave(G, dim=2)
    scores = torch.einsum("bphd,bshd->bhps", q, kk) / math.sqrt(dk)
    pos = torch.arange(T)
    allowed = pos[None, :] <= pos[:, None]
    if window is not None:
        allowed &= pos[None, :] > pos[:, None] - window
    scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bhps,bshd->bphd", probs, vv)


def rel_error(x: Tensor, ref: Tensor) -> float:
    """||x - ref|| / ||ref|| in float64 (0 when both are 0); NaN anywhere gives inf."""
    x64, r64 = x.detach().to(torch.float64).cpu(), ref.detach().to(torch.float64).cpu()
    if torch.isnan(x64).any() or torch.isnan(r64).any():
        return math.inf
    denom = r64.norm().item()
    diff = (x64 - r64).norm().item()
    return diff / denom if denom > 0 else diff


def max_abs_error(x: Tensor, ref: Tensor) -> float:
    x64, r64 = x.detach().to(torch.float64).cpu(), ref.detach().to(torch.float64).cpu()
    if torch.isnan(x64).any():
        return math.inf
    return (x64 - r64).abs().max().item() if x64.numel() else 0.0


def error_ratio(candidate: Tensor, low_precision_ref: Tensor, oracle: Tensor, atol: float = 1e-6) -> float:
    """FlashAttention's rule as a ratio: err(candidate vs oracle) / (2 * err(low-precision ref vs oracle) + atol).
    A ratio <= 1 passes; NaN gives inf."""
    err = max_abs_error(candidate, oracle)
    budget = 2 * max_abs_error(low_precision_ref, oracle) + atol
    return err / budget


def named_tensors(x: Inputs) -> dict[str, Tensor]:
    """The input tensors of x by name (q, gates, kv.<branch>.k/v; a shared k/v appears once, as kv.cmp)."""
    out: dict[str, Tensor] = {"q": x.q, "gates": x.gates}
    for branch in ("cmp", "slc", "win"):
        k, v = x.kv.branch(branch)
        for part, t in (("k", k), ("v", v)):
            if all(t is not o for o in out.values()):
                out[f"kv.{branch}.{part}"] = t
    if x.phi is not None:
        for side in ("k", "v"):
            for part, t in zip(("pos", "w1", "b1", "w2", "b2"), getattr(x.phi, side).tensors()):
                out[f"phi.{side}.{part}"] = t
    return out


def output_and_grads(fn: Callable[[Inputs], NSAOutput], x: Inputs,
                     weights: Tensor) -> tuple[NSAOutput, dict[str, Tensor]]:
    """fn(x) (an NSA forward on x's device, in its dtype) and {name: d(sum(o * weights)) / d(name)} for every input
    tensor of x (named_tensors; zeros for an input o does not depend on)."""
    xg = x.to(requires_grad=True)
    out = fn(xg)
    loss = (out.o * weights.to(device=out.o.device, dtype=out.o.dtype)).sum()
    named = named_tensors(xg)
    got = torch.autograd.grad(loss, list(named.values()), allow_unused=True)
    return out, {n: (torch.zeros_like(t) if g is None else g) for (n, t), g in zip(named.items(), got)}


def perturb_from(x: Inputs, start: int, *, seed: int, scale: float = 3.0, caps=None) -> Inputs:
    """A detached copy of x whose q, every branch's keys/values and gates at sequence positions >= start
    hold new random values (gates stay in [0, 1], and what `caps` can take); phi weights are kept. Shared k/v stay
    shared."""
    y = x.to()
    g = torch.Generator().manual_seed(seed)
    for name, t in named_tensors(y).items():
        if name.startswith("phi.") or t.shape[1] <= start:
            continue
        fresh = torch.rand if name == "gates" else torch.randn
        new = fresh(t[:, start:].shape, generator=g, dtype=torch.float64)
        if name != "gates":
            new = new * scale
        with torch.no_grad():
            t[:, start:] = new.to(dtype=t.dtype, device=t.device)
    if caps is not None:
        conform_gates(y.gates, caps)
    return y


def first_difference(a: Tensor, b: Tensor) -> str:
    """Where two same-shaped tensors first differ (for assertion messages); '' if bitwise equal."""
    if a.shape != b.shape:
        return f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}"
    neq = (a != b) & ~(torch.isnan(a) & torch.isnan(b)) if a.is_floating_point() else a != b
    if not bool(neq.any()):
        return ""
    idx = tuple(int(i) for i in neq.nonzero()[0])
    return f"first at index {idx}: {a[idx].item()!r} vs {b[idx].item()!r} ({int(neq.sum())} entries differ)"


def write_merged_report(out_dir: Path | str, stem: str, report: dict, markdown: Callable[[dict], str]) -> dict:
    """Write this process's part of a GPU report and the merge of every part so far, so the report stays whole
    when pytest-xdist splits a module over workers: <stem>.part-<worker>.json (one per worker, "main" without
    xdist), then <stem>.json and <stem>.md holding every part's lists concatenated (the other keys from the first
    part). The last worker to finish writes the complete merge. Returns the merged report."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    _atomic_write(out_dir / f"{stem}.part-{worker}.json", json.dumps(report, indent=2, default=str))
    merged: dict = {}
    for part in sorted(out_dir.glob(f"{stem}.part-*.json")):
        for key, value in json.loads(part.read_text()).items():
            if isinstance(value, list):
                merged.setdefault(key, []).extend(value)
            else:
                merged.setdefault(key, value)
    _atomic_write(out_dir / f"{stem}.json", json.dumps(merged, indent=2, default=str))
    _atomic_write(out_dir / f"{stem}.md", markdown(merged))
    return merged


def markdown_table(columns: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """The lines of a markdown table: the header, its |---| rule (one per column), then one line per row (cells as
    str())."""
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)] + \
        ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def finish_gpu_report(request, report: dict, stem: str, markdown: Callable[[dict], str],
                      out_dir: Path | str | None) -> None:
    """End of a GPU test module: stamp the report with the GPU and the torch/triton versions, write it with
    write_merged_report when out_dir is given, and print the (merged) markdown in pytest's terminal summary."""
    import torch
    import triton

    report.update(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    if out_dir is not None:
        report = write_merged_report(out_dir, stem, report, markdown)
    terminal = request.config.pluginmanager.getplugin("terminalreporter")
    if terminal is not None:
        terminal.write_line("\n" + markdown(report))
        if out_dir is not None:
            terminal.write_line(f"report written to {out_dir}/{stem}.json and .md")


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
