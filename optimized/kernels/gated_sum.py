"""Eq. 5 on the kernel path in one pass: o = g_cmp * o_cmp + g_slc * o_slc + g_win * o_win, each operand widened to
the compute dtype (fp32 for half inputs, fp64 for fp32: dispatch.compute_dtype), the three products and two sums
rounded one by one in that dtype (no FMA: the launch disables fp fusion) and the result rounded once to the output
dtype: bitwise what the torch expression

    (g[..., 0:1].to(cd) * o_cmp.to(cd) + g[..., 1:2].to(cd) * o_slc.to(cd)
     + g[..., 2:3].to(cd) * o_win.to(cd)).to(dtype)

gives, without its widened copies and temporaries (about 9x less memory traffic at half precision). A branch left
out of the call (its output None: nsa_forward's `branches`) is left out of the sum: its gate is never read and
gets a zero gradient.

gated_sum_kernel is differentiable in the gates and the branch outputs; its backward is one more pass
(_gated_sum_bwd_kernel) with that expression's autograd arithmetic: d o_c = g_c * do in the compute dtype rounded
to o_c's dtype (bitwise the expression's gradient), d g_c = the sum over d_v of do * o_c in the compute dtype
rounded to the gates' dtype (the expression's gradient up to the order of that sum: a row reduction in the kernel,
torch's reduction kernel there), without the widened copies of do and each o_c a torch backward makes. A branch
output made by the range-attention kernel (the compressed and window branches) also gets D0 = sum over d_v of its
d o_c * o_c from this pass, handed to that kernel's backward with d o_c (range_attention.supply_delta0), which
then spends no pass of its own over d o_c and o_c on FlashAttention-2's D.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..dispatch import KERNEL_DTYPES, MAX_KERNEL_HEAD_DIM
from .common import row_pass_shape, row_view
from .range_attention import check_delta0, supply_delta0, takes_supplied_delta0

INPUT_DTYPES = KERNEL_DTYPES + (torch.float64,)  # the selected branch hands o_slc in the compute dtype
COMPUTE_DTYPES = (torch.float32, torch.float64)


@triton.jit
def _gated_term(G, O, rows, cols, row_ok, mask, stride_g, stride_o, WIDE: tl.constexpr):
    """g_c * o_c of one branch (G: its gate column) for the rows' tile, in the compute dtype."""
    g = tl.load(G + rows * stride_g, mask=row_ok, other=0.0)
    o = tl.load(O + rows[:, None] * stride_o + cols[None, :], mask=mask, other=0.0)
    if WIDE:
        g, o = g.to(tl.float64), o.to(tl.float64)
    else:
        g, o = g.to(tl.float32), o.to(tl.float32)
    return g[:, None] * o


@triton.jit
def _gated_sum_kernel(
    G, O_CMP, O_SLC, O_WIN, O,
    stride_g, stride_gc, stride_cmp, stride_slc, stride_win, stride_o,
    n_rows, dv,
    WIDE: tl.constexpr, ROWS: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_CMP: tl.constexpr, HAS_SLC: tl.constexpr, HAS_WIN: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_DV)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols[None, :] < dv)
    # Eq. 5, the terms of the branches present added left to right, as the torch expression
    if HAS_CMP:
        o = _gated_term(G, O_CMP, rows, cols, row_ok, mask, stride_g, stride_cmp, WIDE)
    if HAS_SLC:
        term = _gated_term(G + stride_gc, O_SLC, rows, cols, row_ok, mask, stride_g, stride_slc, WIDE)
        if HAS_CMP:
            o = o + term
        else:
            o = term
    if HAS_WIN:
        term = _gated_term(G + 2 * stride_gc, O_WIN, rows, cols, row_ok, mask, stride_g, stride_win, WIDE)
        if HAS_CMP or HAS_SLC:
            o = o + term
        else:
            o = term
    tl.store(O + rows[:, None] * stride_o + cols[None, :], o.to(O.dtype.element_ty), mask=mask)


@triton.jit
def _branch_grads(G, O, D_O, DG, DELTA0, rows, cols, row_ok, mask, do, stride_g, stride_o, stride_d_o, stride_dg,
                  WIDE: tl.constexpr, GRAD_OUTS: tl.constexpr, GRAD_GATES: tl.constexpr, PRESENT: tl.constexpr,
                  WITH_DELTA0: tl.constexpr):
    """One branch c of Eq. 5's backward (G, DG: its gate column): d o_c = g_c * do, d g_c = sum_dv do * o_c; a
    branch left out (not PRESENT) gets d g_c = 0. WITH_DELTA0 (with GRAD_OUTS): also D0 = sum_dv d o_c * o_c of
    the stored (rounded) d o_c, the backward of the branch's range attention's FlashAttention-2 D, in the compute
    dtype stored as fp32 (DELTA0: [rows] contiguous)."""
    if PRESENT:
        g = tl.load(G + rows * stride_g, mask=row_ok, other=0.0)
        g = g.to(tl.float64) if WIDE else g.to(tl.float32)
        if GRAD_GATES or WITH_DELTA0:
            o = tl.load(O + rows[:, None] * stride_o + cols[None, :], mask=mask, other=0.0)
            o = o.to(tl.float64) if WIDE else o.to(tl.float32)
        if GRAD_OUTS:
            d_o = (do * g[:, None]).to(D_O.dtype.element_ty)
            tl.store(D_O + rows[:, None] * stride_d_o + cols[None, :], d_o, mask=mask)
            if WITH_DELTA0:
                d_o = d_o.to(tl.float64) if WIDE else d_o.to(tl.float32)
                tl.store(DELTA0 + rows, tl.sum(d_o * o, 1).to(tl.float32), mask=row_ok)
        if GRAD_GATES:
            tl.store(DG + rows * stride_dg, tl.sum(do * o, 1).to(DG.dtype.element_ty), mask=row_ok)
    elif GRAD_GATES:
        tl.store(DG + rows * stride_dg, tl.zeros([rows.shape[0]], dtype=DG.dtype.element_ty), mask=row_ok)


@triton.jit
def _gated_sum_bwd_kernel(
    G, DO, O_CMP, O_SLC, O_WIN, D_CMP, D_SLC, D_WIN, DG, DELTA0_CMP, DELTA0_SLC, DELTA0_WIN,
    stride_g, stride_gc, stride_do, stride_cmp, stride_slc, stride_win, stride_dcmp, stride_dslc, stride_dwin,
    stride_dg, stride_dgc,
    n_rows, dv,
    WIDE: tl.constexpr, ROWS: tl.constexpr, BLOCK_DV: tl.constexpr, GRAD_OUTS: tl.constexpr,
    GRAD_GATES: tl.constexpr, HAS_CMP: tl.constexpr, HAS_SLC: tl.constexpr, HAS_WIN: tl.constexpr,
    DELTA0_OF_CMP: tl.constexpr, DELTA0_OF_SLC: tl.constexpr, DELTA0_OF_WIN: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_DV)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols[None, :] < dv)
    do = tl.load(DO + rows[:, None] * stride_do + cols[None, :], mask=mask, other=0.0)
    do = do.to(tl.float64) if WIDE else do.to(tl.float32)
    _branch_grads(G, O_CMP, D_CMP, DG, DELTA0_CMP, rows, cols, row_ok, mask, do, stride_g, stride_cmp, stride_dcmp,
                  stride_dg, WIDE, GRAD_OUTS, GRAD_GATES, HAS_CMP, DELTA0_OF_CMP)
    _branch_grads(G + stride_gc, O_SLC, D_SLC, DG + stride_dgc, DELTA0_SLC, rows, cols, row_ok, mask, do, stride_g,
                  stride_slc, stride_dslc, stride_dg, WIDE, GRAD_OUTS, GRAD_GATES, HAS_SLC, DELTA0_OF_SLC)
    _branch_grads(G + 2 * stride_gc, O_WIN, D_WIN, DG + 2 * stride_dgc, DELTA0_WIN, rows, cols, row_ok, mask, do,
                  stride_g, stride_win, stride_dwin, stride_dg, WIDE, GRAD_OUTS, GRAD_GATES, HAS_WIN, DELTA0_OF_WIN)


def gated_sum_forward(gates: Tensor, o_cmp: Tensor | None, o_slc: Tensor | None, o_win: Tensor | None,
                      compute: torch.dtype, dtype: torch.dtype) -> Tensor:
    """The Eq. 5 kernel (module docstring), not differentiable: o [..., d_v] in dtype; None: a branch left out."""
    outs = (o_cmp, o_slc, o_win)
    present = next(o for o in outs if o is not None)
    out = torch.empty(present.shape, dtype=dtype, device=present.device)
    dv = present.shape[-1]
    g, o = row_view(gates), row_view(out)
    c, s, w = (row_view(x) if x is not None else o for x in outs)  # a branch left out: any tensor, never read
    n_rows = o.shape[0]
    if n_rows * dv == 0:
        return out
    block_dv, rows = row_pass_shape(dv)
    _gated_sum_kernel[(triton.cdiv(n_rows, rows),)](
        g, c, s, w, o,
        g.stride(0), g.stride(1), c.stride(0), s.stride(0), w.stride(0), o.stride(0),
        n_rows, dv,
        WIDE=compute == torch.float64, ROWS=rows, BLOCK_DV=block_dv,
        HAS_CMP=o_cmp is not None, HAS_SLC=o_slc is not None, HAS_WIN=o_win is not None, num_warps=4,
        enable_fp_fusion=False,  # products and sums rounded one by one, as the torch expression's
    )
    return out


def gated_sum_backward(do: Tensor, gates: Tensor, o_cmp: Tensor | None, o_slc: Tensor | None, o_win: Tensor | None,
                       compute: torch.dtype, grad_outs: bool, grad_gates: bool,
                       delta0: tuple[Tensor | None, ...] = (None, None, None)) -> tuple[Tensor | None, ...]:
    """Eq. 5's gradients (module docstring): (d gates [..., 3] in the gates' dtype, d o_cmp, d o_slc, d o_win in
    each output's dtype); None for the ones not asked for and the branches left out.
    delta0: per branch, None or an fp32 tensor [B, T, Hq] (contiguous) that receives D0 = sum over d_v of the
    branch's d o_c (as stored, rounded) * o_c, with grad_outs: the FlashAttention-2 D of a range-attention
    backward of that branch, formed here from the values this pass reads anyway."""
    outs = (o_cmp, o_slc, o_win)
    dv = do.shape[-1]
    d_outs = [torch.empty(o.shape, dtype=o.dtype, device=o.device) if grad_outs and o is not None else None
              for o in outs]
    d_gates = torch.empty(gates.shape, dtype=gates.dtype, device=gates.device) if grad_gates else None
    deltas = [x if grad_outs and o is not None else None for x, o in zip(delta0, outs)]
    for x, o in zip(deltas, outs):
        if x is not None:
            check_delta0("gated_sum_backward", x, o.shape[:-1])
    g, d = row_view(gates), row_view(do)
    c, s, w = (row_view(x) if x is not None else d for x in outs)  # unused pointers: any tensor
    dc, ds, dw = (row_view(x) if x is not None else d for x in d_outs)
    dg = row_view(d_gates) if d_gates is not None else g
    n_rows = d.shape[0]
    if n_rows * dv == 0:
        for x in (d_gates, *deltas):
            if x is not None:
                x.zero_()
        return d_gates, *d_outs
    block_dv, rows = row_pass_shape(dv)
    _gated_sum_bwd_kernel[(triton.cdiv(n_rows, rows),)](
        g, d, c, s, w, dc, ds, dw, dg, *(x if x is not None else dg for x in deltas),
        g.stride(0), g.stride(1), d.stride(0), c.stride(0), s.stride(0), w.stride(0), dc.stride(0), ds.stride(0),
        dw.stride(0), dg.stride(0), dg.stride(1),
        n_rows, dv,
        WIDE=compute == torch.float64, ROWS=rows, BLOCK_DV=block_dv, GRAD_OUTS=grad_outs, GRAD_GATES=grad_gates,
        HAS_CMP=o_cmp is not None, HAS_SLC=o_slc is not None, HAS_WIN=o_win is not None,
        DELTA0_OF_CMP=deltas[0] is not None, DELTA0_OF_SLC=deltas[1] is not None, DELTA0_OF_WIN=deltas[2] is not None,
        num_warps=4, enable_fp_fusion=False,
    )
    return d_gates, *d_outs


class GatedSumFunction(torch.autograd.Function):
    """Eq. 5 on the kernel (forward) and its gradients on the backward kernel."""

    @staticmethod
    def forward(ctx, gates: Tensor, o_cmp: Tensor | None, o_slc: Tensor | None, o_win: Tensor | None,
                compute: torch.dtype, dtype: torch.dtype):
        ctx.save_for_backward(gates, o_cmp, o_slc, o_win)
        ctx.compute, ctx.dtype = compute, dtype
        # branch outputs of range attention: backward hands their backward D0 along with their gradients
        ctx.delta0_of = tuple(o is not None and takes_supplied_delta0(o) for o in (o_cmp, o_slc, o_win))
        return gated_sum_forward(gates, o_cmp, o_slc, o_win, compute, dtype)

    @staticmethod
    def backward(ctx, do: Tensor):
        gates, o_cmp, o_slc, o_win = ctx.saved_tensors
        needs = ctx.needs_input_grad
        delta0 = tuple(torch.empty(o.shape[:-1], dtype=torch.float32, device=o.device) if wanted and need else None
                       for o, wanted, need in zip((o_cmp, o_slc, o_win), ctx.delta0_of, needs[1:4]))
        d_gates, *d_outs = gated_sum_backward(do, gates, o_cmp, o_slc, o_win, ctx.compute,
                                              grad_outs=any(needs[1:4]), grad_gates=needs[0], delta0=delta0)
        d_outs = [d if need else None for d, need in zip(d_outs, needs[1:4])]
        for d_o, d0 in zip(d_outs, delta0):
            if d0 is not None:
                supply_delta0(d_o, d0)
        return d_gates, *d_outs, None, None


def gated_sum_kernel(gates: Tensor, o_cmp: Tensor | None, o_slc: Tensor | None, o_win: Tensor | None, *,
                     compute: torch.dtype, dtype: torch.dtype) -> Tensor:
    """Eq. 5: gates [B, T, Hq, 3] in (cmp, slc, win) order, branch outputs [B, T, Hq, d_v] (each fp64/fp32/bf16/
    fp16, any mix; None for a branch left out of the sum, at least one given), summed in compute (fp32 or fp64) and
    rounded once to dtype (fp32/bf16/fp16); differentiable (GatedSumFunction).
    Tensors on CUDA, or on CPU under TRITON_INTERPRET=1."""
    where = "gated_sum_kernel"
    outs = {name: x for name, x in (("o_cmp", o_cmp), ("o_slc", o_slc), ("o_win", o_win)) if x is not None}
    if not outs:
        raise ValueError(f"{where}: at least one of o_cmp, o_slc, o_win must be given")
    named = (("gates", gates), *outs.items())
    for name, x in named:
        if not isinstance(x, Tensor) or x.dim() != 4 or x.dtype not in INPUT_DTYPES:
            raise ValueError(f"{where}: {name} must be a 4-D fp64/fp32/bf16/fp16 tensor, got "
                             f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    shape = next(iter(outs.values())).shape
    if any(x.shape != shape for x in outs.values()) or shape[-1] > MAX_KERNEL_HEAD_DIM:
        raise ValueError(f"{where}: o_cmp, o_slc, o_win must share one shape [B, T, Hq, d_v] with d_v <= "
                         f"{MAX_KERNEL_HEAD_DIM}, got {[tuple(x.shape) for x in outs.values()]}")
    if tuple(gates.shape) != (*shape[:3], 3):
        raise ValueError(f"{where}: gates must be [B, T, Hq, 3] = {[*shape[:3], 3]}, got {tuple(gates.shape)}")
    if compute not in COMPUTE_DTYPES or dtype not in KERNEL_DTYPES:
        raise ValueError(f"{where}: compute must be one of {COMPUTE_DTYPES} and dtype one of {KERNEL_DTYPES}, got "
                         f"{compute}, {dtype}")
    if len({x.device for _, x in named}) != 1:
        raise ValueError(f"{where}: gates, o_cmp, o_slc, o_win must be on one device, got "
                         f"{[str(x.device) for _, x in named]}")
    return GatedSumFunction.apply(gates, o_cmp, o_slc, o_win, compute, dtype)


class _Recomputed:
    """What a saved view of an Eq. 5 output keeps in its place: the GatedSumFunction node that made the output and
    the view's geometry."""

    __slots__ = ("node", "size", "stride", "offset")

    def __init__(self, node, view: Tensor):
        self.node, self.size, self.stride, self.offset = node, view.size(), view.stride(), view.storage_offset()

    def unpack(self) -> Tensor:
        gates, o_cmp, o_slc, o_win = self.node.saved_tensors  # what the node keeps for its own backward
        o = gated_sum_forward(gates, o_cmp, o_slc, o_win, self.node.compute, self.node.dtype)
        return o.as_strided(self.size, self.stride, self.offset)


@contextlib.contextmanager
def recomputed_in_backward(o: Tensor) -> Iterator[None]:
    """Inside: a tensor autograd saves that is o, the output of gated_sum_kernel, or a view of it (the output
    projection's input) is not kept; backward recomputes it, bitwise, with one more pass of the Eq. 5 kernel over
    the gates and branch outputs that o's own backward keeps anyway. Every other saved tensor is kept as usual, and
    an o that gated_sum_kernel did not make (a torch-path output, a copy) is kept too. Where other saved-tensor
    hooks are already active (activation checkpointing, offloading), saving is left to them: the recomputation
    would unpack, ahead of its own backward, what Eq. 5's node saved through them, which they may allow only once."""
    node = o.grad_fn
    top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)  # None: cannot tell, so no
    if (getattr(node, "_forward_cls", None) is not GatedSumFunction or not torch.is_grad_enabled()
            or top_hooks is None or top_hooks(False) is not None):
        yield
        return
    # The hooks stay with what they packed until backward: they hold o's storage address, not o.
    device, dtype, storage = o.device, o.dtype, o.untyped_storage().data_ptr()

    def pack(t: Tensor):
        same = t.device == device and t.dtype == dtype and t.untyped_storage().data_ptr() == storage
        return _Recomputed(node, t) if same else t

    def unpack(saved):
        return saved.unpack() if isinstance(saved, _Recomputed) else saved

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
