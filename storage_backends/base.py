"""The contract every storage backend fulfils, and the behaviour they share.

A backend stores *extents*: named runs of bytes (a tensor's bytes, or a piece of a larger object),
read into and written from caller-provided buffers at a byte offset inside the extent. Every
read and write is asynchronous and returns an :class:`~offload_core.futures.IOFuture`; reads
never allocate a buffer per request. Public methods live here and do the checks once (open?,
valid key?, writable buffer?, device buffer allowed?) and the in-flight accounting that lets
``close()`` drain safely; subclasses implement the underscored hooks.
"""

from __future__ import annotations

import abc
import re
import threading
from pathlib import Path
from typing import Any, ClassVar, Iterable, Sequence

from offload_core.buffers import buffer_nbytes, is_device_buffer
from offload_core.errors import BackendClosedError, InvalidKeyError
from offload_core.futures import IOFuture, failed

__all__ = ["StorageBackend", "validate_key", "key_to_filename", "filename_to_key"]

_MAX_KEY_LENGTH = 400
_SAFE = re.compile(r"[A-Za-z0-9_.\-]")


def validate_key(key: str) -> str:
    """Check that ``key`` can name an extent; return it unchanged.

    Keys are arbitrary strings chosen by the caller (often parameter names such as
    ``layers.3.attn.q_proj.weight/exp_avg``); they never become paths directly (see
    :func:`key_to_filename`), but empty keys, control characters and absurd lengths are refused.
    """
    if not isinstance(key, str) or not key:
        raise InvalidKeyError(f"extent key must be a non-empty string, got {key!r}")
    if len(key) > _MAX_KEY_LENGTH:
        raise InvalidKeyError(f"extent key is {len(key)} characters long; the limit is {_MAX_KEY_LENGTH}: {key[:60]!r}...")
    if any(ord(c) < 32 or ord(c) == 127 for c in key):
        raise InvalidKeyError(f"extent key {key!r} contains a control character")
    return key


def key_to_filename(key: str) -> str:
    """A single flat file name for ``key``: safe characters kept, everything else ``%XX``-escaped.

    ``/`` and ``..`` are escaped too, so no key can reach outside the storage directory, and a
    leading dot is escaped so no key becomes a hidden file or ``.``/``..``. The mapping is
    reversible (:func:`filename_to_key`).
    """
    out = []
    for i, ch in enumerate(validate_key(key)):
        if _SAFE.fullmatch(ch) and not (ch == "." and i == 0):
            out.append(ch)
        else:
            out.extend(f"%{b:02X}" for b in ch.encode("utf-8"))
    return "".join(out)


def filename_to_key(name: str) -> str:
    """Inverse of :func:`key_to_filename`."""
    raw = bytearray()
    i = 0
    while i < len(name):
        if name[i] == "%":
            raw.append(int(name[i + 1:i + 3], 16))
            i += 3
        else:
            raw.extend(name[i].encode())
            i += 1
    return raw.decode("utf-8")


class StorageBackend(abc.ABC):
    """Abstract storage backend: named extents with asynchronous, zero-allocation reads and writes.

    Life cycle: construct (no side effects), :meth:`open` (creates directories, thread pools,
    probes capabilities), any number of requests, :meth:`close` (waits for requests in flight,
    then releases resources). Usable as a context manager.

    Subclasses set :attr:`name` and implement ``_open``, ``_read_into``, ``_write_from``,
    ``_delete``, ``_exists``, ``_size``, ``_flush``, ``_close`` and, where it helps, ``_allocate``
    and ``_keys``.
    """

    name: ClassVar[str] = "abstract"
    """The name this backend is registered under (``posix``, ``zarr``...)."""

    directories: Sequence[Path] = ()
    """The directories whose files hold the extents (several: striped), for backends that keep
    extents as files; empty for the others. Durable training state (lock, manifest, journal)
    lives in the first one."""

    stripe_bytes: int | None = None
    """Bytes per stripe when extents are striped over several :attr:`directories`."""

    stripe_weights: list[int] | None = None
    """Stripes each of several :attr:`directories` takes of a period of ``sum`` of them (None: even)."""

    def __init__(self) -> None:
        self._state_lock = threading.Condition()
        self._inflight = 0
        self._is_open = False
        self._closing = False

    # ---- capabilities -------------------------------------------------------------------
    @property
    def supports_direct_io(self) -> bool:
        """True when reads and writes bypass the OS page cache (O_DIRECT or GPUDirect Storage)."""
        return False

    @property
    def supports_device_buffers(self) -> bool:
        """True when reads and writes accept CUDA tensors directly (no host staging needed)."""
        return False

    @property
    def supports_rewrite(self) -> bool:
        """True when an extent can be rewritten in place and deleted without the store growing
        (what training needs: every step rewrites its tensors). False for append-only stores."""
        return True

    @property
    def supports_durable_state(self) -> bool:
        """True when the engine can keep a committed training state here: extents are files in
        :attr:`directories`, beside which the lock, manifest and journal live."""
        return bool(self.directories)

    @property
    def location(self) -> str:
        """Human-readable description of where the bytes live, for messages."""
        return self.name

    def describe(self, key: str) -> str:
        """Where ``key``'s bytes live (a path for file backends), for error messages."""
        return f"{self.location}:{key}"

    # ---- life cycle ---------------------------------------------------------------------
    @property
    def is_open(self) -> bool:
        return self._is_open and not self._closing

    def open(self) -> "StorageBackend":
        """Acquire resources (directories, threads) and probe capabilities. Returns ``self``."""
        if not self._is_open:
            self._open()
            self._is_open = True
            self._closing = False
        return self

    def close(self) -> None:
        """Refuse new requests, wait for those in flight to finish, then release resources.

        Requests already submitted complete normally (their futures succeed or fail as they
        would have); nothing in flight is abandoned half-written. Idempotent.
        """
        with self._state_lock:
            if not self._is_open or self._closing:
                return
            self._closing = True
            while self._inflight:
                self._state_lock.wait()
        try:
            self._close()
        finally:
            self._is_open = False

    def __enter__(self) -> "StorageBackend":
        return self.open()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- requests -----------------------------------------------------------------------
    def read_into(self, key: str, buffer, offset: int = 0) -> IOFuture:
        """Read ``nbytes(buffer)`` bytes of extent ``key``, starting at ``offset``, into ``buffer``.

        The future fails with :class:`ExtentNotFoundError` if the extent was never written, and
        with :class:`ShortReadError` if it holds fewer bytes than asked for.
        """
        validate_key(key)
        self._check_buffer(buffer, for_read=True)
        self._check_offset(offset)
        return self._tracked(lambda: self._read_into(key, buffer, offset), f"read {key}")

    def write_from(self, key: str, buffer, offset: int = 0) -> IOFuture:
        """Write all of ``buffer`` into extent ``key`` at ``offset``, creating the extent if needed.

        The future succeeds only once every byte has been handed to the storage; call
        :meth:`flush` to make it durable.
        """
        validate_key(key)
        self._check_buffer(buffer, for_read=False)
        self._check_offset(offset)
        return self._tracked(lambda: self._write_from(key, buffer, offset), f"write {key}")

    def allocate(self, key: str, nbytes: int, *, dtype: str | None = None,
                 shape: Iterable[int] | None = None) -> None:
        """Declare that extent ``key`` will hold ``nbytes`` (optionally of a dtype and shape).

        File backends may reserve the space up front so a full disk shows at once, not in the
        middle of a training step; format backends (zarr) use dtype and shape to store a real
        typed array. Optional: writing without allocating works everywhere.
        """
        validate_key(key)
        self._check_open()
        self._allocate(key, int(nbytes), dtype, None if shape is None else tuple(int(s) for s in shape))

    def delete(self, key: str) -> None:
        """Remove extent ``key``; deleting an absent extent is not an error."""
        validate_key(key)
        self._check_open()
        self._delete(key)

    def exists(self, key: str) -> bool:
        """True if extent ``key`` has been written (or allocated) and not deleted."""
        validate_key(key)
        self._check_open()
        return self._exists(key)

    def size(self, key: str) -> int:
        """Number of bytes extent ``key`` holds; :class:`ExtentNotFoundError` if it does not exist."""
        validate_key(key)
        self._check_open()
        return self._size(key)

    def keys(self) -> list[str]:
        """The keys of all extents stored."""
        self._check_open()
        return self._keys()

    def flush(self) -> None:
        """Make every completed write durable (fsync or the store's equivalent)."""
        self._check_open()
        self._flush()

    def sync(self, keys: Iterable[str]) -> None:
        """Make the completed writes of ``keys`` (and their directory entries) durable.

        The default syncs everything (:meth:`flush`); file backends sync just those files.
        """
        self._check_open()
        for key in keys:
            validate_key(key)
        self._sync([*keys])

    def _sync(self, keys: list[str]) -> None:
        self._flush()

    def free_bytes(self) -> int | None:
        """Bytes that can still be written, or None when the backend cannot tell."""
        return None

    # ---- hooks for subclasses -----------------------------------------------------------
    @abc.abstractmethod
    def _open(self) -> None: ...

    @abc.abstractmethod
    def _read_into(self, key: str, buffer, offset: int) -> IOFuture: ...

    @abc.abstractmethod
    def _write_from(self, key: str, buffer, offset: int) -> IOFuture: ...

    @abc.abstractmethod
    def _delete(self, key: str) -> None: ...

    @abc.abstractmethod
    def _exists(self, key: str) -> bool: ...

    @abc.abstractmethod
    def _size(self, key: str) -> int: ...

    @abc.abstractmethod
    def _flush(self) -> None: ...

    @abc.abstractmethod
    def _close(self) -> None: ...

    def _allocate(self, key: str, nbytes: int, dtype: str | None, shape: tuple[int, ...] | None) -> None:
        return None

    def _keys(self) -> list[str]:
        raise NotImplementedError(f"the {self.name} backend cannot list its extents")

    # ---- shared checks ------------------------------------------------------------------
    def _check_open(self) -> None:
        if not self._is_open:
            raise BackendClosedError(f"{self.name} backend at {self.location} is not open; call open() first")
        if self._closing:
            raise BackendClosedError(f"{self.name} backend at {self.location} is closing; no new requests are accepted")

    def _check_offset(self, offset: int) -> None:
        if not isinstance(offset, int) or offset < 0:
            raise ValueError(f"offset must be a non-negative int, got {offset!r}")

    def _check_buffer(self, buffer, *, for_read: bool) -> None:
        if is_device_buffer(buffer) and not self.supports_device_buffers:
            raise ValueError(f"the {self.name} backend cannot use {buffer.device} buffers; stage through host memory")
        if for_read:
            if isinstance(buffer, (bytes, str)) or (isinstance(buffer, memoryview) and buffer.readonly):
                raise ValueError("read_into needs a writable buffer")
        buffer_nbytes(buffer)  # raises TypeError for objects that are not buffers

    def _tracked(self, submit, description: str) -> IOFuture:
        """Run ``submit()`` (which starts the request) under the in-flight count ``close()`` drains."""
        with self._state_lock:
            self._check_open()
            self._inflight += 1
        try:
            fut = submit()
        except BaseException as e:
            self._request_finished()
            return failed(e, description)
        fut.add_done_callback(lambda _f: self._request_finished())
        return fut

    def _request_finished(self) -> None:
        with self._state_lock:
            self._inflight -= 1
            if self._inflight == 0:
                self._state_lock.notify_all()
