"""`python -m sentinels.launch env|config|preflight|launch`."""

import sys

from .cli import main

sys.exit(main())
