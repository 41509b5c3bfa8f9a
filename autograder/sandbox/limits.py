"""The limits a submission's code runs under, and those of the grader's own worker for it.

Every limit here is enforced by the grader or by the kernel, never by the submission's goodwill:
`autograder.sandbox.process` and `autograder.sandbox.runtime.confine` apply those of the sandboxed process, `autograder.grading.session`
the time limits of its calls, `autograder.grading.grade` and `autograder.grading.batch` those of a grading worker.
"""

from __future__ import annotations

from dataclasses import dataclass

# Address space a notebook's code may map on top of the interpreter and its preloaded modules, unless
# its lab asks for more (`LabSpec.memory_mb`) or the instructor sets ``--memory-mb``. The labs' graded
# code works on small inputs and needs far less; a runaway allocation meets MemoryError quickly.
DEFAULT_MEMORY_MB = 1024


@dataclass(frozen=True)
class Limits:
    """Resource limits for one sandboxed process."""

    call_timeout_s: float = 30.0  # wall clock for one proxied call (a test may set another for a block)
    load_timeout_s: float = 60.0  # wall clock to start and run the notebook's cells
    cpu_s: int = 600  # CPU seconds over the process's life (background threads included)
    memory_mb: int | None = None  # address space on top of the interpreter and preloads (None: the lab's)
    file_mb: int = 64  # largest file the process may write
    notebook_s: float = 900.0  # wall clock for all calls into one notebook; later calls fail at once
    confine_writes: bool = True  # Landlock: no writes outside the working directory
    isolate: bool | None = None  # bubblewrap: None where it can run (`isolation.status`); False: never
    disk_mb: int = 128  # the size of the sandbox's tmpfs (under bubblewrap, all it may write)
    disk_files: int = 10_000  # files and folders its tmpfs may hold (under bubblewrap, as root)
    tasks: int = 256  # processes and threads it may have at once (under bubblewrap; and its cgroup's cap)
    cgroup: bool = True  # a cgroup of its own where the grader can make one (`cgroups.status`); False: never
    cpus: float = 1.0  # its cgroup's CPU quota: CPU seconds per wall-clock second, all its processes together
    group_memory_mb: int | None = None  # its cgroup's memory, all processes, tmpfs and shared memory included
    # (None: the address space, the tmpfs, and 1 GB for the interpreter and its preloads)
    grader_memory_mb: int = 3072  # address space a grading worker may map on top of its start
    watchdog: float | None = None  # wall clock for a notebook's grading worker (None: `watchdog_s`)

    @property
    def sandbox_memory_mb(self) -> int:
        """The memory limit of the sandbox's cgroup (see ``group_memory_mb``)."""
        if self.group_memory_mb is not None:
            return self.group_memory_mb
        return (self.memory_mb or DEFAULT_MEMORY_MB) + self.disk_mb + 1024

    @property
    def watchdog_s(self) -> float:
        """Wall clock after which a notebook's grading worker is stopped, whatever it is doing: by
        default the notebook's budget and loading time, and two minutes for the grader's own work."""
        return self.watchdog if self.watchdog is not None else self.notebook_s + self.load_timeout_s + 120.0
