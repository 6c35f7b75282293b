"""`python -m arborlm serve ...`: the same command as the `arborlm` console script."""

import sys

from arborlm.cli import main

if __name__ == "__main__":
    sys.exit(main())
