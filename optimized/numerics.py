"""Numeric constants and the query chunking shared by the torch path and the kernels.

The dtype arithmetic runs in (compute_dtype) is decided with the backend, in optimized.dispatch.
"""

from __future__ import annotations

LOG2E = 1.4426950408889634  # log2(e): the kernels keep softmax statistics in base 2 (exp(x) = 2^(x * log2(e)))
LN2 = 0.6931471805599453  # ln(2): base-2 log-sum-exp back to the natural log

# Elements of one query chunk's largest temporary on the torch path (logits, or gathered keys+values): bounds the
# peak memory per chunk.
CHUNK_ELEMENTS = 1 << 26


def query_chunks(n_queries: int, chunk_size: int) -> list[tuple[int, int]]:
    """[q0, q1) row ranges of chunk_size rows covering 0..n_queries-1 (the last one shorter)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of query positions, got {chunk_size}")
    return [(s, min(s + chunk_size, n_queries)) for s in range(0, n_queries, chunk_size)]


def auto_chunk_size(n_queries: int, elements_per_query: int) -> int:
    """The most query positions whose per-query temporaries stay within CHUNK_ELEMENTS."""
    return max(1, min(max(n_queries, 1), CHUNK_ELEMENTS // max(1, elements_per_query)))
