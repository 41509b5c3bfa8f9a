"""Chooses between the C++ kernels in `nanolab._C` and their pure-Python twins.

The compiled module is used when it was built. When it is missing (no C++ compiler at install time),
nanolab warns once and uses the twins, which have the same API and behaviour, only slower. Setting
``NANOLAB_PURE_PYTHON=1`` forces the twins without a warning (useful to compare, or to debug in Python).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import warnings
from pathlib import Path
from types import ModuleType

PURE_PYTHON_ENV = "NANOLAB_PURE_PYTHON"


def _load_torchs_openmp() -> None:
    """Load the OpenMP runtime that torch's wheels ship (``torch/lib/libgomp.so.1``) before the kernels, without
    importing torch. A process loads one library per soname, so the kernels' OpenMP then runs on torch's own
    thread team, and torch, imported later, finds the runtime it was built with rather than the system's."""
    spec = importlib.util.find_spec("torch")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        runtime = Path(folder) / "lib" / "libgomp.so.1"
        if runtime.exists():
            with contextlib.suppress(OSError):
                ctypes.CDLL(str(runtime))
            return


def _load() -> tuple[ModuleType | None, str | None]:
    if os.environ.get(PURE_PYTHON_ENV, "").strip() not in ("", "0"):
        return None, f"{PURE_PYTHON_ENV} is set"
    _load_torchs_openmp()
    try:
        from nanolab import _C
    except ImportError as exc:
        warnings.warn(
            f"nanolab's C++ extension is not built ({exc}); using the pure-Python twins. "
            "Reinstall with a C++ compiler (`make setup`) for the fast kernels.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None, f"the extension is not built: {exc}"
    return _C, None


_C, why_pure = _load()
HAS_C = _C is not None


def backend() -> str:
    """``"cpp"`` when the C++ kernels are in use, else ``"python"``."""
    return "cpp" if HAS_C else "python"
