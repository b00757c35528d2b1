"""The test suite. A package, so that its helpers import by name from the repository root:
`tests.builders` (tiny targets, tokenizers, drafter configs, kernel problems) and
`tests.faults` (the fault trials, `python -m tests.faults`)."""
