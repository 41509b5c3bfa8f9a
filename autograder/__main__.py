"""``python -m autograder NOTEBOOK...``: the same as ``nanolab grade``."""

import sys

from autograder.cli import main

sys.exit(main())
