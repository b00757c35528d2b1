"""Measurements, one script per measurement (see bench/RESULTS.md). A package so that the
scripts that import the demo's preparation or another bench module run from the repository
root as `python -m bench.NAME`."""
