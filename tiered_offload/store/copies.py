"""The copy chains of :class:`~tiered_offload.store.tiered_store.TieredStore`: how one tensor's
bytes move between tiers once an operation has claimed it (disk -> host -> device loads, write-backs
through the host, a device copy demoted to the host), and what a landed copy changes in its record.

``TieredStore`` decides *when* bytes move (operations, space, lookahead); this part is *how*. It is
a base class of the store and works on the store's own state (records, spaces, disk, copier),
under the store's lock: the split is by concern, not an interface.
"""

from __future__ import annotations

import math
import time

from offload_core.buffers import aligned_empty
from offload_core.errors import TensorStateError, TierCapacityError
from offload_core.futures import IOFuture, chain, completed, detached
from tiered_offload.store.record import OpKind, TensorRecord, kind_of
from tiered_offload.store.tiers import Tier

__all__ = ["CopyChains"]


class CopyChains:
    """Moving one claimed tensor's bytes between tiers (a part of :class:`TieredStore`)."""

    def _landed(self, rec: TensorRecord, tier: Tier, version: int, src: Tier, extent: str | None = None,
                crc: int | list | None = None):
        """Completion handler: bytes of ``version`` arrived in ``tier`` from ``src`` (or failed).
        ``crc``: the disk copy's checksum, or a one-element list it lands in before this runs."""
        def handler(fut: IOFuture) -> None:
            error = fut.exception()
            old = None
            with self._lock:
                if error is None:
                    rec.loaded(tier, version)
                    rec.disk_reads += src == Tier.DISK
                    kind = kind_of(rec.key)
                    if tier == Tier.DISK:  # the write before this one, if nothing read it
                        if rec.disk_unread:
                            self._stats.unread_writes[kind] = self._stats.unread_writes.get(kind, 0) + rec.nbytes
                        rec.disk_unread = True
                    elif src == Tier.DISK:
                        rec.disk_unread = False
                    self._stats.bytes_read[src] += rec.nbytes
                    self._stats.bytes_written[tier] += rec.nbytes
                    route = f"{src.name.lower()}->{tier.name.lower()}:{kind}"
                    self._stats.bytes_by_route[route] = self._stats.bytes_by_route.get(route, 0) + rec.nbytes
                    if tier == Tier.DISK and extent is not None:
                        old, rec.disk_key, rec.disk_crc = rec.disk_key, extent, crc[0] if isinstance(crc, list) else crc
            if tier != Tier.DISK or extent is None or not self.config.versioned_writes or rec.scratch:
                return
            if error is not None:  # a half-written new extent is garbage; the old one is untouched
                self.disk.delete_quietly(extent)
            elif self.on_disk_written is not None:
                self.on_disk_written(rec.key, extent, rec.disk_crc, old)
            elif old is not None and old != extent:
                self.disk.delete_quietly(old)
        return handler

    def _copy_between(self, rec: TensorRecord, src: Tier, dst: Tier, version: int) -> IOFuture:
        """Start one copy of ``rec``'s bytes (of ``version``) from ``src`` to ``dst``; slots already exist."""
        desc = f"{rec.key} {src.name}->{dst.name}"
        extent = crc = None
        if rec.nbytes == 0:
            fut = completed(0, desc)
            if dst == Tier.DISK:
                extent, crc = self.disk.next_extent(rec), 0
        elif dst == Tier.DISK:
            raw = rec.slots[src].raw
            extent = self.disk.next_extent(rec)
            if raw.device.type != "cpu":
                self._copier.before_device_write()
            fut, crc = self.disk.write(extent, raw)
        elif src == Tier.DISK:
            if dst == Tier.DEVICE:
                self._copier.before_device_read()
            fut = self.disk.read(rec, rec.slots[dst].raw)
        else:
            fut = self._copier.copy(rec.slots[dst].raw, rec.slots[src].raw, desc)
        fut.add_done_callback(self._landed(rec, dst, version, src, extent, crc))  # runs before any later callback
        tracer = self.tracer
        if tracer is not None:
            start, why = time.perf_counter(), rec.op.kind.value if rec.op is not None else ""
            fut.add_done_callback(lambda f: tracer.complete(
                f"{src.name.lower()}->{dst.name.lower()} {rec.key}", "io", start, tensor=rec.key, bytes=rec.nbytes,
                by="lookahead" if why == "lookahead" else why or "caller", ok=f.exception() is None))
        return fut

    def _read_apart(self, rec: TensorRecord):
        """A CPU copy of ``rec``'s current bytes read from the disk into a buffer of its own, outside
        the tiers (for :meth:`TieredStore.read` when no memory tier has a hole for them); None if
        the disk does not hold the current version (a memory tier does: read it there)."""
        with self._lock:
            busy = self._begin(rec, OpKind.LOAD, Tier.HOST)
            if not rec.valid(Tier.DISK) or rec.valid(Tier.HOST) or rec.valid(Tier.DEVICE):
                self._end(rec, busy)
                return None
        raw = aligned_empty(rec.nbytes)  # (page-aligned: the backend reads into it directly)
        try:
            if rec.nbytes:
                self.disk.read(rec, raw).get()
        except BaseException as e:
            self._end(rec, busy, error=detached(e))
            raise
        self._end(rec, busy)
        with self._lock:
            self._stats.bytes_read[Tier.DISK] += rec.nbytes
        return raw.view(rec.dtype).view(rec.shape)

    def _start_load(self, rec: TensorRecord, tier: Tier, *, block: bool = True,
                    further_than: float | None = None) -> IOFuture:
        """Bring the current version into ``tier`` (``rec`` is claimed by the caller)."""
        with self._lock:
            version = rec.version
            zero = rec.zero
        if self._ensure_slot(rec, tier, block=block, further_than=further_than) is None:
            raise TierCapacityError(f"no room to prefetch {rec.key!r} into {tier.name.lower()}")
        if zero:
            self._copier.fill_zero(rec.slots[tier].raw)
            with self._lock:
                rec.loaded(tier, version)
            return completed(0, f"zero {rec.key}")
        other = Tier.HOST if tier == Tier.DEVICE else Tier.DEVICE
        with self._lock:
            other_valid = rec.valid(other)
            disk_valid = rec.valid(Tier.DISK)
        if other_valid:
            fut = self._copy_between(rec, other, tier, version)
            if tier == Tier.HOST and rec.rewrite_due == (Tier.DEVICE, version):
                # read for an update on the host: the device has no further use for these bytes
                fut.add_done_callback(lambda f: self._drop_device_copy(rec) if f.exception() is None else None)
            return fut
        if not disk_valid:
            raise TensorStateError(f"{rec.key!r} has no valid copy anywhere (version {version}); this is a bug")
        if tier == Tier.HOST or self._device_to_disk():
            return self._copy_between(rec, Tier.DISK, tier, version)
        # disk -> host -> device
        if self._ensure_slot(rec, Tier.HOST, block=block, further_than=further_than) is None:
            raise TierCapacityError(f"no room to stage {rec.key!r} in the host tier")
        first = self._copy_between(rec, Tier.DISK, Tier.HOST, version)
        return chain(first, lambda: self._copy_between(rec, Tier.HOST, tier, version), f"load {rec.key}")

    def _device_to_disk(self) -> bool:
        """Whether the disk and the device tier move bytes directly (GPUDirect Storage); otherwise
        every transfer between them is staged in the host tier."""
        return self.backend.supports_device_buffers and self.device.type == "cuda"

    def _start_write_back(self, rec: TensorRecord, to: Tier, *, block: bool = True) -> IOFuture:
        """Copy the current version down to ``to`` (``rec`` is claimed by the caller). ``block=False``
        (making room for a prefetch) never waits for room to stage a device copy in the host tier:
        it raises :class:`TierCapacityError` instead."""
        with self._lock:
            version = rec.version
            if rec.valid(Tier.HOST) and to == Tier.DISK:
                src = Tier.HOST
            elif rec.valid(Tier.DEVICE):
                src = Tier.DEVICE
            else:
                raise TensorStateError(f"write_back({rec.key!r}): no memory tier holds the current version")
        if to == Tier.DISK and src == Tier.DEVICE and not self._device_to_disk():
            if self._ensure_slot(rec, Tier.HOST, block=block) is None:
                raise TierCapacityError(f"no room to stage {rec.key!r} in the host tier on its way to the disk")
            first = self._copy_between(rec, Tier.DEVICE, Tier.HOST, version)
            return chain(first, lambda: self._copy_between(rec, Tier.HOST, Tier.DISK, version), f"write back {rec.key}")
        if to == Tier.HOST:
            self._ensure_slot(rec, Tier.HOST)
        return self._copy_between(rec, src, to, version)

    def _start_demote(self, rec: TensorRecord, *, clean: bool, block: bool = True) -> IOFuture:
        """Move ``rec``'s device copy down to the host tier, to make room on the device (``rec`` is
        claimed by the caller; its device copy is current and the host has none).

        It takes host room that is free or that nothing needed sooner occupies. Where there is
        none, a ``clean`` one (the disk holds it too) is simply dropped (the returned future is then
        already done); a dirty one is written to the disk with GPUDirect and then leaves the device
        too, and without it takes host room all the same (a write would stage it there). Either
        way the device copy goes (a copy left there went down again later: the host tier gives up
        its own copy first where the device holds one). ``block``: as :meth:`_start_write_back`'s.
        """
        with self._lock:
            version = rec.version
        further = self._policies[Tier.HOST].next_use(rec.key)
        if self._ensure_slot(rec, Tier.HOST, block=False, further_than=further) is None:
            if clean:
                self._drop_device_copy(rec)
                return completed(0, f"drop {rec.key} from the device")
            if self._device_to_disk():  # written out, it leaves the device as a copy moved down does
                fut = self._start_write_back(rec, Tier.DISK, block=block)
                fut.add_done_callback(lambda f: self._drop_device_copy(rec) if f.exception() is None else None)
                return fut
            # a write would stage the copy in the host tier anyway, taking room from tensors needed
            # sooner, and leave it there: take that room for the copy moved down instead, and write
            # it only if the host evicts it before its next use (20.7 of 157 MiB written a step were
            # such writes never read back; the total fell by only 3%: docs/RESULTS.md)
            if self._ensure_slot(rec, Tier.HOST, block=block) is None:
                raise TierCapacityError(f"no room to move {rec.key!r} down to the host tier")
        fut = self._copy_between(rec, Tier.DEVICE, Tier.HOST, version)
        fut.add_done_callback(lambda f: self._drop_device_copy(rec) if f.exception() is None else None)
        return fut

    def _drop_device_copy(self, rec: TensorRecord) -> None:
        """Free ``rec``'s device room where another tier holds the bytes and nobody holds the copy:
        a clean victim the host has no room for, or a copy moved down that landed (demoted, or read
        by an update on the host that rewrites it before the device needs it). Left in place, the
        host would give up its copy first (the device holds one), and the device move the same
        bytes down again (up to four times for one weight in one forward, measured)."""
        with self._lock:
            slot = rec.slots.get(Tier.DEVICE)
            if slot is not None and not slot.pins and not slot.loading and rec.held_elsewhere(Tier.DEVICE):
                self._drop_slot(rec, Tier.DEVICE)
                self._stats.evictions[Tier.DEVICE] += 1

    def link_rate(self, nbytes: int = 16 << 20) -> float | None:
        """Bytes per second the copier moves between the host and device tiers (one copy each way,
        best of three), timed in free room of both arenas: within the budgets, and pinned as the
        real copies are. None without a device tier or free room."""
        host, device = self._arenas[Tier.HOST], self._arenas[Tier.DEVICE]
        with self._lock:
            n = min(nbytes, host.largest_hole, device.largest_hole)
            a = host.alloc(n) if n > 0 and device.capacity else None
            b = device.alloc(n) if a is not None else None
            if b is None:
                if a is not None:
                    host.free(a, n)
                return None
        try:
            src, dst = host.view(a, n), device.view(b, n)
            best = math.inf
            for _ in range(3):
                t = time.perf_counter()
                self._copier.copy(dst, src, "link probe up").get()
                self._copier.copy(src, dst, "link probe down").get()
                best = min(best, time.perf_counter() - t)
            return 2 * n / max(best, 1e-9)
        finally:
            with self._lock:
                host.free(a, n)
                device.free(b, n)
