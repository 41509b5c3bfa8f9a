"""The public surface of the hidden tests: everything here is `autograder.authoring.testing`'s (see its
docstring for the contract). Hidden test modules import from this name."""

from autograder.authoring import testing as _testing
from autograder.authoring.testing import *  # noqa: F403 - its public names, listed once in its __all__

__all__ = _testing.__all__
