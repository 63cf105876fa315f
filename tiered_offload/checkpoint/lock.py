"""The storage directory's lock: one process at a time trains in a directory (``flock``, held for the
engine's life; the lock file names its holder, for the error a second process gets); and how the
engine opens the files it keeps there (:func:`open_own`: a regular file, never through a link)."""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import stat
import sys
from pathlib import Path

from offload_core.errors import StorageDirectoryError, StorageLockedError, TieredOffloadError

log = logging.getLogger(__name__)

__all__ = ["LOCK", "DirectoryLock", "holder_gone", "read_holder", "open_own", "read_own", "create_fresh"]

LOCK = "lock"


class DirectoryLock:
    """One process per storage directory: an ``flock`` held for the engine's lifetime.

    The kernel drops the lock when its holder dies, however it dies, so a lock file left by a dead
    process is never mistaken for a live owner (no PID-reuse guessing). The file names the holder.
    """

    def __init__(self, state_dir: Path, *, path: Path | None = None, what: str | None = None,
                 advice: str = "give this run another directory", required: bool = True):
        """The lock of ``state_dir`` (``path``: another file; ``what``: the directory as the error
        names it, and ``advice`` what to do). A file system that cannot lock is a
        :class:`StorageDirectoryError`, or, not ``required``, a warning and no lock."""
        self.path = path or state_dir / LOCK
        self._what = what or f"storage directory {state_dir.parent}"
        self._advice = advice
        self._required = required
        self._fd: int | None = None
        self.took_over: dict | None = None
        """The holder recorded by a previous process that died without releasing the lock."""

    def acquire(self) -> "DirectoryLock":
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):  # (a regular file where the directory goes)
            raise StorageDirectoryError(
                f"{self.path.parent} is not a directory, and the lock of the {self._what} goes in it "
                f"({self.path}). Move it away, or {self._advice}") from None
        fd = open_own(self.path, os.O_RDWR | os.O_CREAT, StorageDirectoryError)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = read_holder(fd)
            os.close(fd)
            who = (f"process {holder.get('pid')} on {holder.get('host')} (started {holder.get('since')}: "
                   f"{holder.get('command')})") if holder else "another process"
            if holder and holder.get("host") == socket.gethostname() and not _alive(holder.get("pid")):
                who = (f"a process started by process {holder.get('pid')}, which has exited (its record: started "
                       f"{holder.get('since')}: {holder.get('command')}); a child it forked (a data loader worker, a "
                       f"subprocess) inherited the lock and still runs: stop it (`fuser -v {self.path}` names it)")
            raise StorageLockedError(f"{self._what} is in use by {who}; the lock is {self.path}. Stop that process, "
                                     f"or {self._advice}") from None
        except OSError as e:  # (a file system without flock: some network and FUSE ones)
            os.close(fd)
            if self._required:
                raise StorageDirectoryError(e.errno, f"{self._what}: its file system cannot lock {self.path} "
                                                     f"({e.strerror}), which keeps a second process out; put it on a "
                                                     f"local disk file system") from None
            log.warning("%s: its file system cannot lock %s (%s): a second process there would not be refused",
                        self._what, self.path, e.strerror)
            return self
        previous = read_holder(fd)
        if previous:
            self.took_over = previous
            log.warning("%s: taking over the lock left by process %s on %s, which is no longer running",
                        self.path, previous.get("pid"), previous.get("host"))
        me = {"pid": os.getpid(), "host": socket.gethostname(),
              "since": datetime.datetime.now().isoformat(timespec="seconds"), "command": " ".join(sys.argv)[:200]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me, sort_keys=True, separators=(",", ":")).encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)  # a clean exit leaves no holder behind
        finally:
            os.close(self._fd)  # releases the flock
            self._fd = None


def _alive(pid) -> bool:
    """Whether process ``pid`` exists on this machine (True when that cannot be told)."""
    if not isinstance(pid, int) or pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def holder_gone(path: Path) -> bool:
    """Whether the lock file ``path`` (another process's directory's) names no running holder: it names
    no one (a clean exit leaves it so) or a process of this machine that has exited. False where that
    cannot be told: no such file, one that cannot be read, a holder on another machine. A guess, for
    decisions it may get wrong safely (a process of another PID namespace looks exited)."""
    try:
        fd = open_own(path, os.O_RDONLY, StorageDirectoryError)
    except (TieredOffloadError, OSError):
        return False
    try:
        raw = os.pread(fd, 4096, 0)
    except OSError:
        return False
    finally:
        os.close(fd)
    holder = _holder(raw)
    return not raw.strip() or (holder.get("host") == socket.gethostname() and not _alive(holder.get("pid")))


def read_holder(fd: int) -> dict:
    """The holder the lock file open at ``fd`` names; ``{}``: none (empty, unreadable, or not a JSON object)."""
    try:
        return _holder(os.pread(fd, 4096, 0))
    except OSError:
        return {}


def _holder(raw: bytes) -> dict:
    try:
        record = json.loads(raw.decode(errors="replace").strip() or "{}")
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}  # (a list or a number there: damaged, names no one)


_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"),
          (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"))


def kind_of(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` that is no regular one is, in words ("a FIFO")."""
    return next((k for test, k in _KINDS if test(mode)), "not a regular file")


_RESTORE = "Remove it; where it was the manifest or the journal, restore the directory from a copy"


def open_own(path: Path, flags: int, error: type[TieredOffloadError], advice: str = _RESTORE) -> int:
    """Open ``path``, a file the engine writes itself (its lock, manifest, journal), as a regular file
    and never through a symbolic link; anything else there is ``error`` naming it, without waiting
    (a FIFO would wait for a writer, a device read without end) and without touching what a link
    points to; the message ends with ``advice``. Other ``OSError``s (none there, read-only media) are
    raised as they are."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        kind = "a symbolic link"
    else:
        mode = os.fstat(fd).st_mode
        if stat.S_ISREG(mode):
            os.set_blocking(fd, True)
            return fd
        os.close(fd)
        kind = kind_of(mode)
    raise error(f"{path} is {kind}, not the regular file the engine writes there: something else put it "
                f"there, so it was neither read nor written. {advice}")


def create_fresh(path: Path) -> int:
    """A new file at ``path`` (owner-only, open to write), whatever was there removed first (a
    crash's leftover temporary; a link or a FIFO someone left): a write never goes through a link
    nor waits on a FIFO."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)


def read_own(path: Path, error: type[TieredOffloadError], *advice: str) -> bytes:
    """The bytes of the engine's own file ``path`` (:func:`open_own`); ``FileNotFoundError`` if none."""
    fd = open_own(path, os.O_RDONLY, error, *advice)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
