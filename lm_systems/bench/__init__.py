"""Benchmarks: ``python -m lm_systems.bench.<name>``; each prints a table and writes benchmarks/results/."""
