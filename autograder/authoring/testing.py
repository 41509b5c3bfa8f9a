"""What a hidden test module may use: the ``lab`` and ``rng`` fixtures, `expect`, and two markers.

A hidden test is an ordinary pytest function in ``autograder/tests/test_labNN*.py`` (or in an
instructor's extra folder, ``nanolab grade --tests DIR``)::

    import pytest

    from autograder.testing import expect
    from nanolab.text import bpe


    @pytest.mark.points(2)
    def test_merge_agrees_with_the_reference(lab, rng):
        \"\"\"merge replaces every occurrence of a pair, left to right\"\"\"
        ids = [rng.randrange(4) for _ in range(50)]
        got = expect(lab.merge(ids, (1, 2), 256), list, f"merge({ids}, (1, 2), 256)")
        assert got == bpe.merge(ids, (1, 2), 256), f"merge({ids}, (1, 2), 256) missed or misplaced a pair"

The contract:

- ``lab`` (a `Learner`): the submission's notebook, reached through a sandboxed process.
  ``lab.merge(...)`` runs the learner's ``merge`` there and returns plain data; an object that is not
  data (a ``Tokenizer``) comes back as a `Remote` handle whose attributes and methods are proxied.
  Whatever the learner's code raises arrives as `RemoteError`. A graded name the notebook does not
  define, that is not the learner's own code, or whose cell failed, fails the test with a message for
  the learner, and so does a process that stops answering.
- ``lab.hold(value)`` copies plain data into the sandbox and keeps it there; the handle it returns
  reaches the learner's code as that object, and ``lab.peek(handle)`` reads it back afterwards, so a
  test can check that a call leaves its input unchanged (arguments are otherwise copied both ways).
- ``lab.set(obj, name, value)`` plays the engine's part on an object of the notebook (``obj.name = value``
  there; ``value`` is data, or a handle for that object itself, such as ``lab.ref(lab.RequestStatus,
  "FINISHED")``, which is an attribute as a handle even where it would cross as data). A test that drives
  the learner's object from here, rather than through a helper of the notebook, judges only decisions that
  object made.
- ``lab.run(calls)`` sends a `Calls` list (calls, attribute reads and sets on the notebook's objects,
  each able to use an earlier one's result) in one message and runs it there in order: a speed test
  drives the graded object itself without a round trip per call.
- ``lab.time_limit(s)`` gives the calls in a block another wall-clock limit; ``lab.cpu_seconds()`` is
  the CPU time the learner's processes have used, read by the grader itself, which is what a speed
  budget should measure (against the reference's ``time.thread_time()``): neither depends on how
  busy the machine is, nor on anything the learner's code does to the grader.
- ``rng``: a `random.Random` seeded from the grading run's seed and the test, so inputs differ
  from run to run (reading the tests does not reveal them) but a run repeats with ``--seed``.
- ``@pytest.mark.points(n)``: what the test is worth (default 1). All or nothing.
- ``@pytest.mark.visibility(v)``: Gradescope's visibility of the result, one of `VISIBILITIES`
  (default "visible").
- The first line of the docstring is the test's name in every report.
- A failure's feedback is the assertion's own message (compared values are never shown), so write
  messages that say what is wrong and on which input, never the expected answer.

Tests may import nanolab's reference freely: they run in the grader, never in the sandbox.
"""

from __future__ import annotations

import functools
import os
import random
import sysconfig
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import pytest

from autograder.grading.session import SESSION_KEY, Session
from autograder.sandbox.remote import Later, Remote, RemoteError, identity

# The fixtures are not imported: a test asks for them by name.
__all__ = [
    "VISIBILITIES",
    "Calls",
    "ExceptionCatcher",
    "Learner",
    "Remote",
    "RemoteError",
    "SandboxAllocator",
    "bundled_model",
    "expect",
    "expect_value_error",
    "identity",
    "spread_out",
    "tiny_qwen2_model",
    "stdlib_text",
]

VISIBILITIES = ("visible", "hidden", "after_due_date", "after_published")


class ExceptionCatcher:
    """Calls a function of the learner's in the sandbox and keeps the exception it raises, as a handle.

    It goes through the standard library's `unittest` (`TestCase.assertRaises`), built here through
    handles, so no code of the notebook stands between the call and the exception read back: a test then
    reads the exception's type and fields (``.param``, ``.retry_after``) from the object itself. ``via``
    names a module the notebook has imported (one that imports ``sys``), the way in to ``sys.modules``.
    """

    def __init__(self, lab: Any, via: str = "logging") -> None:
        modules = lab.ref(getattr(lab, via).sys, "modules")
        unittest = modules.get("importlib").import_module("unittest")
        self.case = unittest.TestCase()
        self.exception = lab.ref(modules.get("builtins"), "Exception")

    def raised(self, function: Any, *args: Any) -> Remote | None:
        """The exception ``function(*args)`` raised in the sandbox (a handle), or None if it returned."""
        context = self.case.assertRaises(self.exception)
        try:
            context.handle("assertRaises", [function, *args], {})
        except RemoteError as e:
            if e.type_name == "AssertionError" and " not raised by " in e.message:
                return None
            raise
        return context.exception


class Calls:
    """Calls on the learner's objects, made from here and sent to the sandbox as one message (`Learner.run`).

    A speed test drives the graded object itself this way, so what it times is that object's work and not a
    helper of the notebook (which a graded cell could rewrite in place), without paying a round trip per
    call. Each method returns a `Later` standing for the step's result, usable as a later step's target or
    argument::

        calls = Calls()
        req = calls.call(lab_request_class, "r0", [1, 2, 3], keep=False)
        calls.call(add, req)          # add: a handle to scheduler.add (lab.ref(scheduler, "add"))
        results = lab.run(calls)      # the kept steps' results, in order; a raised one as a RemoteError
    """

    def __init__(self) -> None:
        self.steps: list[tuple] = []
        self.keep: list[int] = []

    def _step(self, step: tuple, keep: bool) -> Later:
        self.steps.append(step)
        if keep:
            self.keep.append(len(self.steps) - 1)
        return Later(len(self.steps) - 1)

    def call(self, function: Remote | Later, *args: Any, keep: bool = True, **kwargs: Any) -> Later:
        """``function(*args, **kwargs)`` in the sandbox."""
        return self._step(("call", function, list(args), dict(kwargs)), keep)

    def get(self, obj: Remote | Later, name: str, keep: bool = True) -> Later:
        """``obj.name`` in the sandbox."""
        return self._step(("get", obj, name, None), keep)

    def set(self, obj: Remote | Later, name: str, value: Any) -> None:
        """``obj.name = value`` in the sandbox (the engine's part, as `Learner.set`)."""
        self._step(("set", obj, name, value), False)

    def __len__(self) -> int:
        return len(self.steps)


class Learner:
    """The submission's notebook namespace as a hidden test sees it: ``lab.<name>``."""

    def __init__(self, session: Session):
        object.__setattr__(self, "_session", session)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self._session.global_(name)

    def hold(self, value: Any) -> Remote:
        """``value`` (plain data) copied into the learner's process and kept there (see the module docstring)."""
        return self._session.ready().hold(value)

    def peek(self, held: Remote) -> Any:
        """What the object behind ``held`` is now, as plain data."""
        return self._session.ready().value(held)

    def set(self, obj: Remote, name: str, value: Any) -> None:
        """``obj.name = value`` in the learner's process (see the module docstring)."""
        self._session.ready().set(obj, name, value)

    def ref(self, obj: Remote, name: str) -> Remote:
        """``obj.name`` as a handle, also where it would cross as data (see the module docstring)."""
        return self._session.ready().ref(obj, name)

    def run(self, calls: Calls) -> list[Any]:
        """Run ``calls`` in the learner's process in one round trip; the kept steps' results in order (data or
        handles), a step that raised as its `RemoteError` (returned, not raised)."""
        return self._session.ready().batch(calls.steps, calls.keep)

    def time_limit(self, seconds: float) -> AbstractContextManager[None]:
        """``with lab.time_limit(s):`` gives each call inside the block ``s`` seconds of wall clock
        instead of ``--timeout`` (for a speed budget, or a call known to be slow); restarts included."""
        return self._session.time_limit(seconds)

    def cpu_seconds(self) -> float:
        """CPU seconds the learner's processes have used so far (all of them, all threads), read by the
        grader from /proc. Take the difference around calls to measure them; a call that restarts the
        sandbox fails, so the two readings always come from one process tree."""
        return self._session.cpu_seconds()


def expect(value: Any, kind: type | tuple[type, ...], what: str) -> Any:
    """``value`` if it is plain data of type ``kind``; else fail, naming ``what`` and the type it is.

    Use it before comparing what the learner's code returned, so a wrong type gets a clear message
    (and a `Remote` handle is never compared as if it were data).

    Example:
        >>> expect([1, 2], list, "merge(...)")
        [1, 2]
        >>> expect((1, 2), list, "merge(...)")
        Traceback (most recent call last):
        ...
        AssertionError: merge(...) should be a list, but it is a tuple
    """
    if isinstance(value, kind):
        return value
    names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
    got = value.type_name + " object" if isinstance(value, Remote) else type(value).__name__
    raise AssertionError(f"{what} should be a {names}, but it is a {got}")


def expect_value_error(call: Callable[[], object], what: str) -> None:
    """Fail with ``what``, and what happened instead, unless ``call()`` raises ValueError in the learner's code."""
    try:
        call()
    except RemoteError as e:  # an exception of the learner's code
        if "ValueError" in str(e):
            return
        text = str(e)
        happened = f"it raised {text if len(text) <= 100 else text[:95] + '...'}"
    else:
        happened = "it raised nothing"
    raise AssertionError(f"{what} ({happened})")


# -- inputs that several labs' tests share (models run in the grader, never in the sandbox)


@functools.cache
def stdlib_text(*names: str) -> str:
    """The text of these modules of Python's standard library (``"textwrap.py"``, ...), joined: real text
    to tokenize, the same on every machine with this Python."""
    root = sysconfig.get_paths()["stdlib"]
    return "".join(open(os.path.join(root, name), encoding="utf-8").read() for name in names)


@functools.cache
def bundled_model() -> tuple[Any, Any]:
    """nanolab's bundled model and its tokenizer, loaded once per grading process."""
    import nanolab

    return nanolab.load_model(), nanolab.load_tokenizer()


def spread_out(model: Any, seed: int) -> Any:
    """Redraw a random model's weights larger than the training init, so that its logits are spread out
    (near-ties between the top two tokens, which make greedy outputs fragile, become rare)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if "norm" in name and name.endswith("weight") else 0.15 * noise)
    return model.eval()


def tiny_qwen2_model(seed: int, vocab_size: int = 64, max_positions: int = 64) -> Any:
    """A random Qwen2 model, tiny: one KV head for four query heads, q/k/v biases, SwiGLU, RMSNorm and RoPE.
    Its config is read from a Qwen2 ``config.json`` dict, as nanolab reads a Hugging Face checkpoint's; its
    weights, biases included, are drawn by `spread_out` (no transformers needed, none imported)."""
    from nanolab.model.hf import config_from_hf
    from nanolab.model.transformer import Transformer

    raw = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": vocab_size, "hidden_size": 32,
        "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
        "max_position_embeddings": max_positions, "tie_word_embeddings": False, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    }  # fmt: skip
    _, config = config_from_hf(raw, "a tiny Qwen2 model")
    return spread_out(Transformer(config), seed)


class SandboxAllocator:
    """A block allocator for nanolab's engine whose every call goes to an allocator in the sandbox (the
    learner's, or a setup cell's) through its handle: ``LLM(block_allocator=SandboxAllocator(lab.X(...)))``."""

    def __init__(self, remote: Remote) -> None:
        self.remote = remote
        self.num_total = remote.num_total

    @property
    def num_free(self) -> int:
        return self.remote.num_free

    def allocate(self, n: int) -> list[int]:
        return list(self.remote.allocate(n))

    def free(self, block_ids: Any) -> None:
        self.remote.free(list(block_ids))

    def incref(self, block_ids: Any) -> None:
        self.remote.incref(list(block_ids))

    def ref_count(self, block_id: int) -> int:
        return self.remote.ref_count(block_id)


# -- the fixtures (registered by the grader's pytest plugin; a test asks for them by name)


@pytest.fixture
def torch_on_one_thread():
    """torch on one thread in the grader while a test runs: its tensors are small, and idle worker
    threads would spin on the cores the learner's process needs. A module asks for it with
    ``pytestmark = pytest.mark.usefixtures("torch_on_one_thread")``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def lab(request: pytest.FixtureRequest) -> Learner:
    """The submission under test (see `Learner` and the module docstring)."""
    return Learner(request.config.stash[SESSION_KEY])


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> random.Random:
    """Random inputs for this test: the same for the same ``--seed`` and test, new for a new seed."""
    seed = request.config.stash[SESSION_KEY].seed
    return random.Random(f"{seed}:{request.node.nodeid}")
