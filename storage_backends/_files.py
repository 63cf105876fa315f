"""File-system helpers shared by the file-based backends (posix, aiofiles, kvikio, zarr)."""

from __future__ import annotations

import errno
import os
import shutil
import stat
from pathlib import Path

from offload_core.errors import DiskFullError, StorageDirectoryError, StorageIOError
from offload_core.sizes import format_size

__all__ = ["prepare_directory", "fsync_path", "disk_full", "regular_size", "striped_free", "striped_total"]


def prepare_directory(directory: Path, *, create: bool, writable: bool = True) -> None:
    """Make sure ``directory`` exists (created owner-only if ``create``) and is a directory, one this
    user can write unless ``writable`` is false (a reader's: a state on read-only media is read)."""
    if not directory.exists():
        if not create:
            raise StorageDirectoryError(errno.ENOENT, f"storage directory {directory} does not exist; create it or pass create=True")
        try:
            directory.mkdir(parents=True, mode=0o700)
        except OSError as e:
            raise StorageDirectoryError(e.errno, f"cannot create storage directory {directory}: {e.strerror}; "
                                                 f"choose a directory you can write") from e
    if not directory.is_dir():
        raise StorageDirectoryError(errno.ENOTDIR, f"storage path {directory} is not a directory; give a directory")
    if writable and not os.access(directory, os.W_OK | os.X_OK):
        if os.statvfs(directory).f_flag & os.ST_RDONLY:
            raise StorageDirectoryError(errno.EROFS, f"storage directory {directory} is on a read-only file system, "
                                                     f"and an engine writes its state there: copy it to a writable "
                                                     f"disk (tiered-offload inspect, verify and export read it where "
                                                     f"it is)")
        raise StorageDirectoryError(errno.EACCES, f"storage directory {directory} is not writable by this user; "
                                                  f"fix its permissions or choose another")


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or directory by path; a file deleted meanwhile is skipped."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def striped_total(drives: list[tuple[int, float]], weights=None) -> float:
    """What a set of striped directories has of a file system's quantity (its free bytes, its rate),
    given per directory ``(its file system's st_dev, that file system's quantity)``. Directory ``i``
    takes ``w[i] / sum(w)`` of every tensor (``weights``; None: even, ``1 / n``), and the directories
    on one file system share it, so the least of quantity x ``sum(w)`` / (the weights on it)."""
    weights = weights or [1] * len(drives)
    share: dict[int, int] = {}
    for (fs, _), w in zip(drives, weights):
        share[fs] = share.get(fs, 0) + w
    return min(v * sum(weights) / share[fs] for fs, v in drives)


def striped_free(directories, weights=None) -> int:
    """Bytes a set of striped directories can take (:func:`striped_total` of their file systems'
    free bytes). A directory not made yet counts on its nearest existing parent's file system."""
    drives = []
    for d in directories:
        p = Path(d).expanduser().absolute()
        while not p.exists() and p != p.parent:
            p = p.parent
        drives.append((os.stat(p).st_dev, shutil.disk_usage(p).free))
    return int(striped_total(drives, weights))


def disk_full(key: str, path: str, needed: int, what: str = "writing") -> DiskFullError:
    """The error for ENOSPC while ``what`` ``needed`` bytes of ``key`` to ``path``, with the free space."""
    free = shutil.disk_usage(os.path.dirname(path) or ".").free
    return DiskFullError(f"disk full {what} {format_size(needed)} of {key!r} to {path} (needed {needed} bytes, "
                         f"{free} free); free space or add a storage directory",
                         path=path, needed_bytes=needed, free_bytes=free)


def regular_size(path: str | os.PathLike, key: str) -> int:
    """The size of extent ``key``'s file ``path`` (``FileNotFoundError`` if none). Anything but a
    regular file there (a FIFO, whose open would wait for a writer; a device) is a
    :class:`StorageIOError` naming it: the store writes regular files only."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise StorageIOError(errno.EINVAL, f"extent {key!r}: {path} is not a regular file (a FIFO, a device...), so "
                                           f"it was not read: something other than the store put it there. Remove "
                                           f"it and restore the directory from a copy")
    return st.st_size
