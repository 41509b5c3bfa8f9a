"""The public surface of the hidden tests: everything here is `autograder.authoring.testing`'s (see its
docstring for the contract). Hidden test modules import from this name."""

from autograder.authoring.testing import (
    VISIBILITIES,
    Learner,
    Remote,
    RemoteError,
    bundled_model,
    expect,
    expect_value_error,
    spread_out,
    stdlib_text,
)

__all__ = [
    "VISIBILITIES",
    "Learner",
    "Remote",
    "RemoteError",
    "bundled_model",
    "expect",
    "expect_value_error",
    "spread_out",
    "stdlib_text",
]
