"""Benchmarks of verl-hpc pieces; run with `python -m bench NAME [--quick]`."""
