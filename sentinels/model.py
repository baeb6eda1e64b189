"""A small decoder-only language model with NSA attention (RMSNorm, SwiGLU MLP; RoPE lives in NSAAttention).

The attention class is injectable (`model.attention: optimized | reference`). Each layer wraps its
NSAAttention in `NSALayerAttention`, which calls the module's own seams (project -> functional_forward ->
o_proj) so that it can
  * record gate statistics (Eq. 5 gates g^c, computed inside the module) and selection statistics
    (distinct selected blocks, Eq. 6 reads counted by the implementation) of the last forward, and
  * apply the DEBUG switches of the sentinel self-test (planted leaks, gate overrides; config.DebugConfig).

Packed documents (data.packing varlen): the model takes cu_seqlens (batch size 1, reference/packing.py) and
every layer hands it to both seams, `project(x, *, cu_seqlens=...)` (RoPE positions restart at each document)
and `functional_forward(..., cu_seqlens=...)` (NSA never crosses a boundary), so a packed row computes what each
document alone would.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from optimized.device_tables import DeviceTables
from optimized.recompute import ForwardTape
from reference.config import NSAConfig
from reference.contract import KV, BRANCHES, BranchKV, NSAOutput
from reference.packing import check_cu_seqlens

from .config import DebugConfig, ModelConfig, RunConfig
from .data.batch import IGNORE_INDEX

_REQUIRED_SEAMS = ("project", "functional_forward", "phi_weights", "o_proj")


def attention_class(name: str) -> type[nn.Module]:
    """The NSAAttention class named by model.attention."""
    if name == "reference":
        from reference import NSAAttention

        return NSAAttention
    if name == "optimized":
        try:
            import optimized
        except ImportError as exc:  # pragma: no cover - the package ships with the project
            raise ValueError(f"model.attention='optimized' but the optimized package cannot be imported: {exc}")
        cls = getattr(optimized, "NSAAttention", None)
        if cls is None:
            raise ValueError("model.attention='optimized' but optimized.NSAAttention does not exist yet; "
                             "set model.attention: reference")
        return cls
    raise ValueError(f"model.attention must be 'optimized' or 'reference', got {name!r}")


def packs_documents(name: str) -> bool:
    """Whether model.attention `name`'s seams take cu_seqlens (packed documents, data.packing varlen)."""
    import inspect

    cls = attention_class(name)
    return all("cu_seqlens" in inspect.signature(getattr(cls, seam)).parameters
               for seam in ("project", "functional_forward"))


def optimized_available() -> bool:
    try:
        attention_class("optimized")
    except ValueError:
        return False
    return True


def on_kernels(fused: bool | None, x: Tensor, owner: str) -> bool:
    """Whether a part of the model with a `fused` switch runs its Triton kernels on x: None (the default) on CUDA when
    Triton imports; True also in Triton's interpreter (tests), and one clear error on a CPU tensor without it."""
    from optimized.dispatch import interpreting, triton_imports

    if fused is None:
        return x.is_cuda and triton_imports()
    if fused and not x.is_cuda and not interpreting():
        raise ValueError(f"{owner}: fused=True runs Triton kernels, which need CUDA tensors (or TRITON_INTERPRET=1 "
                         f"set before Triton is imported); the input is on {x.device}")
    return fused


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim, in fp32, returned in x's dtype. Called with a residual
    delta as well, it returns (h, norm(h)) for h = x + delta: a pre-norm block's residual add and the norm after it.

    On CUDA (fused=None: when Triton imports) both run as one Triton kernel each way (sentinels/
    residual_norm_kernels.py) that keeps h and 1/rms for backward, and under autocast the normalized h comes out in
    the autocast dtype, the cast the next matmul would make; the add, the norm, the cast and their backwards were
    six memory-bound passes. Elsewhere torch's rms_norm after torch's add, which on CPU computes the expression bit
    for bit."""

    def __init__(self, dim: int, eps: float, fused: bool | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.fused = fused  # None: the kernels on CUDA when Triton imports; True: also in Triton's interpreter

    def forward(self, x: Tensor, delta: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        if self._on_kernels(x, delta):
            out_dtype = x.dtype if delta is None else torch.result_type(x, delta)
            if torch.is_autocast_enabled(x.device.type):
                out_dtype = torch.get_autocast_dtype(x.device.type)
            return _AddRMSNorm.apply(x, delta, self.weight, self.eps, out_dtype)
        h = x if delta is None else x + delta
        normed = F.rms_norm(h.float(), self.weight.shape, self.weight.float(), self.eps).to(h.dtype)
        return normed if delta is None else (h, normed)

    def _on_kernels(self, x: Tensor, delta: Tensor | None) -> bool:
        if delta is not None and delta.shape != x.shape:  # a broadcast delta: torch's add
            return False
        return on_kernels(self.fused, x, "RMSNorm")


class _AddRMSNorm(torch.autograd.Function):
    """RMSNorm.forward on sentinels/residual_norm_kernels.py: y, or (h, y) with a delta."""

    @staticmethod
    def forward(ctx, x: Tensor, delta: Tensor | None, weight: Tensor, eps: float, out_dtype: torch.dtype):
        from .residual_norm_kernels import add_rms_norm_forward

        x = x.contiguous()
        delta = None if delta is None else delta.contiguous()
        h, y, rstd = add_rms_norm_forward(x, delta, weight.contiguous(), eps, out_dtype)
        ctx.save_for_backward(x if h is None else h, weight, rstd)
        ctx.dtypes = (x.dtype, None if delta is None else delta.dtype)
        ctx.set_materialize_grads(False)
        return y if h is None else (h, y)

    @staticmethod
    def backward(ctx, *grads: Tensor | None):
        from .residual_norm_kernels import add_rms_norm_backward

        h, weight, rstd = ctx.saved_tensors
        x_dtype, delta_dtype = ctx.dtypes
        dh, dy = (None, grads[0]) if delta_dtype is None else grads
        if dy is None:  # only h was read later: the norm sends nothing back
            dy = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
        dx, ddelta, dw = add_rms_norm_backward(h, weight, rstd, dy.contiguous(),
                                               None if dh is None else dh.contiguous(), x_dtype, delta_dtype)
        return dx, ddelta, dw.to(weight.dtype), None, None


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)).

    On CUDA (fused=None: when Triton imports) gate and up are one matmul over their concatenated weights and the
    activation one Triton kernel each way (sentinels/swiglu_kernels.py), in fp32 with one rounding; backward keeps
    the matmul's output alone (torch's ops also keep silu(gate(x))). Elsewhere torch's ops, as written above."""

    def __init__(self, dim: int, hidden: int, fused: bool | None = None):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.fused = fused  # None: the kernels on CUDA when Triton imports; True: also in Triton's interpreter

    def forward(self, x: Tensor) -> Tensor:
        if on_kernels(self.fused, x, "SwiGLU"):
            gate_up = F.linear(x, torch.cat([self.gate_proj.weight, self.up_proj.weight]))
            return self.down_proj(_SwiGLUActivation.apply(gate_up))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _SwiGLUActivation(torch.autograd.Function):
    """silu(g) * u of gu = [g, u] on sentinels/swiglu_kernels.py."""

    @staticmethod
    def forward(ctx, gate_up: Tensor) -> Tensor:
        from .swiglu_kernels import swiglu_forward

        gate_up = gate_up.contiguous()
        ctx.save_for_backward(gate_up)
        return swiglu_forward(gate_up)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        from .swiglu_kernels import swiglu_backward

        (gate_up,) = ctx.saved_tensors
        return swiglu_backward(gate_up, grad.contiguous())


@dataclass
class LayerStats:
    """Statistics of one layer's last forward (detached, on the compute device)."""

    gate_mean: Tensor  # [3] mean gate per branch (cmp, slc, win) over batch, positions, heads
    gate_max: Tensor  # [3]
    distinct_blocks: Tensor  # [] mean over (batch, KV group) of distinct selected block ids across positions
    reads: Tensor  # [3] int64 total Eq. 6 reads per branch, summed over batch, positions, groups


def block_ends(T: int, block: int, device: torch.device) -> Tensor:
    """Per token s < T, the last token of its block of `block` tokens (the last block may be partial)."""
    s = torch.arange(T, device=device)
    return torch.clamp((s // block + 1) * block - 1, max=T - 1)


def shift_left(t: Tensor, by: int) -> Tensor:
    """t[:, p] <- t[:, p + by] along the sequence dim (dim 1); the last `by` positions repeat the final one."""
    if by <= 0 or t.shape[1] == 0:
        return t
    tail = t[:, -1:].expand(-1, min(by, t.shape[1]), *t.shape[2:])
    return torch.cat([t[:, by:], tail], dim=1)[:, : t.shape[1]]


class NSALayerAttention(nn.Module):
    """One layer's NSA attention through the module's seams, with statistics and DEBUG switches.

    kv_perturbation (None in training): a function applied to the branch keys/values as the projections return
    them (before any planted leak moves them), kv_perturbation(layer_index, kv) -> kv; the causal-isolation
    sentinel uses it to change one branch's keys and values at one position (sentinels/isolation.py)."""

    def __init__(self, inner: nn.Module, debug: DebugConfig, layer_index: int = 0, n_layers: int = 1):
        super().__init__()
        missing = [s for s in _REQUIRED_SEAMS if not hasattr(inner, s)]
        if missing:
            raise ValueError(f"{type(inner).__name__} lacks the NSAAttention seams {missing} "
                             f"(needs {list(_REQUIRED_SEAMS)})")
        self.inner = inner
        self.debug = debug
        self.layer_index, self.n_layers = layer_index, n_layers
        self.kv_perturbation: Callable[[int, BranchKV], BranchKV] | None = None
        self.last_stats: LayerStats | None = None

    def _leaky_kv(self, kv: BranchKV) -> BranchKV | None:
        """The keys/values of the planted leak (model.debug.leak), or None when no leak applies to this layer."""
        cfg: NSAConfig = self.inner.cfg
        leak = self.debug.leak
        if leak in ("none", "cross_document"):
            return None
        if self.debug.leak_scope == "last_layer" and self.layer_index != self.n_layers - 1:
            return None
        if leak == "kv_next_token":
            return BranchKV(*(KV(shift_left(b.k, 1), shift_left(b.v, 1)) for b in (kv.cmp, kv.slc, kv.win)))
        if leak in ("cmp_block_early", "cmp_one_early", "sel_scores_next_block"):
            # sel_scores_next_block: these are the keys/values Eq. 8-11 score (the layer attends with kv)
            by = 1 if leak == "cmp_one_early" else cfg.cmp_stride
            return BranchKV(cmp=KV(shift_left(kv.cmp.k, by), shift_left(kv.cmp.v, by)), slc=kv.slc, win=kv.win)
        if leak == "win_next_token":
            return BranchKV(cmp=kv.cmp, slc=kv.slc, win=KV(shift_left(kv.win.k, 1), shift_left(kv.win.v, 1)))
        if leak == "slc_values_next_token":
            return BranchKV(cmp=kv.cmp, slc=KV(kv.slc.k, shift_left(kv.slc.v, 1)), win=kv.win)
        if leak == "slc_block_end":
            end = block_ends(kv.slc.k.shape[1], cfg.sel_block, kv.slc.k.device)
            return BranchKV(cmp=kv.cmp, slc=KV(kv.slc.k[:, end], kv.slc.v[:, end]), win=kv.win)
        raise ValueError(f"model.debug.leak {leak!r} is not implemented")

    def _planted_gates(self, gates: Tensor) -> Tensor:
        if self.debug.gate_override == "locals_only":
            keep = torch.tensor([0.0, 0.0, 1.0], dtype=gates.dtype, device=gates.device)
            return gates * keep  # Eq. 5 with g_cmp = g_slc = 0
        if self.debug.gate_override == "saturated":
            return gates * 0 + 1  # keeps the graph; every gate is exactly 1
        return gates

    def forward(self, x: Tensor, position_offset: int = 0, *, cu_seqlens: Tensor | None = None,
                keep_stats: bool = True) -> Tensor:
        """keep_stats: set last_stats from this call (False: a recomputation in backward, whose statistics are
        those of the forward it repeats)."""
        B, T, _ = x.shape
        if cu_seqlens is None:
            q, kv, gates = self.inner.project(x, position_offset)
        else:
            if position_offset != 0:
                raise ValueError(f"position_offset must be 0 with cu_seqlens (positions restart at each "
                                 f"document), got {position_offset}")
            q, kv, gates = self.inner.project(x, cu_seqlens=cu_seqlens)
        if self.kv_perturbation is not None:  # before any planted leak: the probe changes token t's keys/values
            kv = self.kv_perturbation(self.layer_index, kv)  # as the projections hand them over
        gates = self._planted_gates(gates)
        leaky = self._leaky_kv(kv)
        scoring_only = leaky is not None and self.debug.leak == "sel_scores_next_block"
        one_head = leaky is not None and self.debug.leak_scope == "one_head"
        if leaky is not None and not (one_head or scoring_only):
            kv = leaky
        # Everything inside the NSA call runs in the dtype of q (the implementations check dtypes match).
        dtype = q.dtype

        def nsa(kv: BranchKV, indices: Tensor | None = None) -> NSAOutput:
            kv = BranchKV(*(KV(b.k.to(dtype), b.v.to(dtype)) for b in (kv.cmp, kv.slc, kv.win)))
            phi = self.inner.phi_weights()
            forced = {} if indices is None else {"indices": indices}
            if cu_seqlens is None or self.debug.leak == "cross_document":  # the planted leak drops the boundaries
                return self.inner.functional_forward(q, kv, gates.to(dtype), phi, **forced)
            return self.inner.functional_forward(q, kv, gates.to(dtype), phi, cu_seqlens=cu_seqlens, **forced)

        if scoring_only:  # the planted leak: blocks picked on the shifted keys, attended with the clean ones
            with torch.no_grad():
                picked = nsa(leaky).indices
            out = nsa(kv, picked)
        else:
            out = nsa(kv)
        if one_head:  # the planted leak reaches query head 0 only
            o = out.o.clone()
            o[:, :, 0] = nsa(leaky).o[:, :, 0]
            out = dataclasses.replace(out, o=o)
        if keep_stats:
            block_offsets = None
            if cu_seqlens is not None and self.debug.leak != "cross_document":
                block_offsets = _document_block_offsets(cu_seqlens, self.inner.cfg.sel_block)
            self.last_stats = _layer_stats(gates, out, self.inner.cfg, T, block_offsets)
        project_output = getattr(self.inner, "project_output", None)  # optimized.NSAAttention's: o not kept
        if project_output is not None:
            return project_output(out.o, x.dtype)
        return self.inner.o_proj(out.o.reshape(B, T, -1).to(x.dtype))


def _document_block_offsets(cu_seqlens: Tensor, sel_block: int) -> tuple[Tensor, int]:
    """Per position, the number of selection blocks (Eq. 11 blocks of l' tokens) of the documents before its own,
    and the total: a document-relative block index j becomes a row-wide block id offset + j."""
    starts, ends = cu_seqlens[:-1].long(), cu_seqlens[1:].long()
    blocks = torch.div(ends - starts + sel_block - 1, sel_block, rounding_mode="floor")
    before = torch.cumsum(blocks, 0) - blocks
    doc_of = torch.repeat_interleave(torch.arange(len(blocks), device=blocks.device), ends - starts)
    return before[doc_of], int(blocks.sum())


HIT_MAP_ROWS = 1024  # query rows per slice of the statistics' block map (fewer stores to one byte per slice)
_HIT_OFFSETS = DeviceTables()


def _hit_offsets(B: int, T: int, Hkv: int, n_blocks: int, slices: int, device: torch.device, keep: bool) -> Tensor:
    """[B, T, Hkv, 1] int64: where the blocks of row (b, t, g) start in the statistics' hit map, a map of
    [B * Hkv, slices, n_blocks + 1] bytes (slices of HIT_MAP_ROWS rows; slot 0 of each slice: no block, -1). keep:
    built once per shape and kept (optimized.device_tables), for contiguous rows; a packed batch's block count
    changes from batch to batch, so its offsets are built and dropped."""
    def build() -> Tensor:
        bg = torch.arange(B * Hkv, device=device).view(B, 1, Hkv, 1)
        t = torch.arange(T, device=device).view(1, T, 1, 1) // HIT_MAP_ROWS
        return (bg * slices + t) * (n_blocks + 1) + 1
    return _HIT_OFFSETS.kept((B, T, Hkv, n_blocks, device), device, build) if keep else build()


@torch.no_grad()
def _layer_stats(gates: Tensor, out: NSAOutput, cfg: NSAConfig, T: int,
                 block_offsets: tuple[Tensor, int] | None = None) -> LayerStats:
    g = gates.detach().reshape(-1, 3)
    idx = out.indices.detach()  # [B, T, Hkv, n], -1 padded; packed: document-relative block numbers
    B, _, Hkv, _ = idx.shape
    n_blocks = max(1, -(-T // cfg.sel_block))
    if block_offsets is not None:  # packed: block j of a document is a distinct block from block j of another
        offsets, n_blocks = block_offsets
        idx = torch.where(idx >= 0, idx + offsets[None, :, None, None], idx)
        n_blocks = max(1, n_blocks)
    # Which blocks were hit, by a scatter of ones into a byte map (not a count: a scatter-add serialises on block 0,
    # which every query selects; torch.bincount reads its input's maximum back to the host on CUDA, a sync per
    # layer). Row (b, t, g)'s block j >= 0 is byte j + 1 of slice t // HIT_MAP_ROWS of (b, g), -1 byte 0: the map
    # is sliced along the rows because every row of (b, g) storing to one byte of it made that scatter take ~40 us
    # at 16k rows. Built in place of idx's layout: no transposed copy of the indices.
    slices = -(-T // HIT_MAP_ROWS)
    flat = (idx + _hit_offsets(B, T, Hkv, n_blocks, slices, idx.device, keep=block_offsets is None)).reshape(-1)
    hit = torch.zeros(B * Hkv * slices * (n_blocks + 1), dtype=torch.uint8, device=flat.device).scatter_(0, flat, 1)
    # a block is hit where any slice of (b, g) hit it; the mean over (b, g) of its distinct blocks
    distinct = hit.view(B * Hkv, slices, n_blocks + 1)[:, :, 1:].amax(1).sum(dtype=torch.float32) / (B * Hkv)
    reads = torch.stack([getattr(out.reads, b).detach().sum() for b in BRANCHES])
    return LayerStats(gate_mean=g.mean(0, dtype=torch.float32), gate_max=g.amax(0).float(), distinct_blocks=distinct,
                      reads=reads)


class DecoderBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, nsa: NSAConfig, attention_cls: type[nn.Module], layer_index: int = 0):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        inner = attention_cls(cfg.d_model, nsa, gate_hidden=cfg.gate_hidden, phi_hidden=cfg.phi_hidden,
                              rope_base=cfg.rope_base)
        self.attn = NSALayerAttention(inner, cfg.debug, layer_index, cfg.n_layers)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.mlp_hidden)

    def forward(self, x: Tensor, cu_seqlens: Tensor | None = None, *, recompute_attention: bool = False,
                pending: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The residual stream after the block is x + pending + attention + MLP. Returns (x + pending + attention,
        the MLP's output): the last add is left to whatever normalizes the stream next (the next block's attn_norm
        or the final norm), so that each add and the norm after it run as one kernel (RMSNorm with a delta).
        pending: the previous block's MLP output, not yet added (None: x is the whole stream).
        recompute_attention: backward keeps the stream alone for the attention sublayer and recomputes the rest of
        it (recomputed_attention); the MLP sublayer keeps its activations either way."""
        if recompute_attention:
            if pending is not None:
                x = x + pending
            attended = self.recomputed_attention(x, cu_seqlens)
        else:
            if pending is None:
                normed = self.attn_norm(x)
            else:
                x, normed = self.attn_norm(x, pending)
            attended = self.attn(normed, cu_seqlens=cu_seqlens)
        x, normed = self.mlp_norm(x, attended)
        return x, self.mlp(normed)

    def recomputed_attention(self, x: Tensor, cu_seqlens: Tensor | None = None) -> Tensor:
        """attn(attn_norm(x)) under torch.utils.checkpoint: of everything the sublayer would keep for backward (the
        norm's 1 / rms per row, the projections' inputs, rotated q and k, the branches' k, v and outputs, the
        softmax statistics) only x is kept, and backward runs the sublayer again first. On the kernel path NSA's
        selection and selected branch, the costliest stages to run twice, are not run again: their indices, output
        and statistics are kept from the forward and handed back (optimized.recompute.ForwardTape). The
        recomputation is bitwise the forward: the sublayer draws no random numbers (so no RNG state is saved, which
        a CUDA graph recording the step would not allow) and its kernels are deterministic. The layer statistics
        are the forward's; the recomputation does not compute them again."""
        tape = ForwardTape()

        def sublayer(x: Tensor) -> Tensor:
            with tape.run() as replay:
                return self.attn(self.attn_norm(x), cu_seqlens=cu_seqlens, keep_stats=not replay)

        return checkpoint(sublayer, x, use_reentrant=False, preserve_rng_state=False)


class NSALanguageModel(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab_size: int):
        super().__init__()
        nsa = cfg.nsa_config()
        attention_cls = attention_class(cfg.attention)
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.embed = nn.Embedding(vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(DecoderBlock(cfg, nsa, attention_cls, i) for i in range(cfg.n_layers))
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, vocab_size, bias=False)
        self._init_weights()
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.activation_checkpointing: bool | str = False  # train.activation_checkpointing: False, True, "attention"

    def _init_weights(self) -> None:
        std = 0.02
        nn.init.normal_(self.embed.weight, std=std)
        nn.init.normal_(self.lm_head.weight, std=std)
        for block in self.blocks:
            for lin in (block.mlp.gate_proj, block.mlp.up_proj):
                nn.init.normal_(lin.weight, std=std)
            # GPT-2 style: residual output projections scaled by 1/sqrt(2 * n_layers)
            nn.init.normal_(block.mlp.down_proj.weight, std=std / math.sqrt(2 * self.cfg.n_layers))
            nn.init.normal_(block.attn.inner.o_proj.weight, std=std / math.sqrt(2 * self.cfg.n_layers))

    def forward(self, input_ids: Tensor, cu_seqlens: Tensor | None = None, *, labels: Tensor | None = None,
                loss_mask: Tensor | None = None) -> Tensor:
        """Logits [B, T, vocab] for input ids [B, T]; with cu_seqlens (packed documents, B = 1) every layer keeps
        the documents apart. With labels [B, T] (and an optional 0/1 loss_mask), the mean next-token loss instead:
        the LM head and the cross-entropy run over row chunks (lm_head_loss), so the [B, T, vocab] logits never
        exist at once (4.9 GiB of fp32 logits per 16k tokens at a 50k vocabulary, before their gradient)."""
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        if cu_seqlens is not None:
            check_cu_seqlens(cu_seqlens, input_ids.shape[1], input_ids.shape[0])
        x = self.embed(input_ids)
        recompute = self.activation_checkpointing if self.training and torch.is_grad_enabled() else False
        pending = None  # the last block's MLP output, added to the stream by the next norm (DecoderBlock.forward)
        for block in self.blocks:
            if recompute is True:  # a checkpointed block keeps its input alone: the stream, the pending add made
                if pending is not None:
                    x = x + pending
                x, pending = checkpoint(block, x, cu_seqlens, use_reentrant=False)
            else:
                x, pending = block(x, cu_seqlens, recompute_attention=recompute == "attention", pending=pending)
        x = self.final_norm(x) if pending is None else self.final_norm(x, pending)[1]
        if labels is not None:
            return lm_head_loss(x, self.lm_head.weight, labels, loss_mask)
        if loss_mask is not None:
            raise ValueError("loss_mask needs labels: forward(input_ids, labels=..., loss_mask=...)")
        return self.lm_head(x)

    def layer_stats(self) -> list[LayerStats]:
        stats = [block.attn.last_stats for block in self.blocks]
        if any(s is None for s in stats):
            raise RuntimeError("layer statistics missing: the attention seams were not called in the last forward")
        return stats


def _routed_attention(model: nn.Module) -> list[nn.Module]:
    """The attention modules that choose between the torch path and the kernels (backend, range_backend)."""
    return [m for m in model.modules() if hasattr(m, "backend") and hasattr(m, "range_backend")]


def on_torch_path(model: nn.Module) -> None:
    """Every attention layer of model on the torch path (backend and range_backend "torch"): the path that applies
    the visibility and scoring rules through optimized.masks' seams, where the kernels compute them themselves."""
    for module in _routed_attention(model):
        module.backend = module.range_backend = "torch"


def all_on_torch_path(model: nn.Module) -> bool:
    """Whether every attention layer already runs the torch path ("torch", or "auto" where optimized's dispatch
    would not pick the kernels for the layer's parameters)."""
    from optimized.dispatch import auto_picks_kernels

    def torch_path(module: nn.Module, choice: str) -> bool:
        weight = next(module.parameters())
        return choice == "torch" or (choice == "auto" and not auto_picks_kernels(weight.device, weight.dtype))
    return all(torch_path(m, m.backend) and torch_path(m, m.range_backend) for m in _routed_attention(model))


def build_model(cfg: RunConfig) -> NSALanguageModel:
    return NSALanguageModel(cfg.model, cfg.vocab_size())


def count_parameters(model: nn.Module) -> int:
    """Unique parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def count_parameters_for(cfg: RunConfig) -> int:
    """Parameter count of the model a config describes, built on the meta device (no memory)."""
    with torch.device("meta"):
        model = NSALanguageModel(cfg.model, cfg.vocab_size())
    return count_parameters(model)


def lm_loss(logits: Tensor, labels: Tensor, loss_mask: Tensor | None = None) -> Tensor:
    """Mean next-token cross-entropy in fp32; with loss_mask [B, T] (0/1) only masked-in positions count."""
    flat = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    if loss_mask is None:
        return flat.mean()
    weights, total = _mask_weights(loss_mask)
    return (flat * weights).sum() / total


def _mask_weights(loss_mask: Tensor) -> tuple[Tensor, Tensor]:
    """The fp32 weight of every position (loss_mask flattened) and their sum; ValueError when it selects none."""
    weights = loss_mask.reshape(-1).to(torch.float32)
    total = weights.sum()
    if total.item() == 0:
        raise ValueError("loss_mask selects no position")
    return weights, total


LOSS_CHUNK_ROWS = 4096  # rows of hidden states per chunk of lm_head_loss: 0.4 GiB of bf16 logits at a 50k vocabulary
# (and 0.8 GiB of their fp32 copy on the torch path)
# The head's matmuls see the vocabulary padded with zero rows to a multiple of this: at an odd width (GPT-2's 50257)
# every logits row starts at an odd element offset and cuBLAS falls back to its slow 1-element-aligned kernels.
HEAD_VOCAB_MULTIPLE = 64


class _ChunkedHeadCrossEntropy(torch.autograd.Function):
    """sum_i w_i CE(h_i W^T, y_i) / sum_i w_i over row chunks of h. The loss is the end of the graph, so the
    gradients are computed in forward, chunk by chunk (dlogits = w_i / sum w (softmax - onehot)), and backward only
    scales them: no logits are kept, and no extra matmul is spent recomputing them. The matmuls run on the
    weight padded with zero rows to a multiple of HEAD_VOCAB_MULTIPLE; the padded logits are -inf, so the softmax,
    the loss and the gradients are those of the unpadded vocabulary. fused: each chunk's cross-entropy and dlogits
    on sentinels/head_loss_kernels.py's two kernels (the logits stay in the matmul's dtype), else on torch's
    elementwise kernels over an fp32 copy."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, weights: Tensor, total: Tensor | float,
                compute_dtype: torch.dtype, chunk_rows: int, fused: bool) -> Tensor:
        if fused:
            from .head_loss_kernels import softmax_cross_entropy_
        h = hidden.reshape(-1, hidden.shape[-1])
        vocab = weight.shape[0]
        padded_vocab = -(-vocab // HEAD_VOCAB_MULTIPLE) * HEAD_VOCAB_MULTIPLE
        w = F.pad(weight.to(compute_dtype), (0, 0, 0, padded_vocab - vocab))
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=weight.device)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, h.shape[0], chunk_rows):
                rows = slice(start, start + chunk_rows)
                hc, yc = h[rows].to(compute_dtype), labels[rows]
                ignored = yc == IGNORE_INDEX  # F.cross_entropy's ignore_index: no loss, no gradient, still counted
                yc = yc.masked_fill(ignored, 0)
                wc = weights[rows].masked_fill(ignored, 0) / total
                if fused:  # the same fp32 math in two passes over the logits, kept in the matmul's dtype
                    dlogits = hc @ w.t()
                    loss += softmax_cross_entropy_(dlogits, yc, wc, vocab).sum()
                else:
                    logits = (hc @ w.t()).float()
                    logits[:, vocab:] = float("-inf")  # the padding rows: probability 0, gradient 0
                    lse = torch.logsumexp(logits, dim=-1)
                    target = logits.gather(1, yc[:, None]).squeeze(1)
                    loss += ((lse - target) * wc).sum()
                    dlogits = logits.sub_(lse[:, None]).exp_()  # softmax, in the logits' memory
                    dlogits[torch.arange(yc.shape[0], device=yc.device), yc] -= 1
                    dlogits = (dlogits * wc[:, None]).to(compute_dtype)
                grad_h[rows] = (dlogits @ w).to(h.dtype)
                grad_w += (dlogits.t() @ hc).float()
        ctx.save_for_backward(grad_h.view_as(hidden), grad_w[:vocab])
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_loss.to(grad_h.dtype), (grad_w * grad_loss).to(ctx.weight_dtype), None, None, None, \
            None, None, None


def lm_head_loss(hidden: Tensor, weight: Tensor, labels: Tensor, loss_mask: Tensor | None = None, *,
                 chunk_rows: int = LOSS_CHUNK_ROWS, fused: bool | None = None) -> Tensor:
    """lm_loss(hidden @ weight.T, labels, loss_mask) without the [.., vocab] logits: the head and the fp32
    cross-entropy over chunks of chunk_rows rows. Under autocast the head's matmuls run in the autocast dtype
    as nn.Linear's would; the loss and its softmax are fp32. fused: the cross-entropy of each chunk on two Triton
    kernels (sentinels/head_loss_kernels.py) rather than torch's elementwise kernels; default: on CUDA when Triton
    imports."""
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"labels must have shape {tuple(hidden.shape[:-1])} (hidden's without its last dim), "
                         f"got {tuple(labels.shape)}")
    flat_labels = labels.reshape(-1)
    if loss_mask is None:  # every position counts; the count is a host number (no copy to the device)
        weights = torch.ones(flat_labels.shape, dtype=torch.float32, device=hidden.device)
        total: Tensor | float = float(flat_labels.numel())
    else:
        weights, total = _mask_weights(loss_mask)
    device_type = hidden.device.type
    compute_dtype = (torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type)
                     else torch.promote_types(hidden.dtype, weight.dtype))
    return _ChunkedHeadCrossEntropy.apply(hidden, weight, flat_labels, weights, total, compute_dtype,
                                          max(1, chunk_rows), on_kernels(fused, hidden, "lm_head_loss"))
