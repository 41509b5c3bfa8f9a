"""What comes back from a submission's process: plain data, `Remote` handles, or a failure.

A hidden test sees three outcomes of a call into the learner's code: plain data (decoded by
`autograder.sandbox.runtime.codec`), a `Remote` handle for an object that stays in the sandbox, or an exception:
`RemoteError` when the learner's code raised, `SandboxFailure` when its process did not answer.

A `Remote` talks to the process its object lives in through the small `Host` interface, which
`autograder.sandbox.process.Sandbox` provides; this module imports nothing of the grader's.
"""

from __future__ import annotations

from typing import Any, Protocol


class SandboxFailure(Exception):
    """The submission's process did not answer: it timed out, died, or sent something unreadable."""


class RemoteError(Exception):
    """The submission's code raised an exception; carries its type, message and traceback as text."""

    def __init__(self, type_name: str, message: str, traceback: str = ""):
        super().__init__(f"{type_name}: {message}" if message else type_name)
        self.type_name = type_name
        self.message = message
        self.traceback = traceback


class Later:
    """The result of an earlier call of the same `Sandbox.run` batch, used as a target or an argument
    before it exists; it crosses as a handle the sandbox resolves to that result."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __repr__(self) -> str:
        return f"<result {self.index} of the batch>"


def identity(remote: Remote) -> int:
    """The same number for every handle to one sandbox object (while that process runs), so a test can
    tell which of the objects it made a call handed back."""
    return remote._tag["$h"]


class Host(Protocol):
    """The process a `Remote`'s object lives in (`autograder.sandbox.process.Sandbox`).

    ``generation`` counts the process's restarts: a handle made by an earlier generation names an
    object that no longer exists, and `get` and `call` refuse it with `SandboxFailure`.
    """

    generation: int

    def get(self, target: Remote | None, name: str) -> Any:
        """``getattr(target, name)`` in the process (a global of the notebook when target is None)."""
        ...

    def call(self, target: Remote, args: tuple, kwargs: dict) -> Any:
        """``target(*args, **kwargs)`` in the process."""
        ...


class Remote:
    """A handle to an object living in the sandbox; attribute access and calls are proxied.

    It compares equal only to itself and has no truth value, length or iteration, so a test can
    never mistake it for data.
    """

    __slots__ = ("_sandbox", "_tag", "_generation")

    def __init__(self, sandbox: Host, tag: dict):
        object.__setattr__(self, "_sandbox", sandbox)
        object.__setattr__(self, "_tag", {"$h": tag["$h"]})
        object.__setattr__(self, "_generation", sandbox.generation)
        self._tag["type"] = str(tag.get("type", "object"))[:100]
        self._tag["callable"] = tag.get("callable") is True

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self._sandbox.get(self, name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("objects from a submission are read-only here")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._sandbox.call(self, args, kwargs)

    def __bool__(self) -> bool:
        raise TypeError(f"a {self.type_name} object from the submission has no truth value here")

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)

    @property
    def type_name(self) -> str:
        return self._tag["type"]

    def __repr__(self) -> str:
        return f"<{self.type_name} object from the submission>"
