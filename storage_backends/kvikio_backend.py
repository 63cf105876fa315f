"""GPUDirect Storage through kvikio: NVMe <-> CUDA memory without a host bounce.

Loaded only when asked for by name or when ``auto`` finds a GPU and kvikio. It keeps the posix
backend's on-disk layout (same file names, same striping), so a directory written by one is
readable by the other; host buffers take the posix path, CUDA tensors go through
``kvikio.CuFile.pread/pwrite``, which uses GDS where the driver and file system allow it and
kvikio's own POSIX compat mode elsewhere (:attr:`gds_active` tells which).

kvikio pulls about 2.8 GB of CUDA libraries and cannot do any I/O without the NVIDIA driver, so it
is an optional extra: ``pip install 'tiered-offload[gds]'``.
"""

from __future__ import annotations

import errno
import logging
import os

import torch

from offload_core.buffers import is_device_buffer, tensor_bytes
from offload_core.errors import (
    BackendUnavailableError,
    ExtentNotFoundError,
    ShortReadError,
    StorageIOError,
)
from offload_core.futures import IOFuture, gather

from ._files import disk_full
from .posix import PosixBackend, _Part

__all__ = ["KvikioBackend", "kvikio_status"]

log = logging.getLogger(__name__)

INSTALL_HINT = "install it with: pip install 'tiered-offload[gds]' (the kvikio-cu12 wheel), on a machine with the NVIDIA driver"


def kvikio_status() -> str | None:
    """None if kvikio can do I/O here, else the reason it cannot."""
    try:
        import kvikio  # noqa: F401
    except ImportError as e:
        return f"kvikio is not installed ({e}); {INSTALL_HINT}"
    if not torch.cuda.is_available():
        return "no CUDA device is visible to torch (kvikio needs a GPU and the NVIDIA driver)"
    return None


class KvikioBackend(PosixBackend):
    """The posix backend plus zero-copy GPUDirect reads and writes of CUDA tensors."""

    name = "kvikio"

    def __init__(self, location, **options):
        super().__init__(location, **options)
        self._kvikio = None
        self.gds_active = False

    @property
    def supports_device_buffers(self) -> bool:
        return True

    def _open(self) -> None:
        reason = kvikio_status()
        if reason:
            raise BackendUnavailableError(f"kvikio backend unavailable: {reason}")
        import kvikio
        import kvikio.defaults
        self._kvikio = kvikio
        try:
            compat = kvikio.defaults.is_compat_mode_preferred()
        except AttributeError:  # older kvikio
            compat = bool(kvikio.defaults.compat_mode())
        self.gds_active = not compat
        if compat:
            log.warning("kvikio backend: GPUDirect Storage not available here, kvikio uses its POSIX compat mode")
        super()._open()

    def _check_buffer(self, buffer, *, for_read: bool) -> None:
        if is_device_buffer(buffer) and not buffer.is_contiguous():
            raise ValueError("device buffers must be contiguous")
        super()._check_buffer(buffer, for_read=for_read)

    def _read_into(self, key, buffer, offset) -> IOFuture:
        if not is_device_buffer(buffer):
            return super()._read_into(key, buffer, offset)
        if not self._exists(key):
            raise ExtentNotFoundError(f"extent {key!r} was never written (no file {self.describe(key)})")
        flat = tensor_bytes(buffer)
        futures = [self._pool.submit(self._gds_part, key, p, flat[p.buf_start:p.buf_start + p.length], True)
                   for p in self._parts(key, offset, flat.numel())]
        return gather(futures, f"read {key}")

    def _write_from(self, key, buffer, offset) -> IOFuture:
        if not is_device_buffer(buffer):
            return super()._write_from(key, buffer, offset)
        flat = tensor_bytes(buffer)
        parts = self._parts(key, offset, flat.numel())
        with self._dirty_lock:
            self._dirty.update({p.path for p in parts})
        futures = [self._pool.submit(self._gds_part, key, p, flat[p.buf_start:p.buf_start + p.length], False)
                   for p in parts]
        return gather(futures, f"write {key}")

    def _gds_part(self, key: str, part: _Part, chunk: torch.Tensor, read: bool) -> int:
        try:
            if not read and not os.path.exists(part.path):
                os.close(os.open(part.path, os.O_WRONLY | os.O_CREAT, 0o600))
            with self._kvikio.CuFile(part.path, "r" if read else "r+") as f:
                if read:
                    n = f.pread(chunk, part.length, part.file_offset).get()
                    if n != part.length:
                        raise ShortReadError(errno.EIO, f"short read of {key!r}: {part.path} gave {n} of {part.length} bytes at "
                                                        f"offset {part.file_offset}; the file was truncated behind the store's back")
                else:
                    n = f.pwrite(chunk, part.length, part.file_offset).get()
            return part.length
        except ShortReadError:
            raise
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise disk_full(key, part.path, part.length) from e
            raise StorageIOError(e.errno, f"GPUDirect I/O on {part.path} for {key!r} failed: {e.strerror}") from e
        except RuntimeError as e:  # kvikio reports cuFile errors as RuntimeError
            raise StorageIOError(errno.EIO, f"GPUDirect I/O on {part.path} for {key!r} failed: {e}") from e
