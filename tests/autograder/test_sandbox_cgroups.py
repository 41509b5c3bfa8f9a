"""Each sandbox in a cgroup of its own (`autograder.sandbox.cgroups`): memory held outside a process's mappings
(memfd, SysV shared memory, tmpfs files, forked children) counts against one limit, CPU is capped for all the
sandbox's processes together, and the group goes when the sandbox does.

The verdicts are the grader's own observations (the host's view of the group) where they can be. They need
cgroups the grader can make (root, or a delegated cgroup): without them they skip, unless
NANOLAB_SANDBOX_TEST=required (CI) makes that a failure.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from autograder.sandbox import cgroups, isolation, proctree
from autograder.sandbox.limits import Limits
from autograder.sandbox.process import Sandbox
from autograder.sandbox.remote import RemoteError, SandboxFailure

if not cgroups.status().available:
    if os.environ.get("NANOLAB_SANDBOX_TEST") == "required":
        pytest.fail(f"cgroups are required here: {cgroups.status().reason}", pytrace=False)
    pytest.skip(f"no cgroups for sandboxes here: {cgroups.status().reason}", allow_module_level=True)

GROUP_MB = 600  # the sandboxes' cgroup memory in these tests
ATTEMPT_MB = 1500  # what each attack tries to hold


def started(source: str, **limits) -> Sandbox:
    limits = Limits(**{"call_timeout_s": 60, "load_timeout_s": 30, "group_memory_mb": GROUP_MB, **limits})
    sb = Sandbox([{"id": "probe", "source": source}], {"probe": []}, limits)
    report = sb.start()
    assert report["cells"][0]["error"] is None, report
    assert sb._group is not None, "the sandbox got no cgroup"
    return sb


def test_a_sandbox_runs_in_a_cgroup_of_its_own_with_its_limits_and_leaves_none_behind():
    """Every process of the sandbox is in its group (the host's /proc says so), the group holds the budget
    (CPU quota, memory, processes), and closing the sandbox removes it."""
    sb = started("import os\ndef pid():\n    return os.getpid()\n", cpus=0.5, tasks=64)
    with sb:
        group = sb._group
        pids = [sb._proc.pid, *proctree.descendants(sb._proc.pid)]
        names = {d.name for d in group.dirs}
        assert len(names) == 1 and next(iter(names)).startswith("nanolab-sandbox-")
        for pid in pids:
            text = Path(f"/proc/{pid}/cgroup").read_text()
            lines = [line.split(":", 2) for line in text.splitlines()]
            placed = {
                c
                for _, controllers, path in lines
                for c in (controllers.split(",") or [""])
                if path.endswith(next(iter(names)))
            }
            assert ({"cpu", "memory", "pids"} <= placed) or ("" in placed), (pid, text)
        values = {f.name: f.read_text().split() for d in group.dirs for f in d.iterdir() if f.name in WATCHED}
        if cgroups.status().kind == "v1":
            assert values["cpu.cfs_quota_us"] == [str(cgroups.PERIOD_US // 2)]
            assert values["memory.limit_in_bytes"] == [str(GROUP_MB << 20)]
        else:
            assert values["cpu.max"] == [str(cgroups.PERIOD_US // 2), str(cgroups.PERIOD_US)]
            assert values["memory.max"] == [str(GROUP_MB << 20)]
        assert values["pids.max"] == ["64"]
    assert not any(d.exists() for d in group.dirs), "the sandbox's cgroup is still there after close"


WATCHED = {"cpu.cfs_quota_us", "cpu.max", "memory.limit_in_bytes", "memory.max", "pids.max"}

HOARD = f"""
import ctypes, os, time

MB = 1 << 20
WANT = {ATTEMPT_MB}


def memfd():
    held, fds, chunk = 0, [], b"\\1" * MB
    try:
        while held < WANT:  # 32 MB each, under the file size limit
            fds.append(os.memfd_create("hoard"))
            for _ in range(32):
                os.write(fds[-1], chunk)
                held += 1
    except OSError:
        pass
    return held


def sysv_shm():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    held = 0
    while held < WANT:  # 32 MB segments, each written, detached and left behind
        sid = libc.shmget(0, 32 * MB, 0o1000 | 0o600)
        if sid < 0:
            break
        at = libc.shmat(sid, None, 0)
        if at in (None, ctypes.c_void_p(-1).value):
            break
        ctypes.memset(at, 1, 32 * MB)
        libc.shmdt(ctypes.c_void_p(at))
        held += 32
    return held


def tmpfs_files():
    held = 0
    try:
        while held < WANT:
            with open(f"/tmp/hoard{{held}}", "wb") as f:
                f.write(b"\\1" * (8 * MB))
            held += 8
    except OSError:
        pass
    return held


def children():
    held, kids = 0, []
    while held < WANT:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                block = b"\\1" * (100 * MB)
                os.write(w, b"k")
                time.sleep(600)
            finally:
                os._exit(0)
        os.close(w)
        got = os.read(r, 1)
        os.close(r)
        if got != b"k":
            break
        kids.append(pid)
        held += 100
    # A child the OOM killer picked may not have finished dying when the last one answers: give the kills
    # a moment to land (the survivors sleep for minutes), then count the children still there.
    time.sleep(2)
    alive = [pid for pid in kids if os.waitpid(pid, os.WNOHANG) == (0, 0)]  # the rest were killed
    return 100 * len(alive)


def files(n):
    made = 0
    try:
        for i in range(n):
            open(f"/tmp/f{{i}}", "w").close()
            made += 1
    except OSError:
        pass
    return made
"""


@pytest.mark.parametrize("attack", ["memfd", "sysv_shm", "tmpfs_files", "children"])
def test_memory_held_outside_a_process_mappings_counts_against_the_cgroup(attack):
    """Each way of holding memory that an address-space limit does not see stops at the cgroup's limit: the
    attack is refused or killed before it holds the group's memory, and the group never held more."""
    sb = started(HOARD, disk_mb=4096, memory_mb=4096)  # the tmpfs and the per-process limits out of the way
    with sb:
        group = sb._group
        try:
            held = sb.get(None, attack)()
        except (RemoteError, SandboxFailure) as e:
            held = f"stopped: {e}"
        peak = group.memory_peak_mb()
    assert not (isinstance(held, int) and held >= GROUP_MB), (
        f"{attack} held {held} MB in a {GROUP_MB} MB group"
    )
    assert peak is None or peak <= GROUP_MB + 1, f"the group held {peak:.0f} MB"


@pytest.mark.skipif(os.geteuid() != 0, reason="the tmpfs's file limit is set by the root launcher")
def test_the_tmpfs_holds_a_bounded_number_of_files():
    """Empty files cost no bytes but kernel memory: the sandbox's tmpfs stops at its file limit."""
    with started(HOARD, disk_files=2000) as sb:
        assert sb.isolated or not isolation.status().available
        made = sb.get(None, "files")(5000)
    if isolation.status().available:
        assert 1900 <= made < 2000, made


SPIN = """
import os, time


def spin(n):
    for _ in range(n):
        if os.fork() == 0:
            os.setsid()  # a session, and a scheduling group, of its own: no help against the cgroup
            while True:
                pass
    return n
"""


def test_the_cpu_quota_holds_for_all_of_a_sandboxs_processes_together():
    """Eight busy processes, each in a session of its own, get a quarter of a core between them (the quota),
    so a sandbox cannot take the CPU of the notebooks graded beside it."""
    with started(SPIN, cpus=0.25) as sb:
        sb.get(None, "spin")(8)
        before, start = proctree.cpu_seconds(sb._proc.pid), time.monotonic()
        time.sleep(3)
        used, wall = proctree.cpu_seconds(sb._proc.pid) - before, time.monotonic() - start
    assert used <= 0.25 * wall * 1.3 + 0.2, (
        f"the sandbox used {used:.1f} CPU s in {wall:.1f} s with a quota of 0.25"
    )
