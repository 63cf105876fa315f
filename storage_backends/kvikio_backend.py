"""GPUDirect Storage through kvikio: NVMe <-> CUDA memory without a host bounce.

Loaded only when asked for by name, or by ``auto`` on a machine where GPUDirect Storage is really
on (:func:`gds_status`). It keeps the posix backend's on-disk layout (same file names, same
striping), so a directory written by one is readable by the other; host buffers take the posix
path, CUDA tensors go through ``kvikio.CuFile.pread/pwrite``.

How a device request runs: each file is opened (and registered with cuFile) once, on first use,
and stays open until the extent is deleted or the backend closes. A request is cut into its
stripes' ranges; each range is one non-blocking ``pread``/``pwrite`` that kvikio splits into
``task_size`` pieces on its own thread pool. That pool is process-wide: the backend sets its size
and task size from its ``threads`` and ``chunk_bytes`` (so from a bench-io profile too) through
``kvikio.defaults.set``, the last backend opened winning.

Where GPUDirect is not available (no ``nvidia-fs`` driver, a file system cuFile does not
support), kvikio falls back to its compatibility mode: POSIX reads into a bounce buffer, slower
than this project's posix backend. :attr:`KvikioBackend.gds_active` says which, and
:attr:`KvikioBackend.gds_reason` why; ``auto`` does not choose kvikio then.

kvikio pulls CUDA libraries and cannot do any I/O without the NVIDIA driver, so it is an optional
extra: ``pip install 'tiered-offload[gds]'``.
"""

from __future__ import annotations

import errno
import logging
import os
import threading

import torch

from offload_core.buffers import is_device_buffer, tensor_bytes
from offload_core.errors import (
    BackendUnavailableError,
    ExtentNotFoundError,
    ShortReadError,
    StorageIOError,
)
from offload_core.futures import IOFuture

from ._files import disk_full
from .posix import PosixBackend

__all__ = ["KvikioBackend", "kvikio_status", "gds_status"]

log = logging.getLogger(__name__)

INSTALL_HINT = ("install it with: pip install 'tiered-offload[gds]' (kvikio-cu12, or kvikio-cu13 for CUDA 13), on a "
                "machine with the NVIDIA driver")


def kvikio_status() -> str | None:
    """None if kvikio can do I/O here (GPUDirect or its compatibility mode), else the reason it cannot."""
    try:
        import kvikio  # noqa: F401
    except ImportError as e:
        return f"kvikio is not installed ({e}); {INSTALL_HINT}"
    if not torch.cuda.is_available():
        return "no CUDA device is visible to torch (kvikio needs a GPU and the NVIDIA driver)"
    return None


def gds_status() -> tuple[bool, str]:
    """Whether kvikio would use GPUDirect Storage here (not its POSIX compatibility mode), and why."""
    reason = kvikio_status()
    if reason:
        return False, reason
    import kvikio.defaults
    try:
        compat = kvikio.defaults.is_compat_mode_preferred()
    except AttributeError:  # kvikio < 24.12
        compat = bool(kvikio.defaults.compat_mode())
    if compat:
        why = "kvikio runs in its POSIX compatibility mode here"
        try:
            from kvikio import cufile_driver
            if not cufile_driver.get("is_gds_available"):
                why += " (cuFile reports GPUDirect Storage unavailable: no nvidia-fs driver or an unsupported file system)"
        except Exception as e:  # noqa: BLE001 - a driver that cannot even be asked is the same answer
            why += f" (the cuFile driver could not be opened: {e})"
        mode = os.environ.get("KVIKIO_COMPAT_MODE")
        if mode:
            why += f"; KVIKIO_COMPAT_MODE={mode}"
        return False, why
    return True, "GPUDirect Storage is on (kvikio is not in compatibility mode)"


def _set_defaults(kvikio, threads: int, task_size: int) -> None:
    """kvikio's thread pool size and task size, through its defaults API (both spellings)."""
    try:
        kvikio.defaults.set({"num_threads": threads, "task_size": task_size})
    except AttributeError:  # kvikio < 25.02
        kvikio.defaults.num_threads_reset(threads)
        kvikio.defaults.task_size_reset(task_size)


class KvikioBackend(PosixBackend):
    """The posix backend plus zero-copy GPUDirect reads and writes of CUDA tensors."""

    name = "kvikio"

    def __init__(self, location, **options):
        super().__init__(location, **options)
        self._kvikio = None
        self.gds_active = False
        """Whether device transfers use GPUDirect Storage (else kvikio's POSIX compatibility mode)."""
        self.gds_reason = ""
        self._files: dict[str, object] = {}  # path -> open CuFile, for the backend's life
        self._files_lock = threading.Lock()

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
        self.gds_active, self.gds_reason = gds_status()
        if not self.gds_active:
            log.warning("kvikio backend: %s; device transfers will be slower than the posix backend's", self.gds_reason)
        _set_defaults(kvikio, self.threads, self.chunk_bytes)
        super()._open()

    def _close(self) -> None:
        super()._close()
        with self._files_lock:
            files, self._files = list(self._files.values()), {}
        for f in files:
            f.close()

    def open_files(self) -> int:
        """How many files the backend holds open (one CuFile per file touched, until deleted)."""
        with self._files_lock:
            return len(self._files)

    def _cufile(self, path: str, *, create: bool):
        with self._files_lock:
            f = self._files.get(path)
            if f is not None:
                return f
            if not os.path.exists(path):
                if not create:
                    raise FileNotFoundError(errno.ENOENT, "no such file", path)
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
            f = self._files[path] = self._kvikio.CuFile(path, "r+")
            return f

    def _check_buffer(self, buffer, *, for_read: bool) -> None:
        if is_device_buffer(buffer) and not buffer.is_contiguous():
            raise ValueError("device buffers must be contiguous")
        super()._check_buffer(buffer, for_read=for_read)

    def _read_into(self, key, buffer, offset) -> IOFuture:
        if not is_device_buffer(buffer):
            return super()._read_into(key, buffer, offset)
        if not self._exists(key):
            raise ExtentNotFoundError(f"extent {key!r} was never written (no file {self.describe(key)})")
        return self._device_transfer(key, tensor_bytes(buffer), offset, read=True)

    def _write_from(self, key, buffer, offset) -> IOFuture:
        if not is_device_buffer(buffer):
            return super()._write_from(key, buffer, offset)
        flat = tensor_bytes(buffer)
        with self._dirty_lock:
            self._dirty.update({p.path for p in self._parts(key, offset, flat.numel())})
        return self._device_transfer(key, flat, offset, read=False)

    def _ranges(self, key: str, offset: int, nbytes: int) -> list[tuple[str, int, int, int]]:
        """The request as (path, file_offset, buffer_start, length) ranges, contiguous pieces merged:
        one range per stripe run, which kvikio splits by its task size."""
        out: list[list] = []
        for p in self._parts(key, offset, nbytes):
            last = out[-1] if out else None
            if last and last[0] == p.path and last[1] + last[3] == p.file_offset and last[2] + last[3] == p.buf_start:
                last[3] += p.length
            else:
                out.append([p.path, p.file_offset, p.buf_start, p.length])
        return [tuple(r) for r in out]

    def _device_transfer(self, key: str, flat: torch.Tensor, offset: int, *, read: bool) -> IOFuture:
        issued = []
        try:
            for path, file_offset, start, length in self._ranges(key, offset, flat.numel()):
                if read:
                    self._check_length(key, path, file_offset, length)
                f = self._cufile(path, create=not read)
                chunk = flat[start:start + length]
                io = f.pread(chunk, length, file_offset) if read else f.pwrite(chunk, length, file_offset)
                issued.append((path, file_offset, length, io))
        except Exception as e:  # noqa: BLE001 - classified below, after what was issued is waited for
            for *_, io in issued:
                try:
                    io.get()
                except Exception:  # noqa: BLE001 - the first error is the one reported
                    pass
            return IOFuture(self._pool.submit(self._raise, key, e, read), f"{'read' if read else 'write'} {key}")
        return IOFuture(self._pool.submit(self._wait, key, issued, read), f"{'read' if read else 'write'} {key}")

    @staticmethod
    def _check_length(key: str, path: str, file_offset: int, length: int) -> None:
        """A read past the end of a file is a short read (kvikio would fail it with a bare EOF error)."""
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            return  # reported as a missing extent by the read itself
        if size < file_offset + length:
            raise ShortReadError(errno.EIO, f"short read of {key!r}: {path} ends at byte {size} but {file_offset + length - size} "
                                            f"more bytes were expected; the file was truncated or replaced behind the "
                                            f"store's back. Restore it or re-create the storage directory.")

    def _wait(self, key: str, issued: list, read: bool) -> int:
        total, first = 0, None
        for path, file_offset, length, io in issued:  # every transfer is waited for, errors or not
            try:
                n = io.get()
                if read and n != length:
                    raise ShortReadError(errno.EIO, f"short read of {key!r}: {path} gave {n} of {length} bytes at offset "
                                                    f"{file_offset}; the file was truncated behind the store's back")
                total += length
            except Exception as e:  # noqa: BLE001
                first = first or (path, e)
        if first is not None:
            self._raise(key, first[1], read, first[0])
        return total

    def _raise(self, key: str, e: Exception, read: bool, path: str | None = None):
        where = path or self.describe(key)
        if isinstance(e, (ShortReadError, ExtentNotFoundError)):
            raise e
        if isinstance(e, FileNotFoundError):
            raise ExtentNotFoundError(f"extent {key!r}: file {where} is missing (deleted behind the store's back?)") from e
        if isinstance(e, OSError):
            if e.errno == errno.ENOSPC:
                raise disk_full(key, where, 0) from e
            raise StorageIOError(e.errno, f"GPUDirect I/O on {where} for {key!r} failed: {e.strerror}") from e
        if "EOF" in str(e):  # kvikio's compatibility mode reports a read past the end this way
            raise ShortReadError(errno.EIO, f"short read of {key!r}: {where} ended before the bytes asked for; the "
                                            f"file was truncated behind the store's back ({e})") from e
        raise StorageIOError(errno.EIO, f"GPUDirect I/O on {where} for {key!r} failed: {e}") from e  # cuFile errors

    def _delete(self, key: str) -> None:
        with self._files_lock:
            handles = [self._files.pop(p) for p in self._paths(key) if p in self._files]
        for f in handles:
            f.close()
        super()._delete(key)
