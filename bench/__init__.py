"""Benchmarks: figures, not tests. Each script prints a table and writes bench/results/."""
