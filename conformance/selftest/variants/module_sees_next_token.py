"""Bug: a module's own projections read the next token (a causal shift applied the wrong way, e.g. a token-shift
or convolution padded on the right), so output t depends on x[t + 1] although the attention itself is causal.

Adapter: only make_module, a module computing optimized.NSAAttention on x + 0.5 x shifted one step back in time
(x[t + 1] added at t).
Caught by: No peeking, the black-box module (forward(x) only).
"""

from types import SimpleNamespace

import torch

import optimized
from conformance.adapters import EVERYTHING


class SeesNextToken(torch.nn.Module):
    def __init__(self, cfg, hidden_size):
        super().__init__()
        self.inner = optimized.NSAAttention(hidden_size, cfg)

    def forward(self, x):
        ahead = torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], dim=1)
        return self.inner(x + 0.5 * ahead)


IMPL = SimpleNamespace(NAME="optimized[module_sees_next_token]", CAPABILITIES=EVERYTHING,
                       make_module=SeesNextToken)
