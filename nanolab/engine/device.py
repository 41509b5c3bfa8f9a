"""Which torch device the engine runs on: a requested device checked, and what this machine offers.

The engine puts the model, the paged KV pool and every tensor of a step on one device (``EngineConfig.device``,
"cpu" by default). `check_device` turns the setting into a `torch.device` and refuses, with the reason, one
this machine cannot run on; `describe_cuda` is the line ``nanolab info`` prints. Left out: several devices
for one engine (tensor parallelism runs on the CPU), and devices other than the CPU and CUDA get no check
beyond a first tensor made there.
"""

from __future__ import annotations

import torch


class DeviceUnavailableError(ValueError):
    """A well-formed device that this machine (or this build of torch) cannot run on."""


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a `torch.device`, or a `ValueError` that says what is wrong and what to do.

    Anything ``torch.device(...)`` accepts is a device ("cpu", "cuda", "cuda:1", ...); "meta" is not,
    since it holds no values. A device that is well formed but cannot be used here raises
    `DeviceUnavailableError` (a `ValueError`).

    Example:
        >>> check_device("cpu")
        device(type='cpu')
        >>> check_device("gpu")
        Traceback (most recent call last):
        ...
        ValueError: device 'gpu' is not a torch device; use 'cpu', 'cuda' or 'cuda:N'
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device!r} is not a torch device; use 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type == "cpu":
        return dev
    if dev.type == "meta":
        raise ValueError("device 'meta' holds no values, so nothing can run there; use 'cpu' or 'cuda'")
    if dev.type == "cuda":
        if torch.version.cuda is None:
            raise DeviceUnavailableError(
                f"device {str(device)!r} needs CUDA, but this build of torch ({torch.__version__}) has no "
                "CUDA support; install a CUDA build of torch, or use device='cpu'"
            )
        if not torch.cuda.is_available():
            raise DeviceUnavailableError(
                f"device {str(device)!r} needs a CUDA GPU, but torch finds none on this machine; use device='cpu'"
            )
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise DeviceUnavailableError(
                f"device {str(device)!r} names GPU {dev.index}, but this machine has {count} (cuda:0 .. "
                f"cuda:{count - 1})"
            )
        return dev
    try:  # another backend (mps, xpu, ...): usable if a tensor can be made there
        torch.empty(0, device=dev)
    except (RuntimeError, AssertionError) as e:
        raise DeviceUnavailableError(
            f"device {str(device)!r} cannot be used here ({e}); use device='cpu'"
        ) from None
    return dev


def describe_cuda() -> str:
    """One line on CUDA here: the GPUs torch sees, or why there are none."""
    if torch.version.cuda is None:
        return f"cuda: not available (this build of torch, {torch.__version__}, has no CUDA support)"
    if not torch.cuda.is_available():
        return f"cuda: not available (torch {torch.__version__} is built for CUDA {torch.version.cuda}, but finds no GPU)"
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return f"cuda: available, {len(names)} GPU(s): " + ", ".join(f"cuda:{i} {n}" for i, n in enumerate(names))
