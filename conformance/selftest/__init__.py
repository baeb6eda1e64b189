"""Self-test of the conformance suite: deliberately broken variants of `optimized` (variants/) must each make at
least one property FAIL, and the unbroken `optimized` must pass (test_selftest.py)."""
