"""Range attention on the Triton kernels: Eq. 2 for query rows that each read ONE contiguous key range,
differentiable in q, k and v.

Both dense-ish NSA branches are of this kind (window_ranges and compressed_ranges below build the ranges from the
convention seams):
- the sliding window (Section 3.3.3): row p reads keys [max(doc start, p - w + 1), p];
- the compressed branch (Eq. 7-8): row p reads the compressed tokens [first of its document, + N_visible(p) - 1].
A row whose range is empty (hi < lo) outputs 0 and has lse = -inf (the empty compressed set of Eq. 7).

Forward grid (query tile, KV head x head part, batch), FlashAttention-2 style: a program's BLOCK_M tile rows are
(query row, head) pairs, BLOCK_M // HEADS consecutive query rows x HEADS heads of one KV group (common.head_packed_rows;
HEADS = 1: BLOCK_M rows of one head), so each key tile it loads serves every head of the tile. It loads its q tile
once, walks the key tiles covering the union of its rows' ranges (tile starts aligned to multiples of BLOCK_N, so a
row's arithmetic does not depend on which rows share its program), masks each element by its row's range, and
keeps an online softmax in fp32 (base 2). GQA: head h reads KV head h // GROUP. A q/k head dim such as the paper's
d_k = 192 is read in two exact tiles (128 + 64, common.head_dim_tiles) rather than one padded to 256: the logits
are the first tile's dot with the second's accumulated onto it (BLOCK_DK2; the scores kernel does the same).

Outputs o [B, TQ, Hq, dv] (input dtype) and lse2 [B, TQ, Hq] fp32, the base-2 log-sum-exp of the scaled
logits (s * scale * log2(e)); -inf for an empty row. With WITH_OUTPUT=False only lse2 is computed (no V loads,
no P.V dot): the selection scoring needs the compressed branch's normaliser and nothing else.

Backward: range_attention_bwd.py (dq query-centric, dk/dv key-centric over the contiguous run of rows that can
read each key tile; deterministic, no atomics).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.utils.weak import WeakTensorKeyDictionary

from reference.config import NSAConfig

from .. import masks
from ..dispatch import KERNEL_DTYPES, MAX_KERNEL_HEAD_DIM
from ..documents import Documents
from ..numerics import LN2, LOG2E
from .common import (INDEX_DTYPES, RangeTiling, dot_settings, head_dim_tiles, head_packed_grid, head_packed_rows,
                     interpreting, key_tile_logits, key_tile_span, launch_tiling, padded, range_tiling,
                     second_head_tile, smaller_range_tilings)
from .range_attention_bwd import range_attention_backward


@triton.jit
def _range_attention_fwd_kernel(
    Q, K, V, LO, HI, O, LSE2,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh,
    stride_lb, stride_lt,
    n_queries, n_keys, scale_log2,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    HEADS: tl.constexpr, WITH_OUTPUT: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_DK2: tl.constexpr,
):
    # 64-bit offsets everywhere (T >= 64k, Hq * d large). Tile rows are (query row, head) pairs of one KV group.
    offs_m, h, row_mask, kvh = head_packed_rows(n_queries, GROUP, HEADS, BLOCK_M)
    b = tl.program_id(2).to(tl.int64)

    offs_n = tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    dk_mask = offs_dk < DK
    dv_mask = offs_dv < DV

    # ranges and key indices in int32 (keys < 2^31; masks stay cheap in registers), pointer offsets in int64
    lo, hi, start, last = key_tile_span(LO, HI, offs_m, row_mask, n_keys, BLOCK_N)

    q_rows = Q + b * stride_qb + offs_m[:, None] * stride_qt + h[:, None] * stride_qh
    q = tl.load(q_rows + offs_dk[None, :], mask=row_mask[:, None] & dk_mask[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    if BLOCK_DK2 > 0:  # the head dim's second tile (common.head_dim_tiles)
        q2, offs_dk2, dk_mask2 = second_head_tile(q_rows, row_mask, DK, BLOCK_DK, BLOCK_DK2, DOT_FP32)
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh

    # The running max starts finite, so a tile where a row reads nothing gives alpha = 1 and p = 0 (no NaN).
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for start_n in range(start, last + 1, BLOCK_N):
        keys = start_n + offs_n
        key_ok = keys < n_keys
        s = key_tile_logits(q, k_base, keys, key_ok, stride_kt, offs_dk, dk_mask, None, DOT_FP32, INPUT_PRECISION)
        if BLOCK_DK2 > 0:
            s = key_tile_logits(q2, k_base, keys, key_ok, stride_kt, offs_dk2, dk_mask2, s, DOT_FP32, INPUT_PRECISION)
        in_range = (keys[None, :] >= lo[:, None]) & (keys[None, :] <= hi[:, None])
        s = tl.where(in_range, s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if WITH_OUTPUT:
            v = tl.load(v_base + keys.to(tl.int64)[:, None] * stride_vt + offs_dv[None, :],
                        mask=key_ok[:, None] & dv_mask[None, :], other=0.0)
            acc = acc * alpha[:, None]
            if DOT_FP32:  # P enters the dot rounded to the input dtype, as on the GPU (a no-op for fp32)
                acc += tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision=INPUT_PRECISION)
            else:
                acc += tl.dot(p.to(v.dtype), v)
        m_i = m_new

    has_key = l_i > 0.0
    lse2 = tl.where(has_key, m_i + tl.log2(tl.where(has_key, l_i, 1.0)), float("-inf"))
    tl.store(LSE2 + b * stride_lb + offs_m * stride_lt + h, lse2, mask=row_mask)
    if WITH_OUTPUT:
        out = acc / tl.where(has_key, l_i, 1.0)[:, None]
        tl.store(O + b * stride_ob + offs_m[:, None] * stride_ot + h[:, None] * stride_oh + offs_dv[None, :],
                 out.to(O.dtype.element_ty), mask=row_mask[:, None] & dv_mask[None, :])


def range_attention_forward(q: Tensor, k: Tensor, v: Tensor | None, lo: Tensor, hi: Tensor, scale: float, *,
                            tiling: RangeTiling | None = None, out: Tensor | None = None,
                            max_width: int | None = None) -> tuple[Tensor | None, Tensor]:
    """Launch the forward on validated inputs (range_attention.check_range_inputs): q [B, TQ, Hq, dk],
    k [B, TK, Hkv, dk], v [B, TK, Hkv, dv] or None (lse only), lo/hi int32 [TQ] contiguous.
    Returns (o [B, TQ, Hq, dv] in q's dtype or None, lse2 [B, TQ, Hq] fp32 base-2 log-sum-exp).
    tiling: launched as given (the probes time it); default the launch table's, shrunk if the GPU lacks the
    resources (common.launch_tiling).
    out: a [B, TQ, Hq, dv] tensor of q's dtype (last dim contiguous, e.g. rows of a larger output) to write o into.
    max_width: the most keys a row reads, where the caller knows it: the launch table's tile for such ranges
    (common.range_tiling). Another tile may round differently (the online softmax steps over other key tiles)."""
    B, TQ, Hq, dk = q.shape
    TK, Hkv = k.shape[1], k.shape[2]
    with_output = v is not None
    dv = v.shape[-1] if with_output else dk
    o = (out if out is not None else torch.empty((B, TQ, Hq, dv), device=q.device, dtype=q.dtype)) \
        if with_output else None
    lse2 = torch.empty((B, TQ, Hq), device=q.device, dtype=torch.float32)
    if B * TQ * Hq == 0:
        return o, lse2
    dot_fp32, precision = dot_settings(q.dtype)
    vv, oo = (v, o) if with_output else (k, lse2)  # placeholders the kernel never touches without output
    block_dk, block_dk2 = head_dim_tiles(dk)

    def launch(t: RangeTiling) -> None:
        grid, heads = head_packed_grid(t, TQ, Hq, Hkv, B)
        _range_attention_fwd_kernel[grid](
            q, k, vv, lo, hi, oo, lse2,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            vv.stride(0), vv.stride(1), vv.stride(2),
            *((o.stride(0), o.stride(1), o.stride(2)) if with_output else (0, 0, 0)),
            lse2.stride(0), lse2.stride(1),
            TQ, TK, scale * LOG2E,
            GROUP=Hq // Hkv, DK=dk, DV=dv, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
            BLOCK_DK=block_dk, BLOCK_DK2=block_dk2, BLOCK_DV=padded(dv), HEADS=heads, WITH_OUTPUT=with_output,
            DOT_FP32=dot_fp32, INPUT_PRECISION=precision, num_warps=t.num_warps, num_stages=t.num_stages,
        )

    launch_tiling(launch, tiling, range_tiling(padded(dk), padded(dv), q.dtype, "forward" if with_output else "lse",
                                               max_width), smaller_range_tilings)
    return o, lse2


# D0 = rowsum(dO * O) of a RangeAttentionFunction output, handed over with dO by the op that consumed the output
# and already read dO and O in its own backward (Eq. 5's kernel: kernels.gated_sum), keyed by the gradient tensor
# itself, with its version counter: an entry lives only as long as that dO, and a dO that autograd summed from
# several consumers, into a new tensor or into this one in place (a new version), is not taken for it, so that
# backward forms D0 itself.
_SUPPLIED_DELTA0 = WeakTensorKeyDictionary()  # dO -> (D0, dO._version when supplied)


def takes_supplied_delta0(o: Tensor) -> bool:
    """Whether o is an output of RangeAttentionFunction, whose backward reads a D0 supplied with its gradient
    (supply_delta0) instead of forming it in a pass of its own over dO and o."""
    return getattr(o.grad_fn, "_forward_cls", None) is RangeAttentionFunction


def check_delta0(where: str, delta0: Tensor, rows: torch.Size, whose: str = "") -> None:
    """ValueError naming `where` unless delta0 is a D0 the range backward can take: a contiguous float32 tensor of
    shape rows (one value per row of the gradient; whose: how the message names those rows)."""
    if delta0.dtype != torch.float32 or delta0.shape != rows or not delta0.is_contiguous():
        raise ValueError(f"{where}: delta0 must be a contiguous float32 tensor {list(rows)}{whose}, got "
                         f"{delta0.dtype} {tuple(delta0.shape)}")


def supply_delta0(do: Tensor, delta0: Tensor) -> None:
    """Hand D0 = rowsum(do * o) [B, TQ, Hq] fp32 (contiguous) to the backward of the RangeAttentionFunction
    output o whose gradient is do (takes_supplied_delta0(o)); that backward uses it once (and overwrites it)."""
    check_delta0("supply_delta0", delta0, do.shape[:-1], " (do's rows)")
    _SUPPLIED_DELTA0[do] = (delta0, do._version)


class RangeAttentionFunction(torch.autograd.Function):
    """(o, lse2) of Eq. 2 over each row's key range, lse2 the base-2 log-sum-exp of the scaled logits; gradients
    for q, k, v (lse2 is not differentiable). Backward takes D0 from the op that consumed o when it supplied one
    with the gradient (supply_delta0), else forms it."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, lo: Tensor, hi: Tensor, scale: float, max_width: int | None):
        o, lse2 = range_attention_forward(q, k, v, lo, hi, scale, max_width=max_width)
        ctx.save_for_backward(q, k, v, lo, hi, o, lse2)
        ctx.scale = scale
        ctx.mark_non_differentiable(lse2)
        return o, lse2

    @staticmethod
    def backward(ctx, do: Tensor, _dlse2: Tensor):
        q, k, v, lo, hi, o, lse2 = ctx.saved_tensors
        delta0, version = _SUPPLIED_DELTA0.pop(do, (None, None))
        if version != do._version:  # changed in place since (another consumer's gradient summed into it)
            delta0 = None
        dq, dk, dv = range_attention_backward(q, k, v, lo, hi, o, lse2, do.contiguous(), ctx.scale, delta0=delta0)
        return dq, dk, dv, None, None, None, None


def triton_range_attention(q: Tensor, k: Tensor, v: Tensor, lo: Tensor, hi: Tensor,
                           scale: float | None = None) -> tuple[Tensor, Tensor]:
    """Eq. 2 for every query row over its key range [lo[t], hi[t]] (inclusive; empty when hi < lo):
    (o [B, TQ, Hq, dv] in q's dtype, lse [B, TQ, Hq] fp32 natural-log log-sum-exp of the scaled logits,
    -inf for an empty row, whose o is 0).

    q [B, TQ, Hq, dk], k [B, TK, Hkv, dk], v [B, TK, Hkv, dv] (GQA: head h reads KV head h // (Hq / Hkv));
    lo, hi int32/int64 [TQ], the same for every batch row, NON-DECREASING in t (true of the window and of the
    compressed branch, packed documents included), 0 <= lo <= TK and -1 <= hi < TK. scale defaults to
    1/sqrt(dk). fp32/bf16/fp16 inputs (all the same), fp32 accumulation; fp32 dots are exact fp32 (no TF32).
    Tensors must be on CUDA, or on CPU with TRITON_INTERPRET=1 set before the kernels were imported.
    """
    o, lse2 = range_attention_lse2(q, k, v, lo, hi, scale)
    return o, lse2 * LN2


def range_attention_lse2(q: Tensor, k: Tensor, v: Tensor, lo: Tensor, hi: Tensor,
                         scale: float | None = None, *, checked: bool = False,
                         max_width: int | None = None) -> tuple[Tensor, Tensor]:
    """triton_range_attention with the normaliser as the kernel keeps it: (o, lse2), lse2 = lse * log2(e) (the
    base-2 log-sum-exp), which the group-scores kernel takes as it is (no rounding round trip).
    checked: lo, hi are what check_range_inputs returned for these tensors (not validated again).
    max_width: the most keys a row reads, if known (range_attention_forward's)."""
    if not checked:
        lo, hi = check_range_inputs(q, k, v, lo, hi)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    return RangeAttentionFunction.apply(q, k, v, lo, hi, float(scale), max_width)


def range_logsumexp2(q: Tensor, k: Tensor, lo: Tensor, hi: Tensor, scale: float | None = None, *,
                     checked: bool = False) -> Tensor:
    """lse2 [B, TQ, Hq] (base-2 log-sum-exp of the scaled logits, fp32, -inf for an empty row) over each row's key
    range, without the P.V product (the selection scoring's Eq. 8 normaliser); not differentiable.
    checked: as in range_attention_lse2."""
    if not checked:
        lo, hi = check_range_inputs(q, k, None, lo, hi)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    q, k = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k))
    return range_attention_forward(q.detach(), k.detach(), None, lo, hi, float(scale))[1]


def check_range_inputs(q: Tensor, k: Tensor, v: Tensor | None, lo: Tensor, hi: Tensor, *,
                       sync: bool = True, rules: bool = True) -> tuple[Tensor, Tensor]:
    """Validate the inputs of triton_range_attention (ValueError naming the tensor and the rule); returns lo, hi
    as contiguous int32 after checking the range rules: one device sync, or with sync=False an assertion the
    device checks in stream order (no sync: the ranges nsa_forward builds itself; a broken range is a bug of a
    convention seam, and stops the run with the same message). rules=False: lo, hi are int32 ranges already
    checked for this TK (sequence_ranges); only the tensors' shapes, dtypes and devices are checked."""
    where = "triton_range_attention"
    named = (("q", q), ("k", k)) + ((("v", v),) if v is not None else ())
    for name, x in named:
        if not isinstance(x, Tensor) or x.dim() != 4:
            raise ValueError(f"{where}: {name} must be a 4-D tensor, got {getattr(x, 'shape', type(x).__name__)}")
    B, TQ, Hq, dk = q.shape
    _, TK, Hkv, dk_k = k.shape
    if k.shape[0] != B or (v is not None and tuple(v.shape[:3]) != tuple(k.shape[:3])):
        raise ValueError(f"{where}: k [B, TK, Hkv, dk] and v [B, TK, Hkv, dv] must share B, TK, Hkv with q's B; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {None if v is None else tuple(v.shape)}")
    if dk_k != dk:
        raise ValueError(f"{where}: q and k must have the same head dim dk, got {dk} and {dk_k}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"{where}: Hq ({Hq}) must be a multiple of Hkv ({Hkv}) (GQA)")
    dims = (dk,) + ((v.shape[-1],) if v is not None else ())
    if max(dims) > MAX_KERNEL_HEAD_DIM:
        raise ValueError(f"{where}: head dims {dims} must be <= {MAX_KERNEL_HEAD_DIM}")
    if q.dtype not in KERNEL_DTYPES or any(x.dtype != q.dtype for _, x in named):
        raise ValueError(f"{where}: q, k, v must share one dtype among fp32/bf16/fp16, got "
                         f"{[str(x.dtype) for _, x in named]}")
    for name, r in (("lo", lo), ("hi", hi)):
        if not isinstance(r, Tensor) or r.dtype not in INDEX_DTYPES or tuple(r.shape) != (TQ,):
            raise ValueError(f"{where}: {name} must be an int32/int64 tensor [TQ] = [{TQ}], got "
                             f"{getattr(r, 'dtype', type(r).__name__)} {tuple(getattr(r, 'shape', ()))}")
    devices = {x.device for _, x in named} | {lo.device, hi.device}
    if len(devices) != 1:
        raise ValueError(f"{where}: q, k, v, lo, hi must be on one device, got {devices}")
    if q.device.type != "cuda" and not interpreting():
        raise ValueError(f"{where}: tensors must be on CUDA (or set TRITON_INTERPRET=1 before importing the "
                         f"kernels to run them on CPU), got device {q.device}")
    if not rules:
        return lo, hi
    return check_range_rules(lo, hi, TK, sync=sync)


def check_range_rules(lo: Tensor, hi: Tensor, n_keys: int, *, sync: bool = True) -> tuple[Tensor, Tensor]:
    """lo, hi [TQ] as contiguous int32 once they keep the range rules over n_keys keys: a ValueError naming the
    first row that breaks them (one device sync for CUDA tensors), or with sync=False an assertion the device
    checks in stream order."""
    where = "triton_range_attention"
    if lo.numel():
        lo64, hi64 = lo.to(torch.int64), hi.to(torch.int64)
        broken = (lo64 < 0) | (lo64 > n_keys) | (hi64 < -1) | (hi64 >= n_keys)
        broken[1:] |= (lo64[1:] < lo64[:-1]) | (hi64[1:] < hi64[:-1])
        rules = f"0 <= lo <= TK = {n_keys}, -1 <= hi < TK, lo and hi non-decreasing in the row"
        if not sync:
            torch._assert_async(~broken.any(), f"{where}: a range breaks the rules {rules}")
        elif bool(broken.any()):
            t = int(broken.nonzero()[0])
            raise ValueError(f"{where}: the range of row {t}, [lo, hi] = [{int(lo64[t])}, {int(hi64[t])}], breaks "
                             f"the rules {rules}")
    return lo.to(torch.int32).contiguous(), hi.to(torch.int32).contiguous()


# The NSA branches on the kernel -------------------------------------------------------------------------------
# Per-query key ranges of the branches that read one contiguous run of keys, built from the same convention seams
# as the masks of the torch path (masks.window_start, masks.compressed_block_visible), so a convention switch, or a
# planted bug in one of those seams, reaches both paths. Every range is [lo, hi] inclusive, int64 [TQ], empty when
# hi = lo - 1, and non-decreasing in the row, packed documents included (a document's ranges start at or after the
# previous document's).

@dataclass(frozen=True)
class CompressedSoftmax:
    """The compressed branch's softmax as the range kernel computed it: each query's range of compressed tokens
    [lo, hi] (int32 [TQ], validated) and the base-2 log-sum-exp lse2 [B, TQ, Hq] over it. The selection scoring
    reuses both (Eq. 8), so nsa_forward builds and checks the ranges once."""

    lo: Tensor
    hi: Tensor
    lse2: Tensor


def window_ranges(positions: Tensor, cfg: NSAConfig, docs: Documents | None = None) -> tuple[Tensor, Tensor]:
    """Window keys of queries at (packed) positions [TQ]: [max(doc start, doc start + window_start(rel)), p],
    rel = p - doc start (the window restarts at each document start; Section 3.3.3)."""
    start = torch.zeros_like(positions) if docs is None else docs.token_start[positions]
    rel = positions - start
    lo = start + torch.clamp(masks.window_start(rel, cfg), min=0)
    return lo, positions.clone()


def visible_block_count(rel: Tensor, n_blocks: Tensor | int, cfg: NSAConfig, bound: int) -> Tensor:
    """How many of the blocks 0..n_blocks-1 are visible at relative position rel (Eq. 7), asked of
    masks.compressed_block_visible by binary search: visibility is monotone in the block index (block i is
    visible iff its last key i*d + l - 1 is early enough), so the visible blocks are 0..count-1. bound: an upper
    bound of n_blocks known on the host (the search's steps; no device sync)."""
    # an int is filled on the device: a host scalar copied to it would wait for the device's queue
    n = torch.full_like(rel, n_blocks) if isinstance(n_blocks, int) else n_blocks.to(torch.int64).expand_as(rel)
    low, high = torch.zeros_like(rel), n.clone()  # the count lies in [low, high]
    for _ in range(max(0, bound).bit_length() + 1):
        mid = (low + high + 1) // 2
        visible = masks.compressed_block_visible(mid - 1, rel, cfg) & (mid >= 1)
        searching = low < high
        low = torch.where(searching & visible, mid, low)
        high = torch.where(searching & ~visible, mid - 1, high)
    return low


def compressed_ranges(positions: Tensor, n_compressed: int, cfg: NSAConfig,
                      docs: Documents | None = None) -> tuple[Tensor, Tensor]:
    """Compressed tokens read by queries at (packed) positions [TQ]: the first visible_block_count blocks of the
    query's own document, [first, first + count - 1] in the (packed) compressed sequence of n_compressed tokens."""
    if docs is None:
        first = torch.zeros_like(positions)
        rel, n_own = positions, n_compressed
    else:
        doc = docs.token_doc[positions]
        first = docs.cmp_bounds[doc]
        rel, n_own = docs.relative(positions), docs.cmp_bounds[doc + 1] - first
    count = visible_block_count(rel, n_own, cfg, n_compressed)  # a document holds at most all the tokens
    return first, first + count - 1


class SequenceRanges(NamedTuple):
    """The key ranges of the queries of one sequence: lo, hi int32 [TQ] and the keys each row reads on the
    device (reads: int32 for the compressed branch, int64 for the window, as range_reads counts them from the
    ranges the kernel reads), those counts on the host (widths, int64: the selection's chunk plan) and their
    largest (max_width: the range forward's tile, common.range_tiling)."""

    lo: Tensor
    hi: Tensor
    reads: Tensor
    widths: Tensor
    max_width: int


def sequence_ranges(branch: str, first_position: int, n_rows: int, n_keys: int, cfg: NSAConfig,
                    device: torch.device) -> SequenceRanges:
    """The SequenceRanges of queries first_position .. first_position + n_rows - 1 of one sequence over n_keys
    keys (branch "win") or compressed tokens (branch "cmp"). Every layer of a model and every step of a run asks
    for the same ranges, so they are built once per shape, config, device and seam functions (a replaced
    masks.compressed_block_visible or masks.window_start gets its own entry): the window's few ops and the
    compressed ranges' binary search (about ten ops per step of the search) then cost no launch per layer, and
    nothing is read back from the device."""
    return _sequence_ranges(branch, first_position, n_rows, n_keys, cfg, device,
                            (masks.compressed_block_visible, masks.window_start))


@functools.lru_cache(maxsize=64)
def _sequence_ranges(branch: str, first_position: int, n_rows: int, n_keys: int, cfg: NSAConfig,
                     device: torch.device, seams: tuple) -> SequenceRanges:
    """Built on the host (the seams on host integers give what they give on the device), checked there against
    the range rules, copied to the device once."""
    positions = torch.arange(first_position, first_position + n_rows)
    lo, hi = compressed_ranges(positions, n_keys, cfg) if branch == "cmp" else window_ranges(positions, cfg)
    widths = torch.clamp(hi - lo + 1, min=0)
    lo32, hi32 = check_range_rules(lo, hi, n_keys)
    reads = widths.to(torch.int32) if branch == "cmp" else widths
    max_width = int(widths.max()) if widths.numel() else 0
    return SequenceRanges(lo32.to(device), hi32.to(device), reads.to(device), widths, max_width)


def _sequence_branch_ranges(branch: str, q: Tensor, k: Tensor, v: Tensor | None, cfg: NSAConfig,
                            first_position: int) -> tuple[Tensor, Tensor, Tensor, int]:
    """lo, hi (the tensors checked against q, k, v), reads [B, TQ, Hkv] of one sequence's rows and the longest
    row's key count, from sequence_ranges."""
    ranges = sequence_ranges(branch, first_position, q.shape[1], k.shape[1], cfg, q.device)
    lo, hi = check_range_inputs(q, k, v, ranges.lo, ranges.hi, rules=False)
    return lo, hi, ranges.reads[None, :, None].expand(q.shape[0], q.shape[1], cfg.n_kv_heads), ranges.max_width


def range_reads(lo: Tensor, hi: Tensor, batch: int, n_kv_heads: int) -> Tensor:
    """reads [B, TQ, Hkv]: the keys each (query, KV head) range covers, hi - lo + 1 (0 when empty), counted from
    the ranges the kernel read."""
    return torch.clamp(hi - lo + 1, min=0)[None, :, None].expand(batch, lo.shape[0], n_kv_heads)


def compressed_branch(q: Tensor, k_cmp: Tensor, v_cmp: Tensor | None, cfg: NSAConfig, positions: Tensor,
                      docs: Documents | None = None,
                      first_position: int | None = None) -> tuple[Tensor | None, CompressedSoftmax, Tensor]:
    """The compressed branch (Eq. 4 over the Eq. 7 tokens) for queries q [B, TQ, Hq, dk] at positions [TQ]:
    (o_cmp [B, TQ, Hq, dv] in q's dtype, the CompressedSoftmax (each query's range and the base-2 log-sum-exp over
    it, -inf without a visible block: the Eq. 8 normaliser), reads [B, TQ, Hkv] = the visible compressed tokens
    each query's range covers). k_cmp/v_cmp are cast to q's dtype (differentiably), as compress() returns them.
    v_cmp=None: only the normaliser (no P.V product; o_cmp is None), for a call whose output leaves this branch
    out but still selects blocks. first_position: positions is arange(first_position, first_position + TQ) of
    one sequence (sequence_ranges serves the ranges, and the longest range the forward's tile); a packed batch's
    ranges stay on the device, and its forward takes the launch table's tile for any width."""
    k_low = k_cmp.to(q.dtype)
    v_low = None if v_cmp is None else v_cmp.to(q.dtype)
    max_width = None
    if first_position is not None and docs is None:
        lo, hi, reads, max_width = _sequence_branch_ranges("cmp", q, k_low, v_low, cfg, first_position)
    else:
        lo, hi = check_range_inputs(q, k_low, v_low, *compressed_ranges(positions, k_cmp.shape[1], cfg, docs),
                                    sync=False)
        reads = range_reads(lo, hi, q.shape[0], cfg.n_kv_heads)
    if v_low is None:
        o, lse2 = None, range_logsumexp2(q.detach(), k_low.detach(), lo, hi, checked=True)
    else:
        o, lse2 = range_attention_lse2(q, k_low, v_low, lo, hi, checked=True, max_width=max_width)
    return o, CompressedSoftmax(lo, hi, lse2), reads


def window_branch(q: Tensor, k: Tensor, v: Tensor, cfg: NSAConfig, positions: Tensor,
                  docs: Documents | None = None, first_position: int | None = None) -> tuple[Tensor, Tensor]:
    """The window branch (Section 3.3.3) for queries q [B, TQ, Hq, dk] at positions [TQ]: (o_win [B, TQ, Hq, dv]
    in q's dtype, reads [B, TQ, Hkv] = the window keys each query's range covers). first_position: as in
    compressed_branch. The forward's tile is the one for ranges of the longest row's keys (a packed batch's: w,
    what a window holds)."""
    if first_position is not None and docs is None:
        lo, hi, reads, max_width = _sequence_branch_ranges("win", q, k, v, cfg, first_position)
        o, _ = range_attention_lse2(q, k, v, lo, hi, checked=True, max_width=max_width)
        return o, reads
    lo, hi = window_ranges(positions, cfg, docs)
    o, _ = range_attention_lse2(q, k, v, *check_range_inputs(q, k, v, lo, hi, sync=False), checked=True,
                                max_width=cfg.window)
    return o, range_reads(lo, hi, q.shape[0], cfg.n_kv_heads)

