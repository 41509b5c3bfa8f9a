"""Where a submission's code runs: a bubblewrap sandbox of its own, or, where Linux cannot give one, a
plain process as before (and the grader says so).

bubblewrap (``bwrap``, the tool Flatpak uses) starts the submission's process:

- as its own unprivileged uid: uid 65534 ("nobody") inside; on the host, 65534 too when the grader
  runs as root, else the grader's own uid mapped into a user namespace; no capabilities either way,
  and it may not make user namespaces of its own;
- in new PID, mount, IPC, UTS, network and cgroup namespaces: it sees and can signal only its own
  processes (its own ``/proc``), has no network, and all of it is killed with the namespace's first
  process (``--die-with-parent``: also when the grader dies);
- on a file system of its own: ``/usr``, the interpreter and its standard library, the lab's packages
  and their dependencies (`lab_packages`), all read-only, a private ``/dev`` and ``/proc``, and one
  size-limited tmpfs, ``/sandbox`` (its working directory, home and ``/tmp`` are ``/sandbox/work``).
  Nothing else: not the checkout, the hidden tests, the solutions, other submissions, or any module
  the lab blocks; of the grader, only the folder the sandbox runs (`autograder.sandbox.runtime`).

As root, bubblewrap itself runs as uid 65534, so the paths it binds are first bind-mounted (in a
private mount namespace of a small launcher, `_LAUNCHER`) where that uid can reach them: on a stage
that covers ``/tmp`` in that namespace only.

A bind mount shows its source's path in the sandbox's ``/proc/self/mountinfo``, so the grader's own code
and the lab's packages are bound from a mirror in the grader's temporary folder (`mirrored`: hard links),
never from the checkout or the environment the grader runs from. (The grader's few files are copied where
links cannot be made; a package on another file system than that folder is bound where it is.)
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SANDBOX_DIR = "/sandbox"  # the tmpfs
WORK_DIR = (
    "/sandbox/work"  # in it: the working directory, HOME, TMPDIR and /tmp (Landlock's one writable place)
)
SITE_DIR = "/opt/nanolab/site-packages"  # the lab's packages
GRADER_DIR = "/opt/nanolab/grader"  # holds autograder/sandbox/runtime/, the grader's only code in the sandbox
RUNTIME_PACKAGE = Path(__file__).resolve().parent / "runtime"  # what the sandboxed process runs, bound whole
SANDBOX_UID = 65534  # the host uid of a sandbox started by a grader running as root
MIRROR_ENV = "NANOLAB_SANDBOX_MIRROR"  # a mirror folder made by a batch, shared by its grading workers
INSTALL_HINT = (
    "install bubblewrap (Debian, Ubuntu: `sudo apt-get install bubblewrap`; Fedora: `sudo dnf install "
    "bubblewrap`; Arch: `sudo pacman -S bubblewrap`) and make sure user namespaces are enabled"
)

# The sandboxed interpreter's main program. Of the grader it sees only `autograder.sandbox.runtime`,
# bound whole at the same place under GRADER_DIR: the folders above it are empty there, so `autograder`
# and `autograder.sandbox` are namespace packages with nothing else in them. Once the worker is loaded
# that folder leaves the path, so the submission cannot import the grader by name. The interpreter runs
# without `site` (no site-packages of its own); exit() and quit() are still there for the learner's code.
BOOT = f"""
import site, sys
site.setquit()
sys.path.insert(0, "{GRADER_DIR}")
from autograder.sandbox.runtime.worker import main
sys.path.remove("{GRADER_DIR}")
sys.path.append("{SITE_DIR}")
main()
"""

# As root: in a private mount namespace, bind each source into a stage, put the stage over /tmp (which
# uid 65534 can reach whatever the stage's own path), drop to that uid and exec bubblewrap, whose binds
# name the staged copies (/tmp/0, /tmp/1, ...).
_LAUNCHER = """
import ctypes, json, os, sys
spec = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
def check(result, what):
    if result != 0:
        error = ctypes.get_errno()
        sys.exit(f"nanolab sandbox launcher: {what}: {os.strerror(error)}")
check(libc.unshare(0x00020000), "unshare(CLONE_NEWNS)")
check(libc.mount(b"none", b"/", None, 0x4000 | 0x40000, None), "make / private")
stage = spec["stage"]
check(libc.mount(b"tmpfs", stage.encode(), b"tmpfs", 0x2 | 0x4, b"mode=0755,size=64k"), "stage")
for i, source in enumerate(spec["sources"]):
    target = f"{stage}/{i}"
    if os.path.isdir(source):
        os.mkdir(target)
    else:
        open(target, "w").close()
    check(libc.mount(source.encode(), target.encode(), None, 0x1000 | 0x4000, None), "bind " + source)
disk = spec["disk"]  # the sandbox's tmpfs, limited in bytes and in files (bubblewrap's --tmpfs has no inode limit)
os.mkdir(f"{stage}/sandbox")
options = f"mode=0700,size={disk['bytes']},nr_inodes={disk['inodes']},uid={spec['uid']},gid={spec['uid']}"
check(libc.mount(b"tmpfs", f"{stage}/sandbox".encode(), b"tmpfs", 0x2 | 0x4, options.encode()), "sandbox tmpfs")
check(libc.mount(stage.encode(), b"/tmp", None, 0x1000 | 0x4000, None), "stage over /tmp")
uid = spec["uid"]
os.setgroups([])
os.setresgid(uid, uid, uid)
os.setresuid(uid, uid, uid)
os.execv(spec["argv"][0], spec["argv"])
"""


@dataclass(frozen=True)
class Status:
    """Whether submissions can run in a bubblewrap sandbox here, and if not, why."""

    available: bool
    version: str = ""  # "bubblewrap 0.8.0"
    reason: str = ""  # why not, when not available

    def describe(self) -> str:
        """One line for ``nanolab info`` and every grading run."""
        if self.available:
            return (
                f"sandbox: {self.version} (own uid, PID/mount/IPC/UTS/network namespaces, "
                "a file system without the checkout)"
            )
        return (
            f"sandbox: NOT ISOLATED ({self.reason}): a submission's code can read every file and reach "
            f"every process of this user; grade untrusted work inside a container, or {INSTALL_HINT}"
        )


_status: list[Status] = []  # the answer, once known
_status_lock = threading.Lock()


def status() -> Status:
    """Find bubblewrap and start a trial sandbox: once per process (a second caller, in another
    thread, waits for the first one's answer)."""
    with _status_lock:
        if not _status:
            _status.append(_check())
        return _status[0]


def _check() -> Status:
    if not sys.platform.startswith("linux"):
        return Status(False, reason=f"bubblewrap needs Linux, this is {sys.platform}")
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return Status(False, reason="bubblewrap (bwrap) is not installed")
    try:
        version = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=10)
        name = version.stdout.strip() or "bubblewrap"
        host_dir = Path(make_host_dir())
        try:
            argv = command([interpreter(), "-I", "-S", "-c", "pass"], {}, (), 1, host_dir)
            trial = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        finally:
            shutil.rmtree(host_dir, ignore_errors=True)
    except (OSError, subprocess.SubprocessError) as e:
        return Status(False, reason=f"bubblewrap could not be run: {e}")
    if trial.returncode != 0:
        why = (trial.stderr.strip().splitlines() or [f"exit code {trial.returncode}"])[-1]
        return Status(False, reason=f"bubblewrap cannot start a sandbox here: {why[:200]}")
    return Status(True, version=name)


def make_host_dir() -> str:
    """A private directory of the grader for one sandbox (its output log; as root, the stage's mount point)."""
    return tempfile.mkdtemp(prefix="nanolab-sandbox-")


_mirror_lock = threading.Lock()
_own_mirror: list[str] = []  # this process's mirror folder, once made (removed when the process exits)


def _mirror_root() -> Path:
    shared = os.environ.get(MIRROR_ENV)
    if shared and os.path.isdir(shared):
        return Path(shared)
    if not _own_mirror:
        _own_mirror.append(tempfile.mkdtemp(prefix="nanolab-mirror-"))
        atexit.register(shutil.rmtree, _own_mirror[0], True)
    return Path(_own_mirror[0])


@contextlib.contextmanager
def shared_mirror() -> Iterator[None]:
    """One mirror folder for the grading workers this process starts inside the block (they inherit its
    path), removed after it: the lab's packages are mirrored once per batch rather than once per notebook."""
    root = tempfile.mkdtemp(prefix="nanolab-mirror-")
    old = os.environ.get(MIRROR_ENV)
    os.environ[MIRROR_ENV] = root
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(MIRROR_ENV, None)
        else:
            os.environ[MIRROR_ENV] = old
        shutil.rmtree(root, ignore_errors=True)


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:  # another file system, or links refused (fs.protected_hardlinks)
        shutil.copy2(source, target)


def mirrored(source: str, copy: bool = True) -> str:
    """The host file or folder ``source`` as a mirror in the grader's temporary folder (hard links where the
    file system allows, copies otherwise), made once per process or batch and reused: what the sandbox binds
    instead of ``source``, so that its mount table does not name the checkout or the grader's environment.
    With ``copy=False`` (a package such as torch, too big to copy for every batch) a source on another file
    system than the temporary folder is bound as it is."""
    root = _mirror_root()
    if not copy and os.stat(source).st_dev != os.stat(root).st_dev:
        return source
    target = root / hashlib.sha256(source.encode()).hexdigest()[:16] / os.path.basename(source.rstrip("/"))
    with _mirror_lock:
        if target.exists():
            return str(target)
        part = Path(tempfile.mkdtemp(prefix=".part-", dir=root))
        try:
            if os.path.isdir(source):
                shutil.copytree(source, part / target.name, symlinks=True, copy_function=_link_or_copy)
            else:
                _link_or_copy(source, str(part / target.name))
            target.parent.mkdir(exist_ok=True)
            try:
                os.rename(part / target.name, target)
            except OSError:  # a worker beside this one mirrored it first
                if not target.exists():
                    raise
        finally:
            shutil.rmtree(part, ignore_errors=True)
    return str(target)


def interpreter() -> str:
    """The real Python binary behind this (virtual) environment's ``python``."""
    return os.path.realpath(sys.executable)


def _bound_trees() -> list[str]:
    """Host trees bound read-only as they are: /usr and the base interpreter's prefix."""
    prefix = os.path.realpath(sys.base_prefix)
    return ["/usr"] + ([prefix] if not prefix.startswith("/usr/") and prefix != "/usr" else [])


def _masked(trees: list[str]) -> list[str]:
    """Package folders inside the bound trees (the base interpreter's site-packages, Debian's
    dist-packages, a virtual environment placed there, conda's other environments and package cache):
    hidden behind empty read-only mounts."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    candidates = set(site.getsitepackages([sys.base_prefix, sys.prefix]) + site.getsitepackages())
    candidates |= {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    candidates |= {"/usr/lib/python3/dist-packages", f"/usr/lib/{version}/dist-packages"}
    candidates |= {f"/usr/local/lib/{version}/{kind}-packages" for kind in ("site", "dist")}
    candidates |= {os.path.join(sys.base_prefix, name) for name in ("envs", "pkgs")}  # conda's base
    real = {os.path.realpath(p) for p in candidates if os.path.isdir(p)}
    return sorted(p for p in real if any(p == t or p.startswith(t + "/") for t in trees))


@functools.cache
def lab_packages(modules: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """(host path, name) of every top-level entry in site-packages of the distributions that provide
    ``modules``, and of their dependencies (extras left out): all the sandbox gets of site-packages."""
    import importlib.metadata as metadata

    from packaging.requirements import Requirement

    todo, seen, entries = list(modules), set(), {}
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            owners = metadata.packages_distributions().get(name, [])
            todo += [owner for owner in owners if owner.lower() not in seen]
            continue
        root = Path(dist.locate_file(""))
        for top in _top_level(dist):
            if (root / top).exists():
                entries.setdefault(top, str(root / top))
        for text in dist.requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return tuple(sorted((path, name) for name, path in entries.items()))


def _module_key(name: str) -> str:
    """``torch``, ``torch-2.1.dist-info``, ``typing_extensions.py`` -> the module they hold, normalised."""
    name = name.split(".", 1)[0] if not name.endswith(".dist-info") else name.split("-", 1)[0]
    return re.sub(r"[-_.]+", "_", name).lower()


def _top_level(dist) -> set[str]:
    """The top-level names a distribution installed (from its RECORD), its metadata folder included."""
    record = dist.read_text("RECORD") or ""
    names = {line.split(",", 1)[0].split("/", 1)[0] for line in record.splitlines() if line}
    if not names:
        names = set((dist.read_text("top_level.txt") or "").split())
    return {n for n in names if n and n not in ("..", "__pycache__") and not n.endswith(".pth")}


def command(
    inner: list[str],
    env: dict[str, str],
    modules: tuple[str, ...],
    tmpfs_mb: int,
    host_dir: Path,
    blocked: tuple[str, ...] = (),
    tmpfs_inodes: int = 10_000,
) -> list[str]:
    """The argv that runs ``inner`` in a fresh sandbox holding ``modules``' packages but never a
    ``blocked`` one (should one be a dependency), with ``env`` as its whole environment and a tmpfs of
    ``tmpfs_mb`` MB. As root it goes through the launcher, which stages the binds in ``host_dir/stage`` and
    mounts the tmpfs itself, so that it holds at most ``tmpfs_inodes`` files too."""
    bwrap = shutil.which("bwrap") or "bwrap"
    binds: list[tuple[str, str]] = []  # (host path, sandbox path), bound read-only
    args = ["--unshare-all", "--unshare-user", "--disable-userns", "--cap-drop", "ALL"]
    args += ["--die-with-parent", "--new-session", "--hostname", "sandbox"]
    args += ["--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
    trees = _bound_trees()
    binds += [(t, t) for t in trees]
    for link in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(link):
            args += ["--symlink", os.readlink(link), link]
        elif os.path.isdir(link):
            binds.append((link, link))
    for name in ("ld.so.cache", "ld.so.conf", "localtime"):
        if os.path.isfile(f"/etc/{name}"):
            binds.append((os.path.realpath(f"/etc/{name}"), f"/etc/{name}"))
    binds.append((mirrored(str(RUNTIME_PACKAGE)), f"{GRADER_DIR}/autograder/sandbox/runtime"))
    refused = {_module_key(name) for name in blocked}
    packages = lab_packages(modules) if modules else ()
    site_binds = [
        (mirrored(path, copy=False), f"{SITE_DIR}/{name}")
        for path, name in packages
        if _module_key(name) not in refused
    ]
    sources = [source for source, _ in binds + site_binds]
    if os.geteuid() == 0:
        staged = {source: f"/tmp/{i}" for i, source in enumerate(sources)}
    else:
        staged = {source: source for source in sources}
    for source, target in binds:
        args += ["--ro-bind", staged[source], target]
    args += ["--size", str(1 << 20), "--tmpfs", SITE_DIR]
    for source, target in site_binds:
        args += ["--ro-bind", staged[source], target]
    args += ["--remount-ro", SITE_DIR]
    for masked in _masked(trees):
        args += ["--size", "4096", "--tmpfs", masked, "--remount-ro", masked]
    args += ["--proc", "/proc", "--dev", "/dev"]
    if os.geteuid() == 0:
        args += ["--bind", "/tmp/sandbox", SANDBOX_DIR]  # the launcher's tmpfs, staged with the binds
    else:
        args += ["--size", str(tmpfs_mb << 20), "--perms", "0700", "--tmpfs", SANDBOX_DIR]
    args += ["--perms", "0700", "--dir", WORK_DIR, "--symlink", WORK_DIR, "/tmp"]
    args += ["--remount-ro", "/", "--chdir", WORK_DIR]
    args += ["--clearenv"] + [a for key, value in env.items() for a in ("--setenv", key, value)]
    argv = [bwrap, *args, "--", *inner]
    if os.geteuid() != 0:
        return argv
    (host_dir / "stage").mkdir(mode=0o700, exist_ok=True)
    spec = {"stage": str(host_dir / "stage"), "sources": sources, "uid": SANDBOX_UID, "argv": argv}
    spec["disk"] = {"bytes": tmpfs_mb << 20, "inodes": tmpfs_inodes}
    return [sys.executable, "-I", "-S", "-c", _LAUNCHER, json.dumps(spec)]


def environment(home: str) -> dict[str, str]:
    """The submission's whole environment (nothing of the grader's)."""
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": home,
        "TMPDIR": home,
        "LANG": "C.UTF-8",
        "MPLBACKEND": "Agg",
        "MPLCONFIGDIR": home,
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "MALLOC_ARENA_MAX": "2",
    }
