"""Every error tiered-offload raises, in one place.

Each type also inherits the builtin that a caller would naturally catch (``MemoryError`` for a
budget that cannot hold a tensor, ``OSError`` for the disk, ``ImportError`` for a missing optional
package), so code that does not know this library still handles them sensibly. Messages name the
file or tensor involved and say what to do about it.

This module imports nothing from the package, so the backends can use it without cycles.
"""

from __future__ import annotations

import errno as _errno

__all__ = [
    "CorruptionError",
    "StepFailedError",
    "ClipTornError",
    "EngineClosedError",
    "StorageLockedError",
    "CheckpointError",
    "TieredOffloadError",
    "ConfigError",
    "BackendUnavailableError",
    "UnknownBackendError",
    "BackendClosedError",
    "BackendCapabilityError",
    "StorageDirectoryError",
    "DirectIOUnsupportedError",
    "ExtentNotFoundError",
    "ShortReadError",
    "DiskFullError",
    "StorageIOError",
    "TierCapacityError",
    "UnknownTensorError",
    "TensorStateError",
    "InvalidKeyError",
    "ProfileError",
    "ModelStructureError",
    "ModelInputError",
    "NonFiniteError",
    "DistributedError",
]


class TieredOffloadError(Exception):
    """Base class of every error raised by tiered-offload."""


class ConfigError(TieredOffloadError, ValueError):
    """A setting has a value the engine cannot use (bad size string, negative budget...)."""


class BackendUnavailableError(TieredOffloadError, ImportError):
    """A storage backend's optional package or hardware is missing; the message gives the install hint."""


class UnknownBackendError(TieredOffloadError, LookupError):
    """No backend is registered under the requested name."""


class BackendClosedError(TieredOffloadError, RuntimeError):
    """A request was made to a backend that is closed (or closing)."""


class BackendCapabilityError(TieredOffloadError, NotImplementedError):
    """The backend cannot do what was asked (e.g. delete from an append-only zip archive)."""


class StorageDirectoryError(TieredOffloadError, OSError):
    """A storage directory is missing, not a directory, or not writable."""


class DirectIOUnsupportedError(TieredOffloadError, OSError):
    """O_DIRECT was required but the file system refuses it (tmpfs, some overlay and network FS)."""


class ExtentNotFoundError(TieredOffloadError, KeyError):
    """A read asked for an extent that was never written (or was deleted)."""

    def __str__(self) -> str:  # KeyError quotes its argument; we want the sentence as written.
        return str(self.args[0]) if self.args else ""


class ShortReadError(TieredOffloadError, OSError):
    """The file holds fewer bytes than the extent should: truncated or replaced behind the store's back."""


class DiskFullError(TieredOffloadError, OSError):
    """Not enough free disk: reported up front by the preflight check, or when a write hits ENOSPC."""

    def __init__(self, message: str, *, path: str | None = None, needed_bytes: int | None = None,
                 free_bytes: int | None = None):
        super().__init__(_errno.ENOSPC, message)
        self.path = path
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes

    def __str__(self) -> str:
        return self.strerror

    def __reduce__(self):  # (its constructor takes keywords: copied and pickled through them)
        return _disk_full, (self.strerror, self.path, self.needed_bytes, self.free_bytes)


class StorageIOError(TieredOffloadError, OSError):
    """Any other operating-system error while reading or writing an extent; wraps the original."""


class TierCapacityError(TieredOffloadError, MemoryError):
    """A tier's byte budget cannot hold what was asked (a tensor bigger than the tier, or all of it pinned)."""


class UnknownTensorError(TieredOffloadError, KeyError):
    """No tensor is registered under that key."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class TensorStateError(TieredOffloadError, RuntimeError):
    """An operation does not fit the tensor's current state (marking dirty a copy that is not held...)."""


class InvalidKeyError(TieredOffloadError, ValueError):
    """A tensor key that could escape the storage directory or cannot be stored."""


class ProfileError(TieredOffloadError, ValueError):
    """A saved bench-io profile is unreadable or does not match this machine."""


class ModelStructureError(TieredOffloadError, ValueError):
    """The model cannot be split into streamed blocks (no block sequence found, weights shared across blocks...)."""


class ModelInputError(TieredOffloadError, ValueError):
    """The model's forward rejected the batch; the original exception is chained."""


class NonFiniteError(TieredOffloadError, FloatingPointError):
    """A loss or gradient is NaN or infinite; the training state was left untouched."""


class CorruptionError(TieredOffloadError, OSError):
    """Bytes read back do not match the checksum recorded when they were written, or a state file is unreadable."""


class StepFailedError(TieredOffloadError, RuntimeError):
    """An optimizer step's update failed part-way: the engine holds some units' new weights and the
    others' old ones, so every later call refuses; the message says how to go on (``what``: all
    but that, for a caller that says it its own way)."""

    def __init__(self, what: str, how_to_go_on: str = ""):
        super().__init__(f"{what} {how_to_go_on}".rstrip())
        self.what = what


class ClipTornError(StepFailedError):
    """A step run in the backward unclipped (``clip_norm``: exact while the gradients' total norm is
    within it) found the norm over the limit after some units were updated: the step is half applied
    (a :class:`StepFailedError`); the storage keeps the last commit. ``norm``: the total norm (``bound``:
    a lower bound of it, found before the backward ended); ``clip_norm``: the limit. Resume, and run
    that step clipped after the backward."""

    def __init__(self, what: str, how_to_go_on: str, norm: float, clip_norm: float, bound: bool = False):
        super().__init__(what, how_to_go_on)
        self.norm, self.clip_norm, self.bound = norm, clip_norm, bound


class EngineClosedError(TieredOffloadError, RuntimeError):
    """An engine was used after ``close()``: its storage is released, its memory freed."""


class StorageLockedError(TieredOffloadError, RuntimeError):
    """Another live process owns the storage directory."""


class CheckpointError(TieredOffloadError, ValueError):
    """A storage directory's committed state cannot be used (missing, wrong model, unknown format)."""


class DistributedError(TieredOffloadError, RuntimeError):
    """A collective between ranks failed or timed out, or the ranks disagree (model, optimizer, layout)."""


def _disk_full(message: str, path: str | None, needed_bytes: int | None, free_bytes: int | None) -> DiskFullError:
    return DiskFullError(message, path=path, needed_bytes=needed_bytes, free_bytes=free_bytes)
