"""Bug: a module normalises over the batch (a statistic taken over dim 0, e.g. BatchNorm in place of a per-token
norm), so one sequence's output depends on the other sequences it is batched with.

Adapter: only make_module, a module computing optimized.NSAAttention on x minus its mean over the batch.
Caught by: Module level, the black-box batch-row independence (forward(x) only).
"""

from types import SimpleNamespace

import torch

import optimized
from conformance.adapters import EVERYTHING


class MixesBatch(torch.nn.Module):
    def __init__(self, cfg, hidden_size):
        super().__init__()
        self.inner = optimized.NSAAttention(hidden_size, cfg)

    def forward(self, x):
        return self.inner(x - x.mean(dim=0, keepdim=True))


IMPL = SimpleNamespace(NAME="optimized[module_mixes_batch]", CAPABILITIES=EVERYTHING,
                       make_module=MixesBatch)
