"""optimized.masks.ranked_blocks: the integer-key shortcut ranks exactly as the stable descending sort."""

import pytest
import torch

from optimized.masks import ranked_blocks


def sort_ranked(key: torch.Tensor, k: int) -> torch.Tensor:
    return torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :k]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n_blocks, k", [(1, 1), (7, 3), (64, 16), (1024, 16), (5, 5)])
def test_integer_keys_rank_as_the_stable_sort(dtype, n_blocks, k):
    g = torch.Generator().manual_seed(n_blocks * 31 + k)
    rows = 300
    # few distinct values so ties are everywhere, plus signed zeros, infinities and tiny/huge magnitudes
    palette = torch.tensor([0.0, -0.0, 1.0, -1.0, 2.5, float("inf"), float("-inf"), 1e-30, -1e-30, 3e30, 0.5])
    key = palette[torch.randint(0, len(palette), (rows, n_blocks), generator=g)]
    key[: rows // 2] = torch.randn((rows // 2, n_blocks), generator=g)
    key = key.to(dtype)  # -0.0 ties with +0.0 in the sort, so it must in the shortcut too
    assert torch.equal(ranked_blocks(key, k), sort_ranked(key.float(), k))


def test_float64_keys_keep_the_sort():
    key = torch.tensor([[1.0, 1.0 + 2**-40, 1.0]], dtype=torch.float64)  # differ below float32 precision
    assert ranked_blocks(key, 2).tolist() == [[1, 0]]
