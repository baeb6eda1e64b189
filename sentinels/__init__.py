"""Training harness and sentinels: a small NSA language model, a robust data pipeline, and short runs that must
trip on label leaks, gate collapse and stalls before a long training run is launched (docs/sentinels.md)."""
