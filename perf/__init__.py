"""Benchmarks of NSA against SDPA full attention and other NSA libraries: per-stage and whole-layer timings, useful
FLOPs and compulsory bytes against measured ceilings, training throughput against the same model with dense
attention, CSV/JSON/plots under reports/perf/, and a baseline regression gate; the decode bench and kernel probes.

Entry points: `python -m perf run|report|compare|floors|train|train-report|train-profile` (perf/cli.py),
`python -m perf.decode_bench`; `nox -s perf`, `nox -s perf-train` (GPU) and `nox -s perf-cpu`.
"""
