"""`python -m sentinels run|train|prepare`."""

import sys

from .cli import main

sys.exit(main())
