"""Adapter for fla's NSA (`fla-core==0.6.0`, package `fla`, module `fla.ops.nsa`), written from its public functions:

    python -m pytest conformance --properties-only --impl conformance.adapters.fla_nsa:NAIVE \
        --preset equal_blocks --set phi=avg --set group_reduce=mean      # CPU: the pure-PyTorch reference
    python -m pytest conformance --properties-only --impl conformance.adapters.fla_nsa:PARALLEL --device cuda \
        --preset equal_blocks --set phi=avg                              # CUDA: the Triton parallel_nsa

fla's conventions, with the source line that shows each (fla-core 0.6.0):
- one k/v for the three branches: `naive_nsa(q, k, v, ...)` (naive.py:325) and `parallel_nsa` (parallel.py:837);
- one block size for compression and selection, l = d = l' = `block_size`, phi = mean pooling: `k_cmp, v_cmp =
  mean_pooling(k, block_size, cu_seqlens)` (naive.py:383, parallel.py:908); a pooled block's mean runs over its
  tokens, the last partial block over its partial length (ops/utils/pooling.py:64);
- compressed block c visible to query t iff (c + 1) * block_size - 1 <= t, i.e. inclusive visibility
  (naive.py:171, parallel.py kernel `NC = (i_t + 1) // BS`); a query with no visible block gets 0 (naive.py:175);
- selection scores = the compression softmax probabilities (selection_score "probs"): averaged over the query
  heads of a group in the reference (`scores = probs.mean(dim=2)`, naive.py:277: group_reduce "mean"), summed in
  the Triton kernel (`b_i = tl.sum(b_p, 0)`, parallel.py:150: group_reduce "sum");
- forced blocks 0, J - 1 and J (n_init = 1, n_local = 2) by giving them the finite score 1.0 (naive.py:272-278,
  parallel.py:148), then top-n with n = `block_counts` forced blocks included (naive.py:292); the Triton top-n
  rounds n up to a power of two, S = next_power_of_2(n), and reads every one of the S slots (parallel.py:566, 239);
- selected attention with a causal mask inside each block and -1 padding masked (naive.py:114; parallel.py:262);
- gates are inputs, one [B, T, HQ] tensor per branch, combined as o = g_slc o_slc + g_cmp o_cmp (+ g_swa o_swa)
  (naive.py:407-409);
- the sliding window is flash-attn's `window_size=(window_size - 1, 0)` = keys [t - w + 1, t] (naive.py:419):
  window_keys "w"; it needs flash-attn (not installed on CPU, naive.py:23) and half precision inputs, so the
  adapters declare no window branch (fla's window is flash-attn's, not fla's own code);
- the query heads per KV head must be a power of two >= 16 (naive.py:373, parallel.py:904); the Triton kernels
  also need a key dimension <= 256 (parallel.py:625) and block_size >= 2 * S (parallel.py:570), and head dims of
  at least 16: their forward tiles are the next power of two of d_k and d_v with no floor of 16 (parallel.py:618,
  compression.py:396), and Triton's dot refuses smaller tiles (every call with d_k = 4, d_v = 2 raised a
  CompilationError on an H200);
- arithmetic in float32 whatever the inputs (`x.float()`, naive.py:72, 162): precision "float32". The Triton kernels
  call `tl.dot` on float32 tiles without an input precision (parallel.py, compression.py), so Triton's default
  applies: TF32 on NVIDIA GPUs, 10 mantissa bits, errors near 1e-3 on O(1) outputs.

What the adapter adds, and why:
- `mean_pooling` is a Triton kernel behind an autotuner (ops/utils/pooling.py), which cannot run without a GPU:
  on CPU the adapter pools each block with torch (the same block means, partial last block included) and does not
  expose `compress`, so fla's pooling itself is checked only on CUDA (PARALLEL uses fla's `mean_pooling`);
- `naive_nsa` returns o (and the indices) but not the branch outputs: NAIVE calls the three stages `naive_nsa`
  calls, in its order (naive_nsa_compression, naive_nsa_topk, naive_nsa_selection, naive.py:383-408) and gates
  them as it does; PARALLEL does the same with parallel_nsa_compression, parallel_nsa_topk and parallel_nsa given
  those indices (parallel.py:908-938); float64 inputs reach the Triton kernels in float32 (they compute in float32
  anyway), outputs are cast back;
- PARALLEL asks Triton for IEEE float32 dots (`TRITON_F32_DEFAULT=ieee`, unless the caller set that variable;
  Triton keys its compile cache on it): at TF32 every float32 check would measure TF32 rounding, not NSA. The
  semantic checks do not depend on it;
- fla returns the blocks in score order, some -1 slots in between: the adapter sorts them ascending, -1 last;
- reads: fla counts none (reads=None).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch
from torch import Tensor

from conformance.adapters import Capabilities, NotCovered, Sizes
from reference.config import NSAConfig
from reference.contract import BranchKV, NSAOutput

FLA_VERSION = "0.6.0"


def _check(kv: BranchKV, cfg: NSAConfig) -> tuple[Tensor, Tensor]:
    if not cfg.cmp_block == cfg.cmp_stride == cfg.sel_block:
        raise NotCovered(f"fla has one block size (l = d = l'), got l={cfg.cmp_block}, d={cfg.cmp_stride}, "
                         f"l'={cfg.sel_block}")
    if cfg.phi != "avg":
        raise NotCovered("fla compresses by mean pooling only (phi='avg')")
    if (cfg.n_init, cfg.n_local) != (1, 2):
        raise NotCovered("fla always forces blocks 0, J - 1 and J (n_init=1, n_local=2)")
    k, v = kv.cmp
    if any(kv.branch(b).k is not k or kv.branch(b).v is not v for b in ("slc", "win")):
        raise NotCovered("fla takes one k/v for all three branches (independent per-branch k/v given)")
    return k, v


def _ascending(indices: Tensor) -> Tensor:
    """fla's block indices (score order, -1 anywhere) as the contract's: ascending, -1 last, int64."""
    idx = indices.long()
    big = torch.iinfo(torch.int64).max
    ordered = torch.sort(torch.where(idx < 0, big, idx), dim=-1).values
    return torch.where(ordered == big, -1, ordered)


def block_means(x: Tensor, block: int, cu_seqlens: Tensor | None = None) -> Tensor:
    """The blocks fla's mean_pooling produces, with torch: per sequence (or document of cu_seqlens) ceil(L / block)
    blocks, each the mean of its tokens (the last one over its partial length); [B, N, H, D]."""
    if cu_seqlens is None:
        T = x.shape[1]
        return torch.stack([x[:, s:min(s + block, T)].mean(dim=1) for s in range(0, T, block)], dim=1) if T else \
            x.new_zeros(x.shape[0], 0, *x.shape[2:])
    bounds = cu_seqlens.tolist()
    parts = [x[:, s:min(s + block, e)].mean(dim=1) for a, e in zip(bounds, bounds[1:]) for s in range(a, e, block)]
    return torch.stack(parts, dim=1) if parts else x.new_zeros(x.shape[0], 0, *x.shape[2:])


def _gate(o_slc: Tensor, o_cmp: Tensor, gates: Tensor) -> Tensor:
    """naive_nsa's combination (naive.py:407-409): o = o_slc * g_slc, then + o_cmp * g_cmp."""
    o = o_slc * gates[..., 1].unsqueeze(-1)
    return torch.addcmul(o, o_cmp, gates[..., 0].unsqueeze(-1))


# ------------------------------------------------------------------------------------------------------ CPU
def naive_compressed_attention(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, cfg: NSAConfig) -> Tensor:
    from fla.ops.nsa.naive import naive_nsa_compression

    if not cfg.cmp_block == cfg.cmp_stride:
        raise NotCovered("fla's compressed attention takes non-overlapping blocks (l = d) only")
    return naive_nsa_compression(q, k_cmp, v_cmp, cfg.cmp_block, q.shape[-1] ** -0.5)[0]


def naive_selected_attention(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, cfg: NSAConfig) -> Tensor:
    from fla.ops.nsa.naive import naive_nsa_selection

    return naive_nsa_selection(q, k, v, indices, cfg.sel_block, q.shape[-1] ** -0.5)


def naive_nsa_forward(q: Tensor, kv: BranchKV, gates: Tensor, cfg: NSAConfig, phi=None,
                      cu_seqlens: Tensor | None = None) -> NSAOutput:
    from fla.ops.nsa.naive import naive_nsa_compression, naive_nsa_selection, naive_nsa_topk

    k, v = _check(kv, cfg)
    bs, scale = cfg.sel_block, q.shape[-1] ** -0.5
    k_cmp, v_cmp = block_means(k, bs, cu_seqlens), block_means(v, bs, cu_seqlens)
    o_cmp, _ = naive_nsa_compression(q, k_cmp, v_cmp, bs, scale, cu_seqlens=cu_seqlens)
    indices = naive_nsa_topk(q, k_cmp, cfg.n_sel, bs, scale, cu_seqlens=cu_seqlens)
    o_slc = naive_nsa_selection(q, k, v, indices, bs, scale, cu_seqlens=cu_seqlens)
    return NSAOutput(o=_gate(o_slc, o_cmp, gates), indices=_ascending(indices), o_cmp=o_cmp, o_slc=o_slc,
                     o_win=torch.zeros_like(o_slc), reads=None)


_FLA_SIZES = dict(
    phi={"avg"}, cmp_visibility={"inclusive"}, selection_score={"probs"}, block_layout="equal",
    forced_blocks={(1, 2)}, group_sizes=Sizes(minimum=16, power_of_two=True), shared_kv=True, precision="float32",
)

NAIVE = SimpleNamespace(
    NAME="fla-naive",
    CAPABILITIES=Capabilities(**_FLA_SIZES, window_keys={"w"}, group_reduce={"mean"}, branches={"cmp", "slc"},
                              stages={"nsa_forward", "compressed_attention", "selected_attention"}),
    nsa_forward=naive_nsa_forward,
    compressed_attention=naive_compressed_attention,
    selected_attention=naive_selected_attention,
)


# ----------------------------------------------------------------------------------------------------- CUDA
def parallel_nsa_forward(q: Tensor, kv: BranchKV, gates: Tensor, cfg: NSAConfig, phi=None,
                         cu_seqlens: Tensor | None = None) -> NSAOutput:
    from fla.ops.nsa.compression import parallel_nsa_compression
    from fla.ops.nsa.parallel import parallel_nsa, parallel_nsa_topk
    from fla.ops.utils.pooling import mean_pooling

    k, v = _check(kv, cfg)
    if q.device.type != "cuda":
        raise NotCovered("fla's parallel_nsa runs on CUDA only")
    os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")  # float32 dots in IEEE, not TF32 (module docstring)
    dtype = q.dtype
    if dtype == torch.float64:  # its kernels compute in float32: float64 inputs are passed in float32
        q, k, v, gates = (t.float() for t in (q, k, v, gates))
    bs, scale, TK = cfg.sel_block, q.shape[-1] ** -0.5, k.shape[1]
    k_cmp, v_cmp = mean_pooling(k, bs, cu_seqlens), mean_pooling(v, bs, cu_seqlens)
    o_cmp, lse = parallel_nsa_compression(q, k_cmp, v_cmp, TK, bs, scale, cu_seqlens)
    indices = parallel_nsa_topk(q, k_cmp, TK, lse, cfg.n_sel, bs, scale, cu_seqlens)
    o_slc = parallel_nsa(q, k, v, block_indices=indices, block_counts=cfg.n_sel, block_size=bs, scale=scale,
                         cu_seqlens=cu_seqlens)
    o = _gate(o_slc, o_cmp, gates)
    o, o_cmp, o_slc = (t.to(dtype) for t in (o, o_cmp, o_slc))
    return NSAOutput(o=o, indices=_ascending(indices), o_cmp=o_cmp, o_slc=o_slc, o_win=torch.zeros_like(o_slc),
                     reads=None)


PARALLEL = SimpleNamespace(
    NAME="fla-parallel",
    CAPABILITIES=Capabilities(**_FLA_SIZES, window_keys={"w"}, group_reduce={"sum"}, branches={"cmp", "slc"},
                              block_sizes=Sizes(minimum=16, power_of_two=True), n_sel=Sizes(maximum=8),
                              head_dims_qk=Sizes(minimum=16, maximum=256), head_dims_v=Sizes(minimum=16, maximum=256),
                              stages={"nsa_forward"}),
    nsa_forward=parallel_nsa_forward,
)
