"""The test suite. A package, so that the fault trials run from the repository root as
`python -m tests.faults` and import each other by name. Nothing outside tests/ imports from it:
the builders that tests, bench and the demo share are `dflash.testing`."""
