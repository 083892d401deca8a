"""`python -m evaluation`: the dflash-eval command (evaluation/cli.py)."""

import sys

from evaluation.cli import main

sys.exit(main())
