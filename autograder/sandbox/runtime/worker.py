"""The sandbox side: runs a submission's code and answers the grader's calls over a pipe.

This module is the main program of the sandboxed process: under bubblewrap it is loaded by path
with `autograder.sandbox.runtime.codec` and `autograder.sandbox.runtime.confine`, the only files of the grader in the sandbox
(`autograder.sandbox.isolation`); elsewhere it runs as ``python -I -m autograder.sandbox.runtime.worker``.
Everything in this process is untrusted once the submission's first cell runs: the submission may
patch this module, write to the pipe itself or exit. That is fine, because the grader decides every
verdict in its own process from plain data it decodes itself (`autograder.sandbox.runtime.codec`), and decides
itself whether the graded names are the learner's own code (`autograder.submission.origin`); this process can
only answer wrongly, slowly or not at all, and each of those fails the test that asked. What it
reports about origins can only take credit away.

Before any submission code runs it confines itself (`autograder.sandbox.runtime.confine`): resource limits,
Landlock where the kernel offers it, and an import blocker that names why a blocked module is
missing (under bubblewrap such modules are not in the sandbox's file system at all).
Each request carries an id that its reply repeats, so a reply written ahead of time is refused.

The lab's setup code runs in a namespace of its own, and its names are then copied into the notebook's:
graded code uses them as in the notebook, but a graded cell that binds one of them again changes neither
what the setup's own functions see as their globals nor what the grader gets when it asks for that name
(it gets the setup's object; a graded name is always the notebook's). This keeps the lab's helpers the
lab's against plain rebinding only: code that rewrites their objects in place can still change them, so
the tests that count read the graded objects back through their handles.

Requests (one JSON object each, see `autograder.sandbox.runtime.codec` for framing and values)::

    {"op": "load", "cells": [{"id", "source", "setup"}], "graded": {...}}   run the cells
    {"op": "get", "target": handle or null, "name": str}                    an attribute / global
    {"op": "call", "target": handle, "args": [...], "kwargs": {...}}         call a handle
    {"op": "hold", "value": ...}                                            keep a copy, answer a handle
    {"op": "set", "target": handle, "name": str, "value": ...}              setattr (the engine's part)
    {"op": "ref", "target": handle, "name": str}                            an attribute, as a handle
    {"op": "value", "target": handle}                                       a handle's object as data
    {"op": "batch", "steps": [[kind, target, a, b], ...], "keep": [i, ...]}  calls in order (below)
    {"op": "ping"}

A batch runs its steps in order: ``["call", target, args, kwargs]``, ``["get", target, name, null]`` or
``["set", target, name, value]``. A handle with a negative id, ``-1 - i``, stands for step ``i``'s result, so
one message can call a method of an object an earlier step returned. A step that raises is recorded and the
next one runs; a step that uses a failed step's result fails with that step's error. The reply lists ``[i, ok, value or error]`` for each step in ``keep``.

Replies: ``{"ok": true, "value": ..., "id": ...}`` or ``{"ok": false, "error": {"type", "message",
"traceback"}, "id": ...}``. The first message, sent unasked, says what confinement took effect.
"""

from __future__ import annotations

import builtins
import codeop
import gc
import json
import linecache
import os
import sys
import sysconfig
import traceback
import types
from typing import Any

from autograder.sandbox.runtime import codec
from autograder.sandbox.runtime.confine import apply_limits, block_imports, confine, die_with_parent

CELL_PREFIX = "<cell "
_SCALARS = (int, float, str, bool, type(None))  # JSON values that decode to themselves
_NO_KWARGS = {"$d": []}
_STDLIB = sysconfig.get_paths()["stdlib"]


# ---------------------------------------------------------------------------------------------- objects


class _Failed(Exception):
    """A batch step used the result of an earlier step that raised: it fails with that step's error."""

    def __init__(self, error: dict) -> None:
        super().__init__(error.get("message", ""))
        self.error = error


class Worker:
    """Holds the submission's namespace and the objects handed out as handles."""

    def __init__(self) -> None:
        self.namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
        # The setup code's globals, apart from the notebook's (see the module docstring).
        self.setup: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
        self.graded_names: set[str] = set()
        self.handles: dict[int, Any] = {}
        # Like IPython: a cell's `from __future__ import ...` holds for the cells after it, and the
        # worker's own future imports do not leak into the submission's code.
        self.compile = codeop.Compile()
        self.results: list[tuple[bool, Any]] | None = None  # the steps run so far of the batch in progress

    def handle(self, obj: Any) -> dict:
        self.handles[id(obj)] = obj
        return {"$h": id(obj), "type": type(obj).__name__, "callable": callable(obj)}

    def resolve(self, tag: dict) -> Any:
        key = tag["$h"]
        if key < 0 and self.results is not None and -1 - key < len(self.results):
            ok, value = self.results[-1 - key]
            if not ok:
                raise _Failed(value)
            return value
        try:
            return self.handles[key]
        except KeyError:
            raise LookupError("unknown object handle") from None

    def encode(self, value: Any) -> Any:
        return codec.encode(value, self.handle)

    def decode(self, data: Any) -> Any:
        return codec.decode(data, self.resolve)

    # -- requests

    def load(self, cells: list[dict], graded: dict[str, list[str]]) -> dict:
        """Run the cells in order in one namespace; a cell that raises does not stop the next."""
        results = []
        self.graded_names = {name for names in graded.values() for name in names}
        for cell in cells:
            filename = f"{CELL_PREFIX}{cell['id']}>"
            source = cell["source"]
            linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
            namespace = self.setup if cell.get("setup") else self.namespace
            try:
                exec(self.compile(source, filename, "exec"), namespace)
                results.append({"id": cell["id"], "error": None})
            except BaseException as e:  # noqa: B036 - SystemExit in a cell is the cell's failure
                results.append({"id": cell["id"], "error": describe(e)})
            if cell.get("setup"):
                self.namespace.update((k, v) for k, v in self.setup.items() if not k.startswith("__"))
        origins = {name: self.origin(name) for names in graded.values() for name in names}
        return {"cells": results, "origins": origins}

    def origin(self, name: str) -> dict:
        """Where a graded object comes from: defined in the notebook's cells, or elsewhere."""
        if name not in self.namespace:
            return {"defined": False, "own": False, "where": None}
        obj = self.namespace[name]
        foreign = _foreign_parts(obj)
        return {"defined": True, "own": not foreign, "where": foreign[0] if foreign else None}

    def get(self, target: Any, name: str) -> Any:
        if target is None:
            if name in self.setup and name not in self.graded_names and not name.startswith("__"):
                return self.setup[name]
            if name not in self.namespace:
                raise NameError(f"name {name!r} is not defined")
            return self.namespace[name]
        return getattr(self.decode(target), name)

    def quick(self, data: Any) -> Any:
        """`decode`, with the common cases of a batch (a handle, a number) taken without building a decoder."""
        if type(data) in _SCALARS:
            return data
        if type(data) is dict and len(data) == 1 and type(data.get("$h")) is int:
            return self.resolve(data)
        return self.decode(data)

    def call(self, target: Any, args: list, kwargs: dict) -> Any:
        fn = self.decode(target)
        return fn(*self.decode(args), **self.decode(kwargs))

    def batch(self, steps: list, keep: list) -> list:
        """Run the steps in order (see the module docstring); the kept ones' ``[i, ok, result or error]``."""
        self.results = results = []
        kept, wanted = [], set(keep)
        try:
            for i, (kind, target, a, b) in enumerate(steps):
                try:
                    if kind == "call":
                        fn = self.quick(target)
                        args = (
                            a if type(a) is list and all(type(x) in _SCALARS for x in a) else self.decode(a)
                        )
                        value = fn(*args, **self.decode(b)) if b != _NO_KWARGS else fn(*args)
                    elif kind == "get":
                        value = self.get(target, a) if target is None else getattr(self.quick(target), a)
                    elif kind == "set":
                        value = setattr(self.quick(target), a, self.quick(b))
                    else:
                        raise ValueError(f"unknown step {kind!r}")
                    results.append((True, value))
                    if i in wanted:  # as data now: a later step may change the object
                        kept.append([i, True, self.encode(value)])
                except BaseException as e:  # noqa: B036 - as in `serve`: the step's failure only
                    error = e.error if isinstance(e, _Failed) else describe(e)
                    if len(results) == i:
                        results.append((False, error))
                    if i in wanted:
                        kept.append([i, False, self.encode(error)])
            return kept
        finally:
            self.results = None


def _code_file(obj: Any) -> str | None:
    obj = getattr(obj, "__func__", obj)  # classmethod / staticmethod / bound method
    if isinstance(obj, property):
        obj = obj.fget
    for _ in range(10):  # functools.wraps chains (lru_cache, decorators)
        if getattr(obj, "__code__", None) is not None or not hasattr(obj, "__wrapped__"):
            break
        obj = obj.__wrapped__
    code = getattr(obj, "__code__", None)
    return code.co_filename if isinstance(code, types.CodeType) else None


def _is_stdlib_base(klass: type) -> bool:
    """``object``, a builtin type, or an ``abc``/``typing`` base such as ``Protocol`` (by identity)."""
    if klass.__module__ not in ("builtins", "abc", "typing", "collections.abc"):
        return False
    module = builtins if klass.__module__ == "builtins" else sys.modules.get(klass.__module__)
    return getattr(module, klass.__name__, None) is klass


def _foreign_parts(obj: Any) -> list[str]:
    """Names of the parts of ``obj`` (a function or class) that were not defined in notebook cells."""
    if isinstance(obj, type):
        foreign = []
        for klass in obj.__mro__:
            if _is_stdlib_base(klass):
                continue
            if klass.__module__ != "__main__":
                foreign.append(f"{klass.__module__}.{klass.__qualname__}")
                continue
            for attr, value in vars(klass).items():
                filename = _code_file(value)
                if filename is None or filename.startswith(CELL_PREFIX):
                    continue
                # dataclasses, namedtuple and total_ordering generate dunder methods; they are fine
                generated = filename == "<string>" or filename.startswith(_STDLIB)
                if not (attr.startswith("__") and attr.endswith("__") and generated):
                    foreign.append(f"{klass.__qualname__}.{attr} from {filename}")
        return foreign
    filename = _code_file(obj)
    if filename is None:
        module = getattr(obj, "__module__", None) or type(obj).__module__
        return [f"{module}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"]
    return (
        [] if filename.startswith(CELL_PREFIX) else [f"{getattr(obj, '__qualname__', '?')} from {filename}"]
    )


def describe(e: BaseException) -> dict:
    """An exception as plain data, with the traceback cut to the submission's own frames."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename.startswith(CELL_PREFIX)]
    tb = "".join(traceback.format_list(frames[-8:]))
    try:
        message = str(e)
    except BaseException:  # noqa: B036 - a submission's __str__ may raise anything
        message = "<exception message could not be shown>"
    return {"type": type(e).__name__, "message": message[:2000], "traceback": tb[-4000:]}


def serve(read_fd: int, write_fd: int) -> None:
    worker = Worker()
    while True:
        collecting = gc.isenabled()
        gc.disable()  # a large message is many objects and no cycles: parsed without collections
        try:
            request = codec.read_message(read_fd)
        except (EOFError, codec.CodecError):
            return
        finally:
            if collecting:
                gc.enable()
        op = request.get("op")
        try:
            if op == "load":
                value = worker.encode(worker.load(request["cells"], request.get("graded", {})))
            elif op == "get":
                value = worker.encode(worker.get(request.get("target"), request["name"]))
            elif op == "call":
                value = worker.encode(worker.call(request["target"], request["args"], request["kwargs"]))
            elif op == "set":
                setattr(worker.decode(request["target"]), request["name"], worker.decode(request["value"]))
                value = None
            elif op == "ref":
                value = worker.handle(worker.get(request["target"], request["name"]))
            elif op == "hold":
                value = worker.handle(worker.decode(request["value"]))
            elif op == "value":
                value = worker.encode(worker.decode(request["target"]))
            elif op == "batch":
                gc.freeze()  # the batch's own steps are never garbage: collections skip them
                try:
                    value = worker.batch(request["steps"], request["keep"])
                finally:
                    gc.unfreeze()
            elif op == "ping":
                value = "pong"
            else:
                raise ValueError(f"unknown op {op!r}")
            reply = {"ok": True, "value": value, "id": request.get("id")}
        except BaseException as e:  # noqa: B036 - sys.exit() in a graded call fails that call only
            reply = {"ok": False, "error": describe(e), "id": request.get("id")}
        try:
            codec.write_message(write_fd, reply)
        except (ValueError, codec.CodecError, RecursionError) as e:
            codec.write_message(write_fd, {"ok": False, "error": describe(e), "id": request.get("id")})


def main() -> None:
    read_fd, write_fd = int(sys.argv[1]), int(sys.argv[2])
    config = json.loads(sys.argv[3])
    if config.get("parent") is not None:  # a plain process: bubblewrap's namespace does this otherwise
        die_with_parent(config["parent"])
    for module in config.get("preload", []):
        try:
            __import__(module)
        except ImportError:
            pass
    sys.stdin = open(os.devnull)  # noqa: SIM115 - stdin stays closed for the submission
    apply_limits(config["memory_mb"], config["cpu_s"], config["file_mb"], config.get("tasks", 0))
    confined = confine(os.getcwd()) if config.get("confine", True) else {"writes": False, "signals": False}
    block_imports(config.get("blocked", {}))
    sys.argv = ["submission"]
    codec.write_message(
        write_fd, {"ok": True, "value": codec.encode({"confined": confined, "pid": os.getpid()})}
    )
    serve(read_fd, write_fd)


if __name__ == "__main__":
    main()
    os._exit(0)
