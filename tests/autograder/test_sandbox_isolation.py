"""The sandbox as a submission sees it: what a sandboxed process can see, reach and leave behind under
bubblewrap, and what the grader measures of it (`autograder.sandbox.isolation`, `autograder.sandbox.proctree`).

Each test runs a small probe in a real sandbox and asks it what it found; the verdicts are the
grader's own observations where they can be (the host's /proc), the probe's answers otherwise. They
need bubblewrap: without it they skip, unless NANOLAB_SANDBOX_TEST=required (CI) makes that a failure.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from autograder.sandbox import isolation, proctree
from autograder.sandbox.limits import Limits
from autograder.sandbox.process import Sandbox

ROOT = Path(__file__).resolve().parents[2]
SANDBOX_ENV = {"PATH", "PWD", "HOME", "TMPDIR", "LANG", "MPLBACKEND", "MPLCONFIGDIR", "MALLOC_ARENA_MAX"}
SANDBOX_ENV |= {"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"}
LAB1_BLOCKED = {"nanolab": "the reference", "autograder": "the grader", "tiktoken": "the reference"}

if not isolation.status().available:
    if os.environ.get("NANOLAB_SANDBOX_TEST") == "required":
        pytest.fail(f"bubblewrap is required here: {isolation.status().reason}", pytrace=False)
    pytest.skip(f"no bubblewrap sandbox here: {isolation.status().reason}", allow_module_level=True)


def sandbox(source: str, **limits) -> Sandbox:
    """A started Lab 1-like sandbox (regex preloaded, the reference blocked) running ``source``."""
    limits = Limits(**{"call_timeout_s": 20, "load_timeout_s": 30, **limits})
    sb = Sandbox([{"id": "probe", "source": source}], {"probe": []}, limits, LAB1_BLOCKED, ("regex",))
    report = sb.start()
    assert report["cells"][0]["error"] is None, report
    assert sb.isolated
    return sb


def markers(marker: str) -> list[int]:
    """Processes on the host whose command line holds ``marker``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


LOOK_AROUND = """
import importlib.util, os, sys
sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "ImportBlocker"]

def probe(paths, modules):
    found = {"paths": {p: os.path.exists(p) for p in paths}, "modules": {}}
    for name in modules:
        sys.modules.pop(name, None)
        found["modules"][name] = importlib.util.find_spec(name) is not None
    found["uid"], found["gid"], found["groups"] = os.getuid(), os.getgid(), os.getgroups()
    found["root"] = sorted(os.listdir("/"))
    found["env"] = dict(os.environ)
    with open("/proc/self/status") as f:
        found["caps"] = [line.split()[1] for line in f if line.startswith("CapEff")][0]
    return found
"""


def test_the_sandbox_holds_no_checkout_tests_solutions_or_blocked_module(tmp_path):
    """Nothing of the checkout is in the sandbox's file system (not even with the import blocker
    removed): no reference, no hidden tests, no solutions, no other submission; the lab's package is."""
    neighbour = tmp_path / "neighbour.ipynb"
    neighbour.write_text("{}")
    paths = [
        str(ROOT),
        str(ROOT / "autograder" / "tests" / "test_lab01.py"),
        str(ROOT / "solutions" / "lab01_tokenizer.ipynb"),
        str(ROOT / "nanolab" / "text" / "bpe.py"),
        str(neighbour),
        str(Path(sys.prefix) / "pyvenv.cfg"),
        "/etc/passwd",
        "/root/.ssh",
    ]
    modules = ["nanolab", "autograder", "tiktoken", "transformers", "pytest", "torch", "regex", "json"]
    with sandbox(LOOK_AROUND) as sb:
        found = sb.get(None, "probe")(paths, modules)
        host_uids = set()
        for pid in proctree.descendants(sb._proc.pid):
            with open(f"/proc/{pid}/status") as f:
                host_uids |= {int(line.split()[1]) for line in f if line.startswith("Uid:")}
    assert not any(found["paths"].values()), {p: seen for p, seen in found["paths"].items() if seen}
    assert found["modules"] == {name: name in ("regex", "json") for name in modules}, found["modules"]
    assert (found["uid"], found["gid"]) == (isolation.SANDBOX_UID, isolation.SANDBOX_UID)
    assert found["caps"] == "0000000000000000", "the sandbox must hold no capabilities"
    assert "work" not in found["root"] and "home" not in found["root"], found["root"]
    assert set(found["env"]) <= SANDBOX_ENV, "the sandbox's environment must hold nothing of the grader's"
    if os.geteuid() == 0:  # as root, the sandbox is an unprivileged user on the host too
        assert host_uids == {isolation.SANDBOX_UID}, host_uids
    else:
        assert host_uids == {os.geteuid()}, host_uids


MOUNT_TABLE = """
def mount_tables():
    texts = []
    for name in ("/proc/self/mountinfo", "/proc/self/mounts", "/proc/1/mountinfo", "/proc/1/mounts"):
        with open(name) as f:
            texts.append(f.read())
    return "\\n".join(texts)
"""


def test_the_sandboxs_mount_table_names_neither_the_checkout_nor_the_graders_environment():
    """A bind mount shows its source's path in /proc/*/mountinfo: the grader's code and the lab's packages are
    bound from a mirror in the grader's temporary folder, so the sandbox cannot learn where the checkout or
    the grader's Python environment is."""
    with sandbox(MOUNT_TABLE) as sb:
        table = sb.get(None, "mount_tables")()
    assert "/opt/nanolab/site-packages/regex" in table, "the probe did not read the mount table"
    assert str(isolation.RUNTIME_PACKAGE) not in table, "the sandbox's mount table names the grader's code"
    import regex

    if os.stat(regex.__file__).st_dev != os.stat(tempfile.gettempdir()).st_dev:
        pytest.skip("the packages are on another file system than the temporary folder: bound where they are")
    for secret in {str(ROOT), os.path.realpath(ROOT), sys.prefix, os.path.realpath(sys.prefix)}:
        assert secret not in table, f"the sandbox's mount table names {secret}"


REACH_OUT = """
import os, resource, signal, socket

def probe(grader, port):
    out = {"pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()), "ppid": os.getppid()}
    out["hostname"] = socket.gethostname()
    for name, action in [
        ("kill", lambda: os.kill(grader, 0)),
        ("prlimit", lambda: resource.prlimit(grader, resource.RLIMIT_NOFILE, (3, 3))),
        ("environ", lambda: open(f"/proc/{grader}/environ").read()),
        ("affinity", lambda: os.sched_setaffinity(grader, {0})),
        ("connect", lambda: socket.create_connection(("127.0.0.1", port), timeout=2).close()),
        ("kill_init", lambda: os.kill(1, signal.SIGKILL)),
    ]:
        try:
            action()
            out[name] = "done"
        except OSError as e:
            out[name] = type(e).__name__
    return out
"""


def test_the_sandbox_reaches_no_process_and_no_network_of_the_host():
    """It sees only its own processes, so it cannot signal, limit, pin or read the grader, and it has
    no network, not even the host's loopback."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    affinity = os.sched_getaffinity(0)
    try:
        with sandbox(REACH_OUT) as sb:
            out = sb.get(None, "probe")(os.getpid(), port)
            assert sb.alive, "killing its PID namespace's first process from inside must do nothing"
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()
    assert len(out["pids"]) <= 4 and max(out["pids"]) < 100, out["pids"]
    assert out["hostname"] == "sandbox"
    assert out["kill"] == out["prlimit"] == out["affinity"] == "ProcessLookupError", out
    assert out["environ"] == "FileNotFoundError" and out["connect"] != "done", out
    assert os.sched_getaffinity(0) == affinity


WRITE = """
import os

def probe():
    out = {}
    for path in ("/x", "/usr/x", "/opt/nanolab/site-packages/x", "/proc/sys/kernel/hostname"):
        try:
            open(path, "w").write("x")
            out[path] = "written"
        except OSError as e:
            out[path] = e.errno
    sizes = []
    try:
        for i in range(4):  # 4 x 48 MB: each under the file limit, together over the tmpfs
            with open(f"big{i}", "wb") as f:
                f.write(b"x" * (48 << 20))
            sizes.append(i)
    except OSError as e:
        out["full"] = e.errno
    out["written"] = len(sizes)
    return out
"""


def test_writes_stay_in_a_size_limited_tmpfs():
    """Everything outside the sandbox's tmpfs is read-only, and the tmpfs holds no more than its size."""
    import errno

    with sandbox(WRITE, disk_mb=128, file_mb=64) as sb:
        out = sb.get(None, "probe")()
    assert out["/x"] in (errno.EROFS, errno.EACCES) and out["/usr/x"] in (errno.EROFS, errno.EACCES)
    assert out["/opt/nanolab/site-packages/x"] in (errno.EROFS, errno.EACCES)
    assert out["/proc/sys/kernel/hostname"] != "written"
    assert out["written"] == 2 and out["full"] == errno.ENOSPC, out


DETACH = """
import os, sys, time

def probe(marker, seconds):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv(sys.executable, [sys.executable, "-c", "import time\\nwhile True: time.sleep(1)", marker])
        os._exit(0)
    children = []
    for _ in range(2):  # two processes that burn CPU, and are waited for
        pid = os.fork()
        if pid == 0:
            end = time.process_time() + seconds
            while time.process_time() < end:
                pass
            os._exit(0)
        children.append(pid)
    for pid in children:
        os.waitpid(pid, 0)
    return True
"""


def test_every_process_of_a_sandbox_counts_and_dies_with_it():
    """The CPU time of a sandbox is that of all its processes, children included; a process it
    detached (fork, setsid, exec) dies when the sandbox is closed, and its directory goes with it."""
    marker = f"nanolab-detached-{uuid.uuid4().hex}"
    sb = sandbox(DETACH)
    host_dir = sb._dir
    try:
        before = sb.cpu_seconds()
        assert sb.get(None, "probe")(marker, 0.6) is True
        used = sb.cpu_seconds() - before
        deadline = time.monotonic() + 5
        while not markers(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert markers(marker), "the probe's detached process did not start"
    finally:
        sb.close()
    assert used >= 1.1, f"two children burning 0.6 s each were counted as {used:.2f} s"
    assert not markers(marker), "a detached process outlived its sandbox"
    assert not host_dir.exists(), "the sandbox's directory was left behind"


FORK = """
import os, signal

def probe(attempts):
    children, error = [], None
    try:
        for _ in range(attempts):
            pid = os.fork()
            if pid == 0:
                signal.pause()
                os._exit(0)
            children.append(pid)
    except OSError as e:
        error = e.errno
    return len(children), error
"""


def test_a_fork_bomb_stops_at_the_sandboxs_own_task_limit():
    """Processes and threads count against the sandbox's own limit (its user namespace's), so forking
    stops there, and every child dies with the sandbox."""
    import errno

    with sandbox(FORK, tasks=64) as sb:
        made, error = sb.get(None, "probe")(200)
        below = proctree.descendants(sb._proc.pid)
    assert made < 64 and error == errno.EAGAIN, (made, error)
    assert len(below) >= made
    assert not [pid for pid in below if Path(f"/proc/{pid}").exists()], "children outlived the sandbox"


def test_a_blocked_module_is_absent_even_as_a_dependency():
    """The sandbox holds a lab's packages and their dependencies, except any module the lab blocks."""
    probe = LOOK_AROUND
    limits = Limits(call_timeout_s=20, load_timeout_s=30)
    blocked = {"markupsafe": "blocked for this test"}
    with Sandbox([{"id": "probe", "source": probe}], {"probe": []}, limits, blocked, (), ("jinja2",)) as sb:
        sb.start()
        found = sb.get(None, "probe")([], ["jinja2", "markupsafe", "regex"])
    assert found["modules"] == {"jinja2": True, "markupsafe": False, "regex": False}, found["modules"]
