"""`python -m tests.faults`: the fault trials' command line (see harness.py)."""

from tests.faults.harness import main

if __name__ == "__main__":
    main()
