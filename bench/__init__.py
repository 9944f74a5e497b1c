"""Benchmarks for ckptd against what a user would compare it with: `python -m bench`."""
