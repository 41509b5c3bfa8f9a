"""The processes a sandbox started, as the grader sees them in ``/proc``: their CPU time, and killing
them all.

A sandbox is the tree of processes under the one the grader started. The grader reads that tree
itself, so what the submission's code says about itself plays no part: `cpu_seconds` is what a speed
budget measures, and `kill_tree` is how a sandbox ends. Under bubblewrap the tree is one PID
namespace, which dies whole with its first process; without it, `become_subreaper` keeps the
processes a submission detaches (``fork()`` + ``setsid()``) in the grading worker's tree, so that
`kill_tree` of the worker still finds them.

Linux only; elsewhere the functions do what they can without ``/proc`` (see each).
"""

from __future__ import annotations

import os
import signal
import sys
import time

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, CPU ticks of the process and of its reaped children), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2 :].split()  # the name may hold spaces and parentheses
    return int(fields[1]), sum(int(x) for x in fields[11:15])  # ppid; utime, stime, cutime, cstime


def _parents() -> dict[int, tuple[int, int]]:
    """Every process on the host: pid -> (parent pid, CPU ticks)."""
    out = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if name.isdigit() and (stat := _stat(int(name))) is not None:
            out[int(name)] = stat
    return out


def descendants(root: int) -> list[int]:
    """The processes below ``root`` (not ``root`` itself), parents before their children."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in _parents().items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo += children.get(pid, [])
    return out


def cpu_seconds(root: int) -> float:
    """CPU seconds used by ``root`` and every process below it, living or reaped (all threads).

    Without ``/proc`` (macOS) this is the wall clock, which is all the grader can measure there.
    """
    table = _parents()
    if not table:
        return time.monotonic()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    ticks, todo = 0, [root]
    while todo:
        pid = todo.pop()
        ticks += table.get(pid, (0, 0))[1]
        todo += children.get(pid, [])
    return ticks / _TICK


def _signal(pid: int, parent: int | None) -> None:
    """SIGKILL ``pid`` if it is still the process whose parent is ``parent`` (a pid may be reused)."""
    try:
        if hasattr(os, "pidfd_open"):
            fd = os.pidfd_open(pid)
            try:
                stat = _stat(pid)
                if stat is not None and (parent is None or stat[0] == parent):
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
            finally:
                os.close(fd)
        else:
            os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, OSError):
        pass


def kill_tree(root: int, include_root: bool = True) -> None:
    """SIGKILL every process below ``root`` (until none is left), then ``root`` itself.

    ``root`` must be a child of this process that has not been reaped, so that its pid cannot have
    been reused; it is killed last, because its children leave its tree when it dies.
    """
    for _ in range(50):
        below = descendants(root)
        if not below:
            break
        table = _parents()
        for pid in below:
            _signal(pid, table.get(pid, (None, 0))[0])
        time.sleep(0.005)
    if include_root:
        try:
            os.kill(root, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def become_subreaper() -> bool:
    """Adopt this process's orphaned descendants (Linux), so that they stay in its tree."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        return ctypes.CDLL(None).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def reap() -> None:
    """Collect the exit status of any child that has ended (orphans adopted as a subreaper)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
