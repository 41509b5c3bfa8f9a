"""The grader's side of the sandbox: start the submission's process, call into it, kill it.

`Sandbox` starts the worker (`autograder.sandbox.runtime.worker`) with stdin closed, its output going to a log file
of the grader's, and talks to it over two pipes. Where bubblewrap can run, the process gets its own
uid, namespaces and file system (`autograder.sandbox.isolation`); elsewhere it is a plain process in an empty
temporary directory, and `Sandbox.isolated` is False. Every reply is decoded by `autograder.sandbox.runtime.codec` into
plain data or `Remote` handles, so what comes back cannot run code or fake a comparison here. A call
that does not answer within its time limit, or whose process dies, raises `SandboxFailure`; every
process of the sandbox is then killed (`autograder.sandbox.proctree`) and the `Sandbox` is dead (the grading
session, `autograder.grading.session`, decides whether to start a fresh one).

Limits: address space (``memory_mb`` on top of what the interpreter and the preloaded modules map),
CPU seconds, written file size, the size of its tmpfs, wall clock per call; and, where the grader can
make one, a cgroup of its own (`autograder.sandbox.cgroups`) for the CPU share and quota, the memory and the
processes of all its processes together. Writes outside its directory are refused (bubblewrap's read-only
file system, and Landlock where the kernel has it).
What crosses back is described in `autograder.sandbox.remote`.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autograder.sandbox import cgroups, isolation, proctree
from autograder.sandbox.cleanup import remove_tree
from autograder.sandbox.limits import DEFAULT_MEMORY_MB, Limits
from autograder.sandbox.remote import Later, Remote, RemoteError, SandboxFailure
from autograder.sandbox.runtime import codec

__all__ = ["Sandbox"]


@dataclass
class Sandbox:
    """One sandboxed process running a submission's cells."""

    cells: list[dict]  # [{"id": grade_id, "source": code}] in notebook order
    graded: dict[str, list[str]]  # cell id -> names it must define
    limits: Limits = field(default_factory=Limits)
    blocked: dict[str, str] = field(default_factory=dict)  # module -> why it is blocked
    preload: tuple[str, ...] = ()
    packages: tuple[str, ...] = ()  # besides the preloads: what the sandbox's site-packages holds
    # The time limit of the next call, asked before each call. The grader's session owns it (it
    # changes inside a test's `time_limit` block and outlives restarts); None: limits.call_timeout_s.
    current_call_timeout: Callable[[], float] | None = None
    generation: int = 0
    isolated: bool = False  # it runs under bubblewrap (`autograder.sandbox.isolation`)
    confined: bool = False  # writes outside the working directory are refused (bubblewrap or Landlock)
    signals_confined: bool = False  # signals to processes outside the sandbox are refused (Landlock ABI 6)
    load_report: dict | None = None
    _proc: subprocess.Popen | None = None
    _dir: Path | None = None
    _group: cgroups.Group | None = None
    _rfd: int | None = None
    _wfd: int | None = None

    def __post_init__(self) -> None:
        self._next_id = secrets.randbits(48)  # request ids: a reply must name the request it answers
        # One request at a time on the pipe: a test may call into the sandbox from several threads (a
        # server's handlers and its engine thread), and their messages must not interleave.
        self._pipe_lock = threading.RLock()

    # -- life cycle

    def start(self) -> dict:
        """Start the process and run the cells; returns the load report (per-cell errors, origins)."""
        self.launch()
        return self.load()

    @property
    def launched(self) -> bool:
        """Its process was started and its cells were not run yet (see `launch`)."""
        return self._proc is not None and self.load_report is None

    def launch(self) -> None:
        """Start the process and return at once: it loads its interpreter and preloads while the caller
        goes on, and `load` then runs the cells. Call it from a thread that outlives the sandbox (the
        main thread): the sandbox dies with the thread that started it."""
        self.close()
        self.generation += 1
        isolate = self.limits.isolate
        self.isolated = isolation.status().available if isolate is None else isolate
        self._dir = Path(isolation.make_host_dir())
        budget = cgroups.Budget(self.limits.sandbox_memory_mb, self.limits.cpus, self.limits.tasks)
        # None where cgroups cannot be had (`cgroups.status` says why)
        self._group = cgroups.create(budget) if self.limits.cgroup else None
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        config = {
            "memory_mb": self.limits.memory_mb or DEFAULT_MEMORY_MB,
            "cpu_s": self.limits.cpu_s,
            "file_mb": self.limits.file_mb,
            "confine": self.limits.confine_writes,
            "blocked": self.blocked,
            "preload": list(self.preload),
            "parent": None if self.isolated else os.getpid(),  # die with the grader
            # Processes and threads: in bubblewrap's user namespace the limit counts the sandbox's own
            # (a fork bomb stops there); without it, it would count all of this user's, so none is set.
            "tasks": self.limits.tasks if self.isolated else 0,
        }
        fds = [str(to_child_r), str(from_child_w), json.dumps(config)]
        if self.isolated:
            home = isolation.WORK_DIR
            inner = [isolation.interpreter(), "-I", "-S", "-B", "-c", isolation.BOOT, *fds]
            modules = (*self.preload, *self.packages)
            env = isolation.environment(home)
            argv = isolation.command(
                inner,
                env,
                modules,
                self.limits.disk_mb,
                self._dir,
                tuple(self.blocked),
                self.limits.disk_files,
            )
            cwd, env = "/", {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
        else:
            cwd = self._dir / "work"
            cwd.mkdir()
            argv, env = (
                [sys.executable, "-I", "-m", "autograder.sandbox.runtime.worker", *fds],
                isolation.environment(str(cwd)),
            )
        log = open(self._dir / "output.log", "wb")  # noqa: SIM115 - the child writes to it
        try:
            self._proc = subprocess.Popen(
                argv,
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(to_child_r, from_child_w),
                start_new_session=True,
                preexec_fn=self._group.join if self._group is not None else None,  # before bubblewrap starts
            )
        finally:
            log.close()
            os.close(to_child_r)
            os.close(from_child_w)
        self._rfd, self._wfd = from_child_r, to_child_w
        self.load_report = None

    def load(self) -> dict:
        """Wait for the launched process, then run the cells; returns the load report."""
        hello = self._receive(self.limits.load_timeout_s, "starting the sandbox")
        confined = hello.get("confined") if isinstance(hello, dict) else None
        self.confined = self.isolated or (isinstance(confined, dict) and confined.get("writes") is True)
        self.signals_confined = isinstance(confined, dict) and confined.get("signals") is True
        report = self._request(
            {"op": "load", "cells": self.cells, "graded": self.graded}, self.limits.load_timeout_s
        )
        if type(report) is not dict:
            raise SandboxFailure("the sandbox sent a malformed load report")
        self.load_report = report
        return report

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def output_tail(self, n: int = 2000) -> str:
        """The last ``n`` characters the submission printed (stdout and stderr)."""
        if self._dir is None or not (self._dir / "output.log").exists():
            return ""
        with open(self._dir / "output.log", "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode("utf-8", "replace")

    def cpu_seconds(self) -> float:
        """CPU seconds used so far by every process of this sandbox, read by the grader from /proc."""
        if not self.alive or self._proc is None:
            raise SandboxFailure("the submission's process is not running")
        return proctree.cpu_seconds(self._proc.pid)

    def close(self) -> None:
        """Kill every process of the sandbox, then remove its directory."""
        self._kill()
        for fd in (self._rfd, self._wfd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._proc, self._rfd, self._wfd = None, None, None
        if self._group is not None:
            self._group.remove()
            self._group = None
        if self._dir is not None:
            remove_tree(self._dir)
            self._dir = None

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- calls

    def get(self, target: Remote | None, name: str, timeout: float | None = None) -> Any:
        """``getattr(target, name)`` in the sandbox (a global of the notebook when target is None)."""
        return self._request({"op": "get", "target": self._handle(target), "name": name}, timeout)

    def call(self, target: Remote, args: tuple, kwargs: dict, timeout: float | None = None) -> Any:
        """``target(*args, **kwargs)`` in the sandbox; the result comes back as data or handles."""
        message = {"op": "call", "target": self._handle(target), "args": self._encode(list(args))}
        message["kwargs"] = self._encode(dict(kwargs))
        return self._request(message, timeout)

    def hold(self, value: Any, timeout: float | None = None) -> Remote:
        """A copy of ``value`` (plain data) made and kept in the sandbox, as a handle.

        Passed to the submission's code, the handle arrives as that object itself, so `value` can
        tell afterwards whether the call changed it.
        """
        held = self._request({"op": "hold", "value": self._encode(value)}, timeout)
        if not isinstance(held, Remote):
            self._kill()
            raise SandboxFailure("the submission's process did not keep the object it was asked to hold")
        return held

    def set(self, target: Remote, name: str, value: Any, timeout: float | None = None) -> None:
        """``target.name = value`` in the sandbox (``value``: data, or a handle for the object itself)."""
        message = {"op": "set", "target": self._handle(target), "name": name, "value": self._encode(value)}
        self._request(message, timeout)

    def ref(self, target: Remote, name: str, timeout: float | None = None) -> Remote:
        """``target.name`` as a handle, also where it would cross as data (an enum member, to `set` it)."""
        got = self._request({"op": "ref", "target": self._handle(target), "name": name}, timeout)
        if not isinstance(got, Remote):
            self._kill()
            raise SandboxFailure("the submission's process did not answer a handle where one was asked for")
        return got

    def value(self, target: Remote, timeout: float | None = None) -> Any:
        """The object behind ``target`` sent back as plain data (as a handle if it is not data)."""
        return self._request({"op": "value", "target": self._handle(target)}, timeout)

    def batch(self, steps: list[tuple], keep: list[int], timeout: float | None = None) -> list[Any]:
        """Run ``steps`` in the sandbox in order, in one round trip (see `autograder.sandbox.runtime.worker`):
        each ``(kind, target, a, b)``, where a target or an argument may be a `Later` (an earlier step's
        result). Returns, for each index in ``keep``, that step's result (data or a handle), or the
        `RemoteError` it raised."""
        message = {
            "op": "batch",
            "steps": [
                [kind, self._handle(target), self._encode(a), self._encode(b)] for kind, target, a, b in steps
            ],
            "keep": list(keep),
        }
        reply = self._request(message, timeout)
        shape = (
            [e[0] if type(e) is list and len(e) == 3 else None for e in reply]
            if type(reply) is list
            else None
        )
        if shape != list(keep):
            self._kill()
            raise SandboxFailure("the submission's process answered a batch of calls with something else")
        results: list[Any] = []
        for _, ok, value in reply:
            if ok is True:
                results.append(value)
            else:
                error = value if type(value) is dict else {}
                results.append(
                    RemoteError(
                        str(error.get("type", "Error"))[:200],
                        str(error.get("message", "")),
                        str(error.get("traceback", "")),
                    )
                )
        return results

    def _handle(self, target: Remote | Later | None) -> dict | None:
        if target is None:
            return None
        if isinstance(target, Later):
            return {"$h": -1 - target.index}
        if target._sandbox is not self or target._generation != self.generation:
            raise SandboxFailure("this object belonged to a sandbox that has since been restarted")
        return {"$h": target._tag["$h"]}

    def _encode(self, value: Any) -> Any:
        def handle(obj: Any) -> dict:
            if isinstance(obj, (Remote, Later)):
                return self._handle(obj)
            raise codec.CodecError(f"cannot pass a {type(obj).__name__} to the submission")

        return codec.encode(value, handle)

    def _request(self, message: dict, timeout: float | None) -> Any:
        with self._pipe_lock:
            return self._request_now(message, timeout)

    def _request_now(self, message: dict, timeout: float | None) -> Any:
        if not self.alive or self._wfd is None:
            raise SandboxFailure("the submission's process is not running")
        if timeout is None:
            ask = self.current_call_timeout
            timeout = ask() if ask is not None else self.limits.call_timeout_s
        self._next_id += 1
        message = {**message, "id": self._next_id}
        try:
            codec.write_message(self._wfd, message)
        except OSError:
            self._kill()
            raise SandboxFailure(f"the submission's process died ({self._exit_reason()})") from None
        return self._receive(timeout, "answering a call", expect_id=self._next_id)

    def _receive(self, timeout: float, doing: str, expect_id: int | None = None) -> Any:
        deadline = time.monotonic() + timeout
        try:
            header = self._read(codec.HEADER_BYTES, deadline)
            size = int.from_bytes(header, "big")
            if size > codec.MAX_REPLY_BYTES:
                raise codec.CodecError(f"a reply of {size} bytes is larger than {codec.MAX_REPLY_BYTES}")
            reply = codec.loads(self._read(size, deadline))
            if expect_id is not None and reply.get("id") != expect_id:
                raise codec.CodecError("a reply to a request that was not made")
            if reply.get("ok") is True:
                decode_by = time.monotonic() + codec.DECODE_SECONDS
                return codec.decode(reply.get("value"), lambda tag: Remote(self, tag), decode_by)
            error = reply.get("error")
            if type(error) is not dict:
                raise codec.CodecError("malformed error reply")
            raise RemoteError(
                str(error.get("type", "Error"))[:200],
                str(error.get("message", "")),
                str(error.get("traceback", "")),
            )
        except TimeoutError:
            self._kill()
            raise SandboxFailure(f"no answer within {timeout:g} s while {doing} (time limit)") from None
        except EOFError:
            self._settle()
            self._kill()
            raise SandboxFailure(
                f"the submission's process died while {doing} ({self._exit_reason()})"
            ) from None
        except codec.CodecError as e:
            self._kill()
            raise SandboxFailure(
                f"the submission's process sent an unreadable reply while {doing}: {e}"
            ) from None

    def _read(self, n: int, deadline: float) -> bytes:
        chunks, left = [], n
        while left:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            ready, _, _ = select.select([self._rfd], [], [], remaining)
            if not ready:
                raise TimeoutError
            chunk = os.read(self._rfd, min(left, 1 << 20))
            if not chunk:
                raise EOFError
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def _settle(self) -> None:
        """Give a process whose pipe closed a moment to exit by itself, so its exit status is its own."""
        if self._proc is not None:
            try:
                self._proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass

    def _kill(self) -> None:
        """SIGKILL every process of the sandbox and reap it (its exit status stays readable for the
        message). Under bubblewrap, killing the PID namespace's first process kills the namespace."""
        if self._proc is not None and self._proc.returncode is None:
            proctree.kill_tree(self._proc.pid)
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if self._group is not None:  # whatever is left in its cgroup (a plain process's own sessions)
            for pid in self._group.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass

    def _exit_reason(self) -> str:
        if self._proc is None or self._proc.poll() is None:
            return "still running"
        code = self._proc.returncode
        if self.isolated and 128 < code < 128 + 65:  # bubblewrap reports a signal as 128 + its number
            code = 128 - code
        if code < 0:
            name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
            hint = {"SIGXCPU": "CPU time limit", "SIGXFSZ": "file size limit", "SIGKILL": "killed"}.get(name)
            return f"signal {name}" + (f", {hint}" if hint else "")
        return f"exit code {code}"
