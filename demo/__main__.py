"""`python -m demo prepare RUN_DIR [--quick]` / `python -m demo evaluate JOB.toml` (see demo.job)."""

import sys

from demo.job import main

sys.exit(main())
