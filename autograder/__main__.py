"""``python -m autograder NOTEBOOK...``: the same as ``nanolab grade``."""

import sys

from autograder.grading.cli import main

sys.exit(main())
