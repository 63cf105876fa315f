"""A memory tier's space: its arena (exactly the budget), its eviction policy, and the whole rule for
which copy gives up its room and where that copy goes. The store asks; this decides.

The victim rule, in order:

1. Only an idle copy can go: unpinned, not loading, no operation in flight on its tensor.
2. A stale copy (an older version than the tensor's) goes first: it holds nothing anyone needs.
3. In the host tier below a device tier that caches other tensors (``tier_caching="exclusive"``),
   a copy the device tier also holds goes before anything only the host has; not one an update
   in the host tier reads soon (:attr:`TierSpace.kept_twins`: a block's weights during a step in
   the backward), which would come back down the link for it.
4. Otherwise the policy ranks them (LRU, or the lookahead's furthest next use); a prefetch may
   only take the room of a copy needed later than what it fetches (``further_than``).
5. A copy being written to the disk ranks as if idle: where it is the one to go, a load waits for
   its write and then drops it (a prefetch does not wait: it loads later).
6. The copies to go are those of the cheapest run of the arena that, cleared, holds the new copy
   in one piece: the run whose worst-ranked copy ranks best (then the fewest bytes), so no copy
   goes whose room would join no hole the new copy fits.

What happens to the victim (:meth:`TierSpace.fate`): a stale copy, or one another tier (or the
implicit zero) also holds, is dropped; a current device copy the host tier lacks moves down to the
host (a PCIe copy, not a disk write) when the tiers cache different tensors, and leaves the
device as soon as it lands (with no host room, see ``CopyChains._start_demote``); the only
current copy of anything else is written to the disk first.
"""

from __future__ import annotations

import collections
import enum
from typing import Callable, Iterable

from offload_core.errors import TierCapacityError
from offload_core.sizes import format_size
from tiered_offload.store.arena import Arena
from tiered_offload.store.policies import EvictionPolicy
from tiered_offload.store.record import OpKind, TensorRecord
from tiered_offload.store.tiers import Tier

__all__ = ["Fate", "TierSpace"]


class Fate(enum.Enum):
    """What becomes of a victim's copy."""

    DROP = "drop"
    """Nothing is lost: it is stale, or another tier (or the implicit zero) holds the current bytes."""
    DEMOTE = "demote"
    """A device copy moves down to the host tier (with no host room and GPUDirect: written out)."""
    WRITE_BACK = "write back"
    """The only current copy: written to the disk before its room is reused."""


class TierSpace:
    """One memory tier's arena, policy and victim rule.

    Args:
        tier: the tier (DEVICE or HOST).
        arena: its pool of exactly the budget.
        policy: its eviction policy.
        demotes: whether a copy leaving this tier moves down to the host tier (the device tier above
            a host tier with a budget, the tiers caching different tensors).
        exclusive: whether the device and host tiers cache different tensors.
    """

    def __init__(self, tier: Tier, arena: Arena, policy: EvictionPolicy, *, demotes: bool, exclusive: bool):
        self.tier = tier
        self.arena = arena
        self.policy = policy
        self.demotes = demotes
        self.exclusive = exclusive
        self.resident: dict[str, TensorRecord] = {}
        """The tensors with a copy (a slot) in this tier: what :meth:`pick_victim` looks through,
        so that an eviction costs the tier's copies, not every registered tensor."""
        self.victims_written = False
        """Whether a victim here was ever written back to make room: until then the lookahead does
        not look for a dirty copy to write ahead (a pass over the tier's copies a ``get``)."""
        self.kept_twins: set[str] = set()
        """Keys whose copy here is not among the device's twins (rule 3) while the device holds one
        too: an update in this tier reads them soon (:meth:`TieredStore.keep_twins`)."""
        self.at_end: set[str] = set()
        """Keys whose copies stay pinned here through a whole forward (the engine's rest, in the
        compute tier): placed at the end of the arena, or they split the free room a unit's update
        then needs in one piece of several blocks (``tools/fuzz_options.py --stores --wide --seed
        88252``: runs of 36, 92 and 148 KiB, four 52 KiB blocks needed)."""

    def alloc(self, rec: TensorRecord, further_than: float | None = None) -> int | None:
        """A block of the arena for ``rec`` (call with the store's lock): see :attr:`at_end`. One of
        those keys goes beyond every other copy; where one lies in the way and can make room now
        (:meth:`tail_victim`), None: that copy is the victim. Else the last hole that fits."""
        if rec.key not in self.at_end:
            return self.arena.alloc(rec.nbytes)
        offset = self.arena.alloc(rec.nbytes, at_end=True)
        if offset is None or offset >= self._tail_start(rec) or self.tail_victim(rec, further_than) is None:
            return offset
        self.arena.free(offset, rec.nbytes)
        return None

    def _tail_start(self, rec: TensorRecord) -> int:
        """Where the copies other than the :attr:`at_end` keys' end: the tail, theirs."""
        return max((r.slots[self.tier].offset + self.arena.block_size(r.nbytes) for r in self.resident.values()
                    if r is not rec and r.key not in self.at_end), default=0)

    def tail_victim(self, rec: TensorRecord, further_than: float | None) -> TensorRecord | None:
        """For an :attr:`at_end` key: the copy furthest into the arena that is not one, where it can
        give up its room now (nothing holds or moves it, and it is not needed before
        ``further_than``: a prefetch's bound); None: none can, and the key takes the last hole."""
        others = [r for r in self.resident.values() if r is not rec and r.key not in self.at_end]
        if not others:
            return None
        last = max(others, key=lambda r: r.slots[self.tier].offset)
        slot = last.slots[self.tier]
        if last.op is not None or slot.pins or slot.loading:
            return None
        if further_than is not None and self.policy.next_use(last.key) <= further_than:
            return None
        return last

    def placed(self, rec: TensorRecord) -> None:
        """``rec`` was given a slot in this tier (call with the store's lock)."""
        self.resident[rec.key] = rec

    def freed(self, rec: TensorRecord) -> None:
        """``rec``'s slot in this tier is gone (call with the store's lock)."""
        self.resident.pop(rec.key, None)

    def pick_victim(self, exclude: TensorRecord, further_than: float | None,
                    writes: Callable[[TensorRecord], bool] | None = None) -> TensorRecord | None:
        """The copy in this tier to give up its room for ``exclude``, or None (call with the store's
        lock): the best-ranked copy (:meth:`_ranked`) of the cheapest run of the arena that,
        cleared, holds ``exclude`` (:meth:`cheapest_window`). Where pinned copies split every such
        run, the best-ranked copy anywhere: its room serves once they are released. Where the best
        victim's room, with the holes beside it, holds ``exclude``, that run is the cheapest: one
        pass finds it, nothing is ranked (what most evictions are).

        ``writes``: copies being written to the disk whose write can end while the caller waits
        (``writes(copy)``: not one it is starting) count too, and where the best victim is one, the
        copy returned is that one with its write in flight: the caller waits for the write (the
        copy is then dropped) rather than evicting a copy needed sooner. A step's optimizer
        states, written behind its update, are needed only by the next step; evicted in their
        place, the weights the backward read again (docs/RESULTS.md, the fiftieth session)."""
        if exclude.key in self.at_end:  # (one in the way of its place at the end first)
            last = self.tail_victim(exclude, further_than)
            if last is not None:
                return last
        need = self.arena.block_size(exclude.nbytes)
        classes = self._candidates(exclude, writes)
        best = self._best(classes, further_than)
        if best is None or self._room_with_holes(best) >= need:
            return best
        window = self.cheapest_window(need, self._ranked(classes, further_than))
        return window[0] if window else best

    def _candidates(self, exclude: TensorRecord, writes: Callable[[TensorRecord], bool] | None
                    ) -> tuple[list, dict, dict]:
        """The copies that may give up their room now (and those being written to the disk that
        ``writes`` accepts), in the victim rule's classes: stale, the device's twins, the others."""
        tier = self.tier
        stale: list[TensorRecord] = []
        twins: dict[str, TensorRecord] = {}
        idle: dict[str, TensorRecord] = {}
        for key, r in self.resident.items():
            slot = r.slots[tier]
            if r is exclude or slot.pins or slot.loading:
                continue
            if r.op is not None:
                if writes and r.op.is_(OpKind.WRITE_BACK, Tier.DISK) and slot.version == r.version and writes(r):
                    idle[key] = r
            elif slot.version != r.version:
                stale.append(r)
            elif (self.exclusive and tier == Tier.HOST and Tier.DEVICE in r.slots and r.valid(Tier.DEVICE)
                  and key not in self.kept_twins):
                twins[key] = r  # (free to drop: the device copy moves back down if the device evicts it)
            else:
                idle[key] = r
        return stale, twins, idle

    def _best(self, classes: tuple[list, dict, dict], further_than: float | None) -> TensorRecord | None:
        """The first of :meth:`_ranked`, in one pass."""
        stale, twins, idle = classes
        if stale:
            return min(stale, key=lambda r: r.serial)
        if twins:
            return twins[self.policy.best_victim(twins)]
        key = self.policy.best_victim(idle)
        if key is None or (further_than is not None and self.policy.next_use(key) <= further_than):
            return None
        return idle[key]

    def _ranked(self, classes: tuple[list, dict, dict], further_than: float | None) -> list[TensorRecord]:
        """The candidates best victim first (the victim rule of the module docstring): stale
        copies (the oldest first), the device's twins, then the policy's ranking; a prefetch's
        (``further_than``) leaves out the copies the policy needs before that."""
        stale, twins, idle = classes
        out = sorted(stale, key=lambda r: r.serial) + [twins[k] for k in self.policy.rank_victims(twins)]
        for k in self.policy.rank_victims(idle):
            if further_than is not None and self.policy.next_use(k) <= further_than:
                break  # (ranked furthest use first: the rest are needed sooner still)
            out.append(idle[k])
        return out

    def _room_with_holes(self, rec: TensorRecord) -> int:
        """The bytes of ``rec``'s block and of the holes on either side of it."""
        off, size = rec.slots[self.tier].offset, self.arena.block_size(rec.nbytes)
        return size + sum(h for o, h in self.arena.holes() if o + h == off or o == off + size)

    def cheapest_window(self, need: int, order: list[TensorRecord]) -> list[TensorRecord]:
        """The copies of the cheapest contiguous run of the arena, ``need`` bytes or more of holes
        and of copies in ``order`` (best victim first), that cleared holds a block of ``need``
        bytes, best victim first; [] where there is none. Cheapest: its worst-ranked copy is the
        best, then the fewest bytes to give up.

        The policy's best victim alone is not enough where the arena is split into holes: its room
        may join no hole, and the next victims went one after the other until two rooms met, the
        first of them for nothing (``tests/test_store.py``, the test of the cheapest run)."""
        rank = {r.key: i for i, r in enumerate(order)}
        blocked = len(rank)
        copies = [(r.slots[self.tier].offset, self.arena.block_size(r.nbytes), rank.get(r.key, blocked), r)
                  for r in self.resident.values()]
        segments = sorted(copies + [(off, size, -1, None) for off, size in self.arena.holes()], key=lambda s: s[0])
        best, chosen = None, []
        run: list = []  # the contiguous segments since the last pinned copy or gap
        for seg in segments + [(None, 0, blocked, None)]:
            if seg[2] == blocked or (run and seg[0] != run[-1][0] + run[-1][1]):
                best, chosen = self._cheapest_in(run, need, best, chosen)
                run = [] if seg[2] == blocked else [seg]
            else:
                run.append(seg)
        return chosen

    @staticmethod
    def _cheapest_in(run: list, need: int, best: tuple | None, chosen: list) -> tuple[tuple | None, list]:
        """:meth:`cheapest_window` over one contiguous run of segments ``(offset, bytes, rank,
        record)`` (a hole's rank is -1): the least windows ending at each segment, the worst rank
        in each kept by a monotonic queue, so a tier of many copies costs one pass."""
        left, covered, evicted, worst = 0, 0, 0, collections.deque()
        for right, (_, size, r, _) in enumerate(run):
            covered += size
            if r >= 0:
                evicted += size
                while worst and run[worst[-1]][2] <= r:
                    worst.pop()
                worst.append(right)
            while covered - run[left][1] >= need:  # (a shorter window that still holds it is never worse)
                covered -= run[left][1]
                evicted -= run[left][1] if run[left][2] >= 0 else 0
                if worst and worst[0] == left:
                    worst.popleft()
                left += 1
            if covered >= need and worst:
                cost = (run[worst[0]][2], evicted, run[left][0])
                if best is None or cost < best:
                    window = sorted(run[left:right + 1], key=lambda s: s[2])
                    best, chosen = cost, [s[3] for s in window if s[3] is not None]
        return best, chosen

    def fate(self, victim: TensorRecord) -> Fate:
        """What becomes of ``victim``'s copy in this tier (see the module docstring)."""
        stale = victim.slots[self.tier].version != victim.version
        demote = self.demotes and not stale and not victim.zero and not victim.valid(Tier.HOST)
        if stale or (victim.held_elsewhere(self.tier) and not demote):
            return Fate.DROP
        return Fate.DEMOTE if demote else Fate.WRITE_BACK

    def fits_beside(self, sizes: Iterable[int], taken: list[tuple[int, int]]) -> bool:
        """Whether tensors of ``sizes`` bytes could all be placed at once in the gaps that copies at
        ``taken`` (``(offset, bytes)``) leave: best fit, largest first. The byte count alone is not
        enough: pinned copies split the arena into holes."""
        arena = self.arena
        gaps, at = [], 0
        for off, size in sorted(taken):
            if off > at:
                gaps.append(off - at)
            at = max(at, off + size)
        if arena.capacity > at:
            gaps.append(arena.capacity - at)
        for need in sorted((arena.block_size(n) for n in sizes if n), reverse=True):
            fits = [i for i, g in enumerate(gaps) if g >= need]
            if not fits:
                return False
            best = min(fits, key=lambda i: gaps[i])
            gaps[best] -= need
        return True

    def unpinned(self) -> list[str]:
        """The keys of the copies in this tier that nothing pins (call with the store's lock)."""
        return [key for key, r in self.resident.items() if not r.slots[self.tier].pins]

    def capacity_error(self, records: Iterable[TensorRecord], rec: TensorRecord, why: str) -> TierCapacityError:
        """The error for ``rec`` not fitting, with the numbers (budget, in use, pinned, largest hole)."""
        arena, tier = self.arena, self.tier
        pinned = sum(r.nbytes for r in records if tier in r.slots and r.slots[tier].pins)
        name = tier.name.lower()
        return TierCapacityError(
            f"cannot fit tensor {rec.key!r} ({format_size(rec.nbytes)}) in the {name} tier: budget "
            f"{format_size(arena.capacity)}, in use {format_size(arena.used)}, pinned {format_size(pinned)}, largest "
            f"free block {format_size(arena.largest_hole)}; {why}. Release tensors you hold, or raise the {name} budget")
