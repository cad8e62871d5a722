"""`python -m infercourse COMMAND ...`: the command line (`infercourse.cli.main`), which the
`infercourse` console script also runs."""
from __future__ import annotations

import sys

from infercourse.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
