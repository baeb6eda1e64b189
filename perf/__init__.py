"""perf package (in progress)."""
