"""How the sandboxed process confines itself before it runs a submission's code.

Three layers, all applied by the process to itself (so they hold for everything it later runs,
children included), inside bubblewrap's sandbox where the grader could start one
(`autograder.sandbox.isolation`) and on their own where it could not:

- resource limits: address space, CPU seconds, written file size, no core files, and under bubblewrap
  the number of processes and threads (`apply_limits`);
- Landlock, where the Linux kernel has it: no writes outside one directory, no ptrace of other
  processes, and (Landlock ABI 6, Linux 6.12+) no signals to processes outside the sandbox (`confine`);
- an import blocker for the reference modules of the lab being graded (`block_imports`): under
  bubblewrap they are absent anyway and it only says why; without it, it is all there is.

Deliberately left out here: namespaces (bubblewrap's part) and seccomp.
"""

from __future__ import annotations

import ctypes
import importlib.abc
import os
import resource
import sys
from typing import Any


def _vm_bytes() -> int:
    """The process's current address-space size, read from /proc (0 where there is no /proc)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def apply_limits(memory_mb: int, cpu_s: int, file_mb: int, tasks: int = 0) -> None:
    """Cap address space (on top of what is mapped now), CPU seconds, written file size and, when
    ``tasks`` is given, processes and threads (in a user namespace of its own, they count its own only).

    A limit the platform refuses is skipped (macOS, for one, does not enforce RLIMIT_AS); the
    grader's wall-clock limits still hold.
    """

    def cap(which: int, value: int, hard_extra: int = 0) -> None:
        _, hard = resource.getrlimit(which)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        try:
            resource.setrlimit(which, (value, value + hard_extra))
        except (ValueError, OSError):
            pass

    cap(resource.RLIMIT_CORE, 0)
    cap(resource.RLIMIT_CPU, cpu_s, hard_extra=5)  # SIGXCPU at the soft limit, SIGKILL 5 s later
    cap(resource.RLIMIT_FSIZE, file_mb * 1024 * 1024)
    if tasks > 0:
        cap(resource.RLIMIT_NPROC, tasks)
    mapped = _vm_bytes()
    if memory_mb > 0 and mapped > 0:
        cap(resource.RLIMIT_AS, mapped + memory_mb * 1024 * 1024)


# Landlock (Linux >= 5.13) lets an unprivileged process give up rights for itself and its children:
# here, writing files outside one directory and (ABI >= 6) signalling processes outside the sandbox.
_LL_CREATE_RULESET, _LL_ADD_RULE, _LL_RESTRICT_SELF = 444, 445, 446
_LL_WRITE_FILE, _LL_REFER, _LL_TRUNCATE = 1 << 1, 1 << 13, 1 << 14
_LL_DIR_WRITES = sum(1 << b for b in range(4, 13))  # remove dir/file, make char/dir/reg/sock/fifo/block/sym
_LL_SCOPE = 0b11  # LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET | LANDLOCK_SCOPE_SIGNAL


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def confine(writable_dir: str) -> dict[str, bool]:
    """Forbid writes outside ``writable_dir`` (and /dev/null), and signals to processes outside
    this one and its children. Returns what could be enforced: ``{"writes": ..., "signals": ...}``."""
    none = {"writes": False, "signals": False}
    if not sys.platform.startswith("linux"):
        return none
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        abi = libc.syscall(_LL_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
        if abi < 1:
            return none
        handled = _LL_WRITE_FILE | _LL_DIR_WRITES
        handled |= _LL_REFER if abi >= 2 else 0
        handled |= _LL_TRUNCATE if abi >= 3 else 0
        scoped = _LL_SCOPE if abi >= 6 else 0
        attr = _RulesetAttr(handled, 0, scoped)
        size = ctypes.sizeof(attr) if scoped else 8  # older kernels accept only the first field
        ruleset = libc.syscall(
            _LL_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0)
        )
        if ruleset < 0:
            return none
        file_rights = handled & (_LL_WRITE_FILE | _LL_TRUNCATE)
        for path, rights in ((writable_dir, handled), ("/dev/null", file_rights)):
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            rule = _PathBeneath(rights, fd)
            ok = libc.syscall(_LL_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(1), ctypes.byref(rule), 0)
            os.close(fd)
            if ok != 0:
                return none
        if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS, required before restrict_self
            return none
        if libc.syscall(_LL_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)) != 0:
            return none
        return {"writes": True, "signals": bool(scoped)}
    except (OSError, AttributeError):
        return none


def die_with_parent(parent: int) -> None:
    """Be killed when the grader that started this process dies (Linux); exit now if it is gone."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:
        os._exit(1)


class ImportBlocker(importlib.abc.MetaPathFinder):
    """Refuses to import the given modules (and their submodules), saying why."""

    def __init__(self, blocked: dict[str, str]):
        self.blocked = blocked

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        for name, why in self.blocked.items():
            if fullname == name or fullname.startswith(name + "."):
                raise ImportError(
                    f"`{fullname}` cannot be imported while this lab is graded: {why}", name=fullname
                )
        return None


def block_imports(blocked: dict[str, str]) -> None:
    for name in list(sys.modules):
        if any(name == b or name.startswith(b + ".") for b in blocked):
            del sys.modules[name]
    sys.meta_path.insert(0, ImportBlocker(blocked))
