"""Tensors as zarr v3 arrays in any zarr store: the portable format other tools can read.

Each extent is a one-dimensional array in a flat group. When the caller declares the tensor's
dtype and shape (:meth:`StorageBackend.allocate`, which the tiered store always does), the array
has that numpy dtype and carries ``{"shape": [...], "dtype": "..."}`` attributes, so
``zarr.open_array(...)[:].reshape(attrs["shape"])`` gives the tensor back in any zarr reader.
Dtypes numpy lacks (bfloat16) and undeclared extents are stored as raw ``uint8``.

Location: a directory (``LocalStore``), a path ending in ``.zip`` (``ZipStore``), ``memory``
(``MemoryStore``), or a zarr store object.
"""

from __future__ import annotations

import errno
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import zarr
import zarr.storage

from offload_core.buffers import byte_view
from offload_core.errors import (
    BackendCapabilityError,
    ExtentNotFoundError,
    ShortReadError,
    StorageIOError,
)
from offload_core.futures import IOFuture
from offload_core.sizes import parse_size

from ._files import fsync_path
from .base import StorageBackend, filename_to_key, key_to_filename

__all__ = ["ZarrBackend"]


class ZarrBackend(StorageBackend):
    """Extents as zarr v3 arrays (uncompressed, ``chunk_bytes`` per chunk) in a zarr group."""

    name = "zarr"

    def __init__(self, location="memory", *, chunk_bytes: int | str = "4MiB", threads: int = 4):
        super().__init__()
        self._location = location
        self.chunk_bytes = parse_size(chunk_bytes, what="chunk_bytes")
        self.threads = int(threads)
        self._group = None
        self._store = None
        self._pool: ThreadPoolExecutor | None = None
        self._meta_lock = threading.RLock()
        self._io_lock: threading.Lock | None = None  # only for stores that are not thread-safe (zip)

    @property
    def location(self) -> str:
        return str(self._location) if isinstance(self._location, (str, os.PathLike)) else type(self._location).__name__

    def _open(self) -> None:
        loc = self._location
        if isinstance(loc, (str, os.PathLike)):
            text = str(loc)
            if text in ("", "memory"):
                self._store = zarr.storage.MemoryStore()
            elif text.endswith(".zip"):
                Path(text).expanduser().parent.mkdir(parents=True, exist_ok=True)
                self._store = zarr.storage.ZipStore(os.path.expanduser(text), mode="a")
                self._io_lock = threading.Lock()
            else:
                Path(text).expanduser().mkdir(parents=True, exist_ok=True, mode=0o700)
                self._store = zarr.storage.LocalStore(os.path.expanduser(text))
        else:
            self._store = loc
        self._group = zarr.open_group(store=self._store, mode="a")
        self._pool = ThreadPoolExecutor(1 if self._io_lock else self.threads, thread_name_prefix="tiered-offload-zarr")

    @property
    def supports_rewrite(self) -> bool:
        """A ``.zip`` store appends a new entry on every rewrite and cannot delete one."""
        return not isinstance(self._location, (str, os.PathLike)) or not str(self._location).endswith(".zip")

    def _close(self) -> None:
        self._pool.shutdown(wait=True)
        self._pool = None
        if isinstance(self._store, zarr.storage.ZipStore):
            self._store.close()

    # ---- arrays -------------------------------------------------------------------------
    def _array(self, key: str):
        name = key_to_filename(key)
        with self._meta_lock:
            if name not in self._group:
                return None
            return self._group[name]

    def _create(self, key: str, nbytes: int, dtype: np.dtype, shape=None, torch_dtype: str | None = None):
        itemsize = dtype.itemsize
        arr = self._group.create_array(
            key_to_filename(key), shape=(nbytes // itemsize,), dtype=dtype,
            chunks=(max(1, self.chunk_bytes // itemsize),), compressors=None, fill_value=0, overwrite=True)
        arr.attrs.update({"key": key, "dtype": torch_dtype or str(dtype), "shape": list(shape) if shape else [nbytes // itemsize]})
        return arr

    def _allocate(self, key, nbytes, dtype, shape) -> None:
        np_dtype = np.dtype("uint8")
        if dtype is not None:
            try:
                np_dtype = np.dtype(str(dtype).replace("torch.", ""))
            except TypeError:
                np_dtype = np.dtype("uint8")
            if nbytes % np_dtype.itemsize:
                np_dtype = np.dtype("uint8")
        with self._meta_lock:
            arr = self._array(key)
            if arr is None or arr.nbytes < nbytes:
                self._create(key, nbytes, np_dtype, shape, str(dtype).replace("torch.", "") if dtype else None)

    @staticmethod
    def _element_range(arr, key: str, offset: int, nbytes: int) -> tuple[int, int]:
        isz = arr.dtype.itemsize
        if offset % isz or nbytes % isz:
            raise ValueError(f"extent {key!r} is stored as {arr.dtype}: byte offset {offset} and length {nbytes} "
                             f"must be multiples of {isz}")
        return offset // isz, (offset + nbytes) // isz

    # ---- requests -----------------------------------------------------------------------
    def _read_into(self, key, buffer, offset) -> IOFuture:
        mv = byte_view(buffer)
        arr = self._array(key)
        if arr is None:
            raise ExtentNotFoundError(f"extent {key!r} was never written (zarr store {self.location})")

        def run() -> int:
            if offset + len(mv) > arr.nbytes:
                raise ShortReadError(errno.EIO, f"short read of {key!r}: the zarr array holds {arr.nbytes} bytes, "
                                                f"asked for {len(mv)} at offset {offset} (store {self.location})")
            a, b = self._element_range(arr, key, offset, len(mv))
            try:
                if self._io_lock:
                    with self._io_lock:
                        data = arr[a:b]
                else:
                    data = arr[a:b]
            except OSError as e:
                raise StorageIOError(e.errno, f"reading zarr array {key!r} from {self.location} failed: {e}") from e
            mv[:] = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
            return len(mv)

        return IOFuture(self._pool.submit(run), f"read {key}")

    def _write_from(self, key, buffer, offset) -> IOFuture:
        mv = byte_view(buffer)
        with self._meta_lock:
            arr = self._array(key)
            if arr is None:
                arr = self._create(key, offset + len(mv), np.dtype("uint8"))
            elif arr.nbytes < offset + len(mv):
                arr.resize(((offset + len(mv) + arr.dtype.itemsize - 1) // arr.dtype.itemsize,))

        def run() -> int:
            a, b = self._element_range(arr, key, offset, len(mv))
            values = np.frombuffer(mv, dtype=np.uint8).view(arr.dtype)
            try:
                if self._io_lock:
                    with self._io_lock:
                        arr[a:b] = values
                else:
                    arr[a:b] = values
            except OSError as e:
                raise StorageIOError(e.errno, f"writing zarr array {key!r} to {self.location} failed: {e}") from e
            return len(mv)

        return IOFuture(self._pool.submit(run), f"write {key}")

    def _delete(self, key) -> None:
        if not self.supports_rewrite:
            raise BackendCapabilityError(
                f"cannot delete {key!r} from {self.location}: a zip archive only appends. Use a zarr directory "
                f"(zarr:/path/to/state) for training; a .zip suits a state written once")
        with self._meta_lock:
            name = key_to_filename(key)
            if name in self._group:
                del self._group[name]

    def _exists(self, key) -> bool:
        return self._array(key) is not None

    def _size(self, key) -> int:
        arr = self._array(key)
        if arr is None:
            raise ExtentNotFoundError(f"extent {key!r} does not exist (zarr store {self.location})")
        return arr.nbytes

    def _keys(self) -> list[str]:
        with self._meta_lock:
            return sorted(filename_to_key(n) for n in self._group.array_keys())

    def _flush(self) -> None:
        root = getattr(self._store, "root", None)
        if isinstance(self._store, zarr.storage.LocalStore) and root is not None:
            for dirpath, _dirs, files in os.walk(root):
                for f in files:
                    fsync_path(os.path.join(dirpath, f))
