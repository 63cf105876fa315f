"""The portable asyncio fallback: files through ``aiofiles``, buffered I/O, one directory.

It runs anywhere Python does (no O_DIRECT, no ``preadv``), at a fraction of the posix backend's
speed (bench-io measures how much); use it where the posix backend cannot run.
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
from pathlib import Path

import aiofiles
import aiofiles.os

from offload_core.buffers import byte_view
from offload_core.errors import (
    ConfigError,
    ExtentNotFoundError,
    ShortReadError,
    StorageIOError,
)
from offload_core.futures import IOFuture
from offload_core.sizes import parse_size

from . import _aio
from ._files import disk_full, fsync_path, prepare_directory, regular_size
from .base import StorageBackend, filename_to_key, key_to_filename

__all__ = ["AiofilesBackend"]


class AiofilesBackend(StorageBackend):
    """One file per extent in ``location``; each request is split into ``chunk_bytes`` pieces run concurrently."""

    name = "aiofiles"

    def __init__(self, location: str | os.PathLike, *, chunk_bytes: int | str = "8MiB", create: bool = True):
        super().__init__()
        if not location or "," in str(location):
            raise ConfigError("aiofiles backend: give exactly one directory (striping is a posix backend feature)")
        self.directory = Path(location).expanduser().absolute()
        self.chunk_bytes = parse_size(chunk_bytes, what="chunk_bytes")
        self.create = create
        self._dirty: set[str] = set()

    @property
    def location(self) -> str:
        return str(self.directory)

    @property
    def directories(self) -> list[Path]:
        return [self.directory]

    def describe(self, key: str) -> str:
        return str(self.directory / key_to_filename(key))

    def _open(self) -> None:
        prepare_directory(self.directory, create=self.create)

    def _close(self) -> None:
        if self._dirty:
            self._flush()

    def _ranges(self, nbytes: int):
        return [(s, min(nbytes, s + self.chunk_bytes)) for s in range(0, nbytes, self.chunk_bytes)]

    def _read_into(self, key, buffer, offset) -> IOFuture:
        mv = byte_view(buffer)
        path = self.describe(key)
        if not os.path.exists(path):
            raise ExtentNotFoundError(f"extent {key!r} was never written (no file {path})")

        async def one(a: int, b: int) -> int:
            async with aiofiles.open(path, "rb", buffering=0) as f:
                await f.seek(offset + a)
                done = 0
                while done < b - a:
                    n = await f.readinto(mv[a + done:b])
                    if not n:
                        raise ShortReadError(errno.EIO, f"short read of {key!r}: {path} ends at byte {offset + a + done}, "
                                                        f"{b - a - done} more bytes expected; the file was truncated behind the store's back")
                    done += n
            return b - a

        async def run() -> int:
            try:
                return sum(await asyncio.gather(*(one(a, b) for a, b in self._ranges(len(mv)))))
            except FileNotFoundError as e:
                raise ExtentNotFoundError(f"extent {key!r}: file {path} disappeared") from e
            except (ShortReadError, ExtentNotFoundError):
                raise
            except OSError as e:
                raise StorageIOError(e.errno, f"reading {path} for {key!r} failed: {e.strerror}") from e

        return IOFuture(_aio.submit(run()), f"read {key}")

    def _write_from(self, key, buffer, offset) -> IOFuture:
        mv = byte_view(buffer)
        path = self.describe(key)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
        self._dirty.add(path)

        async def one(a: int, b: int) -> int:
            async with aiofiles.open(path, "r+b", buffering=0) as f:
                await f.seek(offset + a)
                done = 0
                while done < b - a:
                    done += await f.write(mv[a + done:b])
            return b - a

        async def run() -> int:
            try:
                return sum(await asyncio.gather(*(one(a, b) for a, b in self._ranges(len(mv)))))
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise disk_full(key, path, len(mv)) from e
                raise StorageIOError(e.errno, f"writing {path} for {key!r} failed: {e.strerror}") from e

        return IOFuture(_aio.submit(run()), f"write {key}")

    def _delete(self, key) -> None:
        path = self.describe(key)
        self._dirty.discard(path)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def _exists(self, key) -> bool:
        return os.path.exists(self.describe(key))

    def _size(self, key) -> int:
        try:
            return regular_size(self.describe(key), key)
        except FileNotFoundError:
            raise ExtentNotFoundError(f"extent {key!r} does not exist (no file {self.describe(key)})") from None

    def _keys(self) -> list[str]:
        return sorted(filename_to_key(f) for f in os.listdir(self.directory) if not f.startswith("."))

    def _flush(self) -> None:
        dirty, self._dirty = self._dirty, set()
        for path in sorted(dirty):
            fsync_path(path)

    def free_bytes(self) -> int | None:
        return shutil.disk_usage(self.directory).free
