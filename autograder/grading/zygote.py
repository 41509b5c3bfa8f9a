"""What the grading workers' fork server imports, once, before it forks the first worker.

A worker (`autograder.grading.batch`) is forked from that server rather than started afresh, so it begins with
the grader, pytest and every lab's big modules (torch, numpy, nanolab's engine and server) already imported,
instead of spending two to three seconds of CPU importing them again for each notebook. Each worker is still a
process of its own: nothing one notebook does to its worker reaches the server or the next worker.

Only the fork server imports this module (multiprocessing's preload). Importing it also makes that process
undumpable on Linux, as every worker makes itself, so that no other process of the same user can ptrace the
server and, through it, reach the workers it forks later.
"""

from __future__ import annotations

import contextlib
import importlib

from autograder.grading import grade, plugin  # noqa: F401 - the grader, and pytest with the grader's plugin
from autograder.submission.labs import LABS

grade._not_dumpable()

for _spec in LABS.values():
    for _module in (*_spec.preload, *_spec.grader_preload):
        with contextlib.suppress(ImportError):  # the worker says what is missing, where it needs it
            importlib.import_module(_module)
