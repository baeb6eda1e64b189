"""Benchmark cases: random inputs for one sequence length and the callables that run one (stage, pass).

A case is built lazily (its inputs are allocated inside the runner's per-case memory accounting and OOM
handling) and returns a `Prepared`: the callable to time, plus the selected-token count of the indices it
used (for the FLOP accounting of the selected branch and the layer).

Passes: "fwd" runs under torch.no_grad() (inference: nothing saved for backward); "fwd_bwd" runs the forward
with leaf inputs that require grad and then torch.autograd.grad of the outputs against random output
gradients (no .grad accumulation between runs).

Workloads: WORKLOADS maps a workload name to its input builder. "single": one sequence of length T per batch
row. "packed": one row (batch 1) of T tokens holding documents of mixed lengths
(packed_document_lengths), given to every NSA stage as cu_seqlens; SDPA runs the same documents as one causal
call per document (what a varlen kernel saves is the launches, not the work). Rows carry the workload name, so
the reports show packed next to single.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from reference.contract import KV, BranchKV, PhiWeights
from reference.packing import check_cu_seqlens, cu_seqlens_of

from .flops import selected_token_count
from .implementations import NSAImplementation
from .spec import BenchSpec


@dataclass
class Inputs:
    """Random inputs of one sequence length (never zeros): q, independent k/v per branch, gates in (0, 1),
    phi weights (phi="mlp")."""

    q: Tensor
    kv: BranchKV
    gates: Tensor
    phi: PhiWeights | None
    cu_seqlens: Tensor | None = None  # packed workload: int32 [N + 1] document boundaries of the one row

    @property
    def doc_start(self) -> Tensor | None:
        """[T] first token of each token's document (packed workload), None for independent rows."""
        if self.cu_seqlens is None:
            return None
        bounds = self.cu_seqlens.to(self.q.device, torch.int64)
        lengths = bounds[1:] - bounds[:-1]
        return torch.repeat_interleave(bounds[:-1], lengths)

    def documents(self) -> list[tuple[int, int]]:
        """[start, end) of every non-empty document (one (0, T) for a single sequence)."""
        if self.cu_seqlens is None:
            return [(0, self.q.shape[1])]
        return [(s, e) for s, e in check_cu_seqlens(self.cu_seqlens, self.q.shape[1], self.q.shape[0]) if e > s]


@dataclass
class Prepared:
    run: Callable[[], object]
    token_count: int | None = None  # tokens the selected branch read (counted from the indices used)
    note: str = ""


def _randn(shape: Sequence[int], gen: torch.Generator, device: torch.device, dtype: torch.dtype) -> Tensor:
    return torch.randn(tuple(shape), generator=gen, device=device, dtype=torch.float32).to(dtype)


def single_sequence_inputs(spec: BenchSpec, T: int, device: torch.device, seed: int) -> Inputs:
    cfg, B, dtype = spec.cfg, spec.batch, spec.torch_dtype
    gen = torch.Generator(device=device).manual_seed(seed)
    q = _randn((B, T, cfg.n_heads, cfg.head_dim_qk), gen, device, dtype)
    branches = {}
    for name in ("cmp", "slc", "win"):
        branches[name] = KV(_randn((B, T, cfg.n_kv_heads, cfg.head_dim_qk), gen, device, dtype),
                            _randn((B, T, cfg.n_kv_heads, cfg.head_dim_v), gen, device, dtype))
    gates = torch.sigmoid(_randn((B, T, cfg.n_heads, 3), gen, device, torch.float32)).to(dtype)
    phi = None
    if cfg.phi == "mlp":
        cpu_gen = torch.Generator().manual_seed(seed + 1)
        phi = PhiWeights.init(cfg, spec.phi_width, generator=cpu_gen, dtype=dtype, device=device)
    return Inputs(q=q, kv=BranchKV(**branches), gates=gates, phi=phi)


PACKED_MIN_DOCUMENT = 128  # shortest packed document drawn (the row's last one may be cut shorter)


def packed_document_lengths(T: int, seed: int) -> tuple[int, ...]:
    """Documents of mixed lengths filling T tokens: lengths drawn log-uniformly between PACKED_MIN_DOCUMENT and
    max(PACKED_MIN_DOCUMENT, T // 4) (a fixed seed, so every run of the same T packs the same documents), the
    last one cut at T. At T = 64k: a few dozen documents of about 128 to 16k tokens."""
    gen = torch.Generator().manual_seed(seed)
    low, high = math.log(PACKED_MIN_DOCUMENT), math.log(max(PACKED_MIN_DOCUMENT, T // 4))
    lengths, total = [], 0
    while total < T:
        draw = int(round(math.exp(low + (high - low) * float(torch.rand((), generator=gen)))))
        n = min(max(1, draw), T - total)
        lengths.append(n)
        total += n
    return tuple(lengths)


def document_lengths(workload: str, T: int, seed: int) -> tuple[int, ...]:
    """The documents of one row of a workload: (T,) for "single", packed_document_lengths for "packed"."""
    return packed_document_lengths(T, seed) if workload == "packed" else (T,)


def packed_inputs(spec: BenchSpec, T: int, device: torch.device, seed: int) -> Inputs:
    """single_sequence_inputs for one row (batch 1, as cu_seqlens requires) plus the boundaries of
    packed_document_lengths(T, seed)."""
    if spec.batch != 1:
        raise ValueError(f"the packed workload packs documents into ONE row: BenchSpec.batch must be 1, got "
                         f"{spec.batch}")
    inputs = single_sequence_inputs(spec, T, device, seed)
    inputs.cu_seqlens = cu_seqlens_of(packed_document_lengths(T, seed), device)
    return inputs


WORKLOADS: dict[str, Callable[[BenchSpec, int, torch.device, int], Inputs]] = {
    "single": single_sequence_inputs,
    "packed": packed_inputs,
}


def _leaf(t: Tensor) -> Tensor:
    return t.detach().requires_grad_(True)


def _as_tuple(out: object) -> tuple[Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _forward_only(forward: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        with torch.no_grad():
            return forward()
    return run


def _forward_backward(forward: Callable[[], object], leaves: Sequence[Tensor], seed: int,
                      first_out: object) -> Callable[[], object]:
    """forward() then d(outputs)/d(leaves) against fixed random output gradients shaped like first_out."""
    gen = torch.Generator(device=leaves[0].device).manual_seed(seed)
    grads = [_randn(o.shape, gen, o.device, o.dtype) for o in _as_tuple(first_out)]

    def run() -> object:
        outs = _as_tuple(forward())
        return torch.autograd.grad(outs, list(leaves), grads, allow_unused=True)
    return run


def _phi_leaves(phi: PhiWeights | None) -> tuple[PhiWeights | None, list[Tensor]]:
    if phi is None:
        return None, []
    k = type(phi.k)(*(_leaf(t) for t in phi.k.tensors()))
    v = type(phi.v)(*(_leaf(t) for t in phi.v.tensors()))
    return PhiWeights(k=k, v=v), [*k.tensors(), *v.tensors()]


def _packing(inputs: Inputs) -> dict[str, Tensor]:
    """The keyword every stage call of a packed workload must take (NSAImplementation.call requires it)."""
    return {} if inputs.cu_seqlens is None else {"cu_seqlens": inputs.cu_seqlens}


def _selection(impl: NSAImplementation, inputs: Inputs, cfg) -> tuple[Tensor, Tensor, Tensor]:
    """k_cmp, v_cmp and the selected block indices of these inputs (untimed set-up of later stages)."""
    packing = _packing(inputs)
    with torch.no_grad():
        k_cmp, v_cmp = impl.call("compress", inputs.kv.cmp.k, inputs.kv.cmp.v, cfg, inputs.phi, **packing)
        indices = impl.select(inputs.q, k_cmp, cfg, **packing)
    return k_cmp, v_cmp, indices


def build_nsa_case(impl: NSAImplementation, stage: str, pass_name: str, inputs: Inputs, spec: BenchSpec,
                   seed: int) -> Prepared:
    """The callable for one NSA stage ('layer' = nsa_forward) and pass. The first forward runs here."""
    cfg = spec.cfg
    train = pass_name == "fwd_bwd"
    wrap = (lambda f, leaves, first: _forward_backward(f, leaves, seed, first)) if train else \
        (lambda f, leaves, first: _forward_only(f))
    first_call = (lambda f: f()) if train else (lambda f: _forward_only(f)())
    token_count = None
    note = ""
    packing = _packing(inputs)
    doc_start = inputs.doc_start

    if stage == "layer":
        q = _leaf(inputs.q) if train else inputs.q
        kv = BranchKV(**{b: KV(*(_leaf(t) if train else t for t in inputs.kv.branch(b)))
                         for b in ("cmp", "slc", "win")})
        gates = _leaf(inputs.gates) if train else inputs.gates
        phi, phi_leaves = _phi_leaves(inputs.phi) if train else (inputs.phi, [])
        forward = lambda: impl.call("nsa_forward", q, kv, gates, cfg, phi, **packing)  # noqa: E731
        first = first_call(forward)
        token_count = selected_token_count(first.indices, cfg.sel_block, doc_start)
        forward_o = lambda: forward().o  # noqa: E731
        leaves = [q, *(t for b in ("cmp", "slc", "win") for t in kv.branch(b)), gates, *phi_leaves]
        return Prepared(wrap(forward_o, leaves, first.o), token_count, note)

    if stage == "compress":
        k = _leaf(inputs.kv.cmp.k) if train else inputs.kv.cmp.k
        v = _leaf(inputs.kv.cmp.v) if train else inputs.kv.cmp.v
        phi, phi_leaves = _phi_leaves(inputs.phi) if train else (inputs.phi, [])
        forward = lambda: impl.call("compress", k, v, cfg, phi, **packing)  # noqa: E731
        return Prepared(wrap(forward, [k, v, *phi_leaves], first_call(forward)), None, note)

    if stage == "gate":
        gen = torch.Generator(device=inputs.q.device).manual_seed(seed + 7)
        shape = (*inputs.q.shape[:3], cfg.head_dim_v)
        outs = [_randn(shape, gen, inputs.q.device, inputs.q.dtype) for _ in range(3)]
        gates = inputs.gates
        if train:
            gates, outs = _leaf(gates), [_leaf(o) for o in outs]
        forward = lambda: impl.gated_sum(gates, *outs)  # noqa: E731
        return Prepared(wrap(forward, [gates, *outs], first_call(forward)), None, f"gate: {impl.gate_source}")

    if stage == "window":
        q = _leaf(inputs.q) if train else inputs.q
        k, v = (_leaf(t) if train else t for t in inputs.kv.win)
        forward = lambda: impl.call("window_attention", q, k, v, cfg, **packing)  # noqa: E731
        return Prepared(wrap(forward, [q, k, v], first_call(forward)), None, note)

    k_cmp, v_cmp, indices = _selection(impl, inputs, cfg)
    if stage == "cmp_attn":
        del indices
        q = _leaf(inputs.q) if train else inputs.q
        k_cmp, v_cmp = (_leaf(k_cmp), _leaf(v_cmp)) if train else (k_cmp, v_cmp)
        forward = lambda: impl.call("compressed_attention", q, k_cmp, v_cmp, cfg, **packing)  # noqa: E731
        return Prepared(wrap(forward, [q, k_cmp, v_cmp], first_call(forward)), None, note)

    if stage == "select":
        del indices, v_cmp

        forward = lambda: impl.select(inputs.q, k_cmp, cfg, **packing)  # noqa: E731
        # Top-n is discrete: no gradient flows through selection, so both passes time the forward only.
        note = f"select: {impl.select_source}; forward only in both passes (top-n, Eq. 11, has no backward)"
        return Prepared(_forward_only(forward), None, note)

    if stage == "selected":
        del k_cmp, v_cmp
        token_count = selected_token_count(indices, cfg.sel_block, doc_start)
        q = _leaf(inputs.q) if train else inputs.q
        k, v = (_leaf(t) if train else t for t in inputs.kv.slc)
        forward = lambda: impl.call("selected_attention", q, k, v, indices, cfg, **packing)  # noqa: E731
        return Prepared(wrap(forward, [q, k, v], first_call(forward)), token_count, note)

    raise ValueError(f"unknown NSA stage {stage!r}")


def build_sdpa_case(pass_name: str, inputs: Inputs, spec: BenchSpec, seed: int) -> Prepared:
    """torch SDPA causal full attention over the selection branch's k/v in SDPA's [B, H, T, D] layout.

    sdpa_gqa="expand": k/v are repeated to the query heads before timing (the layout every SDPA backend
    accepts; the expand is not timed); "enable_gqa": SDPA's own GQA flag (torch >= 2.5).
    Packed workload: one causal SDPA call per document over that document's slice of the row."""
    cfg = spec.cfg
    train = pass_name == "fwd_bwd"
    q = inputs.q.transpose(1, 2).contiguous()
    k, v = (t.transpose(1, 2) for t in inputs.kv.slc)
    kwargs = {"is_causal": True}
    if spec.sdpa_gqa == "expand":
        k = k.repeat_interleave(cfg.group_size, dim=1).contiguous()
        v = v.repeat_interleave(cfg.group_size, dim=1).contiguous()
        note = "sdpa: k/v expanded to the query heads (untimed)"
    else:
        k, v = k.contiguous(), v.contiguous()
        kwargs["enable_gqa"] = True
        note = "sdpa: enable_gqa=True"
    if train:
        q, k, v = _leaf(q), _leaf(k), _leaf(v)
    if inputs.cu_seqlens is None:
        forward = lambda: F.scaled_dot_product_attention(q, k, v, **kwargs)  # noqa: E731
    else:
        documents = inputs.documents()
        note += f"; one causal call per document ({len(documents)} documents)"

        def forward():
            return [F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], **kwargs)
                    for s, e in documents]
    if train:
        return Prepared(_forward_backward(forward, [q, k, v], seed, forward()), None, note)
    run = _forward_only(forward)
    run()
    return Prepared(run, None, note)
