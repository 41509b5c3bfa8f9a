"""Chooses between the C++ kernels in `nanolab._C` and their pure-Python twins.

The compiled module is used when it was built. When it is missing (no C++ compiler at install time),
nanolab warns once and uses the twins, which have the same API and behaviour, only slower. Setting
``NANOLAB_PURE_PYTHON=1`` forces the twins without a warning (useful to compare, or to debug in Python).
"""

from __future__ import annotations

import os
import warnings
from types import ModuleType

PURE_PYTHON_ENV = "NANOLAB_PURE_PYTHON"


def _load() -> tuple[ModuleType | None, str | None]:
    if os.environ.get(PURE_PYTHON_ENV, "").strip() not in ("", "0"):
        return None, f"{PURE_PYTHON_ENV} is set"
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
