"""Adapter for lucidrains' `native-sparse-attention-pytorch==0.2.3` (module `native_sparse_attention_pytorch`,
class `SparseAttention`, causal=True), written from its public API:

    python -m pytest conformance --properties-only --impl conformance.adapters.lucidrains_nsa:IMPL \
        --preset equal_blocks --set phi=avg --set window_keys=w+1 --set cmp_visibility=strict \
        --set selection_score=logits --set group_reduce=mean

`SparseAttention(dim, dim_head, heads, sliding_window_size, compress_block_size, compress_block_sliding_stride,
selection_block_size, num_selected_blocks, kv_heads, ...)` is a whole attention layer with its own projections:
forward(x [B, T, dim]) -> [B, T, dim]. Its conventions, with the line of native_sparse_attention.py (0.2.3) that
shows each:
- one k/v for the three branches: `q, k, v = self.to_qkv(inp).split(...)` (line 592);
- compressed block i covers tokens (i + 1) d - l .. (i + 1) d - 1, left-padded with zeros (`nn.ZeroPad2d`, line
  272), so for l > d its first blocks are partial: only l = d matches the contract's blocks, and the selection
  scores average l'/d compressed scores per selection block "to improvise" Eq. 9 (line 667): equal blocks
  (l = d = l') is the layout both agree on;
- compressed block i visible to query t iff (i + 1) d - 1 < t: strict visibility (lines 634-637);
- a learned "memory" compressed key/value is always attended (num_compressed_mem_kv >= 1, lines 277, 625);
- selection scores: the scaled logits of the compressed attention (csim, line 639) averaged over the query heads
  of a group (line 660: group_reduce "mean"), then a softmax over the blocks with a -1e3 pad (line 693) - the
  ranking of the logits (selection_score "logits");
- top num_selected_blocks of those (line 713), then only the blocks whose score exceeds 1e-10 are read
  (`fmask = selected_importance_values > 1e-10`, line 742), plus the current block J, always, causally masked
  (lines 757-770): n_init = 0, n_local = 1, n = num_selected_blocks + 1;
- the window is LocalAttention with exact_windowsize=True (line 254), keys [t - w, t]: window_keys "w+1";
- gates: sigmoid(strategy_combine_mlp(x)) per head and branch (line 325), combined as sum_c g_c o_c (line 856);
- RoPE on q and k for the selected and window branches only (line 643), none on the compressed branch;
- computes in the module's dtype (float64 works): precision "inputs".

How the adapter reaches the contract's stages through that API (make_module below is the layer as users build it):
- nsa_forward builds a SparseAttention whose projections pass the contract's inputs through: x carries q, k, v and
  the gates side by side, to_qkv is replaced by taking x's q, k, v columns (no matmul, so a NaN in q stays in q),
  combine_heads gets identity weights; norm=False; the rotary frequencies (its parameter `rotary_emb.freqs`) are
  set to 0, so RoPE is the identity;
- phi: compress_mlp (a constructor argument) is mean pooling (phi="avg"), or the contract's MLP on the block plus
  the contract's position embedding (phi="mlp": the k and v copies, attributes k_compress / v_compress, get the
  contract's two MLPs);
- the gates: its gate network (attribute to_strategy_combine: strategy_combine_mlp then sigmoid, line 325) is
  replaced by the contract's gates, read from x; the library still combines the branches with them (line 856);
- the memory key/value is neutralised: every head gets one extra dimension, 1 in q and 0 in every key, and the
  memory key -1e30 there (its value 0), so its logit is -1e30 and its weight 0 (a query with no visible block
  gets 0, as in the contract); q is scaled by sqrt(D / d_k) so the library's 1/sqrt(D) is the contract's
  1/sqrt(d_k) (D = the padded head dimension, even: the rotary embedding needs an even dimension);
- the branch outputs and the selection are observed, not recomputed: a torch.overrides.TorchFunctionMode records
  the library's `stack([compressed, fine, sliding])` (line 856), its `importance_scores.topk(...)` (line 713) and
  the `> 1e-10` mask of the values it returned (line 742); the reported indices are the blocks it read (top-n
  where the mask holds, then J), ascending, -1 last;
- window_attention: nsa_forward with gates (0, 0, 1), its sliding-window output;
- decode_step: forward(..., return_cache=True) on the prompt (or on the first token when there is none), then
  forward(token, cache=...) per new token (forward_inference, line 338), observed the same way;
- reads: it counts none (reads=None).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from conformance.adapters import Capabilities, NotCovered, Sizes
from reference.config import NSAConfig
from reference.contract import BranchKV, NSAOutput, PhiMLPWeights

VERSION = "0.2.3"
MEMORY_LOGIT = -1e30


class MeanPool(nn.Module):
    """phi = mean pooling of a block: [b, h, w, n, d] -> [b, h, w, d]."""

    def forward(self, blocks: Tensor) -> Tensor:
        return blocks.mean(dim=-2)


class ContractPhi(nn.Module):
    """The contract's phi MLP (reference.contract.PhiMLPWeights) on the first `dim` features of each block of a
    padded head: [b, h, w, n, D] -> [b, h, w, D] (the padding stays 0). Holds the weight tensors themselves, so
    gradients reach them."""

    def __init__(self, weights: PhiMLPWeights, dim: int) -> None:
        super().__init__()
        self.w, self.dim = weights, dim

    def forward(self, blocks: Tensor) -> Tensor:
        w = self.w
        x = (blocks[..., : self.dim] + w.pos).flatten(-2)
        out = torch.nn.functional.silu(x @ w.w1 + w.b1) @ w.w2 + w.b2
        return torch.nn.functional.pad(out, (0, blocks.shape[-1] - self.dim))


class Columns(nn.Module):
    """A projection replaced by the first `width` columns of x: q, k and v reach the layer as given (a Linear with
    an identity block would add 0 * x[other] terms, so a NaN in q would also reach k and v)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width

    def forward(self, x: Tensor) -> Tensor:
        return x[..., : self.width]


class GateColumns(nn.Module):
    """The gate network replaced by the contract's gates: the gate columns of x as [b, heads, n, 3]."""

    def __init__(self, start: int, heads: int) -> None:
        super().__init__()
        self.start, self.heads = start, heads

    def forward(self, x: Tensor) -> Tensor:
        gates = x[..., self.start:self.start + 3 * self.heads]
        return gates.reshape(*x.shape[:2], self.heads, 3).transpose(1, 2)


class Observe(TorchFunctionMode):
    """Records, during the library's forward, the three branch outputs it stacks, the (values, indices) of its
    top-n and the mask of the values it keeps (> 1e-10)."""

    def __init__(self) -> None:
        super().__init__()
        self.branches: list[Tensor] | None = None
        self.top: tuple[Tensor, Tensor] | None = None
        self.kept: Tensor | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.stack and len(args[0]) == 3 and all(t.ndim == 4 for t in args[0]):
            self.branches = list(args[0])
        elif func is torch.Tensor.topk:
            self.top = out
        elif func in (torch.Tensor.gt, torch.Tensor.__gt__) and self.top is not None and args[0] is self.top[0]:
            self.kept = out
        return out


def _head_dim(cfg: NSAConfig) -> int:
    dim = max(cfg.head_dim_qk, cfg.head_dim_v) + 1
    return dim + dim % 2


def _layer(cfg: NSAConfig, phi, dtype, device) -> tuple[nn.Module, int]:
    from native_sparse_attention_pytorch import SparseAttention

    if not cfg.cmp_block == cfg.cmp_stride == cfg.sel_block:
        raise NotCovered("only equal blocks (l = d = l') match: SparseAttention left-pads partial compressed blocks")
    D = _head_dim(cfg)
    Hq, Hkv = cfg.n_heads, cfg.n_kv_heads
    width = (Hq + 2 * Hkv) * D
    layer = SparseAttention(
        dim=width + 3 * Hq, dim_head=D, heads=Hq, kv_heads=Hkv, sliding_window_size=cfg.window,
        compress_block_size=cfg.cmp_block, compress_block_sliding_stride=cfg.cmp_stride,
        selection_block_size=cfg.sel_block, num_selected_blocks=cfg.n_sel - 1, num_compressed_mem_kv=1, causal=True,
        norm=False, compress_mlp=MeanPool(),
    ).to(device=device, dtype=dtype)
    layer.to_qkv = Columns(width)
    layer.to_strategy_combine = GateColumns(width, Hq)
    with torch.no_grad():
        layer.rotary_emb.freqs.zero_()
        layer.combine_heads.weight.zero_()
        layer.combine_heads.weight[: Hq * D] = torch.eye(Hq * D, dtype=dtype, device=device)
        layer.compress_mem_kv.zero_()
        layer.compress_mem_kv[0, ..., -1] = MEMORY_LOGIT
    if cfg.phi == "mlp":
        if phi is None:
            raise ValueError("NSAConfig.phi='mlp' needs phi weights (a PhiWeights); got phi=None")
        layer.k_compress = ContractPhi(phi.k, cfg.head_dim_qk)
        layer.v_compress = ContractPhi(phi.v, cfg.head_dim_v)
    return layer, D


def _layer_input(q: Tensor, k: Tensor, v: Tensor, gates: Tensor, D: int) -> Tensor:
    """x = [q (scaled, padded, 1 in the last dim) | k (padded) | v (padded) | gates], per token."""

    def pad(t: Tensor, last: float = 0.0) -> Tensor:
        out = torch.nn.functional.pad(t, (0, D - t.shape[-1]))
        if last:
            out = out + torch.nn.functional.pad(torch.full_like(t[..., :1], last), (D - 1, 0))
        return out

    q = pad(q * math.sqrt(D / q.shape[-1]), last=1.0)
    return torch.cat([q.flatten(2), pad(k).flatten(2), pad(v).flatten(2), gates.flatten(2)], dim=-1)


def _indices(seen: Observe, T: int, first: int, cfg: NSAConfig, batch: int, device) -> Tensor:
    """The blocks the library read for queries first..first+T-1: its top-n where kept, and J; [B, T, Hkv, n]."""
    J = (torch.arange(first, first + T, device=device) // cfg.sel_block).view(1, T, 1, 1)
    J = J.expand(batch, T, cfg.n_kv_heads, 1)
    if seen.top is None:  # no complete block yet: the library selects nothing but J
        chosen = J
    else:
        top = seen.top[1].permute(0, 2, 1, 3)  # [b, h, i, sel] -> [b, i, h, sel]
        kept = seen.kept.permute(0, 2, 1, 3)
        chosen = torch.cat([torch.where(kept, top, -1), J], dim=-1)
    big = torch.iinfo(torch.int64).max
    chosen = torch.sort(torch.where(chosen < 0, big, chosen.long()), dim=-1).values
    repeat = torch.zeros_like(chosen, dtype=torch.bool)
    repeat[..., 1:] = chosen[..., 1:] == chosen[..., :-1]
    chosen = torch.sort(torch.where(repeat, big, chosen), dim=-1).values
    chosen = torch.where(chosen == big, -1, chosen)
    out = torch.full((batch, T, cfg.n_kv_heads, cfg.n_sel), -1, dtype=torch.int64, device=device)
    width = min(cfg.n_sel, chosen.shape[-1])
    out[..., :width] = chosen[..., :width]
    return out


def _output(seen: Observe, y: Tensor, cfg: NSAConfig, D: int, indices: Tensor) -> NSAOutput:
    B, T = y.shape[:2]
    dv = cfg.head_dim_v

    def heads(t: Tensor) -> Tensor:  # [b, h, n, D] -> [b, n, h, d_v]
        return t.permute(0, 2, 1, 3)[..., :dv]

    o_cmp, o_slc, o_win = (heads(t) for t in seen.branches)
    o = y[..., : cfg.n_heads * D].reshape(B, T, cfg.n_heads, D)[..., :dv]
    return NSAOutput(o=o, indices=indices, o_cmp=o_cmp, o_slc=o_slc, o_win=o_win, reads=None)


def _shared(kv: BranchKV) -> tuple[Tensor, Tensor]:
    k, v = kv.cmp
    if any(kv.branch(b).k is not k or kv.branch(b).v is not v for b in ("slc", "win")):
        raise NotCovered("SparseAttention takes one k/v for all three branches (independent per-branch k/v given)")
    return k, v


def nsa_forward(q: Tensor, kv: BranchKV, gates: Tensor, cfg: NSAConfig, phi=None) -> NSAOutput:
    k, v = _shared(kv)
    layer, D = _layer(cfg, phi, q.dtype, q.device)
    seen = Observe()
    with seen:
        y = layer(_layer_input(q, k, v, gates, D))
    return _output(seen, y, cfg, D, _indices(seen, q.shape[1], 0, cfg, q.shape[0], q.device))


def window_attention(q: Tensor, k: Tensor, v: Tensor, cfg: NSAConfig) -> Tensor:
    """The library's window branch alone: nsa_forward with gates (0, 0, 1), its observed sliding-window output."""
    gates = torch.zeros(*q.shape[:3], 3, dtype=q.dtype, device=q.device)
    gates[..., 2] = 1
    phi = None
    if cfg.phi == "mlp":
        cfg = cfg.replace(phi="avg")  # the window branch does not compress: any phi will do
    return nsa_forward(q, BranchKV.shared(k, v), gates, cfg, phi).o_win


def decode_step(q: Tensor, kv: BranchKV, gates: Tensor, cfg: NSAConfig, phi=None) -> NSAOutput:
    """The last TQ = q.shape[1] of TK positions through the library's cache: the prompt (positions < TK - TQ, or
    the first token when TQ = TK) by forward(return_cache=True), then one forward(token, cache=...) per token."""
    k, v = _shared(kv)
    TK, TQ = k.shape[1], q.shape[1]
    layer, D = _layer(cfg, phi, q.dtype, q.device)
    pad_q = torch.cat([q.new_zeros(q.shape[0], TK - TQ, *q.shape[2:]), q], dim=1)
    pad_g = torch.cat([gates.new_full((gates.shape[0], TK - TQ, *gates.shape[2:]), 0.5), gates], dim=1)
    x = _layer_input(pad_q, k, v, pad_g, D)
    prompt = max(TK - TQ, 1)
    outs = []
    seen = Observe()
    with seen:
        y, cache = layer(x[:, :prompt], return_cache=True)
    if TK == TQ:
        outs.append(_output(seen, y, cfg, D, _indices(seen, 1, 0, cfg, q.shape[0], q.device)))
    for t in range(prompt, TK):
        seen = Observe()
        with seen:
            y, cache = layer(x[:, t:t + 1], cache=cache, return_cache=True)
        outs.append(_output(seen, y, cfg, D, _indices(seen, 1, t, cfg, q.shape[0], q.device)))
    return NSAOutput(*(torch.cat([getattr(o, f) for o in outs], dim=1)
                       for f in ("o", "indices", "o_cmp", "o_slc", "o_win")), reads=None)


def make_module(cfg: NSAConfig, hidden_size: int) -> nn.Module:
    """The layer as a user builds it (its own projections, RoPE, memory key/value and compression MLP), with the
    config's sizes: the black-box protocol checks it through forward(x) only."""
    from native_sparse_attention_pytorch import SparseAttention

    return SparseAttention(
        dim=hidden_size, dim_head=_head_dim(cfg), heads=cfg.n_heads, kv_heads=cfg.n_kv_heads,
        sliding_window_size=cfg.window, compress_block_size=cfg.cmp_block,
        compress_block_sliding_stride=cfg.cmp_stride, selection_block_size=cfg.sel_block,
        num_selected_blocks=cfg.n_sel - 1, causal=True,
    )


IMPL = SimpleNamespace(
    NAME="native-sparse-attention-pytorch",
    CAPABILITIES=Capabilities(
        phi={"avg", "mlp"}, window_keys={"w+1"}, cmp_visibility={"strict"}, selection_score={"logits"},
        group_reduce={"mean"}, block_layout="equal", forced_blocks={(0, 1)}, n_sel=Sizes(minimum=2),
        shared_kv=True, precision="inputs", stages={"nsa_forward", "window_attention", "decode_step", "make_module"},
    ),
    nsa_forward=nsa_forward,
    window_attention=window_attention,
    decode_step=decode_step,
    make_module=make_module,
)
