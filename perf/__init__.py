"""Benchmarks of NSA against SDPA full attention (issue 8): per-stage and whole-layer timings, useful FLOPs and
compulsory bytes against measured ceilings, CSV/JSON/plots under reports/perf/, and a baseline regression gate.

Entry point: `python -m perf run|report|compare|floors` (perf/cli.py); `nox -s perf` (GPU) and `nox -s perf-cpu`.
"""
