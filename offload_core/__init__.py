"""Primitives shared by :mod:`tiered_offload` and :mod:`storage_backends`, importing neither:
typed errors, I/O futures, aligned buffers, byte sizes. Both packages build on this one, so
neither needs the other to import."""

from .errors import *  # noqa: F401,F403
from .errors import __all__ as _error_names
from .futures import IOFuture, completed, failed, gather
from .sizes import format_size, format_size_up, parse_size

__all__ = ["IOFuture", "completed", "failed", "gather", "format_size", "format_size_up", "parse_size", *_error_names]
