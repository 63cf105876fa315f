"""Durable training state: the storage directory *is* the checkpoint, consistent after every step.

Layout of a storage directory (the first one when striped)::

    .tiered-offload/lock            held with flock() by the one process using the directory
    .tiered-offload/manifest.json   the last fully written step: every tensor's extent, checksum
    .tiered-offload/journal.jsonl   what happened since: at most one step's intent and unit records
    .tiered-offload/previous.json   sharded snapshot commits: the commit before, till every rank has the last
    block.0%2Fweight@7 ...          tensor extents; a new version always goes to a new extent

Protocol (redo log with copy-on-write extents). Nothing is ever overwritten in place:

1. ``step()`` makes every gradient durable, then appends an *intent* record: the step number,
   the optimizer hyperparameters and gradient scale it will use, each gradient's extent and
   checksum, and the state after the step (step counter, learning rates, scheduler, RNG,
   user dict). Once the intent is on disk the step is committed: whatever happens next, the
   state after it can be rebuilt from the previous state and those gradients.
2. Each unit's new weights and optimizer states are written to new extents; once they are
   durable a *unit* record names them, and only then are the unit's previous extents (and its
   gradient's) deleted. At most ``window`` units are between "updated" and "recorded", which
   bounds the extra disk space.
3. When every unit is recorded the manifest is rewritten atomically (temporary file, fsync,
   rename, fsync of the directory) and the journal emptied.

Snapshot commits (``commit_every=N`` with N > 1, and any run whose state fits the compute tier)
skip the journal: every Nth step, once its update is done, every durable tensor that changed is
written to a new extent in the background (beside the next forward and backward), made durable,
and the manifest replaced. Until then the previous manifest's extents stay on disk untouched, so
a crash resumes from the last commit; the price is disk space for both versions of what changed
(up to twice the state) and at most N-1 steps redone.

Sharded, every rank commits its own directory, so a crash can stop the ranks one commit apart. Each
rank keeps the manifest of the commit before (``previous.json``) and its extents until the ranks
agree, at the next step, that every one has written the new manifest; a resume finds the oldest
manifest on every rank (as its manifest or as the one kept) and goes back to it where needed.

Recovery reads the manifest and the journal, deletes extents that nothing refers to (the
remains of a write cut short), and re-runs the update for the units of a committed step that
have no unit record, from their previous extents and the gradients the intent names: the same
code on the same bytes, so the result is bitwise what the uninterrupted run computed.

Every record and the manifest carry a CRC and are checked against the format
(:mod:`.schema`); a torn last journal line (a crash mid-append) is ignored, any other damage (a
bad line with records after it, a damaged manifest, a field of the wrong type) is a
:class:`CorruptionError` naming the file and the line or field, and nothing is deleted or
truncated to "repair" it.
"""

from __future__ import annotations

import base64
import errno
import json
import logging
import os
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from offload_core.errors import (
    CheckpointError,
    CorruptionError,
    DiskFullError,
)

from .lock import DirectoryLock, create_fresh, read_own  # (re-exported: the lock is its own part)
from .schema import check_manifest, check_record, parse_json

log = logging.getLogger(__name__)

__all__ = ["STATE_DIR", "FORMAT", "READABLE_FORMATS", "manifest_checksum", "DirectoryLock", "StateFiles", "Committer", "encode_rng", "decode_rng",
           "encode_tensor", "decode_tensor", "state_directory", "CommittedState", "read_committed"]

STATE_DIR = ".tiered-offload"
FORMAT = "tiered-offload/3"
"""The storage format this version writes. Format 3 keeps the model's buffers in an extent
(``meta["buffer_file"]``), format 2 as JSON (read still); both name their checksum algorithm in
the manifest (XXH3 by default). Format 1 (0.1) recorded CRC-32s and is read as such."""
READABLE_FORMATS = {"tiered-offload/1": "crc32", "tiered-offload/2": None, FORMAT: None}
"""Formats this version reads -> the checksum they imply (None: named in the manifest)."""
MANIFEST = "manifest.json"
JOURNAL = "journal.jsonl"
PREVIOUS = "previous.json"


def state_directory(location: str) -> Path:
    """Where the lock, manifest and journal of a storage location (``dir`` or ``dir1,dir2``) live."""
    return Path(str(location).split(",")[0]).expanduser().absolute() / STATE_DIR


def fsync_directory(path: Path) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


# ---- the manifest and the journal ---------------------------------------------------------
class StateFiles:
    """The manifest (replaced atomically) and the journal (appended, one checksummed JSON line per record)."""

    def __init__(self, state_dir: Path):
        self.dir = state_dir
        self.manifest_path = state_dir / MANIFEST
        self.journal_path = state_dir / JOURNAL
        self.previous_path = state_dir / PREVIOUS
        """Sharded snapshot commits: the manifest of the commit before, kept until every rank has the
        manifest's step (:meth:`keep_previous`), so that ranks a crash left one commit apart resume at
        the older one together (:func:`~tiered_offload.engine.sharding.reconcile_resume`)."""

    def read_manifest(self) -> dict | None:
        """The manifest, checked (:func:`~.schema.check_manifest`); None when there is none."""
        return self._read_manifest(self.manifest_path)

    def read_previous(self) -> dict | None:
        """The commit before the manifest's, where one is kept (:attr:`previous_path`), checked alike."""
        return self._read_manifest(self.previous_path)

    def _read_manifest(self, path: Path) -> dict | None:
        try:
            data = read_own(path, CorruptionError)
        except FileNotFoundError:
            return None
        except CorruptionError:
            raise
        except OSError as e:
            raise CorruptionError(f"{path} cannot be read ({e})") from e
        crc, _, payload = data.partition(b" ")
        try:
            ok = int(crc, 16) == zlib.crc32(payload)
        except ValueError:
            ok = False
        if not ok:
            raise CorruptionError(f"{path} is damaged (its checksum does not match); it was modified by "
                                  f"something other than tiered-offload. Restore the directory from a copy")
        manifest = check_manifest(parse_json(payload, path), path)
        fmt = manifest.get("format")
        if fmt not in READABLE_FORMATS:
            raise CheckpointError(
                f"{path} has storage format {fmt!r}; this version of tiered-offload reads "
                f"{sorted(READABLE_FORMATS)}. Use the tiered-offload version that wrote it (a newer one, if the "
                f"format is newer), or export the weights with it (`tiered-offload export`) and start from "
                f"them with init_from")
        return manifest

    def write_manifest(self, manifest: dict) -> None:
        payload = _dumps(manifest)
        self._replace(self.manifest_path, f"{zlib.crc32(payload.encode()):08x} {payload}".encode())

    def _replace(self, path: Path, data: bytes) -> None:
        """Replace ``path`` with ``data`` atomically and durably (temporary file, fsync, rename, fsync
        of the directory)."""
        tmp = path.with_suffix(".tmp")
        fd = create_fresh(tmp)
        try:
            _write_all(fd, data, tmp)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fsync_directory(self.dir)

    def keep_previous(self) -> None:
        """Copy the manifest to :attr:`previous_path` before a new commit replaces it."""
        self._replace(self.previous_path, read_own(self.manifest_path, CorruptionError))

    def restore_previous(self) -> None:
        """Go back to the commit before the manifest's: one atomic rename (the kept copy is gone)."""
        os.replace(self.previous_path, self.manifest_path)
        fsync_directory(self.dir)

    def drop_previous(self) -> None:
        """Forget the commit before the manifest's (every rank has the manifest's)."""
        try:
            self.previous_path.unlink()
        except FileNotFoundError:
            return
        fsync_directory(self.dir)

    def read_journal(self) -> list[dict]:
        """The journal's records, without the tail of an append a crash cut short."""
        return self._parse()[0]

    def _parse(self) -> tuple[list[dict], int]:
        """The valid records and the length of the valid prefix, in bytes.

        A crash during an append leaves a *torn tail*: a last piece without its newline, or a last
        line whose checksum fails with nothing after it. That is ignored (the step it began was not
        committed). A damaged line with anything after it is *damage*, not a crash: it is reported
        as a :class:`CorruptionError` naming the line, and nothing is "repaired" (a resume that
        dropped it would lose the committed records after it, and delete the files they name)."""
        try:
            data = read_own(self.journal_path, CorruptionError)
        except FileNotFoundError:
            return [], 0
        except CorruptionError:
            raise
        except OSError as e:
            raise CorruptionError(f"{self.journal_path} cannot be read ({e})") from e
        *lines, tail = data.split(b"\n")  # a last piece without its newline is incomplete
        records, valid = [], 0
        for i, line in enumerate(lines):
            crc, _, payload = line.partition(b" ")
            try:
                ok = len(crc) == 8 and int(crc, 16) == zlib.crc32(payload)
            except ValueError:
                ok = False
            if not ok:
                if i == len(lines) - 1 and not tail:
                    break  # the last line, nothing after it: an append cut short
                raise CorruptionError(
                    f"{self.journal_path} line {i + 1} is damaged (its checksum does not match) and "
                    f"{len(lines) - 1 - i + bool(tail)} more record(s) follow it: the file was modified or the disk "
                    f"returned bad data, not a crash. Nothing was changed; restore the directory from a copy")
            where = f"{self.journal_path} line {i + 1}"
            records.append(check_record(parse_json(payload, self.journal_path, f" line {i + 1}"), where))
            valid += len(line) + 1
        return records, valid

    def trim(self) -> None:
        """Cut a torn tail off the journal, so later appends follow the last valid record (damage
        elsewhere raises, see :meth:`_parse`)."""
        _records, valid = self._parse()
        if self.journal_path.exists() and self.journal_path.stat().st_size != valid:
            fd = os.open(self.journal_path, os.O_WRONLY)
            try:
                os.ftruncate(fd, valid)
                os.fsync(fd)
            finally:
                os.close(fd)

    def append(self, record: dict) -> None:
        """Append one record and fsync; a failed append is cut off again, never left half-written."""
        payload = _dumps(record).encode()
        line = b"%08x %s\n" % (zlib.crc32(payload), payload)
        fd = os.open(self.journal_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            before = os.fstat(fd).st_size
            try:
                _write_all(fd, line, self.journal_path)
                os.fsync(fd)
            except BaseException:
                try:
                    os.ftruncate(fd, before)
                except OSError:
                    pass  # trim() at the next start removes it
                raise
        finally:
            os.close(fd)

    def forget_first_commit(self) -> None:
        """Remove the manifest of a first commit (step 0) that a fresh start makes again (sharded: not
        every rank made it); its tensors are the garbage the start removes."""
        self.manifest_path.unlink(missing_ok=True)
        fsync_directory(self.dir)
        self.reset_journal()

    def reset_journal(self) -> None:
        fd = os.open(self.journal_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_directory(self.dir)


def manifest_checksum(manifest: dict) -> str:
    """The checksum algorithm of a manifest's extents."""
    return READABLE_FORMATS.get(manifest.get("format")) or manifest["checksum"]


def _write_all(fd: int, data: bytes, path: Path) -> None:
    view = memoryview(data)
    try:
        while view:
            n = os.write(fd, view)
            view = view[n:]
    except OSError as e:
        if e.errno == errno.ENOSPC:
            import shutil
            free = shutil.disk_usage(path.parent).free
            raise DiskFullError(f"disk full writing {path} ({len(data)} bytes needed, {free} free); the last "
                                f"committed state is intact. Free space and resume",
                                path=str(path), needed_bytes=len(data), free_bytes=free) from e
        raise


def encode_rng(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode()


def encode_tensor(t: torch.Tensor) -> dict:
    """A small tensor (a module buffer) as JSON: dtype, shape and its bytes in base64."""
    t = t.detach().to("cpu").contiguous()
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "data": base64.b64encode(t.reshape(-1).view(torch.uint8).numpy().tobytes()).decode("ascii")}


def decode_tensor(value: dict) -> torch.Tensor:
    """The tensor :func:`encode_tensor` wrote."""
    try:
        dtype = getattr(torch, value["dtype"])
        raw = bytearray(base64.b64decode(value["data"], validate=True))
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(value["shape"]).clone()
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as e:
        raise CheckpointError(f"a saved buffer cannot be decoded ({e}); the manifest is damaged") from e


def decode_rng(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


# ---- the commit protocol -----------------------------------------------------------------
Ref = tuple[str, int | None] | None
"""An extent and its CRC, or None for an all-zero tensor (no extent)."""


@dataclass
class CommittedState:
    """The training state a storage directory holds: the manifest's step, plus the step in flight
    that the journal holds when the engine stopped between a step's intent and its last unit
    record (committed all the same: its gradients and hyperparameters are in the intent)."""

    manifest: dict
    intent: dict | None = None
    """The intent record of step ``manifest["step"] + 1``, if that step is in flight."""
    recorded: dict[str, dict[str, Ref]] = field(default_factory=dict)
    """Of the step in flight, the units already rewritten: unit -> {key: (extent, crc) or None}."""
    previous: dict | None = None
    """Sharded snapshot commits: the manifest of the commit before, while one is kept
    (:attr:`StateFiles.previous_path`)."""

    def committed(self) -> dict[str, Ref]:
        """``{key: (extent, crc)}`` of the manifest's tensors (None: all zeros)."""
        return {k: v["extent"] and (v["extent"], v["crc"]) for k, v in self.manifest["tensors"].items()}

    def tensors(self) -> dict[str, Ref]:
        """The current version of every durable tensor: the manifest's, then the recorded units'."""
        out = self.committed()
        for refs in self.recorded.values():
            out.update(refs)
        return out

    def grads(self) -> dict[str, Ref]:
        """The gradients the step in flight applies ({} when none is in flight)."""
        if self.intent is None:
            return {}
        return {k: _ref(v) for k, v in self.intent["grads"].items()}


def read_committed(files: "StateFiles") -> CommittedState | None:
    """Read a directory's committed state (the one journal replay, for the engine and the offline
    tools alike); None when it holds none."""
    manifest = files.read_manifest()
    if manifest is None:
        return None
    records = files.read_journal()
    nxt = manifest["step"] + 1
    intent = next((r for r in records if r.get("type") == "intent" and r.get("step") == nxt), None)
    recorded = {}
    if intent is not None:
        recorded = {r["unit"]: {k: _ref(v) for k, v in r["tensors"].items()}
                    for r in records if r.get("type") == "unit" and r.get("step") == nxt}
        units = {u["name"] for u in manifest["units"]}
        unknown = ([f"unit {u!r}" for u in recorded if u not in units]
                   + [f"tensor {k!r}" for refs in recorded.values() for k in refs if k not in manifest["tensors"]]
                   + [f"gradient {k!r}" for k in intent["grads"] if k.split("/", 1)[0] not in units])
        if unknown:
            raise CorruptionError(f"{files.journal_path} names {unknown[0]}, which {files.manifest_path} does not have: "
                                  f"the two files are not from the same run. Restore the directory from a copy")
    return CommittedState(manifest, intent, recorded, files.read_previous())


class Committer:
    """Runs the commit protocol for one engine: which extents the durable state refers to, and when
    superseded ones may be deleted. Journal work runs on one background thread, in order.

    Args:
        files: the manifest and journal.
        store: the engine's store (versioned writes; its ``on_disk_written`` is set here).
        units: unit name -> the keys of its durable tensors (weights, optimizer states).
        grads: unit name -> its gradient key.
        describe: ``fn(step, committed, meta) -> manifest`` builds the manifest for a step.
    """

    def __init__(self, files: StateFiles, store, units: dict[str, list[str]], grads: dict[str, str],
                 describe: Callable[[int, dict[str, Ref], dict], dict]):
        self.files, self.store, self.units, self.grads, self.describe = files, store, units, grads, describe
        self._lock = threading.Condition()
        self._committed: dict[str, Ref] = {}
        self._latest: dict[str, str] = {}
        self._refs: dict[str, int] = {}
        self._intent: dict | None = None
        self._intent_grads: dict[str, tuple | None] = {}
        """Gradient key -> ``(ref,)`` of the disk copy the intent in flight names (None: not yet known)."""
        self._intent_durable = False
        self._waiting: set[str] = set()
        self._finishing = False  # claimed once: by whoever saw the last unit recorded (finish_now)
        self._in_window: dict[str, int] = {}
        """Units updated but not yet recorded, and the bytes of their new extents."""
        self._meta: dict = {}
        self._step, self._snapshotting = 0, False
        self._held: list[str] = []
        """Extents only the kept previous commit names (:meth:`release_previous` deletes them)."""
        self._error: BaseException | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tiered-offload-journal")
        store.on_disk_written = self._written

    # ---- references ---------------------------------------------------------------------
    def _ref(self, ref: Ref) -> None:
        if ref is not None:
            self._refs[ref[0]] = self._refs.get(ref[0], 0) + 1

    def _unref(self, ref: Ref) -> list[str]:
        """Drop a reference; the extents that became garbage (call with the lock held)."""
        if ref is None:
            return []
        n = self._refs.get(ref[0], 0) - 1
        if n > 0:
            self._refs[ref[0]] = n
            return []
        self._refs.pop(ref[0], None)
        return [] if ref[0] in self._latest.values() else [ref[0]]

    def _delete(self, extents: Iterable[str]) -> None:
        for e in extents:
            self.store.disk.delete_quietly(e)

    def _written(self, key: str, extent: str | None, crc: int | None, old: str | None) -> None:
        """The store wrote a new version of ``key`` to ``extent``; ``old`` is superseded."""
        with self._lock:
            if extent is None:  # the tensor went back to all zeros: no extent holds it any more
                self._latest.pop(key, None)
            else:
                self._latest[key] = extent
                self._take_intent_grad(key, (extent, crc))  # if the intent in flight names this gradient copy
            garbage = [old] if old is not None and old != extent and old not in self._refs else []
        self._delete(garbage)

    # ---- setting up -----------------------------------------------------------------------
    def start(self, step: int, committed: dict[str, Ref], meta: dict, latest: dict[str, str]) -> None:
        """Adopt a committed state (fresh, or read back from the manifest)."""
        self.files.trim()
        with self._lock:
            self._step, self._meta = step, meta
            self._committed = dict(committed)
            self._latest.update(latest)
            for ref in committed.values():
                self._ref(ref)

    def resume_intent(self, intent: dict, recorded: dict[str, dict[str, Ref]]) -> list[str]:
        """Continue a committed step found in the journal; returns the units still to update."""
        with self._lock:
            self._intent = intent
            for ref in intent["grads"].values():
                self._ref(_ref(ref))
            for unit, refs in recorded.items():
                self._record_unit(unit, refs)
            self._waiting = set(self.units) - set(recorded)
            return sorted(self._waiting)

    # ---- a step -------------------------------------------------------------------------
    def begin_step(self, intent: dict, *, wait: bool = False) -> None:
        """Start committing the step's intent: its gradients written and made durable, then the
        record appended, on the journal thread. The update may start at once (``wait``: only once
        the intent is durable): a unit's record is appended after the intent (the journal thread
        runs in order), and until then the unit's new extents are files no committed state refers
        to, which a resume deletes.

        Every gradient's write-back is claimed here, before the caller can zero one, and each
        gradient extent is referenced as soon as it is known, so zeroing the gradient after its
        unit's update cannot delete the copy the intent names.
        """
        self.wait()
        start = time.perf_counter()
        keys = list(self.grads.values())
        with self._lock:
            self._intent = dict(intent, type="intent", grads=None)  # the step in flight (grads: once durable)
            self._intent_grads = dict.fromkeys(keys)
            self._intent_durable = False
            self._waiting = set(self.units)
            self._in_window = {}
        try:
            futures = [self.store.write_back(k) for k in keys]
            for k, f in zip(keys, futures):
                if f.done():  # already on disk (or all zeros): its extent now, before anything can supersede it
                    self._take_intent_grad(k, self.store.extent(k))
        except BaseException:
            with self._lock:  # nothing of this step reaches the journal: no step is in flight
                self._intent = None
                self._lock.notify_all()
            raise
        self._pool.submit(self._write_intent, futures, start)
        if wait:
            with self._lock:
                while not self._intent_durable and self._error is None:
                    self._lock.wait()
                if self._error is not None:
                    raise self._error

    def _take_intent_grad(self, key: str, ref: tuple) -> None:
        """The disk copy of gradient ``key`` the step's intent names (referenced once, at once)."""
        with self._lock:
            if self._intent_grads.get(key, 0) is None:  # a gradient of the intent in flight, not yet taken
                self._intent_grads[key] = (list(ref) if ref[0] is not None else None,)
                self._ref(_ref(self._intent_grads[key][0]))

    def _write_intent(self, futures: list, start: float) -> None:
        try:
            for f in futures:
                f.get()
            with self._lock:
                unseen = [k for k, r in self._intent_grads.items() if r is None]
                grads = {k: r[0] for k, r in self._intent_grads.items() if r is not None}
            if unseen:
                raise CheckpointError(f"the step's gradients {unseen} were written but their disk copies were not "
                                      f"reported; this is a bug")
            self.store.backend.sync([r[0] for r in grads.values() if r is not None])
            record = dict(self._intent, grads=grads)
            self.files.append(record)
            with self._lock:
                self._intent = record
                self._intent_durable = True
                self._lock.notify_all()
            if self.store.tracer is not None:
                self.store.tracer.complete(f"intent step {record['step']}", "commit", start)
        except BaseException as e:  # noqa: BLE001 - surfaced by wait() / throttle()
            with self._lock:
                self._error = e
                self._lock.notify_all()

    def throttle(self, size: int, admits: Callable[[list[int], int], bool]) -> None:
        """Wait until ``admits(bytes of the units updated but not yet recorded, size)``: a unit
        whose new extents take ``size`` bytes may be updated (bounds the extra disk)."""
        with self._lock:
            if not admits(list(self._in_window.values()), size) and self._error is None:
                start = time.perf_counter()
                while not admits(list(self._in_window.values()), size) and self._error is None:
                    self._lock.wait()
                if self.store.tracer is not None:
                    self.store.tracer.complete("wait commit window", "wait", start, bytes=size)
            if self._error is not None:
                raise self._error

    def unit_updated(self, unit: str, futures: list, size: int) -> None:
        """``unit``'s new weights and states (``size`` bytes) are being written (``futures``): record them once durable."""
        with self._lock:
            self._in_window[unit] = size
        self._pool.submit(self._record_when_durable, unit, futures)

    def _record_when_durable(self, unit: str, futures: list) -> None:
        try:
            with self._lock:
                if self._error is not None:
                    return
            for f in futures:
                f.get()
            refs = {k: self.store.extent(k) for k in self.units[unit]}
            missing = [k for k, r in refs.items() if r[0] is None and not self.store.record(k).zero]
            if missing:
                raise CheckpointError(f"unit {unit}: {missing} not on disk after their write-back; this is a bug")
            self.store.backend.sync([r[0] for r in refs.values() if r[0] is not None])
            record = {"type": "unit", "step": self._intent["step"], "unit": unit,
                      "tensors": {k: (list(r) if r[0] is not None else None) for k, r in refs.items()}}
            self.files.append(record)
            with self._lock:
                garbage = self._record_unit(unit, record["tensors"])
            # the superseded extents go before the unit leaves the window (after, they met the next unit's)
            self._delete(garbage)
            with self._lock:
                self._waiting.discard(unit)
                self._in_window.pop(unit, None)
                finished = not self._waiting and not self._finishing
                self._finishing |= finished
                self._lock.notify_all()
            if finished:
                self._finish()
        except BaseException as e:  # noqa: BLE001 - surfaced by wait() / throttle()
            with self._lock:
                self._error = e
                self._lock.notify_all()

    def _record_unit(self, unit: str, refs: dict[str, Any]) -> list[str]:
        """Point the committed state at a unit's new extents (lock held); the garbage it leaves."""
        garbage: list[str] = []
        for k, r in refs.items():
            new = _ref(r)
            self._ref(new)
            garbage += self._unref(self._committed.get(k))
            self._committed[k] = new
        return garbage

    def _finish(self) -> None:
        """Every unit of the step is recorded: fold the journal into a new manifest."""
        start = time.perf_counter()
        intent = self._intent
        with self._lock:
            committed = dict(self._committed)
        self.files.write_manifest(self.describe(intent["step"], committed, intent["meta"]))
        self.files.reset_journal()
        with self._lock:
            garbage = []
            for r in intent["grads"].values():
                garbage += self._unref(_ref(r))
        self._delete(garbage)
        with self._lock:
            self._step, self._meta = intent["step"], intent["meta"]
            self._intent, self._finishing = None, False
            self._lock.notify_all()
        if self.store.tracer is not None:
            self.store.tracer.complete(f"commit step {intent['step']}", "commit", start, kind="manifest")

    # ---- snapshot commits ------------------------------------------------------------------
    def snapshot(self, step: int, meta: dict, *, keep_previous: bool = False) -> None:
        """Commit the state after ``step`` as the store holds it now, in the background: write
        every durable tensor that changed since the last commit to a new extent, make them
        durable, then replace the manifest. Until the manifest is replaced the previous committed
        state stays whole on disk (its extents are never superseded in place), so a crash at any
        moment resumes from one or the other. ``keep_previous`` (sharded): the previous commit
        stays whole until :meth:`release_previous`. The caller must not change a durable tensor
        until :meth:`wait` returns."""
        with self._lock:
            if self._snapshotting:
                raise CheckpointError("a snapshot commit is already in flight; wait() for it first")
            if keep_previous and self._held:
                raise CheckpointError("the commit before is still kept; release_previous() first")
            self._snapshotting = True
        self._pool.submit(self._snapshot, step, meta, keep_previous)

    def release_previous(self) -> None:
        """Every rank has committed the manifest's step: forget the commit before it."""
        self.files.drop_previous()
        with self._lock:
            held, self._held = self._held, []
        self._delete(held)

    def _snapshot(self, step: int, meta: dict, keep_previous: bool) -> None:
        tracer, start = self.store.tracer, time.perf_counter()
        try:
            keys = [k for ks in self.units.values() for k in ks]
            for f in [self.store.write_back(k) for k in keys]:
                f.get()
            refs = {k: self.store.extent(k) for k in keys}
            missing = [k for k, r in refs.items() if r[0] is None and not self.store.record(k).zero]
            if missing:
                raise CheckpointError(f"{missing[:3]} not on disk after their write-back; this is a bug")
            self.store.backend.sync([r[0] for r in refs.values() if r[0] is not None])
            new = {k: (r if r[0] is not None else None) for k, r in refs.items()}
            with self._lock:
                for r in new.values():
                    self._ref(r)
            if keep_previous:
                self.files.keep_previous()
            self.files.write_manifest(self.describe(step, new, meta))
            with self._lock:
                garbage = []
                for r in self._committed.values():
                    garbage += self._unref(r)
                self._committed = new
                self._step, self._meta = step, meta
                if keep_previous:
                    self._held, garbage = garbage, []
            self._delete(garbage)
            if tracer is not None:
                tracer.complete(f"commit step {step}", "commit", start, kind="snapshot")
        except BaseException as e:  # noqa: BLE001 - surfaced by wait()
            with self._lock:
                self._error = e
        finally:
            with self._lock:
                self._snapshotting = False
                self._lock.notify_all()

    def finish_now(self) -> None:
        """Finish a resumed step whose units were all recorded (else the journal thread does)."""
        with self._lock:
            if self._intent is None or self._waiting or self._finishing:
                return
            self._finishing = True
        self._finish()

    def write_manifest(self, step: int, meta: dict) -> None:
        """Write the manifest of the current committed state (a fresh directory, or to refresh meta)."""
        self.wait()
        with self._lock:
            committed = dict(self._committed)
            self._step, self._meta = step, meta
        self.files.write_manifest(self.describe(step, committed, meta))

    def fail(self, error: BaseException) -> None:
        """The step's update failed: it will never be fully recorded. The journal keeps its intent,
        so the next engine on this directory finishes it; this one reports ``error`` from now on."""
        with self._lock:
            if self._error is None:
                self._error = error
            self._lock.notify_all()

    def wait(self) -> None:
        """Wait until the step in flight is fully recorded; raise what went wrong while recording it."""
        with self._lock:
            while (self._intent is not None or self._snapshotting) and self._error is None:
                self._lock.wait()
            if self._error is not None:
                raise self._error

    @property
    def step(self) -> int:
        with self._lock:
            return self._step

    @property
    def committed_meta(self) -> dict:  # the meta of the state the manifest holds now
        with self._lock:
            return self._meta

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        # a write landing after this (of a unit whose update failed midway) may supersede committed
        # state: nothing is deleted from now on; the next start deletes what no commit refers to
        self.store.on_disk_written = lambda key, extent, crc, old: None


def _ref(value) -> Ref:
    return None if value is None else (value[0], value[1])
