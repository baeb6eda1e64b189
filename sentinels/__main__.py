"""`python -m sentinels run|train|prepare|env`."""

import sys

if sys.argv[1:2] == ["env"]:  # the launch gate's environment guard (sentinels/launch/env.py, docs/runbook.md)
    from .launch.cli import env_main

    sys.exit(env_main(sys.argv[2:]))

from .cli import main  # noqa: E402

sys.exit(main())
