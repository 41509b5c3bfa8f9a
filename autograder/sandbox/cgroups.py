"""Each sandbox in a cgroup of its own: a CPU weight and quota, a memory limit, and a cap on processes.

Resource limits (`autograder.sandbox.runtime.confine`) hold per process, and a submission can step around
them: every process it starts in a session of its own gets a scheduling group of its own, so two dozen of
them take CPU from the notebooks graded beside it; and an address-space limit does not count memory held
outside the process's mappings (files on a tmpfs, memfd and SysV shared memory) or by its children. A
cgroup counts all of it, for every process in it.

The group is made beneath the cgroup the grader itself runs in, and the sandbox's first process joins it
before bubblewrap starts (`Group.join`, run between fork and exec), so everything the submission starts is
in it. Two layouts are known:

- the unified (v2) hierarchy, where the grader's cgroup offers the ``cpu``, ``memory`` and ``pids``
  controllers and can hand them down (``cpu.weight``, ``cpu.max``, ``memory.max``, ``memory.swap.max``,
  ``pids.max``);
- otherwise the v1 ``cpu``, ``memory`` and ``pids`` hierarchies (``cpu.shares``, ``cpu.cfs_quota_us``,
  ``memory.limit_in_bytes``, ``memory.memsw.limit_in_bytes``, ``pids.max``).

Either way the memory limit counts the pages of a tmpfs and of shared memory the group's processes
create, and (on current kernels) the kernel memory behind their files and inodes. Where neither layout
can be written (a grader that is not root and has no delegated cgroup, a container without the
controllers), sandboxes run without one and `status` says so, for ``nanolab info`` and every grading run.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

CONTROLLERS = ("cpu", "memory", "pids")
PERIOD_US = 100_000  # the CPU quota's period


@dataclass(frozen=True)
class Budget:
    """What one sandbox's cgroup allows its processes, all of them together."""

    memory_mb: int  # resident memory, tmpfs and shared memory pages, kernel memory of its files
    cpus: float  # CPU time per wall-clock second (1.0: one core's worth)
    tasks: int  # processes and threads at once
    weight: int = 100  # its CPU share against the grader's other groups and processes (v2's scale)


@dataclass(frozen=True)
class Status:
    """Whether sandboxes get a cgroup of their own here: the layout used, or why not."""

    available: bool
    kind: str = ""  # "v2" or "v1"
    reason: str = ""  # why not, when not available
    roots: tuple[str, ...] = field(default=(), repr=False)  # where the groups are made: one dir per hierarchy

    def describe(self) -> str:
        """One line for ``nanolab info`` and every grading run."""
        if self.available:
            return (
                f"cgroups: {self.kind} (one per sandbox, under {self.roots[0]}"
                + (" and its v1 siblings" if self.kind == "v1" else "")
                + "): CPU weight and quota, a memory limit counting tmpfs and shared memory, a process cap"
            )
        return (
            f"cgroups: NONE ({self.reason}): a submission's processes are limited one by one, so many of "
            "them can slow the notebooks graded beside it, and memory outside their mappings (tmpfs files, "
            "shared memory) is not counted; grade as root, or give the grader a delegated cgroup"
        )


class Group:
    """One sandbox's cgroup: a directory in each hierarchy used."""

    def __init__(self, dirs: list[Path]) -> None:
        self.dirs = dirs
        self._procs = [str(d / "cgroup.procs") for d in dirs]

    def join(self) -> None:
        """Move the calling process into the group. Runs in the child between fork and exec, so it uses
        bare system calls only."""
        for path in self._procs:
            fd = os.open(path, os.O_WRONLY)
            try:
                os.write(fd, b"0")  # 0: the process that writes
            finally:
                os.close(fd)

    def pids(self) -> set[int]:
        """The processes in the group now."""
        found: set[int] = set()
        for path in self._procs:
            try:
                found |= {int(p) for p in Path(path).read_text().split()}
            except OSError:
                pass
        return found

    def memory_peak_mb(self) -> float | None:
        """The most memory the group has held (None where the hierarchy does not say)."""
        for d in self.dirs:
            for name in ("memory.peak", "memory.max_usage_in_bytes"):
                try:
                    return int((d / name).read_text()) / 2**20
                except (OSError, ValueError):
                    continue
        return None

    def remove(self) -> None:
        """Remove the group once its processes are gone (the caller has killed them; their exit may take a
        moment to reach the cgroup)."""
        for d in self.dirs:
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)


def create(budget: Budget) -> Group | None:
    """A fresh cgroup for one sandbox with ``budget`` applied, or None where cgroups cannot be had."""
    known = status()
    if not known.available:
        return None
    name = f"nanolab-sandbox-{os.getpid()}-{secrets.token_hex(4)}"
    dirs = [Path(root) / name for root in known.roots]
    group = Group(dirs)
    try:
        for d in dirs:
            d.mkdir()
        _apply(known.kind, dirs, budget)
    except OSError:
        group.remove()
        raise
    return group


def _apply(kind: str, dirs: list[Path], budget: Budget) -> None:
    quota = max(1000, int(budget.cpus * PERIOD_US))
    memory = str(budget.memory_mb << 20)
    if kind == "v2":
        (d,) = dirs
        (d / "cpu.weight").write_text(str(budget.weight))
        (d / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        (d / "memory.max").write_text(memory)
        if (d / "memory.swap.max").exists():
            (d / "memory.swap.max").write_text("0")
        (d / "pids.max").write_text(str(budget.tasks))
        return
    cpu, mem, pids = dirs
    (cpu / "cpu.shares").write_text(str(max(2, budget.weight * 1024 // 100)))
    (cpu / "cpu.cfs_period_us").write_text(str(PERIOD_US))
    (cpu / "cpu.cfs_quota_us").write_text(str(quota))
    (mem / "memory.limit_in_bytes").write_text(memory)
    if (mem / "memory.memsw.limit_in_bytes").exists():  # memory and swap together: no escape to swap
        (mem / "memory.memsw.limit_in_bytes").write_text(memory)
    (pids / "pids.max").write_text(str(budget.tasks))


# ---------------------------------------------------------------------------------------------- discovery


_status: list[Status] = []
_lock = threading.Lock()


def status() -> Status:
    """Whether sandboxes get a cgroup here (found once per process, by making and removing a trial group)."""
    with _lock:
        if not _status:
            _status.append(_check())
        return _status[0]


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(root, mount point, file system type, super options) of each cgroup mount this process sees."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
                found.append((fields[3], fields[4], tail[0], set(tail[2].split(","))))
    return found


def _own_paths() -> dict[str, str]:
    """The grader's cgroup in each hierarchy: controller (or "" for the unified one) -> path."""
    paths = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                paths[c] = path
    return paths


def _where(mount_root: str, mount_point: str, path: str) -> Path | None:
    """The directory of cgroup ``path`` under a mount of the hierarchy's ``mount_root``."""
    if path != mount_root and not path.startswith(mount_root.rstrip("/") + "/"):
        return None
    return Path(mount_point) / os.path.relpath(path, mount_root)


def _v2_root(mounts, own) -> tuple[Path | None, str]:
    v2 = [(root, point) for root, point, kind, _ in mounts if kind == "cgroup2"]
    if not v2 or "" not in own:
        return None, "no unified (v2) hierarchy"
    d = _where(*v2[0], own[""])
    if d is None:
        return None, "the grader's v2 cgroup is outside the mounted hierarchy"
    offered = (
        set((d / "cgroup.controllers").read_text().split()) if (d / "cgroup.controllers").exists() else set()
    )
    missing = [c for c in CONTROLLERS if c not in offered]
    if missing:
        return None, f"the unified (v2) hierarchy offers no {'/'.join(missing)} controller here"
    enabled = set((d / "cgroup.subtree_control").read_text().split())
    try:
        for c in CONTROLLERS:
            if c not in enabled:
                (d / "cgroup.subtree_control").write_text(f"+{c}")
    except OSError as e:
        return None, f"cannot hand the v2 controllers down from {d} ({e.strerror})"
    return d, ""


def _v1_roots(mounts, own) -> tuple[list[Path], str]:
    dirs = []
    for c in CONTROLLERS:
        mount = next(
            ((root, point) for root, point, kind, opts in mounts if kind == "cgroup" and c in opts), None
        )
        if mount is None or c not in own:
            return [], f"no v1 {c} hierarchy"
        d = _where(*mount, own[c])
        if d is None:
            return [], f"the grader's v1 {c} cgroup is outside the mounted hierarchy"
        dirs.append(d)
    return dirs, ""


def _check() -> Status:
    try:
        mounts, own = _mounts(), _own_paths()
    except OSError as e:
        return Status(False, reason=f"cgroups cannot be read ({e.strerror})")
    reasons = []
    v2, why = _v2_root(mounts, own)
    candidates = [("v2", [v2])] if v2 is not None else []
    reasons.append(why)
    v1, why = _v1_roots(mounts, own)
    if v1:
        candidates.append(("v1", v1))
    reasons.append(why)
    for kind, roots in candidates:
        trial = Status(True, kind, roots=tuple(map(str, roots)))
        dirs = [r / f"nanolab-trial-{os.getpid()}-{secrets.token_hex(4)}" for r in roots]
        try:
            for d in dirs:
                d.mkdir()
            _apply(kind, dirs, Budget(memory_mb=64, cpus=1.0, tasks=8))
            return trial
        except OSError as e:
            reasons.append(f"cannot make a {kind} cgroup under {roots[0]} ({e.strerror})")
        finally:
            Group(dirs).remove()
    return Status(False, reason="; ".join(r for r in reasons if r))
