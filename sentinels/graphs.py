"""train.cuda_graphs: each micro-step's forward and backward replayed from CUDA graphs.

The NSA layer queues many short kernels (compression, scoring, top-n, three branches, Eq. 5, their backward),
and launching them one by one from Python takes longer than the GPU takes to run them unless the sequence is long:
the device then waits for the host. torch.cuda.make_graphed_callables records the model's loss call (forward)
and its backward once, as two CUDA graphs, and every later micro-step replays them: one launch each, whatever
the number of kernels inside.

What a graph needs, and what this module checks or arranges:
- no host synchronization inside the forward or backward (the kernel path has none: tests/gpu/test_no_host_sync.py);
- the same shapes every micro-step: batches of [micro_batch_size, seq_len] tokens without cu_seqlens (data.packing
  contiguous) and without a loss_mask; a batch of another form runs eagerly, with one warning;
- one process (DDP's gradient all-reduce hooks and FSDP's sharding run outside what a graph can replay);
- autocast without its weight-cast cache (a cached cast made while recording would be reused stale).

Replays compute what the eager step computes, with the same kernels in the same order. The trainer zeroes the
gradients in place between steps (GraphedLoss.zero_grads) instead of dropping them, so replayed backward passes
accumulate into them. The per-layer statistics (NSALayerAttention.last_stats) are tensors written by the recorded
forward, so each replay refreshes them in place; an eager forward in between (an evaluation, a batch the graph
cannot replay) binds new ones, so each replay binds the recorded ones again.
The graphs keep their activations and workspaces in a private memory pool, recorded at the first micro-step.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)


class _LossCall(nn.Module):
    """model(inputs, labels=labels): the loss call with positional tensors, as make_graphed_callables takes it."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, inputs: Tensor, labels: Tensor) -> Tensor:
        return self.model(inputs, labels=labels)


class GraphedLoss:
    """The model's training loss (NSALanguageModel.forward with labels) through CUDA graphs, recorded at the first
    call under `autocast` (a context factory: the trainer's bf16 autocast without its cache, or a null context).
    A micro-batch the graph cannot replay runs eagerly, said once: as a warning, or at info level when `quiet`
    (train.cuda_graphs auto, where the user did not ask for graphs)."""

    def __init__(self, model: nn.Module, autocast: Callable[[], contextlib.AbstractContextManager],
                 quiet: bool = False):
        self.model = model
        self.autocast = autocast
        self.quiet = quiet
        self._call = _LossCall(model)
        self._graphed: nn.Module | None = None
        self._signature: tuple | None = None
        self._stats: list[tuple[nn.Module, object]] = []  # each layer's statistics the recorded forward writes
        self._warned = False

    def zero_grads(self) -> None:
        """Every parameter's .grad set to zeros in place (allocated at the first call), instead of to None.

        A replayed backward hands autograd the gradients in the graph's own output buffers. A parameter whose .grad
        is None takes such a buffer as its .grad (AccumulateGrad keeps an unshared incoming gradient rather than
        copying it), and the next replay overwrites it: with gradient accumulation the earlier micro-steps'
        gradients would be lost. A .grad that exists is added to, in its own memory."""
        grads = []
        for p in self.model.parameters():
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
        torch._foreach_zero_(grads)

    @staticmethod
    def signature(inputs: Tensor, labels: Tensor) -> tuple:
        return tuple((tuple(t.shape), t.dtype, t.device) for t in (inputs, labels))

    def graphable(self, cu_seqlens: Tensor | None, loss_mask: Tensor | None) -> bool:
        return cu_seqlens is None and loss_mask is None

    def __call__(self, inputs: Tensor, labels: Tensor, *, cu_seqlens: Tensor | None = None,
                 loss_mask: Tensor | None = None) -> Tensor:
        signature = self.signature(inputs, labels)
        if not self.graphable(cu_seqlens, loss_mask) or (self._signature not in (None, signature)):
            if not self._warned:
                say = log.info if self.quiet else log.warning
                say("train.cuda_graphs: a micro-batch of another form (shapes %s, cu_seqlens %s, loss_mask %s) than "
                    "the recorded one (%s) runs eagerly", signature[0][0], cu_seqlens is not None,
                    loss_mask is not None, None if self._signature is None else self._signature[0][0])
                self._warned = True
            with self.autocast():
                return self.model(inputs, cu_seqlens, labels=labels, loss_mask=loss_mask)
        if self._graphed is None:
            with self.autocast():
                # allow_unused_input: a parameter without a gradient (e.g. a branch the config turns off) is fine
                self._graphed = torch.cuda.make_graphed_callables(self._call, (inputs, labels),
                                                                  allow_unused_input=True)
            self._signature = signature
            self._stats = [(m, m.last_stats) for m in self.model.modules() if hasattr(m, "last_stats")]
        loss = self._graphed(inputs, labels)
        for module, stats in self._stats:  # an eager forward since (an evaluation, a fallback batch) rebound them
            module.last_stats = stats
        return loss
