"""The sandbox, host side: starting the submission's process (under bubblewrap where it can run) and
calling it, its limits, its processes and its directory. `runtime/` is the only code that runs inside."""
