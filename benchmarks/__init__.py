"""Benchmarks: ``python -m benchmarks.<name>``; each prints a table and writes CSV + markdown to runs/bench/."""
