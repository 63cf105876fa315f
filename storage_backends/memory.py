"""An in-memory backend: extents are ``bytearray`` objects in a dict. For tests and experiments.

Requests still run on a small thread pool, so concurrency bugs in callers show up here too.
"""

from __future__ import annotations

import errno
import threading
from concurrent.futures import ThreadPoolExecutor

from offload_core.buffers import byte_view
from offload_core.errors import ExtentNotFoundError, ShortReadError
from offload_core.futures import IOFuture, completed, failed

from .base import StorageBackend

__all__ = ["MemoryBackend"]


class MemoryBackend(StorageBackend):
    """Extents held in process memory; lost on close. ``location`` is only a label.

    ``threads=0`` runs every request in the caller's thread, so each returned future is already
    done: I/O takes no time, which makes the scheduler's decisions deterministic in tests.
    """

    name = "memory"

    def __init__(self, location: str | None = None, *, threads: int = 4):
        super().__init__()
        self.label = location or "memory"
        self.threads = int(threads)
        self._data: dict[str, bytearray] = {}
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    @property
    def location(self) -> str:
        return f"memory:{self.label}"

    def _open(self) -> None:
        if self.threads > 0:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="tiered-offload-memory")

    def _close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._pool = None
        self._data.clear()

    def _submit(self, run, description: str) -> IOFuture:
        if self._pool is not None:
            return IOFuture(self._pool.submit(run), description)
        try:
            return completed(run(), description)
        except BaseException as e:  # noqa: BLE001 - delivered through the future, as from a thread
            return failed(e, description)

    def _read_into(self, key, buffer, offset) -> IOFuture:
        mv = byte_view(buffer)
        with self._lock:
            if key not in self._data:
                raise ExtentNotFoundError(f"extent {key!r} was never written ({self.location})")

        def run() -> int:
            with self._lock:
                data = self._data.get(key)
                if data is None:
                    raise ExtentNotFoundError(f"extent {key!r} was deleted before the read ran ({self.location})")
                if offset + len(mv) > len(data):
                    raise ShortReadError(errno.EIO, f"short read of {key!r}: it holds {len(data)} bytes, "
                                                    f"asked for {len(mv)} at offset {offset} ({self.location})")
                mv[:] = data[offset:offset + len(mv)]
            return len(mv)

        return self._submit(run, f"read {key}")

    def _write_from(self, key, buffer, offset) -> IOFuture:
        mv = byte_view(buffer)

        def run() -> int:
            with self._lock:
                data = self._data.setdefault(key, bytearray())
                if len(data) < offset + len(mv):
                    data.extend(bytes(offset + len(mv) - len(data)))
                data[offset:offset + len(mv)] = mv
            return len(mv)

        return self._submit(run, f"write {key}")

    def _allocate(self, key, nbytes, dtype, shape) -> None:
        with self._lock:
            data = self._data.setdefault(key, bytearray())
            if len(data) < nbytes:
                data.extend(bytes(nbytes - len(data)))

    def _delete(self, key) -> None:
        with self._lock:
            self._data.pop(key, None)

    def _exists(self, key) -> bool:
        with self._lock:
            return key in self._data

    def _size(self, key) -> int:
        with self._lock:
            if key not in self._data:
                raise ExtentNotFoundError(f"extent {key!r} does not exist ({self.location})")
            return len(self._data[key])

    def _keys(self) -> list[str]:
        with self._lock:
            return sorted(self._data)

    def _flush(self) -> None:
        return None
