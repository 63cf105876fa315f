"""One engine's durable storage directory, from opening to closing: the lock, the committed state
read back (the manifest plus the journal's step in flight), recovery, and the commit protocol for
each new step. The engine supplies what only it knows (the manifest's description of the model,
and how to redo one unit's update); everything about files, extents and records lives here."""

from __future__ import annotations

from typing import Callable, Iterable

from offload_core.errors import CheckpointError, ConfigError

from .durable import (
    CommittedState,
    Committer,
    DirectoryLock,
    StateFiles,
    read_committed,
    state_directory,
)

__all__ = ["CheckpointSession"]


class CheckpointSession:
    """The storage directory of one engine as a checkpoint.

    Life cycle: :meth:`open` (lock; read the committed state), :meth:`collect_garbage`,
    :meth:`start` (hand the state to the commit protocol; finish a step a crash interrupted),
    then per step :meth:`begin_step`, :meth:`throttle` and :meth:`unit_updated`; :meth:`close`.

    Args:
        store: the engine's store (versioned writes), whose backend holds the directory.
        describe: ``fn(step, committed refs, meta) -> manifest`` for the engine's model.
    """

    def __init__(self, store, describe: Callable[[int, dict, dict], dict]):
        self.store = store
        self.describe = describe
        self.lock: DirectoryLock | None = None
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
        self.files = StateFiles(where)
        state = read_committed(self.files)
        if state is not None and not resume:
            raise CheckpointError(
                f"{backend.location} already holds a training state (step {state.manifest['step']}); pass "
                f"resume=True to continue it, or give an empty directory (or delete this one) to start over")
        if state is None and resume is True:
            raise CheckpointError(f"{backend.location} holds no committed training state to resume "
                                  f"(no {self.files.manifest_path}); pass resume='auto' to start fresh when there is none")
        self.recovered = state
        return state

    def collect_garbage(self, mine: set[str]) -> None:
        """Delete the extents of keys in ``mine`` that the committed state does not name: remains of
        writes a crash cut short. Other files in the directory are never touched."""
        keep = set()
        if self.recovered is not None:
            keep = {r[0] for r in [*self.recovered.tensors().values(), *self.recovered.grads().values()] if r}
        for extent in self.store.backend.keys():
            key, _, gen = extent.rpartition("@")
            if key in mine and gen.isdigit() and extent not in keep:
                self.store.backend.delete(extent)

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
        todo = self.committer.resume_intent(state.intent, state.recorded)
        redo(state.intent, todo)
        self.committer.finish_now()
        self.committer.wait()
        return state.intent["meta"]

    def begin_step(self, intent: dict, *, wait: bool = False) -> None:
        self.committer.begin_step(intent, wait=wait)

    def throttle(self, size: int, admits: Callable[[list[int], int], bool]) -> None:
        self.committer.throttle(size, admits)

    def unit_updated(self, unit: str, futures: Iterable, size: int) -> None:
        self.committer.unit_updated(unit, list(futures), size)

    def snapshot(self, step: int, meta: dict) -> None:
        """Commit the state after ``step`` as the store holds it now (in the background)."""
        self.committer.snapshot(step, meta)

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
