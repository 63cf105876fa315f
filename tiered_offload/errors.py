"""The typed errors of tiered-offload (defined in :mod:`offload_core.errors`, shared with the
storage backends): each also inherits the matching builtin, so callers can catch either."""

from offload_core.errors import *  # noqa: F401,F403
from offload_core.errors import __all__  # noqa: F401
