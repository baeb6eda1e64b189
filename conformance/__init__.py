"""The NSA conformance suite: properties of the paper checked against any implementation (docs/adapters.md).

- test_<property>.py: one module per property, each with PROPERTY / EQUATION (the verdict table's rows);
- adapters/: how an implementation is loaded (--impl), NOT COVERED, the worked third-party example;
- rules.py: the suite's own closed-form index rules; strategies.py: hypothesis configs and reproducers;
- verdict.py: the pytest plugin that prints the table, writes reports/conformance/ and checks the baseline;
- selftest/: known-broken variants of optimized that the suite must catch.
Our own kernel and parity tests of `optimized` are not properties: they live in tests/kernels and tests/gpu.
"""
