"""Eviction policies: which resident tensor a full tier gives up, and what to prefetch.

A policy sees keys only, never memory: the store tells it about registrations and accesses, and
asks it to rank eviction candidates. Each tier has its own policy instance.

* :class:`LRUPolicy`: evict the least recently used tensor. No prefetching.
* :class:`LookaheadPolicy`: the caller declares the access sequence (a training step reads
  blocks 0..L forward, L..0 backward, then runs the optimizer, and repeats); the policy evicts
  the tensor whose next use is furthest away (Belady's optimal rule) and names the tensors to
  prefetch next, in order.
"""

from __future__ import annotations

import abc
import bisect
import contextlib
import itertools
import math
import threading
from typing import Callable, Iterable, Sequence

from offload_core.errors import ConfigError

__all__ = ["EvictionPolicy", "LRUPolicy", "LookaheadPolicy", "make_policy", "walk_as"]

_walker = threading.local()


def _walker_id() -> int:
    """Whose cursor the calling thread moves: its own, or the one :func:`walk_as` named."""
    return getattr(_walker, "ident", None) or threading.get_ident()


@contextlib.contextmanager
def walk_as(ident: int):
    """Within this block the calling thread walks the access sequence with thread ``ident``'s
    cursor: threads that take turns over one stretch of the sequence (``forward_backward``'s
    micro-batches, each of which the update of a unit may run on) are one walker, not several
    cursors each behind the accesses the others made."""
    before = getattr(_walker, "ident", None)
    _walker.ident = ident
    try:
        yield
    finally:
        _walker.ident = before


class EvictionPolicy(abc.ABC):
    """The interface the store drives. Implementations must be thread-safe."""

    prefetches: bool = False
    """Whether :meth:`upcoming` can name anything (the store skips prefetch work otherwise)."""

    def on_register(self, key: str) -> None:
        """A tensor was registered."""

    def on_unregister(self, key: str) -> None:
        """A tensor was removed."""

    @abc.abstractmethod
    def on_access(self, key: str) -> None:
        """The caller used ``key`` (a ``get``)."""

    @abc.abstractmethod
    def rank_victims(self, keys: Iterable[str]) -> list[str]:
        """``keys`` ordered from the best victim to the worst."""

    def best_victim(self, keys: Iterable[str]) -> str | None:
        """The first of :meth:`rank_victims` (None for no keys), for a caller that needs one victim;
        a policy overrides it to find the one key without ordering them all. (The store asks for it
        at every eviction; where its room joins no hole the new copy fits, it ranks them all.)"""
        ranked = self.rank_victims(keys)
        return ranked[0] if ranked else None

    def next_use(self, key: str) -> float:
        """How many accesses until ``key`` is needed again (``inf`` if unknown or never)."""
        return math.inf

    def upcoming(self, limit: int) -> list[str]:
        """Up to ``limit`` distinct keys expected next, soonest first."""
        return []

    def set_sequence(self, keys: Sequence[str], *, cyclic: bool = True) -> None:
        """Declare the access sequence. Policies that do not look ahead ignore it."""


class LRUPolicy(EvictionPolicy):
    """Least recently used first; never-used tensors before any used one (the latest registered
    first), and keys it was never told of before both."""

    def __init__(self) -> None:
        self._stamp: dict[str, int] = {}
        """Per key, when it was last used (1, 2, ...), or, never used, minus its registration's
        count (-1, -2, ...): ordering by it is the LRU order."""
        self._uses = itertools.count(1)
        self._registrations = itertools.count(-1, -1)
        self._lock = threading.Lock()

    def on_register(self, key: str) -> None:
        with self._lock:
            self._stamp[key] = next(self._registrations)

    def on_unregister(self, key: str) -> None:
        with self._lock:
            self._stamp.pop(key, None)

    def on_access(self, key: str) -> None:
        with self._lock:
            self._stamp[key] = next(self._uses)

    def age(self, key: str) -> float:
        """``key``'s place in the LRU order: lower goes first (call with :attr:`_lock`)."""
        return self._stamp.get(key, -math.inf)

    def rank_victims(self, keys: Iterable[str]) -> list[str]:
        with self._lock:
            return sorted(keys, key=self.age)

    def best_victim(self, keys: Iterable[str]) -> str | None:
        with self._lock:
            return min(keys, key=self.age, default=None)


class LookaheadPolicy(EvictionPolicy):
    """Belady eviction and in-order prefetching over a declared access sequence.

    The sequence is usually cyclic (one training step, repeated). A sequence that is not cyclic
    (the device tier's forward and backward under an update in the host tier: what follows them
    is rewritten first) is never looked past its end; an access of an earlier key after the end
    starts it over from there. A cursor follows each calling
    thread: an access moves that thread's cursor just past the next occurrence of the accessed
    key, so an access that skips ahead (or a key used out of order) resynchronises it. Several
    threads can walk different parts of the sequence at once (the engine's background optimizer
    step runs ahead of the forward): a key's next use is the nearest one seen from any cursor, so
    what one thread is about to use is not evicted by the other. A new thread's cursor starts
    from the last cursor moved. Keys absent from the sequence count as never needed again, so
    they are evicted first; among keys with equal distance, the least recently used goes first.
    """

    prefetches = True

    def __init__(self, sequence: Sequence[str] = (), *, cyclic: bool = True, late_window: int = 32) -> None:
        self._lock = threading.Lock()
        self._lru = LRUPolicy()
        self.late_window = late_window
        """An access to a key that occurred up to this many positions *behind* the cursor is a
        late access (slightly out of order), not a jump a whole cycle ahead."""
        self.set_sequence(sequence, cyclic=cyclic)

    def set_sequence(self, keys: Sequence[str], *, cyclic: bool = True) -> None:
        with self._lock:
            self._seq = list(keys)
            self._cyclic = cyclic
            self._cursors: dict[int, int] = {}
            self._last = 0
            self._positions: dict[str, list[int]] = {}
            for i, k in enumerate(self._seq):
                self._positions.setdefault(k, []).append(i)

    @property
    def cursor(self) -> int:
        """Index in the sequence of the calling thread's next expected access."""
        return self._cursors.get(_walker_id(), self._last)

    def on_register(self, key: str) -> None:
        self._lru.on_register(key)

    def on_unregister(self, key: str) -> None:
        self._lru.on_unregister(key)

    def on_access(self, key: str) -> None:
        self._lru.on_access(key)
        with self._lock:
            pos = self._positions.get(key)
            if not pos:
                return
            n = len(self._seq)
            tid = _walker_id()
            cursor = self._cursors.get(tid, self._last)
            i = bisect.bisect_left(pos, cursor)
            if self._late(pos, i, n, cursor):
                return
            # past its last occurrence: the sequence starts over (cyclic, or run again from the top)
            nxt = pos[i] + 1 if i < len(pos) else pos[0] + 1
            self._cursors[tid] = self._last = nxt % n if self._cyclic else min(nxt, n)

    def _late(self, pos: list[int], i: int, n: int, cursor: int) -> bool:
        """Whether an access of the key at sorted positions ``pos`` (``i``: the first at or after
        ``cursor``) is a late one of its occurrence shortly before ``cursor``, which leaves the
        cursor where it is: that one is at most ``late_window`` positions back (and a quarter of
        the sequence), and no nearer than the next one ahead. Nearer ahead, it is the next one:
        where the backward turns, the forward's last blocks come just before the backward's
        first, and the backward's accesses counted as the forward's late ones left the cursor
        at the turn; the blocks done looked needed next, and those next evicted for them
        (``tests/test_store.py``, the test of the turn; docs/RESULTS.md, the fiftieth session)."""
        behind = cursor - pos[i - 1] if i > 0 else cursor + n - pos[-1] if self._cyclic else math.inf
        ahead = pos[i] - cursor if i < len(pos) else pos[0] + n - cursor if self._cyclic else math.inf
        return behind <= min(self.late_window, n // 4) and behind <= ahead

    def _distance(self, key: str, cursors: Iterable[int] = ()) -> float:
        """Accesses until ``key`` is next needed: the nearest from any of ``cursors`` (default: every
        thread's, or the last moved); ``inf`` for a key the sequence does not hold, or past the end
        of a sequence that is not cyclic. Runs once per resident copy at an eviction: kept flat."""
        pos = self._positions.get(key)
        if not pos:
            return math.inf
        n, distance = len(self._seq), math.inf
        for c in cursors or self._cursors.values() or (self._last,):
            i = bisect.bisect_left(pos, c)
            d = pos[i] - c if i < len(pos) else pos[0] + n - c if self._cyclic else math.inf
            if d < distance:
                distance = d
        return distance

    def next_use(self, key: str) -> float:
        with self._lock:
            return self._distance(key)

    def _furthest_first(self) -> Callable[[str], tuple[float, float]]:
        """The victim order's sort key, for the cursors as they are now (call with both locks):
        needed furthest ahead first, the least recently used of those first."""
        cursors, age = list(self._cursors.values()) or [self._last], self._lru.age
        return lambda k: (-self._distance(k, cursors), age(k))

    def rank_victims(self, keys: Iterable[str]) -> list[str]:
        with self._lru._lock, self._lock:  # the only places both are held: always in this order
            return sorted(keys, key=self._furthest_first())

    def best_victim(self, keys: Iterable[str]) -> str | None:
        """The first of :meth:`rank_victims`, without ordering them all."""
        with self._lru._lock, self._lock:
            return min(keys, key=self._furthest_first(), default=None)

    def upcoming(self, limit: int) -> list[str]:
        """The calling thread's next keys."""
        with self._lock:
            n = len(self._seq)
            if not n or limit <= 0:
                return []
            cursor = self._cursors.get(_walker_id(), self._last)
            if self._cyclic:
                indices = itertools.islice(itertools.cycle(range(n)), cursor, cursor + n)
            else:
                indices = range(cursor, n)
            out: list[str] = []
            seen: set[str] = set()
            for i in indices:
                k = self._seq[i]
                if k not in seen:
                    seen.add(k)
                    out.append(k)
                    if len(out) >= limit:
                        break
            return out


def make_policy(name: "str | Callable[[], EvictionPolicy]") -> EvictionPolicy:
    """A new policy from its name (``"lru"``, ``"lookahead"``) or a factory (e.g. a policy class)."""
    if name == "lru":
        return LRUPolicy()
    if name == "lookahead":
        return LookaheadPolicy()
    if callable(name):
        return name()
    raise ConfigError(f"unknown eviction policy {name!r}; use 'lru' or 'lookahead'")
