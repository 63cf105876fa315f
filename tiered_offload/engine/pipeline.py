"""The optimizer step as a pipeline over units: run inline, on a background thread that the
next forward paces (the step updates unit ``i`` just before the forward needs it, never more
than ``lead`` units ahead of it, so what it updated is still resident when the forward arrives),
or deferred: each unit's update runs on the thread that first waits for that unit (the next
forward, just before it needs the unit), so the weights the update wrote are the ones the
forward reads, without a second working set beside the forward's.

The pipeline owns its thread, a per-unit event, the pacing condition and the error of a failed
step; the engine tells it what one unit's update is and asks it to wait. A step that failed part-way
leaves some units' new weights beside the others' old ones: every wait from then on raises it
(:meth:`UpdatePipeline.wait`), so no call of the engine trains on from that mix.
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence

from offload_core.errors import StepFailedError, TieredOffloadError

__all__ = ["UpdatePipeline"]


class UpdatePipeline:
    """Runs ``update(name)`` for each unit name in order, inline or in the background.

    Args:
        lead: how many units the background step may run ahead of the forward.
        before_each: called with each unit's name before its update (the commit protocol throttles there).
        on_error: called with the exception that stopped a background step.
        on_flush: called before a deferred step's updates run whole, for a wait on every unit
            rather than by the forward (the lookahead's order changes).
        how_to_go_on: what a failed step's error tells the user to do (the storage's part).
    """

    def __init__(self, lead: int, *, before_each: Callable[[str], None] | None = None,
                 on_error: Callable[[BaseException], None] | None = None,
                 on_flush: Callable[[], None] | None = None, how_to_go_on: Callable[[], str] | None = None):
        self.lead = lead
        self.how_to_go_on = how_to_go_on or (lambda: "")
        self.on_flush = on_flush
        self.before_each = before_each
        self.on_error = on_error
        self._updated: dict[str, threading.Event] = {}
        self._after: dict[str, list[Callable[[], None]]] = {}
        self._lock = threading.Lock()
        self._progress = threading.Condition()
        self._forward_at = -1
        self._free_run = True
        self._error: BaseException | None = None
        """What stopped a step: kept, every wait raises it (see :meth:`_raise_failure`)."""
        self._reported = False
        self._updating: str | None = None  # the unit being updated (where a step failed)
        self._failed_in: str | None = None
        self._thread: threading.Thread | None = None
        self._deferred: tuple[list[str], Callable[[str], None], Callable[[], None] | None] | None = None
        self._cursor = 0
        self._deferring = threading.RLock()
        self._owner: int | None = None  # the thread running deferred updates, while it does

    # ---- running ----------------------------------------------------------------------------
    def run(self, names: Sequence[str], update: Callable[[str], None], *, background: bool,
            then: Callable[[], None] | None = None, deferred: bool = False) -> None:
        """Update every unit of ``names`` in order, then call ``then()`` (a commit). In the
        background: returns at once, and the forward paces it through :meth:`forward_reached`.
        Deferred: returns at once, and each :meth:`wait` runs the updates up to the unit it waits
        for on the caller's thread. Inline: returns when all are updated (raising what failed)."""
        self.wait()
        with self._lock:
            self._updated = {n: threading.Event() for n in names}
            self._after = {}
        if deferred:
            self._deferred, self._cursor = (list(names), update, then), 0
            return
        if not background:
            self._run(list(names), update, then)
            self.wait()
            return
        with self._progress:
            self._forward_at, self._free_run = -1, False
        self._thread = threading.Thread(target=self._run, args=(list(names), update, then), name="tiered-offload-step",
                                        daemon=True)
        self._thread.start()

    def _run(self, names: list[str], update: Callable[[str], None], then: Callable[[], None] | None = None) -> None:
        try:
            self._update_all(names, update)
            if then is not None:
                then()
        except BaseException as e:  # surfaced by the next wait()
            self._failed(e)
            if self.on_error is not None:
                self.on_error(e)
        finally:
            for ev in self._updated.values():
                ev.set()

    def _update_all(self, names: list[str], update: Callable[[str], None]) -> None:
        for index, name in enumerate(names):
            with self._progress:
                while not self._free_run and index - self._forward_at > self.lead:
                    self._progress.wait()
            self._update_one(name, update)

    def _update_one(self, name: str, update: Callable[[str], None]) -> None:
        self._updating = name
        if self.before_each is not None:
            self.before_each(name)
        update(name)
        self._updating = None
        with self._lock:
            for fn in self._after.pop(name, ()):
                fn()
            self._updated[name].set()

    def _run_deferred(self, name: str | None) -> None:
        """Run the deferred updates up to unit ``name`` (all if None) here; the last one's ``then``."""
        with self._deferring:
            if self._deferred is None:
                return
            names, update, then = self._deferred
            upto = len(names) if name is None else (names.index(name) + 1 if name in names else 0)
            self._owner = threading.get_ident()
            try:
                if name is None and self._cursor == 0 and self.on_flush is not None:
                    self.on_flush()
                while self._cursor < upto:
                    self._update_one(names[self._cursor], update)
                    self._cursor += 1
                if self._cursor == len(names):
                    self._deferred = None
                    if then is not None:
                        then()
            except BaseException as e:  # raised by the wait() below, as a background step's error
                self._deferred = None
                self._failed(e)
                if self.on_error is not None:
                    self.on_error(e)
                for ev in self._updated.values():
                    ev.set()
            finally:
                self._owner = None

    # ---- the forward's side -------------------------------------------------------------------
    def forward_reached(self, index: int) -> None:
        """The forward started on unit ``index`` of the update order: let the background step advance."""
        with self._progress:
            if index > self._forward_at:
                self._forward_at = index
                self._progress.notify_all()

    def wait(self, name: str | None = None) -> None:
        """Wait until the step in flight has updated unit ``name`` (every unit if None); re-raise its
        error. A deferred step runs its updates up to ``name`` here."""
        if self._owner == threading.get_ident():
            return  # a deferred update (or its commit) waiting on the step it is part of
        if self._deferred is not None:
            self._run_deferred(name)
        if name is None:  # not the forward: nothing will consume units in order any more
            with self._progress:
                self._free_run = True
                self._progress.notify_all()
            events = list(self._updated.values())
        else:
            events = [self._updated[name]] if name in self._updated else []
        for ev in events:
            ev.wait()
        if name is None and self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            self._raise_failure()

    @property
    def failed(self) -> bool:
        """Whether a step failed (part-way or in its commit): none may follow."""
        return self._error is not None

    def settle(self) -> None:
        """:meth:`wait` for a close: a failed step already reported is not raised again."""
        if not self._reported:
            self.wait()

    def _failed(self, error: BaseException) -> None:
        if self._error is None:
            self._error, self._failed_in = error, self._updating
        self._updating = None

    def _raise_failure(self) -> None:
        """The first report of a failed step is its error as it came where that is the library's
        own (typed) or Ctrl-C; an error of PyTorch's or of the optimizer's code is a
        :class:`StepFailedError` naming the unit (not the batch's fault: the next forward is where
        an update beside it reports). Every later wait raises :class:`StepFailedError`."""
        error, first = self._error, not self._reported
        self._reported = True
        if first and (isinstance(error, TieredOffloadError) or not isinstance(error, Exception)):
            raise error
        where = f"the update of {self._failed_in}" if self._failed_in else "its commit, after every unit's update"
        raise StepFailedError(
            f"the optimizer step failed in {where}: {type(error).__name__}: {error}. The units updated before it hold "
            f"the step's new weights and the others their old ones, so this engine cannot train on from them (its "
            f"forward, backward and step, and every read of its weights, raise this).", self.how_to_go_on()
        ) from error

    def after_update(self, name: str, fn: Callable[[], None]) -> None:
        """Run ``fn`` once unit ``name``'s update in flight is done: now if it is (or none is in flight)."""
        with self._lock:
            ev = self._updated.get(name)
            if ev is not None and not ev.is_set():
                self._after.setdefault(name, []).append(fn)
                return
        fn()
