"""One engine's durable storage directory, from opening to closing: the lock, the committed state
read back (the manifest plus the journal's step in flight), recovery, and the commit protocol for
each new step. The engine supplies what only it knows (the manifest's description of the model,
and how to redo one unit's update); everything about files, extents and records lives here."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch

from offload_core.errors import (CheckpointError, ConfigError, CorruptionError, DistributedError, ExtentNotFoundError,
                                 TieredOffloadError)
from tiered_offload.trace import span

from .buffer_file import BUFFER_KEY, BufferFile, referenced
from .durable import (
    CommittedState,
    fsync_directory,
    manifest_checksum,
    Committer,
    StateFiles,
    read_committed,
    state_directory,
)
from .lock import LOCK, DirectoryLock, holder_gone
from .layout import parse_extent
from .stripes import check_stripes, hold_stripes, mark_stripes, release_stripes

log = logging.getLogger(__name__)

__all__ = ["CheckpointSession", "Intent", "Commits", "NoCommits", "DurableCommits", "JournalCommits", "SnapshotCommits",
           "commits_for"]


class CheckpointSession:
    """The storage directory of one engine as a checkpoint.

    Life cycle: :meth:`open` (lock; read the committed state), :meth:`collect_garbage`,
    :meth:`start` (hand the state to the commit protocol; finish a step a crash interrupted),
    then per step the commit strategy (:class:`JournalCommits`, :class:`SnapshotCommits`) drives
    :attr:`committer`; :meth:`close`.

    Args:
        store: the engine's store (versioned writes), whose backend holds the directory.
        describe: ``fn(step, committed refs, meta) -> manifest`` for the engine's model.
    """

    def __init__(self, store, describe: Callable[[int, dict, dict], dict]):
        self.store = store
        self.describe = describe
        self.lock: DirectoryLock | None = None
        self.stripe_locks: list[DirectoryLock] = []
        """The locks of a striped state's other directories (:mod:`.stripes`)."""
        self.files: StateFiles | None = None
        self.committer: Committer | None = None
        self.recovered: CommittedState | None = None

    # ---- opening --------------------------------------------------------------------------------
    def open(self, resume: bool | str) -> CommittedState | None:
        """Lock the directory; the committed state to resume from, or None to start fresh."""
        backend = self.store.backend
        if not backend.supports_durable_state:
            raise ConfigError(f"durable=True needs storage in a directory (posix, aiofiles, kvikio); "
                              f"{backend.location} has none")
        where = state_directory(str(backend.directories[0]))
        self.lock = DirectoryLock(where).acquire()
        self.stripe_locks = hold_stripes(backend.directories)
        self.files = StateFiles(where)
        state = read_committed(self.files)
        check_stripes(backend.directories, state and state.manifest, backend.stripe_bytes, backend.stripe_weights)
        if state is not None and not resume:
            raise CheckpointError(
                f"{backend.location} already holds a training state (step {state.manifest['step']}); pass "
                f"resume=True to continue it, or give an empty directory (or delete this one) to start over")
        if state is None and resume is True:
            raise CheckpointError(f"{backend.location} holds no committed training state to resume "
                                  f"(no {self.files.manifest_path}); pass resume='auto' to start fresh when there is none")
        if state is None:
            mark_stripes(backend.directories)  # (before any tensor is written)
        self.recovered = state
        return state

    def collect_garbage(self, mine: set[str]) -> None:
        """Delete the extents of keys in ``mine`` that the committed state does not name: remains of
        writes a crash cut short. Other files in the directory are never touched.

        First every extent the committed state needs must be there: if one is missing, the state
        on disk is not what its files say (a damaged record read as a torn one, a file deleted by
        hand), and nothing is deleted: a :class:`CorruptionError` names what is missing."""
        present = set(self.store.backend.keys())
        keep = set()
        mine = set(mine) | {BUFFER_KEY}
        if self.recovered is not None:
            refs = {**self.recovered.tensors(), **self.recovered.grads()}
            keep = {r[0] for r in refs.values() if r} | referenced(self.recovered.manifest["meta"],
                                                                    (self.recovered.intent or {}).get("meta"))
            sizes = self.recovered.manifest["tensors"]
            empty = {k for k, t in sizes.items() if t["nbytes"] == 0}  # a 0-byte tensor has no file
            missing = sorted(k for k, r in refs.items() if r and r[0] not in present and k not in empty)
            if missing:
                where = (f"{self.files.journal_path} and {self.files.manifest_path} describe"
                         if self.recovered.intent is not None else f"{self.files.manifest_path} describes")
                first = f"tensor {missing[0]!r}: {self.store.backend.describe(refs[missing[0]][0])}"
                raise CorruptionError(
                    f"{self.store.backend.location}: the committed state needs {len(missing)} file(s) that are not there "
                    f"({first}), as {where} it. A record may be damaged or a file was removed; nothing was deleted. "
                    f"Restore the directory from a copy")
            self._check_sizes({k: r for k, r in refs.items() if k not in empty}, sizes)
        for extent in present:
            key, generation = parse_extent(extent)
            if key in mine and generation is not None and extent not in keep:
                self.store.backend.delete(extent)

    def _check_sizes(self, refs: dict, sizes: dict) -> None:
        """Every file the committed state needs is a regular file (a FIFO there made the first read
        wait for a writer forever) holding at least its tensor's bytes: else nothing is read or
        deleted, and a :class:`CorruptionError` names the file."""
        backend = self.store.backend
        for key, ref in refs.items():
            if not ref:
                continue
            try:
                held = backend.size(ref[0])
            except (OSError, ExtentNotFoundError) as e:
                raise CorruptionError(f"{backend.location}: tensor {key!r} of the committed state cannot be "
                                      f"read: {e}; nothing was deleted") from None
            need = sizes.get(key, {}).get("nbytes", 0)  # (a gradient's size is its unit's: checked when read)
            if held < need:
                raise CorruptionError(f"{backend.describe(ref[0])} holds {held} bytes of tensor {key!r}, {need} "
                                      f"expected by the committed state; nothing was deleted. Run `tiered-offload "
                                      f"verify` on {backend.location}, and restore the directory from a copy")

    # ---- the commit protocol ------------------------------------------------------------------
    def start(self, units: dict[str, list[str]], grads: dict[str, str], meta: Callable[[], dict],
              redo: Callable[[dict, list[str]], None]) -> dict:
        """Hand the committed state to the commit protocol and return the meta of the state now
        current. A fresh directory gets its first manifest (step 0, ``meta()``); a step a crash
        interrupted is finished with ``redo(intent, units not yet recorded)``, which re-runs their
        update from the same bytes.

        Args:
            units: unit name -> keys of its durable tensors; grads: unit name -> gradient key.
        """
        store = self.store
        self.committer = Committer(self.files, store, units, grads, self.describe)
        state = self.recovered
        if state is None:
            committed = {k: store.extent(k) for keys in units.values() for k in keys}
            committed = {k: (r if r[0] is not None else None) for k, r in committed.items()}
            latest = {k: r[0] for k, r in committed.items() if r}
            store.backend.sync(latest.values())
            first = meta()
            self.committer.start(0, committed, first, latest)
            self.committer.write_manifest(0, first)
            return first
        manifest = state.manifest
        latest = {k: e for k in store.keys() if (e := store.extent(k)[0]) is not None}
        self.committer.start(manifest["step"], state.committed(), manifest["meta"], latest)
        if state.intent is None:
            return manifest["meta"]
        unrecorded = self.committer.resume_intent(state.intent, state.recorded)
        redo(state.intent, unrecorded)
        self.committer.finish_now()
        self.committer.wait()
        return state.intent["meta"]

    def fail(self, error: BaseException) -> None:
        if self.committer is not None:
            self.committer.fail(error)

    def wait(self) -> int:
        """Wait until the last step is fully recorded; its number."""
        if self.committer is None:
            return 0
        self.committer.wait()
        return self.committer.step

    def close(self) -> None:
        """Stop the journal thread and release the lock (the committed state stays as it is)."""
        if self.committer is not None:
            self.committer.close()
            self.committer = None
        if self.lock is not None:
            self.lock.release()
            self.lock = None
        release_stripes(self.stripe_locks)
        self.stripe_locks = []


# ---- commit strategies: what a step does to make itself durable ---------------------------------
@dataclass
class Intent:
    """A step's intent record (journal commits): what the update of step :attr:`step` applies, so a
    resume re-runs it bitwise from the previous state and the gradients the record names."""

    step: int
    """The step number after this step (the manifest's ``step`` once it is fully recorded)."""
    step_index: int
    """The step count before it."""
    hyper: list[dict]
    """Each parameter group's hyperparameters, as JSON."""
    no_grad: list[str]
    """Optimized parameters without a gradient this step (left as they are)."""
    scale: float | None
    """The gradient scale clipping applies (None: no clipping)."""
    meta: dict
    """The training state after the step (:meth:`TrainState.state_dict`)."""

    def to_record(self) -> dict:
        return {"step": self.step, "step_index": self.step_index, "hyper": self.hyper, "no_grad": self.no_grad,
                "scale": self.scale, "meta": self.meta}

    @classmethod
    def from_record(cls, record: dict) -> "Intent":
        hyper = record["hyper"]
        return cls(step=record["step"], step_index=record.get("step_index", record["step"] - 1),
                   hyper=hyper if isinstance(hyper, list) else [hyper], no_grad=list(record.get("no_grad", ())),
                   scale=record["scale"], meta=record["meta"])


class Commits:
    """How the engine's steps become durable: the hooks a step calls, in order.

    ``before_backward`` -> ``begin_step`` (returns what to run once the update is done) ->
    per unit ``before_unit``, the update, ``unit_updated`` -> ``commit`` / ``wait`` -> ``close``.
    This base class commits nothing (the storage is scratch space: ``durable=False``).
    """

    durable = False
    weights_behind = False
    """Whether a unit's new weights must go to disk right after its update (the journal records them)."""

    def __init__(self, train_state, store=None):
        self.train_state = train_state
        self.store = store
        self.tracer = None
        self.lock: DirectoryLock | None = None
        """Scratch storage in a directory is locked too: no second process may train in it."""
        self.stripe_locks: list[DirectoryLock] = []

    def open(self, resume, placement, layout) -> CommittedState | None:
        """Take the directory and read the committed state to resume from (None: start fresh)."""
        backend = self.store.backend if self.store is not None else None
        if backend is not None and backend.supports_durable_state:
            self.lock = DirectoryLock(state_directory(str(backend.directories[0]))).acquire()
            self.stripe_locks = hold_stripes(backend.directories)  # (its scratch files' names are the same there)
        return None

    def start(self, layout, update_unit, update_order, rewrite_bytes, admits) -> None:
        """Hand the state to the commit protocol (after the tensors are registered)."""

    def before_backward(self, wait_for_update: Callable[[], None]) -> None:
        """A backward is about to write gradients."""

    def begin_step(self, hypers: list[dict], scale, updates, *, barrier: Callable[[str], None] | None = None
                   ) -> Callable[[], None] | None:
        """The optimizer step's bookkeeping is done (``train_state`` is after the step); its units
        are about to be updated. Returns what to run once every unit is updated (or None)."""
        return None

    def before_unit(self, rewrite_bytes: int, admits) -> None:
        """A unit is about to be updated (``rewrite_bytes`` of new extents)."""

    def unit_updated(self, unit: str, futures: Iterable, rewrite_bytes: int) -> None:
        """A unit's update was issued; ``futures`` finish its writes."""

    def commit(self) -> int:
        """Commit the last step now and wait until it is durable; its number."""
        return self.wait()

    def wait(self) -> int:
        """Wait until the last commit is durable; its step."""
        return self.train_state.step_count

    def fail(self, error: BaseException) -> None:
        """The update failed: no commit may follow."""

    def how_to_go_on(self) -> str:
        """What the error of a step that failed part-way tells the user to do, for this storage."""
        return ("Its storage is scratch space (durable=False), so nothing of the run is kept there: close it, and "
                "train again from your last export or checkpoint.")

    def close(self) -> None:
        """Finish the last commit and release the directory."""
        self.release()

    def release(self) -> None:
        """Release the directory as it is (an error path: nothing more is committed)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None
        release_stripes(self.stripe_locks)
        self.stripe_locks = []


NoCommits = Commits


def commits_for(train_state, store, layout, model_config, *, durable: bool, snapshot: bool, every: int,
                peft: dict | None = None) -> Commits:
    """The commit strategy of an engine: none (scratch storage), snapshots (``snapshot``: the state
    fits in memory, or ``every`` > 1) or the journal."""
    if not durable:
        return NoCommits(train_state, store)
    session = CheckpointSession(store, layout.describer(store, model_config, peft))
    return SnapshotCommits(train_state, session, every) if snapshot else JournalCommits(train_state, session)


class DurableCommits(Commits):
    """Commits into a storage directory through a :class:`CheckpointSession`: the shared part of the
    journal and snapshot strategies (starting from a committed state, waiting, closing)."""

    durable = True

    def __init__(self, train_state, session: CheckpointSession):
        super().__init__(train_state)
        self.session = session
        self.ranks = None
        """Sharded: the placement, whose ranks agree on each commit (None on one process)."""

    def open(self, resume, placement, layout) -> CommittedState | None:
        """Lock the directory, read its committed state (every rank's brought to one step), check it
        was written for this model and optimizer, and delete the remains of writes a crash cut short
        (a first start that died before its first manifest too)."""
        session = self.session
        self.ranks = placement if placement.world > 1 else None
        recovered = session.recovered = placement.reconcile(session.open(resume), resume, session.files)
        if recovered is not None and recovered.previous is not None:  # every rank is at one step now
            session.files.drop_previous()
            recovered.previous = None
        if recovered is not None:
            layout.check(recovered.manifest, session.files.manifest_path)
            session.store.use_checksum(manifest_checksum(recovered.manifest))  # the directory's own
            # where the state's optimizer step ran: the engine places its own (and redoes a step in
            # flight) the same way under optimizer_device="auto"
            self.train_state.update_tier = recovered.manifest["meta"].get("update_tier")
        session.collect_garbage(layout.keys())
        return recovered

    def start(self, layout, update_unit, update_order, rewrite_bytes, admits) -> None:
        """Hand the committed state to the commit protocol, finishing a step a crash interrupted
        (``update_unit(name, hypers, scale, updates)`` re-runs one unit's update from the bytes it
        started from), and restore the training state it records; a fresh directory gets its first
        manifest."""
        def redo(record: dict, unrecorded: list[str]) -> None:
            intent = Intent.from_record(record)
            hypers = self.train_state.hypers_from_json(intent.hyper)
            scale = None if intent.scale is None else torch.tensor(intent.scale, dtype=torch.float32)
            updates = self.train_state.replayed_updates(intent.meta, intent.no_grad)
            for name in update_order:
                if name in unrecorded:
                    self.session.committer.throttle(rewrite_bytes(name), admits)
                    update_unit(name, hypers, scale, updates)
        grads = layout.grad_keys()
        session = self.session
        self.train_state.buffer_file = buffers = BufferFile(
            session.store.backend, session.store.checksum, lambda: session.committer and session.committer.committed_meta)
        if session.recovered is not None:  # a step in flight is redone from the state before it
            self.train_state.load_scalars(session.recovered.manifest["meta"])
        meta = session.start(layout.durable_keys(), grads, self.train_state.state_dict, redo)
        if session.recovered is None:
            return
        for key in grads.values():  # the step's gradients were applied (or never taken)
            session.store.zero(key)
        buffers.adopt(session.recovered.manifest["meta"])  # a finished step in flight supersedes its extent
        buffers.adopt(meta)
        self.train_state.load_state_dict(meta, str(session.files.manifest_path))

    def wait(self) -> int:
        return self.session.wait()

    def fail(self, error: BaseException) -> None:
        self.session.fail(error)

    def how_to_go_on(self) -> str:
        return ("Close it, and build the engine again on the same storage with resume=True: it goes on from the "
                "last step the storage recorded.")

    def close(self) -> None:
        try:
            self.session.wait()
        finally:
            self.session.close()

    def release(self) -> None:
        self.session.close()


class JournalCommits(DurableCommits):
    """Every step is committed by its intent record, then each unit's record as its new extents
    become durable (the state does not fit in memory: the gradients are on disk anyway)."""

    weights_behind = True

    def before_backward(self, wait_for_update: Callable[[], None]) -> None:
        # the last step's gradients stay on disk until every unit of it is recorded: wait, so this
        # backward's gradients never need a second copy alongside them (the forward has waited for
        # every unit it used; a unit it skipped is updated now)
        with span(self.tracer, "wait last step's commit", "wait"):
            wait_for_update()
            self.session.wait()

    def begin_step(self, hypers, scale, updates, *, barrier=None):
        # the step is committed once its gradients and this record are on disk: from here on a
        # crash resumes after it, by re-running the update of the units not yet recorded. They go
        # to disk beside the update (a unit's record follows the intent in the journal); sharded,
        # every rank's intent must be durable before any rank updates anything
        state = self.train_state
        intent = Intent(step=state.step_count, step_index=state.step_count - 1, hyper=state.hypers_to_json(hypers),
                        no_grad=updates.no_grad, scale=None if scale is None else float(scale.item()),
                        meta=state.state_dict())
        self.session.committer.begin_step(intent.to_record(), wait=barrier is not None)
        if barrier is not None:  # nothing is updated anywhere before every rank's intent is durable
            barrier("every rank's intent")
        return None

    def before_unit(self, rewrite_bytes: int, admits) -> None:
        self.session.committer.throttle(rewrite_bytes, admits)

    def unit_updated(self, unit: str, futures: Iterable, rewrite_bytes: int) -> None:
        self.session.committer.unit_updated(unit, list(futures), rewrite_bytes)


class SnapshotCommits(DurableCommits):
    """Every ``every``-th step, once its update is done, what changed is written to new extents in
    the background and the manifest replaced (the state fits in memory, or ``commit_every`` > 1).

    Sharded, each rank commits its own directory, and a crash can stop the ranks one commit apart:
    each keeps the commit before until the ranks agree, at the next step, that every one has the
    new one (then it is deleted); a resume brings them all to the older one where they differ."""

    def __init__(self, train_state, session: CheckpointSession, every: int):
        super().__init__(train_state, session)
        self.every = every
        self.pending: tuple[int, dict] | None = None
        """The last step not yet committed, and its meta."""
        self.owed: int | None = None
        """Sharded: the step of the last commit started, until the ranks agree each has it."""

    def begin_step(self, hypers, scale, updates, *, barrier=None):
        # the last commit must have written what it snapshots before this step changes it
        self._settle()
        self.pending = (self.train_state.step_count, self.train_state.state_dict())
        return self._commit_pending if self.train_state.step_count % self.every == 0 else None

    def _settle(self) -> None:
        """Wait for the last commit; sharded, the ranks then agree that every one has it (one
        collective, on the step's thread) before each forgets the commit before it."""
        if self.owed is None:
            self.session.wait()
            return
        step, self.owed, error = self.owed, None, None
        try:
            self.session.wait()
        except Exception as e:  # (the other ranks learn of it through the agreement, then it is raised)
            error = e
        every = self.ranks.all_agree(error is None, f"every rank's commit of step {step}")
        if error is not None:
            raise error
        if not every:
            raise DistributedError(f"another rank could not commit step {step} (its own error says why); this rank "
                                   f"keeps the commit before it, and the job resumes from the last step every rank "
                                   f"committed when it is started again")
        self.session.committer.release_previous()

    def _commit_pending(self) -> None:
        """Start the snapshot commit of the last step (its update is done)."""
        step, meta = self.pending
        self.pending = None
        self.session.committer.snapshot(step, meta, keep_previous=self.ranks is not None)
        if self.ranks is not None:
            self.owed = step

    def commit(self) -> int:
        if self.pending is not None:
            self.session.wait()
            self._commit_pending()
        return self.session.wait()

    def close(self) -> None:
        try:
            self.session.wait()
            if self.pending is not None:  # steps since the last scheduled commit
                self._commit_pending()
                self.session.wait()
            if self.owed is not None:  # sharded: the commit before the last is still kept
                self._release_at_rest(self.owed)
        finally:
            self.session.close()

    REST_WAIT_S = 30.0
    """How long a sharded rank's close waits for the other ranks to commit its last step."""

    def _release_at_rest(self, step: int) -> None:
        """Sharded, at close: the commit before ``step`` is kept for ranks a crash could leave one commit
        behind. Once every rank's manifest has ``step``, no start can go back to it: let go of it
        (a whole state's bytes at most). The manifests are read from the ranks' directories:
        ``close`` issues no collective and asks nothing of the ranks' store, since it runs on error
        paths too (a dead rank 0 takes the store with it); their directories are synced before the
        commit goes (a rename seen is not yet durable). Where the ranks fell out of step, a rank
        without the step has ended (:func:`_ended`), or after :attr:`REST_WAIT_S`, the commit stays
        until the next start, as before."""
        peers = self.ranks.peer_state_dirs(self.session.files.dir)
        if peers is None or self.ranks.out_of_step:
            return
        deadline = time.monotonic() + self.REST_WAIT_S
        while late := [p for p in peers if _manifest_step(p) < step]:
            ended = next((p for p in late if _ended(p)), None)
            if ended is not None or time.monotonic() > deadline:
                log.info("%s did not commit step %d by this rank's close; the commit before it stays until the next "
                         "start", ended.parent.name if ended else "not every rank", step)
                return
            time.sleep(0.05)
        try:  # (a manifest seen renamed may not be durable yet: its directory's entries made so first)
            for p in peers:
                fsync_directory(p)
        except OSError:
            return
        self.owed = None
        self.session.committer.release_previous()


def _ended(state_dir: Path) -> bool:
    """Whether the rank of ``state_dir`` (another rank's) can commit nothing more that this machine
    would see: its directory is not here (another node's), or its lock names no running process."""
    return not state_dir.is_dir() or holder_gone(state_dir / LOCK)


def _manifest_step(state_dir: Path) -> int:
    """The step of the manifest in ``state_dir`` (another rank's), or -1: none, or unreadable now."""
    try:
        manifest = StateFiles(state_dir).read_manifest()
    except (TieredOffloadError, OSError, ValueError):
        return -1
    return -1 if manifest is None else manifest["step"]
