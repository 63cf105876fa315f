"""The lookahead: which tensors the store loads ahead of their use, into which tier, how far ahead.

The order comes from the caller (:meth:`Prefetching.declare_access_sequence`: one training step),
each tier's policy follows the accesses, and after every ``get`` the store walks the policy's
upcoming keys for each memory tier and starts loads of those this part wants, as long as free
space, or space held by tensors needed later, allows (the store's allocator decides that). Below
a device tier, the host tier prefetches only a short window (``host_prefetch_share`` of its
budget): reaching further ahead evicted what the step needed before that, which was then read
again (measured: 2.6x the disk reads with 16 keys ahead; docs/STEP_TIME.md). The host tier as the
compute tier prefetches ``prefetch_share`` of its budget ahead: there a load far ahead took free
room that the forward's and backward's nearer needs then took back (an optimizer state read, given
up, read again: 1.1-1.4x the reads). A tensor whose value
is all zeros (a gradient ``zero_grad()`` cleared) costs no read, so the lookahead makes it only in
room that nothing else needs (free, a stale copy's, or a host copy the device also holds), and the
walk stops there when there is none; its ``get`` makes room when it is used, as late as it can
be. Made with the room of tensors needed after it (Belady's rule for loads), the zeros of the
next backward held a quarter of the host tier through the update and the forward, and the
optimizer states they pushed out were written and read back (2-3x the disk bytes at a budget
just under the state; docs/RESULTS.md). Where the room its ``get`` would take is held by a dirty
copy needed later, the walk starts that copy's write (and takes no room).

A walk that finds the room for a load (or a zero) held by a dirty copy starts its write and gives
up the load; the write's end walks again (:class:`Rewalk`), so the load starts then and not at the
next ``get``, after the compute between them. A disk-bound backward waited for each block's weights
and gradient room in turn with the disk idle through the compute (docs/RESULTS.md, fifty-first session).
"""

from __future__ import annotations

import contextlib
import math
import threading
import weakref
from typing import Callable, Iterable, Iterator, Sequence

from offload_core.errors import TierCapacityError
from offload_core.futures import IOFuture, completed
from tiered_offload.store.record import OpKind, TensorRecord
from tiered_offload.store.space import Fate
from tiered_offload.store.tiers import Tier

__all__ = ["Lookahead", "Prefetching", "Rewalk"]


class Lookahead:
    """Prefetch decisions for a store (numbers and records only; the store moves the bytes).

    Args:
        config: the store's :class:`StoreConfig` (``prefetch_depth``, ``host_prefetch_share``,
            ``prefetch_share``).
        spaces: the store's :class:`~tiered_offload.store.space.TierSpace` per memory tier.
        device_buffers: whether the backend reads straight into device memory (GPUDirect).
    """

    def __init__(self, config, spaces: dict, device_buffers: bool):
        self.config = config
        self.spaces = spaces
        self.device_buffers = device_buffers

    def tiers(self) -> Iterator[tuple[Tier, object, float, bool]]:
        """``(tier, policy, window in bytes, whether the nearest tensor to load is always in it)``
        of each tier that prefetches, host first. The window counts the upcoming tensors in the
        tier already, as their room is taken until their use; the host tier as the compute tier
        (``prefetch_share``) always starts the nearest load, behind tensors it holds already."""
        depth = self.config.prefetch_depth
        for tier in (Tier.HOST, Tier.DEVICE):
            space = self.spaces[tier]
            if not space.policy.prefetches or space.arena.capacity == 0 or depth == 0:
                continue
            below_device = tier == Tier.HOST and self.spaces[Tier.DEVICE].arena.capacity > 0
            compute_host = tier == Tier.HOST and not below_device
            share = (self.config.host_prefetch_share if below_device else
                     self.config.prefetch_share if compute_host else math.inf)
            yield tier, space.policy, share * space.arena.capacity, compute_host

    def wants(self, rec: TensorRecord, tier: Tier) -> bool:
        """Whether to start loading ``rec`` into ``tier`` now (call with the store's lock)."""
        if rec.valid(tier) or rec.op is not None or rec.rewrite_due == (tier, rec.version):
            return False
        if tier == Tier.HOST and rec.valid(Tier.DEVICE):
            return False  # the tiers cache different tensors: the device copy serves
        if tier == Tier.DEVICE and not (rec.zero or rec.valid(Tier.HOST) or self.device_buffers):
            return False  # the host pass brings it up first
        return True

    @staticmethod
    def within(ahead: int, nbytes: int, window: float, first_load: bool = False) -> bool:
        """Whether a tensor of ``nbytes`` that brings the bytes walked so far to ``ahead`` is still in
        the window (the nearest tensor always is, and so is ``first_load``: see :meth:`tiers`)."""
        return ahead <= window or ahead <= nbytes or first_load


class Prefetching:
    """The access order and the loads ahead of it (a part of
    :class:`~tiered_offload.store.tiered_store.TieredStore`, working on its state under its lock,
    like :class:`~tiered_offload.store.copies.CopyChains`)."""

    def declare_access_sequence(self, keys: Sequence[str], *, cyclic: bool = True, tier: Tier | str | None = None) -> None:
        """Tell the lookahead policies (of every tier, or of ``tier``) the order in which tensors
        will be accessed (e.g. one step). A tier given a sequence of its own follows only the
        accesses in that tier (the device tier under an update in the host tier: the update's
        reads of the weights must not move it past the forward that comes next)."""
        only = None if tier is None else Tier.parse(tier)
        for t, p in self._policies.items():
            if only is None or t == only:
                p.set_sequence(list(keys), cyclic=cyclic)
                if only is None:
                    self._own_sequence.discard(t)
        if only is not None:
            self._own_sequence.add(only)

    def rewrite_due(self, keys: Iterable[str], tier: Tier | str | None) -> None:
        """The current bytes of ``keys`` will be rewritten (or zeroed) before ``tier`` needs them:
        its lookahead leaves them alone until then (a copy fetched now would be stale before use).
        ``tier=None``: they will not be after all (a unit the step found nothing to update in)."""
        tier = None if tier is None else self._memory_tier(tier)
        with self._lock:
            for key in keys:
                rec = self._rec(key)
                rec.rewrite_due = None if tier is None else (tier, rec.version)

    def _accessed(self, key: str, tier: Tier) -> None:
        """``key`` was used in ``tier``: the policies that follow that tier move on."""
        for t, p in self._policies.items():
            if t == tier or t not in self._own_sequence:
                p.on_access(key)

    @contextlib.contextmanager
    def lookahead_held(self) -> Iterator[None]:
        """No load ahead starts inside (on any thread): a group placed side by side after its copies
        were split by loads ahead (``get_group``) is not split again by the next ones."""
        with self._lock:
            self._lookahead_held += 1
        try:
            yield
        finally:
            with self._lock:
                self._lookahead_held -= 1

    def _prefetch_ahead(self) -> None:
        """Start loading the tensors the policies expect next (see :class:`Lookahead`), as far as free
        or cheaply freed space allows."""
        if self._lookahead_held:
            return
        for tier, policy, window, nearest_load in self._lookahead.tiers():
            ahead, first = 0, nearest_load
            for key in policy.upcoming(self.config.prefetch_depth):
                with self._lock:
                    rec = self._records.get(key)
                    if rec is None:
                        continue
                    ahead += rec.nbytes
                    wanted = self._lookahead.wants(rec, tier)
                    if not self._lookahead.within(ahead, rec.nbytes, window, first and wanted):
                        break
                    if not wanted:
                        continue
                    first = False
                    zero = rec.zero
                    busy = self._begin(rec, OpKind.LOOKAHEAD, tier, block=False)
                    if busy is None:
                        continue
                # zeros cost no read: they take only room that nothing else needs (see the docstring)
                if self._load_ahead(rec, tier, busy, math.inf if zero else policy.next_use(key)) is None:
                    # the tier is full of tensors needed sooner (or, for zeros, has no free room: going
                    # on past them measured worse, the loads after them took the states' room)
                    if zero:
                        self._clean_ahead(rec, tier, policy.next_use(key))
                    break

    def _load_ahead(self, rec: TensorRecord, tier: Tier, busy: IOFuture, further_than: float) -> IOFuture | None:
        """Run the load ahead of ``rec`` into ``tier`` that ``busy`` claimed, evicting only copies needed
        later than ``further_than`` accesses from now; None where that leaves no room for it."""
        try:
            return self._run(rec, busy, lambda: self._start_load(rec, tier, block=False, further_than=further_than))
        except TierCapacityError:
            return None

    def _clean_ahead(self, rec: TensorRecord, tier: Tier, further_than: float) -> None:
        """For a zero the walk found no room for: start writing the dirty copy its ``get`` would
        evict, where that copy is needed later than the zero, so that the ``get`` finds it clean
        and drops it at once instead of waiting for its write. The zero takes no room before its
        use (see the module docstring): only the write moves earlier, into the disk's idle time.
        Only once an eviction in this tier has written a victim: where they all drop clean copies,
        the search (a pass over the tier's copies) finds nothing to write, and it made a ``get``
        1.4x as costly (``python tools/bench_store.py --bookkeeping 2000``)."""
        space = self._spaces[tier]
        if not space.victims_written:
            return
        with self._lock:
            victim = space.pick_victim(rec, further_than)
            if victim is None or victim.op is not None or space.fate(victim) != Fate.WRITE_BACK:
                return
            busy = self._begin(victim, OpKind.WRITE_BACK, Tier.DISK, block=False)
        if busy is not None:
            try:
                with self._waits.moving_victim():
                    fut = self._run(victim, busy, lambda: self._start_write_back(victim, Tier.DISK, block=False))
            except TierCapacityError:
                return  # (a device copy with no host room to stage it: its get makes room)
            self._walk_again_after(fut)

    def _walk_again_after(self, fut: IOFuture) -> None:
        """Walk the lookahead again once ``fut`` ends: a victim's write (or move down) that a walk
        started to make room, and then gave up on the load. Walking only after the next ``get``,
        the load waited for that ``get`` and the disk idled through a block's compute
        (docs/RESULTS.md, fifty-first session). Not where it ended already, in this thread (a
        synchronous backend's, ``threads=0``): the next ``get`` walks, as it did before, and no
        thread races the caller (a walk there made a synchronous store's hits depend on timing)."""
        if fut.done():
            return
        fut.add_done_callback(lambda _f: self._rewalk.kick())

    def offer(self, key: str, tier: Tier | str) -> IOFuture | None:
        """Start bringing ``key``'s current bytes up into ``tier`` as the lookahead brings what it
        expects next: into room that is free or held by copies ``tier``'s policy needs later than
        ``key`` (nothing needed sooner is evicted for it). Returns the load's future, or None where
        there is no such room or ``key`` is busy, there already, or due to be rewritten there. Advice:
        the caller needs nothing of it (the update in the host tier under a step in the backward
        offers each block's new weights to the device; :mod:`tiered_offload.engine.step_in_backward`)."""
        tier = self._memory_tier(tier)
        policy = self._policies[tier]
        with self._lock:
            rec = self._rec(key)
            if not self._lookahead.wants(rec, tier):
                return None
            busy = self._begin(rec, OpKind.LOOKAHEAD, tier, block=False)
            if busy is None:
                return None
        return self._load_ahead(rec, tier, busy, policy.next_use(key))

    # ---- moving bytes -------------------------------------------------------------------
    def prefetch(self, key: str, tier: Tier | str | None = None) -> IOFuture:
        """Start bringing the current bytes into ``tier``; the future resolves when they are there.

        May block the caller while it makes room (waiting for a dirty victim's write-back).
        ``prefetch(key, "disk")`` is :meth:`write_back`.
        """
        tier = Tier.parse(tier) if tier is not None else self.compute_tier
        if tier == Tier.DISK:
            return self.write_back(key, Tier.DISK)
        tier = self._memory_tier(tier)
        with self._lock:
            rec = self._rec(key)
            if rec.valid(tier):
                return completed(0, f"prefetch {key}")
            if rec.op is not None and rec.op.is_(OpKind.LOAD, tier):
                return rec.op.future
            # A lookahead load in flight may still give up for lack of room: wait for it to end
            # (in _begin), then load for this caller if it did not land.
            busy = self._begin(rec, OpKind.LOAD, tier)
            if rec.valid(tier):
                self._end(rec, busy, result=0)
                return busy
        return self._run(rec, busy, lambda: self._start_load(rec, tier))


class Rewalk:
    """A thread that runs ``walk`` (the store's lookahead walk) when kicked: after a write that
    makes room, where no ``get`` would walk before the compute that follows it ends. Kicks that
    come while one is pending make one walk. Started on the first kick; :meth:`close` stops it.
    It holds the store weakly: a store dropped unclosed ends it too.

    A walk in this thread follows the cursor of the thread that accessed the sequence last (it is
    no walker itself). Errors are left to the ``get`` that needs the tensor: a walk is advice."""

    IDLE_CHECK_S = 5.0
    """How often an idle thread looks whether its store still exists."""

    def __init__(self, walk: Callable[[], None]):
        self._walk = weakref.WeakMethod(walk)
        self._cond = threading.Condition()
        self._pending = self._closed = False
        self._thread: threading.Thread | None = None

    def kick(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._pending = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tiered-offload-rewalk", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._pending and not self._closed:
                    self._cond.wait(self.IDLE_CHECK_S)
                if self._closed:
                    return
                pending, self._pending = self._pending, False
            walk = self._walk()
            if walk is None:
                return
            if pending:
                try:
                    walk()
                except Exception:  # noqa: BLE001 - advice only: the get that needs the tensor meets it
                    pass
            del walk

    def close(self) -> None:
        """Stop the thread (after a walk in progress) and ignore later kicks."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
