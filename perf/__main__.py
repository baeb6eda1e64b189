"""`python -m perf ...`: see perf/cli.py."""

import sys

from .cli import main

sys.exit(main())
