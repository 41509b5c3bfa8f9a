"""The trusted side's orchestration: grading one notebook and a batch, one submission's session across its
tests, the pytest plugin, results and the feedback safe to print, and the `nanolab grade` command."""
