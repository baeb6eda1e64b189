"""The trainer's model at a benchmark geometry, with NSA or with dense attention, and the trainer that trains it.

Both models come from `sentinels.trainer.Trainer` for the same `RunConfig`: the same seed and initial weights, the
trainer's AdamW (fused on CUDA, decay / no-decay groups), LR schedule, gradient clipping, bf16 autocast on CUDA, its
data source (synthetic uniform tokens over the configured vocabulary) and its statistics. The NSA model is exactly
what the trainer builds (`model.attention: optimized`, the module's default backend: what a user gets). The dense
model is the same trainer after `use_dense_attention`: every layer's NSA attention is replaced by `DenseAttention`,
which keeps that layer's query, key and value projections (the selection branch's key and value), its RoPE and its
output projection, and attends with causal `scaled_dot_product_attention` with GQA (`enable_gqa=True`). The NSA
parameters a dense model has no use for (the compressed and window branches' projections, the gate MLP, phi) are
dropped from the model and from the optimizer before the first step, so the dense model trains and stores only its
own parameters.

Geometries (GEOMETRIES): `prod-125m` (configs/prod-125m.yaml's model), `paper` (the paper's attention layout, 64 query
heads in 4 KV groups, d_k = d_v = 128, l = 32, d = 16, l' = 64, n = 16, w = 512, phi MLP, in a 2-layer model with the
paper's hidden size 2560 so that a 64k-token step fits one 80 GB card) and `tiny` (configs/tiny-cpu.yaml, the CPU
variant the tests run).
"""

from __future__ import annotations

import contextlib
import inspect
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from optimized.module import cast_once_for_autocast, projected_heads
from reference.config import NSAConfig
from sentinels.config import RunConfig, load_config
from sentinels.model import LayerStats, NSALayerAttention
from sentinels.trainer import Trainer

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
MODELS = ("nsa", "dense")
PAPER_NSA = NSAConfig.preset("paper", head_dim_qk=128, head_dim_v=128)


# --activation-checkpointing's modes: train.activation_checkpointing's values
CHECKPOINTING = {"off": False, "blocks": True, "attention": "attention"}


@dataclass(frozen=True)
class Execution:
    """How the trainer runs one model's steps: train.activation_checkpointing (False, True for whole blocks, or
    "attention": each block's attention sublayer recomputed in backward) and train.cuda_graphs (sentinels/graphs.py)."""

    activation_checkpointing: bool | str = False
    cuda_graphs: bool = False

    def overrides(self) -> dict[str, bool | str]:
        return {"train.activation_checkpointing": self.activation_checkpointing,
                "train.cuda_graphs": self.cuda_graphs}

    def parts(self) -> list[str]:
        """What a report says of a row: nothing for plain eager steps."""
        recompute = {True: "activation checkpointing", "attention": "attention recomputed"}
        return [name for on, name in ((self.activation_checkpointing, recompute.get(self.activation_checkpointing)),
                                      (self.cuda_graphs, "CUDA graphs")) if on]


@dataclass(frozen=True)
class Geometry:
    """A model shape to benchmark: a run config of configs/ with dotted overrides (RunConfig.replace keys)."""

    name: str
    config: str  # file name under configs/
    overrides: tuple[tuple[str, Any], ...]
    description: str

    def run_config(self, *, seq_len: int, micro_batch: int, grad_accum: int, steps: int, device: str, out_dir: Path,
                   execution: Execution = Execution()) -> RunConfig:
        """The config of one benchmark case: synthetic uniform tokens over the model's vocabulary, no warm-up of the
        learning rate (the schedule does not change the work of a step), no checkpoints, monitors that never fire on
        a benchmark (a first step that compiles kernels is not a stall; a dense model has no gates)."""
        base = load_config(CONFIGS / self.config)
        vocab = base.vocab_size()
        changes = dict(self.overrides)
        changes.update({
            "data.source": "synthetic", "data.packing": "contiguous", "data.synthetic.task": "uniform",
            "data.synthetic.vocab_size": vocab, "train.seq_len": seq_len, "train.micro_batch_size": micro_batch,
            "train.grad_accum": grad_accum, "train.steps": steps, "train.warmup_steps": 0, "train.save_every": 0,
            "train.device": device, "train.out_dir": str(out_dir), **execution.overrides(),
            "monitors.halt_on_event": False, "monitors.gate_collapse.steps": 10**9,
            "monitors.watchdog.heartbeat_stall_s": 10.0**7,
        })
        return base.replace(**changes)


GEOMETRIES: dict[str, Geometry] = {g.name: g for g in (
    Geometry("prod-125m", "prod-125m.yaml", (),
             "configs/prod-125m.yaml: 12 layers, d_model 768, SwiGLU 2048, 12 query heads in 2 KV groups, "
             "d_k = d_v = 64, l=32 d=16 l'=64 n=16 w=512, phi MLP, GPT-2 vocabulary, bf16"),
    Geometry("paper", "prod-125m.yaml",
             (("model.d_model", 2560), ("model.n_layers", 2), ("model.mlp_hidden", 6912),
              ("model.nsa", PAPER_NSA.to_dict())),
             "the paper's attention layout: 64 query heads in 4 KV groups, d_k = d_v = 128, l=32 d=16 l'=64 n=16 "
             "w=512, phi MLP; 2 layers, d_model 2560, SwiGLU 6912, GPT-2 vocabulary, bf16"),
    Geometry("tiny", "tiny-cpu.yaml", (),
             "configs/tiny-cpu.yaml: 2 layers, d_model 64, 4 query heads in 2 KV groups, d = 16 (CPU, fp32)"),
)}


def geometry(name: str) -> Geometry:
    if name not in GEOMETRIES:
        raise ValueError(f"unknown geometry {name!r}; known: {sorted(GEOMETRIES)}")
    return GEOMETRIES[name]


class DenseAttention(nn.Module):
    """Causal SDPA with GQA in place of one layer's NSA: the NSA module's q projection, its selection branch's k and v
    projections (one matmul, as NSAAttention.project runs its projections), RoPE on q and k as NSAAttention.project
    applies it, and its output projection.

    `last_stats` is a constant LayerStats of zeros (a dense layer has no gates, selections or counted reads), so the
    trainer's per-step statistics run unchanged. On CUDA the call is restricted to the fused SDPA kernels (flash
    attention is the one with GQA), never the O(T^2)-memory math kernel; where no fused kernel takes enable_gqa, k and
    v are expanded to the query heads instead and `sdpa_backend` (shown in the reports) says so."""

    def __init__(self, nsa: NSALayerAttention):
        super().__init__()
        inner = nsa.inner
        cfg: NSAConfig = inner.cfg
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = inner.q_proj, inner.k_slc_proj, inner.v_slc_proj, \
            inner.o_proj
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim_qk, self.head_dim_v = cfg.head_dim_qk, cfg.head_dim_v
        self.rope_base = inner.rope_base
        device = self.q_proj.weight.device
        self.sdpa_backend = "fused kernels, enable_gqa" if device.type == "cuda" else "torch CPU kernel, enable_gqa"
        zeros3 = torch.zeros(3, device=device)
        self.last_stats = LayerStats(gate_mean=zeros3, gate_max=zeros3, distinct_blocks=torch.zeros((), device=device),
                                     reads=torch.zeros(3, dtype=torch.int64, device=device))

    def project(self, x: Tensor, position_offset: int = 0) -> tuple[Tensor, Tensor, Tensor]:
        """q [B, T, Hq, dk] and k [B, T, Hkv, dk] rotated, v [B, T, Hkv, dv], with the kernels NSAAttention.project
        uses for its own: one matmul over the concatenated q, k and v weights (x cast once under autocast), the parts
        taken apart by module.projected_heads (on the kernel path q and k rotated in one RoPE launch, v copied out of
        the matmul's output, the parts' gradients written into the matmul's). A dense layer with three matmuls would
        add three input gradients in backward, work the NSA layer does not do."""
        Hq, Hkv, dk, dv = self.n_heads, self.n_kv_heads, self.head_dim_qk, self.head_dim_v
        x = cast_once_for_autocast(x)
        y = F.linear(x, torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]))
        return projected_heads(y, (Hq, Hkv), dk, (Hkv,), dv, self.rope_base, position_offset)

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Causal SDPA with GQA in [B, H, T, D] layout; returns [B, T, Hq, dv]."""
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if not q.is_cuda:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return o.transpose(1, 2)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
        if self.sdpa_backend == "fused kernels, enable_gqa":
            try:
                with sdpa_kernel(fused):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
            except RuntimeError:  # no fused kernel takes GQA on this build: expand k/v (said in the report)
                self.sdpa_backend = "fused kernels, k/v expanded to the query heads (no fused GQA kernel)"
        group = self.n_heads // self.n_kv_heads
        k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
        with sdpa_kernel(fused):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)

    def forward(self, x: Tensor, position_offset: int = 0, *, cu_seqlens: Tensor | None = None,
                keep_stats: bool = True) -> Tensor:
        """keep_stats: NSALayerAttention's keyword; the statistics here are constant."""
        if cu_seqlens is not None:
            raise ValueError("DenseAttention runs contiguous windows only (the benchmark's data.packing contiguous)")
        B, T, _ = x.shape
        o = self.attend(*self.project(x, position_offset))
        return self.o_proj(o.reshape(B, T, -1))


def use_dense_attention(trainer) -> None:
    """Replace every layer's NSA attention of the trainer's model by DenseAttention, before its first step, and drop
    the parameters the dense model no longer has from the trainer's optimizer (its state is still empty)."""
    if trainer.optimizer.state:
        raise ValueError("use_dense_attention: the optimizer has already stepped; swap attention before training")
    for block in trainer.model.blocks:
        block.attn = DenseAttention(block.attn)
    kept = {id(p) for p in trainer.model.parameters()}
    for group in trainer.optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) in kept]


def attention_path(model: nn.Module) -> dict[str, Any]:
    """How the model's attention is configured: the attention class of the first layer and every `*backend*`
    attribute it holds (the backend switches it hands to the functional NSA; their defaults when unset), so a
    report says which path a user of this module gets."""
    attn = model.blocks[0].attn
    module = attn.inner if isinstance(attn, NSALayerAttention) else attn
    out: dict[str, Any] = {"class": f"{type(module).__module__}.{type(module).__name__}"}
    out.update({name: value for name, value in sorted(vars(module).items())
                if "backend" in name and isinstance(value, (str, type(None)))})
    if isinstance(attn, NSALayerAttention):
        out["nsa_forward_defaults"] = _keyword_defaults(module)
    return out


def _keyword_defaults(module: nn.Module) -> dict[str, Any]:
    """The backend keywords' defaults of the functional NSA the module's package exports (optimized.nsa_forward)."""
    import importlib

    package = importlib.import_module(type(module).__module__.split(".")[0])
    fn: Callable | None = getattr(package, "nsa_forward", None)
    if fn is None:
        return {}
    return {name: p.default for name, p in inspect.signature(fn).parameters.items()
            if "backend" in name and p.default is not inspect.Parameter.empty}


def count_parameters(model: nn.Module) -> int:
    """Unique parameters of the model (tied weights once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step of `tokens` tokens is cut at one sequence length: micro_batch sequences per micro-step,
    grad_accum micro-steps."""

    seq_len: int
    micro_batch: int
    grad_accum: int

    @property
    def tokens(self) -> int:
        return self.seq_len * self.micro_batch * self.grad_accum


def batch_plan(seq_len: int, tokens_per_step: int, micro_tokens: int) -> BatchPlan:
    """Sequences of seq_len tokens making tokens_per_step tokens per optimizer step, at most micro_tokens tokens per
    micro-step (but at least one sequence), the rest by gradient accumulation."""
    if tokens_per_step % seq_len:
        raise ValueError(f"--tokens-per-step {tokens_per_step} is not a multiple of seq_len {seq_len}")
    sequences = tokens_per_step // seq_len
    micro = max(1, min(sequences, micro_tokens // seq_len))
    while sequences % micro:
        micro -= 1
    return BatchPlan(seq_len, micro, sequences // micro)


@contextlib.contextmanager
def trainer_for(geom: Geometry, model: str, plan: BatchPlan, *, steps: int, device: torch.device,
                step_hook: Callable[[Trainer, int], None] | None = None,
                execution: Execution = Execution()) -> Iterator[Trainer]:
    """The trainer of one benchmark case (run directory in a temporary folder, removed afterwards), its model
    switched to DenseAttention for model="dense"; closed on exit."""
    if model not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {model!r}")
    with tempfile.TemporaryDirectory(prefix="perf-train-") as run_dir:
        cfg = geom.run_config(seq_len=plan.seq_len, micro_batch=plan.micro_batch, grad_accum=plan.grad_accum,
                              steps=steps, device=device.type, out_dir=Path(run_dir),
                              execution=execution)
        trainer = Trainer(cfg, console=False, save_checkpoints=False, step_hook=step_hook)
        try:
            if model == "dense":
                use_dense_attention(trainer)
            yield trainer
        finally:
            trainer.close()
