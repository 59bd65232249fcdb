"""`python -m zephon_stream.cli ...` is the `zephon` command."""

import sys

from zephon_stream.cli.main import main

if __name__ == "__main__":  # spawned worker processes may import this module again: they must not run it
    sys.exit(main())
