"""When a thread that finds no room in a memory tier may wait for some, and when it must fail at once.

A blocking allocation that finds no victim (every resident copy is pinned or busy) waits only for
what another thread will free without needing the waiting one:

* an operation in flight (a copy into or out of the tier), unless this thread is still starting
  it, in an enclosing frame (a load that must move a victim down first): it cannot end before the
  wait does, so waiting for it would hang until ``wait_timeout_s``;
* pins that another thread took as *brief* (:meth:`WaitRules.brief`): the optimizer step's, which
  holds a unit's weights, gradients and state pieces while it updates them. An update on the host
  running beside the forward pins them in the host tier, where the forward's device tier moves
  its offloaded activations and victims; the forward waits for the unit to be done instead of
  failing mid-step for room that is only split into holes.

  Not while the thread moves a victim out of the way (:meth:`WaitRules.moving_victim`): the update
  may need that very tensor (a gradient the device tier evicts), and would wait for the victim's
  operation while the victim's mover waited for its pins. The move fails instead, which ends the
  victim's operation; the allocation that chose it then waits, claiming nothing the update needs.

Any other pin (the caller's own, a user's ``hold``) fails at once with the tier's numbers.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from typing import Iterable, Iterator

__all__ = ["WaitRules"]


class WaitRules:
    """Per thread: the operations it is starting and the pins it took as brief."""

    def __init__(self):
        self._local = threading.local()
        self._brief: dict[int, Counter] = {}
        """Per thread inside :meth:`brief`: its pinned ``(key, tier)`` copies, counted."""

    def may_wait(self, records: Iterable, rec, tier) -> bool:
        """Whether a blocking allocation for ``rec`` in ``tier`` that found no victim among ``records``
        may wait for room (call with the store's lock held): see the module's docstring."""
        return any(r.op is not None and r is not rec and tier in r.slots and self.started_elsewhere(r)
                   for r in records) or self.may_wait_for_brief(tier)

    # ---- operations being started ---------------------------------------------------------------
    @contextlib.contextmanager
    def starting(self, rec) -> Iterator[None]:
        """While this thread starts ``rec``'s operation (the store's ``_run``)."""
        recs = self._local.__dict__.setdefault("recs", [])
        recs.append(rec)
        try:
            yield
        finally:
            recs.pop()

    def started_elsewhere(self, rec) -> bool:
        """Whether ``rec``'s operation can end while this thread waits: it is not starting it."""
        return not any(r is rec for r in getattr(self._local, "recs", ()))

    @contextlib.contextmanager
    def moving_victim(self) -> Iterator[None]:
        """While this thread moves a victim down to make room (its operation claimed)."""
        self._local.victims = getattr(self._local, "victims", 0) + 1
        try:
            yield
        finally:
            self._local.victims -= 1

    # ---- brief pins -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def brief(self) -> Iterator[None]:
        """Pins this thread takes inside are brief: it lets them go without waiting for an operation a
        thread that waits for room may hold (the optimizer step waits only for copies in flight,
        and for the forward's pace with no pin held). Another thread that finds no room waits for them."""
        me = threading.get_ident()
        self._brief[me] = Counter()
        try:
            yield
        finally:
            del self._brief[me]

    def pinned(self, key: str, tier) -> None:
        """This thread pinned ``key`` in ``tier`` (call with the store's lock held)."""
        held = self._brief.get(threading.get_ident())
        if held is not None:
            held[key, tier] += 1

    def released(self, key: str, tier) -> None:
        """This thread released ``key`` in ``tier`` (call with the store's lock held)."""
        held = self._brief.get(threading.get_ident())
        if held is not None and held[key, tier] > 0:
            held[key, tier] -= 1

    def waited_for_brief(self, cond: threading.Condition, deadline: float) -> bool:
        """Wait on ``cond`` (held) for a release, if :meth:`may_wait_for_brief` in any tier; whether
        one came before ``deadline`` (``time.monotonic()``)."""
        return self.may_wait_for_brief() and cond.wait(max(0.0, deadline - time.monotonic()))

    def may_wait_for_brief(self, tier=None) -> bool:
        """Whether this thread may wait for room in ``tier`` (None: any) that another thread's brief
        pins hold: there are some, and this thread is not moving a victim (call with the store's lock held)."""
        if getattr(self._local, "victims", 0):
            return False
        me = threading.get_ident()
        return any(n > 0 and tier in (None, t) for thread, held in list(self._brief.items()) if thread != me
                   for (_, t), n in held.items())
