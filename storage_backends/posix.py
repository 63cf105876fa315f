"""The default backend: plain files, O_DIRECT, a thread pool, RAID-0 striping over several directories.

Why this shape: on Linux, ``os.preadv``/``os.pwritev`` release the GIL, so a handful of Python
threads issuing multi-megabyte O_DIRECT requests keep an NVMe queue as full as fio does, with
no native extension to build (the libaio build failures users hit elsewhere cannot happen).

How a request runs: it is cut into parts at multiples of ``chunk_bytes`` (and of
``stripe_bytes`` when striping), and each part goes to the pool. A part's page-aligned body is
transferred with O_DIRECT straight from/into the caller's buffer when the buffer is page-aligned
(the store's buffers always are), through a per-thread aligned bounce buffer when it is not.
The unaligned head and tail of a part (less than a page each, only at the ends of an extent that
is not a multiple of 4096 bytes) go through a buffered descriptor; the kernel keeps the two
views of the file coherent because they never share a page at the same time.

Striping: with directories ``d0..dN-1``, stripe ``s`` of an extent (``stripe_bytes`` each) is
stored in ``d[s % N]`` at offset ``(s // N) * stripe_bytes`` of that directory's file for the key.
With ``stripe_weights`` (drives of unequal speed), directory ``i`` takes ``w[i]`` of every
``sum(w)`` stripes, interleaved (smooth weighted round robin): stripe ``s`` is the ``s % sum(w)``-th
of its period, whose directory is :attr:`PosixBackend._order`'s. Equal weights are the even layout.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from offload_core.buffers import PAGE, aligned_empty, byte_view
from offload_core.errors import (
    ConfigError,
    DirectIOUnsupportedError,
    ExtentNotFoundError,
    ShortReadError,
    StorageDirectoryError,
    StorageIOError,
)
from offload_core.futures import IOFuture, gather
from offload_core.sizes import parse_size

from ._files import disk_full, fsync_path, prepare_directory, regular_size, striped_free
from .base import StorageBackend, filename_to_key, key_to_filename

__all__ = ["PosixBackend", "probe_direct_io", "stripe_weights_of"]

log = logging.getLogger(__name__)

_O_DIRECT = getattr(os, "O_DIRECT", 0)
DEFAULT_THREADS = 8
"""I/O threads when neither the caller nor ``TIERED_OFFLOAD_IO_THREADS`` says."""
DEFAULT_CHUNK = "8MiB"
"""Request size when neither the caller nor ``TIERED_OFFLOAD_CHUNK`` says."""
DEFAULT_STRIPE = "4MiB"


def probe_direct_io(directory: str | os.PathLike) -> str | None:
    """Try an O_DIRECT write and read in ``directory``; return None if it works, else the reason."""
    if not _O_DIRECT:
        return "this platform has no O_DIRECT"
    probe = Path(directory) / f".tiered-offload-probe-{os.getpid()}-{threading.get_ident()}"
    buf = aligned_empty(PAGE)
    try:
        fd = os.open(probe, os.O_CREAT | os.O_RDWR | _O_DIRECT, 0o600)
    except OSError as e:
        return f"the file system refuses O_DIRECT ({e.strerror})"
    try:
        mv = byte_view(buf)
        os.pwritev(fd, [mv], 0)
        os.preadv(fd, [mv], 0)
        return None
    except OSError as e:
        return f"O_DIRECT I/O failed ({e.strerror})"
    finally:
        os.close(fd)
        try:
            os.unlink(probe)
        except OSError:
            pass


@dataclass(frozen=True)
class _Part:
    """One contiguous piece of a request: a range of one stripe file and of the caller's buffer."""
    path: str
    file_offset: int
    buf_start: int
    length: int


MAX_WEIGHT = 64
"""The largest stripe weight (a period of stripes per weight unit: more only lengthens the tables)."""


def stripe_weights_of(value, n: int) -> list[int] | None:
    """``stripe_weights`` (a list, or text such as ``"3:1"`` or ``"3,1"``) as integers reduced by their
    greatest common divisor, one per directory; None where there are none or all are equal (the
    even layout)."""
    if value is None:
        return None
    items = re.split(r"[:,]", value) if isinstance(value, str) else list(value)
    if len(items) != n:
        raise ConfigError(f"posix backend: stripe_weights: {len(items)} weights for {n} directories; give one per "
                          f"directory, in their order (3:1: the first takes 3 of every 4 stripes)")
    weights = []
    for x in items:
        try:
            w = int(x) if isinstance(x, str) or (isinstance(x, int) and not isinstance(x, bool)) else None
        except ValueError:
            w = None
        if w is None or not 1 <= w <= MAX_WEIGHT:
            raise ConfigError(f"posix backend: stripe_weights: {x!r} is not an integer from 1 to {MAX_WEIGHT}")
        weights.append(w)
    g = math.gcd(*weights)
    return None if len(set(weights)) == 1 else [w // g for w in weights]


def _order(weights: list[int]) -> list[int]:
    """The directory of each stripe of a period of ``sum(weights)``, interleaved (smooth weighted
    round robin: each turn the directory furthest behind its share, the first on ties)."""
    current, total, order = [0] * len(weights), sum(weights), []
    for _ in range(total):
        current = [c + w for c, w in zip(current, weights)]
        i = max(range(len(weights)), key=current.__getitem__)
        current[i] -= total
        order.append(i)
    return order


def _count(what: str, value) -> int:
    """A thread count given as ``what`` (an option's text, a number, the environment's), as an int."""
    try:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"posix backend: {what} must be an integer >= 1, got {value!r}") from None


class PosixBackend(StorageBackend):
    """Files in one or more directories, O_DIRECT where possible, parallel ``preadv``/``pwritev``.

    Args:
        location: a directory, a list of directories (striped RAID-0 style), or a string of
            directories separated by commas.
        threads: I/O threads (default 8, or ``TIERED_OFFLOAD_IO_THREADS``).
        chunk_bytes: largest single request handed to the kernel (default 8 MiB, or
            ``TIERED_OFFLOAD_CHUNK``). ``tiered-offload bench-io`` measures the best value.
        stripe_bytes: stripe unit when striping over several directories. Part of the on-disk
            layout: reopen a directory set with the same value it was written with.
        stripe_weights: one integer per directory (a list, or ``"3:1"``): directory ``i`` takes
            ``w[i]`` of every ``sum(w)`` stripes, so drives of unequal speed each carry their share
            (``tiered-offload bench-io`` with a ``--path`` per drive advises them). None or equal
            weights: even stripes. Part of the on-disk layout, as ``stripe_bytes``.
        direct: ``"auto"`` (O_DIRECT where the file system allows it, buffered with a logged
            reason elsewhere), ``True`` (refuse to run without it) or ``False``.
        create: create missing directories (owner-only) instead of failing.
        writable: ``False`` for a reader (``tiered-offload inspect``, ``verify``, ``export``): the
            directories need not be writable (a state on read-only media), and nothing is written.
    """

    name = "posix"

    def __init__(self, location: str | os.PathLike | Sequence[str | os.PathLike], *,
                 threads: int | None = None, chunk_bytes: int | str | None = None,
                 stripe_bytes: int | str = DEFAULT_STRIPE, direct: bool | str = "auto",
                 create: bool = True, writable: bool = True, stripe_weights=None):
        super().__init__()
        if isinstance(location, (str, os.PathLike)):
            location = [p for p in str(location).split(",") if p]
        for p in location:
            if not isinstance(p, (str, os.PathLike)) or "," in os.fspath(p):
                raise ConfigError(f"posix backend: storage directory {p!r} ({type(p).__name__}) is not a path "
                                  f"without a comma (a comma separates striped directories); give each as a str "
                                  f"or pathlib.Path")
        self.directories = [Path(p).expanduser().absolute() for p in location]
        if not self.directories:
            raise ConfigError("posix backend: give at least one directory")
        # the environment is read when a backend is made, not when this module is imported
        self.threads = _count("threads", threads) if threads else _count(
            "TIERED_OFFLOAD_IO_THREADS", os.environ.get("TIERED_OFFLOAD_IO_THREADS") or DEFAULT_THREADS)
        self.chunk_bytes = parse_size(chunk_bytes or os.environ.get("TIERED_OFFLOAD_CHUNK") or DEFAULT_CHUNK,
                                      what="chunk_bytes")
        self.stripe_bytes = parse_size(stripe_bytes, what="stripe_bytes")
        self.stripe_weights = stripe_weights_of(stripe_weights, len(self.directories))
        weights = self.stripe_weights or [1] * len(self.directories)
        self._weight = weights
        self._order = _order(weights)
        """The directory of each stripe of a period (:func:`_order`)."""
        self._slot = [self._order[:r].count(d) for r, d in enumerate(self._order)]
        """Each stripe of a period: how many of its directory's stripes come before it in the period."""
        self._positions = [[r for r, d in enumerate(self._order) if d == i] for i in range(len(weights))]
        """Per directory: the places of its stripes in a period."""
        for what, v in (("chunk_bytes", self.chunk_bytes), ("stripe_bytes", self.stripe_bytes)):
            if v <= 0 or v % PAGE:
                raise ConfigError(f"posix backend: {what} must be a positive multiple of {PAGE}, got {v}")
        if self.threads < 1:
            raise ConfigError(f"posix backend: threads must be >= 1, got {self.threads}")
        if isinstance(direct, str):
            if direct not in ("auto", "true", "false", "1", "0"):
                raise ConfigError(f"posix backend: direct must be auto, true or false, got {direct!r}")
            direct = "auto" if direct == "auto" else direct in ("true", "1")
        self.direct_mode = direct
        self.create, self.writable = create, writable
        self._direct = False
        self.direct_reason: str | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._local = threading.local()
        self._dirty: set[str] = set()
        self._dirty_lock = threading.Lock()

    # ---- capabilities / descriptions ----------------------------------------------------
    @property
    def supports_direct_io(self) -> bool:
        return self._direct

    @property
    def location(self) -> str:
        return ",".join(str(d) for d in self.directories)

    def describe(self, key: str) -> str:
        name = key_to_filename(key)
        return ", ".join(str(d / name) for d in self.directories)

    def _paths(self, key: str) -> list[str]:
        name = key_to_filename(key)
        return [str(d / name) for d in self.directories]

    # ---- life cycle ---------------------------------------------------------------------
    def _open(self) -> None:
        reasons = []
        seen: dict[tuple[int, int], Path] = {}
        for d in self.directories:
            prepare_directory(d, create=self.create, writable=self.writable)
            st = d.stat()
            first = seen.setdefault((st.st_dev, st.st_ino), d)
            if first is not d:  # stripes s and s + 1 would share a file's offsets: each overwrote the other
                raise StorageDirectoryError(
                    f"posix backend: the directory {first} is given twice (as {first} and {d}); stripe s of a tensor "
                    f"goes to directory s % {len(self.directories)}, so two of them would overwrite each other. "
                    f"Give each drive's directory once")
            if self.direct_mode is not False:
                reason = probe_direct_io(d)
                if reason:
                    reasons.append(f"{d}: {reason}")
        if self.direct_mode is False:
            self._direct, self.direct_reason = False, "direct I/O disabled by configuration"
        elif reasons:
            if self.direct_mode is True:
                raise DirectIOUnsupportedError(errno.EINVAL, "O_DIRECT required but unavailable: " + "; ".join(reasons)
                                               + ". Put the storage on a local disk file system (ext4, xfs) or pass direct=False.")
            self._direct, self.direct_reason = False, "; ".join(reasons)
            log.warning("posix backend: using buffered I/O, %s", self.direct_reason)
        else:
            self._direct = True
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="tiered-offload-posix")

    def _close(self) -> None:
        with self._dirty_lock:
            pending = bool(self._dirty)
        if pending:
            self._flush()
        self._pool.shutdown(wait=True)
        self._pool = None

    # ---- layout -------------------------------------------------------------------------
    def _parts(self, key: str, offset: int, nbytes: int) -> list[_Part]:
        paths = self._paths(key)
        n = len(paths)
        parts = []
        pos, end = offset, offset + nbytes
        while pos < end:
            nxt = min(end, (pos // self.chunk_bytes + 1) * self.chunk_bytes)
            if n > 1:
                nxt = min(nxt, (pos // self.stripe_bytes + 1) * self.stripe_bytes)
                stripe, within = divmod(pos, self.stripe_bytes)
                d, local = self._where(stripe)
                path = paths[d]
                file_offset = local * self.stripe_bytes + within
            else:
                path, file_offset = paths[0], pos
            parts.append(_Part(path, file_offset, pos - offset, nxt - pos))
            pos = nxt
        return parts

    def _where(self, stripe: int) -> tuple[int, int]:
        """Stripe ``stripe`` of an extent: its directory, and its index among that directory's stripes."""
        period, r = divmod(stripe, len(self._order))
        d = self._order[r]
        return d, period * self._weight[d] + self._slot[r]

    def _stripe(self, d: int, local: int) -> int:
        """The stripe of an extent that is directory ``d``'s ``local``-th (:meth:`_where` undone)."""
        period, k = divmod(local, self._weight[d])
        return period * len(self._order) + self._positions[d][k]

    # ---- requests -----------------------------------------------------------------------
    def _read_into(self, key: str, buffer, offset: int) -> IOFuture:
        mv = byte_view(buffer)
        if not any(os.path.exists(p) for p in self._paths(key)):
            raise ExtentNotFoundError(f"extent {key!r} was never written (no file {self.describe(key)})")
        futures = [self._pool.submit(self._read_part, key, p, mv[p.buf_start:p.buf_start + p.length])
                   for p in self._parts(key, offset, len(mv))]
        return gather(futures, f"read {key}")

    def _write_from(self, key: str, buffer, offset: int) -> IOFuture:
        mv = byte_view(buffer)
        parts = self._parts(key, offset, len(mv))
        with self._dirty_lock:
            self._dirty.update({p.path for p in parts})
        futures = [self._pool.submit(self._write_part, key, p, mv[p.buf_start:p.buf_start + p.length])
                   for p in parts]
        return gather(futures, f"write {key}")

    def _bounce(self) -> memoryview:
        b = getattr(self._local, "bounce", None)
        if b is None or len(b) < self.chunk_bytes:
            self._local.bounce_tensor = aligned_empty(self.chunk_bytes)
            b = self._local.bounce = byte_view(self._local.bounce_tensor)
        return b

    @staticmethod
    def _aligned_split(file_offset: int, length: int) -> tuple[int, int]:
        """Lengths of the unaligned head and of the page-aligned body of a file range."""
        head = min(length, (-file_offset) % PAGE)
        body = (length - head) // PAGE * PAGE
        return head, body

    def _read_part(self, key: str, part: _Part, mv: memoryview) -> int:
        try:
            return self._transfer_part(key, part, mv, read=True)
        except FileNotFoundError as e:
            raise ExtentNotFoundError(f"extent {key!r}: file {part.path} is missing (deleted behind the store's back?)") from e
        except (ShortReadError, ExtentNotFoundError):
            raise
        except OSError as e:
            raise StorageIOError(e.errno, f"reading {part.path} for {key!r} failed: {e.strerror}") from e

    def _write_part(self, key: str, part: _Part, mv: memoryview) -> int:
        try:
            return self._transfer_part(key, part, mv, read=False)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise disk_full(key, part.path, part.length) from e
            raise StorageIOError(e.errno, f"writing {part.path} for {key!r} failed: {e.strerror}") from e

    def _transfer_part(self, key: str, part: _Part, mv: memoryview, *, read: bool) -> int:
        """Move one part: the page-aligned body with O_DIRECT, a sub-page head or tail buffered."""
        head, body = self._aligned_split(part.file_offset, part.length) if self._direct else (part.length, 0)
        flags = os.O_RDONLY if read else os.O_WRONLY | os.O_CREAT
        ends = [(lo, n) for lo, n in ((0, head), (head + body, part.length - head - body)) if n]
        if ends:  # only extents whose size is not a multiple of 4096 (or buffered mode) get here
            fd = os.open(part.path, flags, 0o600)
            try:
                for lo, n in ends:
                    if read:
                        self._pread_full(fd, mv[lo:lo + n], part.file_offset + lo, key, part)
                    else:
                        self._pwrite_full(fd, mv[lo:lo + n], part.file_offset + lo)
            finally:
                os.close(fd)
        if body:
            dfd = os.open(part.path, flags | _O_DIRECT, 0o600)
            try:
                self._direct_transfer(dfd, mv[head:head + body], part.file_offset + head, key, part, read=read)
            finally:
                os.close(dfd)
        return part.length

    def _direct_transfer(self, fd: int, mv: memoryview, file_offset: int, key: str, part: _Part, *, read: bool) -> None:
        """Move a page-aligned range with O_DIRECT, bouncing through an aligned buffer if ``mv`` is not aligned."""
        address = _address(mv)
        if address % PAGE == 0:
            if read:
                self._pread_full(fd, mv, file_offset, key, part, direct=True)
            else:
                self._pwrite_full(fd, mv, file_offset)
            return
        bounce = self._bounce()
        done = 0
        while done < len(mv):
            n = min(len(bounce), len(mv) - done)
            if read:
                self._pread_full(fd, bounce[:n], file_offset + done, key, part, direct=True)
                mv[done:done + n] = bounce[:n]
            else:
                bounce[:n] = mv[done:done + n]
                self._pwrite_full(fd, bounce[:n], file_offset + done)
            done += n

    @staticmethod
    def _pread_full(fd: int, mv: memoryview, file_offset: int, key: str, part: _Part, direct: bool = False) -> None:
        done = 0
        while done < len(mv):
            n = os.preadv(fd, [mv[done:]], file_offset + done)
            # An O_DIRECT read only comes back short at end of file; retrying from an unaligned
            # offset would fail with EINVAL, so report the truncation at once.
            if n == 0 or (direct and n < len(mv) - done):
                done += n
                raise ShortReadError(
                    errno.EIO, f"short read of {key!r}: {part.path} ends at byte {file_offset + done} but "
                               f"{len(mv) - done} more bytes were expected; the file was truncated or replaced "
                               f"behind the store's back. Restore it or re-create the storage directory.")
            done += n

    @staticmethod
    def _pwrite_full(fd: int, mv: memoryview, file_offset: int) -> None:
        done = 0
        while done < len(mv):
            n = os.pwritev(fd, [mv[done:]], file_offset + done)
            if n == 0:  # pragma: no cover - the kernel reports ENOSPC instead in practice
                raise OSError(errno.ENOSPC, "write made no progress")
            done += n

    # ---- metadata -----------------------------------------------------------------------
    def _allocate(self, key, nbytes, dtype, shape) -> None:
        """Reserve the extent's blocks with ``posix_fallocate`` so a full disk fails here, not mid-step."""
        if nbytes <= 0:
            return
        per_dir = [0] * len(self.directories)
        for p in self._parts(key, 0, nbytes):
            idx = self._paths(key).index(p.path)
            per_dir[idx] = max(per_dir[idx], p.file_offset + p.length)
        for path, length in zip(self._paths(key), per_dir):
            if not length:
                continue
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                os.posix_fallocate(fd, 0, length)
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise disk_full(key, path, length, "reserving") from e
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise StorageIOError(e.errno, f"reserving space in {path} failed: {e.strerror}") from e
            finally:
                os.close(fd)
            with self._dirty_lock:
                self._dirty.add(path)

    def _delete(self, key: str) -> None:
        for p in self._paths(key):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
            with self._dirty_lock:
                self._dirty.discard(p)

    def _exists(self, key: str) -> bool:
        return any(os.path.exists(p) for p in self._paths(key))

    def _size(self, key: str) -> int:
        n = len(self.directories)
        end, found = 0, False
        for d, path in enumerate(self._paths(key)):
            try:
                local = regular_size(path, key)
            except FileNotFoundError:
                continue
            found = True
            if not local:
                continue
            if n == 1:
                end = local
                break
            k, within = divmod(local - 1, self.stripe_bytes)
            end = max(end, self._stripe(d, k) * self.stripe_bytes + within + 1)
        if not found:
            raise ExtentNotFoundError(f"extent {key!r} does not exist (no file {self.describe(key)})")
        return end

    def _keys(self) -> list[str]:
        names = set()
        for d in self.directories:
            names.update(f for f in os.listdir(d) if not f.startswith("."))
        return sorted(filename_to_key(f) for f in names)

    def _flush(self) -> None:
        with self._dirty_lock:
            dirty, self._dirty = self._dirty, set()
        for path in sorted(dirty):
            fsync_path(path)
        for d in self.directories:
            fsync_path(d)

    def _sync(self, keys: list[str]) -> None:
        paths = {p for k in keys for p in self._paths(k)}
        with self._dirty_lock:
            self._dirty -= paths
        for path in sorted(paths):
            fsync_path(path)
        for d in self.directories:
            fsync_path(d)

    def free_bytes(self) -> int | None:
        return striped_free(self.directories, self.stripe_weights)  # (directories on one file system share it)


def _address(mv: memoryview) -> int:
    """Address of a memoryview's first byte (via numpy, which reads the buffer protocol's pointer)."""
    if len(mv) == 0:
        return 0
    return np.frombuffer(mv, dtype=np.uint8).ctypes.data
