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
just under the state; docs/RESULTS.md).
"""

from __future__ import annotations

import math
from typing import Iterable, Iterator, Sequence

from offload_core.errors import TierCapacityError
from tiered_offload.store.record import OpKind, TensorRecord
from tiered_offload.store.tiers import Tier

__all__ = ["Lookahead", "Prefetching"]


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

    def _prefetch_ahead(self) -> None:
        """Start loading the tensors the policies expect next (see :class:`Lookahead`), as far as free
        or cheaply freed space allows."""
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
                distance = math.inf if zero else policy.next_use(key)
                try:
                    self._run(rec, busy, lambda r=rec, t=tier, d=distance: self._start_load(r, t, block=False, further_than=d))
                except TierCapacityError:
                    # the tier is full of tensors needed sooner (or, for zeros, has no free room: going
                    # on past them measured worse, the loads after them took the states' room)
                    break
