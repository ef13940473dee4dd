"""`python -m slacktier ...`: the same as the `slacktier` command."""

import sys

from slacktier.cli import main

if __name__ == "__main__":
    sys.exit(main())
