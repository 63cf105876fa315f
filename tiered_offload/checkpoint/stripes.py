"""The directories of a state striped over several (``storage=[a, b]``, RAID-0): each held by the
engine that trains there, each marked with its place, so that a state is resumed, read or started
over only in its own directories, in their order.

Only the first directory holds the manifest and the journal; the others hold bytes alone, so
nothing there said whose bytes they were. Locking and reading the first alone let a fresh run whose
first directory was another state's second delete that state's files (its keys are the model's), a
resume without a stripe read other bytes and called the state damaged, and a second engine train in
a directory a live one striped into. Now:

- every directory is locked (:class:`~.lock.DirectoryLock`), not the first alone;
- a fresh start writes a record into each (``.tiered-offload/stripe.json``: the state's id, the
  directory's place, how many there are), before any tensor;
- :func:`check_stripes` refuses, with what to do, a directory given in a place other than its
  record's, another state's directory, a first directory that is another state's stripe, and a
  resume whose directories or stripe bytes are not those its manifest lists.

A state written before the records keeps only the checks its manifest allows (the count, the stripe
bytes).
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from pathlib import Path

from offload_core.errors import CheckpointError, CorruptionError
from offload_core.sizes import format_size
from storage_backends.posix import stripe_weights_of

from .durable import MANIFEST, STATE_DIR, DirectoryLock, _write_all, create_fresh, fsync_directory, read_own
from .schema import parse_json

__all__ = ["STRIPE", "read_stripe", "check_stripes", "mark_stripes", "hold_stripes", "release_stripes",
           "stripe_of_a_state"]

STRIPE = "stripe.json"


def _stripe_path(directory: Path) -> Path:
    return Path(directory) / STATE_DIR / STRIPE


def read_stripe(directory: Path) -> dict | None:
    """The record of ``directory``'s place in a striped state (None where it has none)."""
    path = _stripe_path(directory)
    try:
        data = read_own(path, CorruptionError, f"Delete {path} if {directory} holds no state you keep")
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise CorruptionError(f"{path} cannot be read ({e})") from e
    record = parse_json(data, path)
    kinds = {"state": str, "index": int, "count": int, "first": str}
    if not isinstance(record, dict) or any(type(record.get(k)) is not t for k, t in kinds.items()) \
            or not 0 <= record["index"] < record["count"]:
        raise CorruptionError(f"{path} is not a stripe record of tiered-offload (a state id, a place and a count); "
                              f"it was modified by something else. Restore it from a copy, or delete it if "
                              f"{directory} holds no state you keep")
    return record


def _has_manifest(directory: Path) -> bool:
    return os.path.lexists(Path(directory) / STATE_DIR / MANIFEST)


def check_stripes(directories: list[Path], manifest: dict | None, stripe_bytes: int | None = None,
                  stripe_weights: list[int] | None = None) -> None:
    """Refuse ``directories`` (the first holding ``manifest``, the committed state; None: none) where
    they are not one state's directories in their order: a :class:`CheckpointError` naming the
    directory and what to give instead. ``stripe_bytes`` and ``stripe_weights`` (None: even): the
    backend's layout, checked against the state's (a reader passes neither: it takes the state's)."""
    dirs = [Path(d) for d in directories]
    n, first = len(dirs), dirs[0]
    for i, d in enumerate(dirs[1:], 1):
        if _has_manifest(d):
            raise CheckpointError(
                f"{d}, given as stripe {i + 1} of {n}, holds a training state of its own ({d / STATE_DIR / MANIFEST}): "
                f"it is that state's first directory. Give a state's directories first to last, as its manifest "
                f"lists them, or another directory")
    own = read_stripe(first)
    if manifest is None and own is not None and own["index"] != 0:
        raise CheckpointError(_elsewhere(first, own, "here it is given as the first directory of a new state"))
    if manifest is not None:
        storage = manifest.get("storage") or {}
        listed = storage.get("directories") or [str(first)]
        if len(listed) != n:
            raise CheckpointError(
                f"{first / STATE_DIR / MANIFEST} says the state is striped over {len(listed)} directories "
                f"({', '.join(listed)}); {n} given ({', '.join(map(str, dirs))}). Give them all, in that order "
                f"(where they were moved, where they are now)")
        theirs = storage.get("stripe_bytes")
        if n > 1 and theirs and stripe_bytes and theirs != stripe_bytes:
            raise CheckpointError(
                f"{first / STATE_DIR / MANIFEST}: the state is striped in stripes of {format_size(theirs)}, and this "
                f"storage's are {format_size(stripe_bytes)}; give the storage stripe_bytes={theirs} "
                f"(`posix:{','.join(map(str, dirs))}?stripe_bytes={theirs}`)")
        weighed = stripe_weights_of(storage.get("stripe_weights"), n)  # (reduced, as the backend's are)
        if n > 1 and stripe_bytes and weighed != stripe_weights:
            said = ":".join(map(str, weighed)) if weighed else "even (none)"
            mine = ":".join(map(str, stripe_weights)) if stripe_weights else "even (none)"
            listed = ", ".join(map(str, weighed or []))
            how = (f"stripe_weights={said} (`posix:{','.join(map(str, dirs))}?stripe_bytes={theirs or stripe_bytes}"
                   f"&stripe_weights={said}`; tiered-offload train: offload.stripe_weights: [{listed}])"
                   if weighed else "no stripe_weights")
            raise CheckpointError(
                f"{first / STATE_DIR / MANIFEST}: the state is striped with stripe weights {said}, and this storage's "
                f"are {mine}; give the storage {how}")
    for i, d in enumerate(dirs[1:], 1):
        record = read_stripe(d)
        # with no state committed, a record of this place under this first directory is a start that died
        # before its first manifest (maybe while it wrote the records, so their ids can differ)
        ours = record is not None and record["index"] == i and record["count"] == n and (
            record["first"] == str(first) if manifest is None else own is not None and record["state"] == own["state"])
        if record is not None and not ours:
            raise CheckpointError(_elsewhere(d, record, f"here it is given as stripe {i + 1} of {n} of {first}"))
        if record is None and manifest is not None and own is not None:
            raise CheckpointError(
                f"{d} is not stripe {i + 1} of {n} of the training state in {first} (it has no "
                f"{_stripe_path(d)}, which each of that state's directories has). Give the state's directories in "
                f"their order: {', '.join((manifest.get('storage') or {}).get('directories') or [])}")


def stripe_of_a_state(directory: Path) -> str | None:
    """What a reader given ``directory`` as a state's first, where it holds none, is to be told: that it
    is another stripe of a state (give that state's first), or None."""
    record = read_stripe(directory)
    if record is None or record["index"] == 0:
        return None
    return _elsewhere(directory, record, "give that state's first directory first, and this one as its stripe "
                                         f"{record['index'] + 1} (`--stripe {directory}`)", advice=False)


def _elsewhere(directory: Path, record: dict, here: str, advice: bool = True) -> str:
    return (f"{directory} holds stripe {record['index'] + 1} of {record['count']} of the training state whose first "
            f"directory is {record['first']} ({_stripe_path(directory)}); {here}"
            + (f". Give that state's directories in their order to resume it, or another directory (delete "
               f"{directory}'s files first if that state is gone)" if advice else ""))


def mark_stripes(directories: list[Path]) -> None:
    """Record each directory's place in a fresh state striped over them (nothing for one directory)."""
    dirs = [Path(d) for d in directories]
    if len(dirs) < 2:
        return
    state = uuid.uuid4().hex
    for i, d in enumerate(dirs):
        path = _stripe_path(d)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        fd = create_fresh(tmp)
        try:
            record = {"state": state, "index": i, "count": len(dirs), "first": str(dirs[0])}
            _write_all(fd, json.dumps(record).encode(), tmp)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fsync_directory(path.parent)


def hold_stripes(directories: list[Path]) -> list[DirectoryLock]:
    """Lock every directory after the first (the caller holds the first's): a second engine that names
    one, in any place, is refused while this one lives."""
    dirs = [Path(d) for d in directories]
    locks: list[DirectoryLock] = []
    try:
        for i, d in enumerate(dirs[1:], 1):
            locks.append(DirectoryLock(d / STATE_DIR, what=f"storage directory {d} (stripe {i + 1} of {len(dirs)} of "
                                                          f"{dirs[0]})").acquire())
    except BaseException:
        release_stripes(locks)
        raise
    return locks


def release_stripes(locks: list[DirectoryLock]) -> None:
    for lock in locks:
        with contextlib.suppress(OSError):
            lock.release()
