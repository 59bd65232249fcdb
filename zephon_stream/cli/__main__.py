"""`python -m zephon_stream.cli ...` is the `zephon` command."""

import sys

from zephon_stream.cli.main import main

sys.exit(main())
