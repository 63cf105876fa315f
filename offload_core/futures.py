"""The one future type that every asynchronous operation returns.

``IOFuture`` wraps a :class:`concurrent.futures.Future` and says what it is: ``get()`` waits and
returns the number of bytes moved (or raises the operation's error), ``done()`` polls. Several
futures can be joined into one (a request split into chunks, or a chain of tier copies).
"""

from __future__ import annotations

import copy
import threading
from concurrent.futures import Future
from typing import Callable, Iterable

__all__ = ["IOFuture", "completed", "detached", "failed", "gather", "chain"]


class IOFuture:
    """The result of an asynchronous read, write or tier move: the number of bytes it moved."""

    __slots__ = ("_future", "description")

    def __init__(self, future: Future, description: str = ""):
        self._future = future
        self.description = description

    def get(self, timeout: float | None = None) -> int:
        """Wait for completion and return the bytes moved; raise the operation's error if it failed."""
        return self._future.result(timeout)

    def done(self) -> bool:
        """True once the operation has finished, successfully or not."""
        return self._future.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait, then return the operation's error, or None if it succeeded."""
        return self._future.exception(timeout)

    def add_done_callback(self, fn: Callable[["IOFuture"], None]) -> None:
        """Call ``fn(self)`` once the operation finishes (at once if it already has)."""
        self._future.add_done_callback(lambda _f: fn(self))

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<IOFuture {self.description or ''} {state}>"


def completed(nbytes: int = 0, description: str = "") -> IOFuture:
    """A future that has already succeeded with ``nbytes``."""
    f: Future = Future()
    f.set_result(nbytes)
    return IOFuture(f, description)


def detached(error: BaseException) -> BaseException:
    """``error`` again, of its type, message and attributes, without its traceback, cause and
    context (the error itself where it cannot be copied). For a future that outlives the raise: a
    traceback holds its frames, each frame its caller (``f_back``) and, once finished, its locals."""
    try:
        return copy.copy(error)
    except Exception:  # noqa: BLE001 - an error type whose constructor its args do not fit
        return error


def failed(error: BaseException, description: str = "") -> IOFuture:
    """A future that has already failed with ``error``."""
    f: Future = Future()
    f.set_exception(error)
    return IOFuture(f, description)


def gather(parts: Iterable[Future | IOFuture], description: str = "",
           on_done: Callable[[int | None, BaseException | None], None] | None = None) -> IOFuture:
    """Join several futures into one that succeeds with the sum of their results.

    It completes only after *every* part has finished, even when one fails early: a caller that
    sees the joined future fail may then safely reuse the buffers the parts were using. The error
    reported is the first part's error in submission order. ``on_done(total, error)`` runs before
    the joined future resolves, so state updates it makes are visible to whoever waits.
    """
    parts = [p._future if isinstance(p, IOFuture) else p for p in parts]
    joined: Future = Future()
    if not parts:
        if on_done is not None:
            on_done(0, None)
        joined.set_result(0)
        return IOFuture(joined, description)
    remaining = [len(parts)]
    lock = threading.Lock()

    def _finish() -> None:
        total, error = 0, None
        for p in parts:
            e = p.exception()
            if e is not None:
                error = error or e
            else:
                total += p.result() or 0
        if on_done is not None:
            try:
                on_done(None if error else total, error)
            except BaseException as e:  # a failing state update must not leave waiters hanging
                error = error or e
        if error is not None:
            joined.set_exception(error)
        else:
            joined.set_result(total)

    def _one_done(_f: Future) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            _finish()

    for p in parts:
        p.add_done_callback(_one_done)
    return IOFuture(joined, description)


def chain(first: IOFuture, then: Callable[[], IOFuture], description: str = "") -> IOFuture:
    """Run ``then()`` (which starts another operation) once ``first`` succeeds; resolve with both byte counts.

    If ``first`` fails, ``then`` is not called and the chain fails with that error.
    """
    out: Future = Future()

    def on_first(_f: IOFuture) -> None:
        error = first.exception()
        if error is not None:
            out.set_exception(error)
            return
        try:
            second = then()
        except BaseException as e:
            out.set_exception(e)
            return

        def on_second(_s: IOFuture) -> None:
            e2 = second.exception()
            if e2 is not None:
                out.set_exception(e2)
            else:
                out.set_result(first.get() + second.get())

        second.add_done_callback(on_second)

    first.add_done_callback(on_first)
    return IOFuture(out, description)
