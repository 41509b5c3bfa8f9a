"""Faults a test can switch on in an engine that runs in another process, through files in a folder.

`faulty_engine(path, folder)` loads a checkpoint whose model's forward first looks in ``folder``:
``slow`` there makes every forward sleep 10 ms; ``fail_once`` makes the next forward raise
RuntimeError("injected failure") and removes the file. `Faults` switches them from the test's side.
The same switches work on an engine in this process (tests of the engine thread use them too).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from nanolab.engine.engine import Engine
from nanolab.model.loading import load_model, load_tokenizer

SLOW_S = 0.01


def faulty_forward(original, folder: str):
    slow, fail = os.path.join(folder, "slow"), os.path.join(folder, "fail_once")

    def forward(*args, **kwargs):
        if os.path.exists(fail):
            os.unlink(fail)
            raise RuntimeError("injected failure")
        if os.path.exists(slow):
            time.sleep(SLOW_S)
        return original(*args, **kwargs)

    return forward


def faulty_engine(path: str, folder: str, config=None) -> Engine:
    """The engine process's factory: the checkpoint at ``path``, its forward watching ``folder``."""
    model = load_model(path)
    model.forward = faulty_forward(model.forward, folder)
    return Engine(model, load_tokenizer(path), config)


def engine_noting_threads(path: str, note: str) -> Engine:
    """The engine process's factory: the checkpoint at ``path``, after writing torch's thread count to ``note``."""
    import torch

    Path(note).write_text(str(torch.get_num_threads()))
    return Engine(load_model(path), load_tokenizer(path))


class Faults:
    """The test's side of the switches in ``folder``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def slow(self) -> AbstractContextManager[None]:
        """Every forward sleeps while the block runs."""
        return self._switched("slow")

    def fail_once(self) -> AbstractContextManager[None]:
        """The next forward raises (once)."""
        return self._switched("fail_once")

    @contextmanager
    def _switched(self, name: str) -> Iterator[None]:
        flag = self.folder / name
        flag.touch()
        try:
            yield
        finally:
            flag.unlink(missing_ok=True)
