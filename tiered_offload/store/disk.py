"""The store's disk tier: the storage backend and what the store adds on top of it.

* opening the backend from ``storage=`` (a spec string, a directory, a backend object), tuned by
  the bench-io profile of its file system;
* versioned extents (``key@N``: a new version never overwrites the committed one);
* checksums recorded as bytes are written, checked as they are read back;
* disk space reserved (or checked) when a tensor is registered;
* the time any transfer is in flight (``disk_busy_seconds``: the rate the disk delivered).

:class:`DiskTier` is owned by :class:`~tiered_offload.store.tiered_store.TieredStore` and shares
its lock and counters; it never decides *when* bytes move, only how they reach the backend.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future

import torch

from offload_core.errors import ConfigError, CorruptionError, DiskFullError
from offload_core.futures import IOFuture
from storage_backends.base import StorageBackend
from tiered_offload.checkpoint.layout import extent_name
from tiered_offload.store.checksum import checksum_function, describe, device_checksum, matches
from tiered_offload.store.record import StoreStats, TensorRecord

__all__ = ["DiskTier", "open_backend"]

log = logging.getLogger(__name__)


def open_backend(backend_arg, profile=None) -> tuple[StorageBackend, bool]:
    """The backend for ``backend_arg`` (a backend object, a spec string, a directory), opened;
    and whether the caller owns it (opened it, so closes it). ``profile``: a bench-io profile
    file whose recommended options tune a file backend on the same file system (None: the
    default profile file, ``TIERED_OFFLOAD_PROFILE`` or the per-user one)."""
    from storage_backends import create_backend, resolve_storage  # the registry imports this package's errors
    from tiered_offload.profile import profile_path, tuned_options
    spec = resolve_storage(backend_arg)
    if spec.backend is not None:
        backend, owns = spec.backend, not spec.backend.is_open
    else:
        # bench-io profiles tune the file backends (threads, request size, direct I/O)
        tuned = spec.name in ("posix", "kvikio", "auto") and spec.location
        defaults = tuned_options(spec.location, profile) if tuned else {}
        try:
            backend = create_backend(spec, defaults=defaults)
        except ConfigError as e:
            if not defaults:
                raise
            backend = create_backend(spec)  # (the caller's own options failing too: their error)
            log.warning("the I/O profile %s recommends options %s that %s refuses (%s); opened without them: delete "
                        "the file or run tiered-offload bench-io --save-profile again", profile_path(profile), defaults,
                        spec.name, e)
        owns = True
    if owns:
        backend.open()
    if not backend.supports_rewrite:
        if owns:
            backend.close()
        raise ConfigError(
            f"storage {backend.location} cannot rewrite or delete a tensor in place (a zip archive only appends: it "
            f"would grow with every write). Give a directory (zarr:/path/to/state, or a plain directory) instead")
    return backend, owns


class DiskTier:
    """How the store's bytes reach the backend (see the module docstring).

    Args:
        backend: the opened backend.
        config: the store's :class:`StoreConfig` (``versioned_writes``, ``verify_checksums``,
            ``preallocate``, ``checksum``).
        lock: the store's lock (records and counters are mutated under it).
        stats: the store's counters (``disk_busy_seconds`` is kept here).
    """

    def __init__(self, backend: StorageBackend, config, lock, stats: StoreStats):
        self.backend = backend
        self.config = config
        self._lock = lock
        self._stats = stats
        self.checksum_fn = checksum_function(config.checksum)
        self._inflight = 0
        self._since = 0.0

    @property
    def checksum(self) -> str:
        """The checksum algorithm of the disk copies (``"xxh3"`` or ``"crc32"``)."""
        return self.checksum_fn.__name__

    # ---- space -----------------------------------------------------------------------------
    def reserve(self, rec: TensorRecord) -> None:
        """Reserve ``rec``'s disk space (``preallocate``), or refuse a tensor the free space cannot hold."""
        if rec.nbytes == 0:
            return
        if self.config.preallocate and not self.config.versioned_writes and not rec.scratch:
            self.backend.allocate(rec.key, rec.nbytes, dtype=str(rec.dtype).replace("torch.", ""), shape=rec.shape)
            return
        free = self.backend.free_bytes()
        if free is not None and rec.nbytes > free:
            raise DiskFullError(
                f"not enough free disk for tensor {rec.key!r} in {self.backend.location}: needed {rec.nbytes} bytes, "
                f"{free} free; free space or add a storage directory",
                path=self.backend.location, needed_bytes=rec.nbytes, free_bytes=free)

    def next_extent(self, rec: TensorRecord) -> str:
        """The extent the next write of ``rec`` goes to (a new version when writes are versioned)."""
        if not self.config.versioned_writes or rec.scratch:
            return rec.key
        with self._lock:
            rec.disk_gen += 1
            return extent_name(rec.key, rec.disk_gen)

    def delete_quietly(self, extent: str) -> None:
        """Delete a superseded extent; a failure leaves a file behind and is logged, not raised."""
        try:
            self.backend.delete(extent)
        except Exception as e:  # noqa: BLE001 - a leftover file is reported, not fatal
            log.warning("could not delete superseded extent %r: %s", extent, e)

    # ---- transfers ---------------------------------------------------------------------------
    def write(self, extent: str, raw: torch.Tensor) -> tuple[IOFuture, list | None]:
        """Start writing ``raw`` to ``extent``. Returns the future and, when checksums are on, a
        one-element list the bytes' checksum lands in before the future resolves."""
        fut = self._timed(lambda: self.backend.write_from(extent, raw))
        if not self.config.verify_checksums:
            return fut, None
        # the checksum runs on the I/O thread that finished the write (off the GIL), so the caller
        # goes on and the backend's other threads keep the disk busy meanwhile
        return self._checksummed(fut, raw)

    def read(self, rec: TensorRecord, raw: torch.Tensor) -> IOFuture:
        """Read ``rec``'s disk copy into ``raw``; fail with :class:`CorruptionError` if its checksum differs."""
        with self._lock:
            extent, expected = rec.disk_key or rec.key, rec.disk_crc
        inner = self._timed(lambda: self.backend.read_into(extent, raw))
        if expected is None or not self.config.verify_checksums:
            return inner
        out: Future = Future()

        def check(f: IOFuture) -> None:
            error = f.exception()
            if error is None:
                try:
                    ok, actual = matches(raw, expected, self.checksum)
                    if not ok:
                        error = CorruptionError(
                            f"tensor {rec.key!r}: the bytes read from {self.backend.describe(extent)} do not match "
                            f"the checksum recorded when they were written ({describe(actual, self.checksum)}, "
                            f"expected {describe(expected, self.checksum)}); the file was modified or the disk "
                            f"returned bad data. Restore the directory from a copy, or run `tiered-offload verify` "
                            f"on it to list every damaged tensor")
                except BaseException as e:  # noqa: BLE001 - whatever went wrong reaches the waiter
                    error = e
            if error is not None:
                out.set_exception(error)
            else:
                out.set_result(f.get())
        inner.add_done_callback(check)
        return IOFuture(out, f"read {rec.key}")

    def _timed(self, start) -> IOFuture:
        """Start a backend transfer, counting the time any is in flight (``disk_busy_seconds``)."""
        with self._lock:
            if self._inflight == 0:
                self._since = time.perf_counter()
            self._inflight += 1

        def end(_f=None) -> None:
            with self._lock:
                self._inflight -= 1
                if self._inflight == 0:
                    self._stats.disk_busy_seconds += time.perf_counter() - self._since
        try:
            fut = start()
        except BaseException:
            end()
            raise
        fut.add_done_callback(end)
        return fut

    def _checksummed(self, write: IOFuture, raw: torch.Tensor) -> tuple[IOFuture, list]:
        """``write``, then the checksum of ``raw`` computed where the write completed; the checksum
        lands in the returned one-element list before the returned future resolves."""
        checksum_out: list = [None]
        out: Future = Future()

        def done(f: IOFuture) -> None:
            error = f.exception()
            if error is None:
                try:
                    checksum_out[0] = device_checksum(raw, self.checksum)  # on a GPU buffer: computed there
                except BaseException as e:  # noqa: BLE001 - reported through the future
                    error = e
            if error is not None:
                out.set_exception(error)
            else:
                out.set_result(f.get())
        write.add_done_callback(done)
        return IOFuture(out, write.description), checksum_out
