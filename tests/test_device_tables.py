"""optimized.device_tables.DeviceTables: a value is built once per key and kept (the same object back), the
store keeps only its last `size` keys, a value first asked for under inference mode is an ordinary tensor (a later
training step can save it for backward), and a value built while a CUDA graph is being captured is not kept."""

from __future__ import annotations

import pytest
import torch

from optimized.device_tables import DeviceTables


def test_built_once_per_key_and_only_the_last_ones_kept() -> None:
    tables = DeviceTables(size=2)
    builds = []

    def build(value):
        return lambda: builds.append(value) or torch.tensor([value])

    cpu = torch.device("cpu")
    a = tables.kept("a", cpu, build(1))
    assert tables.kept("a", cpu, build(99)) is a and builds == [1]
    tables.kept("b", cpu, build(2))
    tables.kept("a", cpu, build(99))  # a is the most recent again
    tables.kept("c", cpu, build(3))  # b, the least recent, goes
    assert builds == [1, 2, 3]
    assert tables.kept("a", cpu, build(99)) is a
    assert int(tables.kept("b", cpu, build(4))) == 4 and builds == [1, 2, 3, 4]
    tables.clear()
    assert int(tables.kept("a", cpu, build(5))) == 5


def test_a_table_first_made_under_inference_mode_serves_training() -> None:
    from optimized.kernels.rope import contiguous_rope_tables, project_heads

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the interpreter runs on CPU hosts only
    with torch.inference_mode():
        tables = contiguous_rope_tables(5, 3, 4, 100.0, torch.float32, device)
    assert not any(t.is_inference() for t in tables)
    y = torch.randn(1, 5, 12, device=device, requires_grad=True)
    q, v = project_heads(y, tables, (2,), 4, (1,), 4)
    (q.sum() + v.sum()).backward()  # saving the tables for backward raises for inference tensors
    assert y.grad is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU")
def test_not_kept_when_built_during_a_capture() -> None:
    tables = DeviceTables()
    cuda = torch.device("cuda")
    kept_before = tables.kept("before", cuda, lambda: torch.ones(4, device=cuda))
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        assert tables.kept("before", cuda, lambda: pytest.fail("kept before the capture")) is kept_before
        during = tables.kept("during", cuda, lambda: torch.arange(4, device=cuda))
    graph.replay()
    torch.cuda.synchronize()
    again = tables.kept("during", cuda, lambda: torch.arange(4, device=cuda) + 10)
    assert again is not during and again.tolist() == [10, 11, 12, 13]
