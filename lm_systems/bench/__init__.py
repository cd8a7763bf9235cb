"""Benchmarks: ``python -m lm_systems.bench.<name>``; each prints a table and writes CSV + markdown to runs/bench/."""
