"""tests/gpu/conftest.py shares the CPU cores among pytest-xdist workers for torch's CPU threads (the GPU suites'
float64 oracles run on the CPU)."""

from tests.gpu.conftest import worker_threads


def test_each_worker_gets_its_share_of_the_cores_and_at_least_one():
    assert worker_threads(16, 4) == 4
    assert worker_threads(16, 14) == 1
    assert worker_threads(16, 5) == 3
    assert worker_threads(2, 8) == 1
    assert worker_threads(8, 0) == 8  # no workers reported: every core
