"""Measurements, one script per measurement (see bench/RESULTS.md). A package so that the
scripts that import another bench module run from the repository root as
`python -m bench.NAME`. bench imports dflash (and dflash.testing's builders and prepared
SmolLM2/chitchat), never demo/ or tests/; the demo imports bench.engine_venv."""
