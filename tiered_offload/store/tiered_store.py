"""The three-tier tensor store: device memory, a bounded host pool, and a storage backend.

Every tensor is registered under a stable key with its shape and dtype, and gets one
:class:`TensorRecord`, owned by the store. The record knows which tiers hold a copy, which
version of the bytes each copy holds, and which single operation is in flight on the tensor.

Consistency model: a tensor has a *version* that grows each time a copy is modified
(:meth:`TieredStore.mark_dirty`, :meth:`TieredStore.write`). A copy is valid when it holds the
current version. Moving bytes from tier to tier labels the destination with the version the
source held when the move started, so a copy that is modified while being written down just
leaves the destination stale; nothing can mark torn bytes as current. A tensor registered
without data is implicitly all zeros (version 0) until first written: no disk read is ever
needed for it, which is why fresh gradients and optimizer states cost no I/O.

Budgets: the host and device tiers take all their memory from an :class:`~tiered_offload.store.arena.Arena`
of exactly their budget, allocated once, so they cannot exceed it. When a tier is full, its space
picks the victims among idle copies (the victim rule: :mod:`~tiered_offload.store.space`); a victim
holding the only valid copy is written back first (through the host pool, or with GPUDirect).

Operations are asynchronous: :meth:`prefetch`, :meth:`write_back` and :meth:`evict` return an
:class:`~offload_core.futures.IOFuture`; :meth:`get` waits and pins the copy until
:meth:`release`. Work that must wait for space (eviction of a dirty victim) happens in the calling
thread; completion handlers on I/O threads only update state and start the next copy of a chain.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import time
from concurrent.futures import Future
from typing import Iterable, Iterator

import torch

from offload_core.errors import TensorStateError, TierCapacityError, UnknownTensorError
from offload_core.futures import IOFuture, chain, completed, detached, gather
from offload_core.sizes import format_size
from storage_backends.base import StorageBackend, validate_key
from tiered_offload.config import StoreConfig
from tiered_offload.store.arena import Arena
from tiered_offload.store.checksum import checksum_function
from tiered_offload.store.copier import Copier
from tiered_offload.store.copies import CopyChains
from tiered_offload.store.disk import DiskTier, open_backend
from tiered_offload.store.policies import EvictionPolicy, make_policy
from tiered_offload.store.space import Fate, TierSpace
from tiered_offload.store.prefetch import Lookahead, Prefetching, Rewalk
from tiered_offload.store.record import Operation, OpKind, Slot, StoreStats, TensorRecord
from tiered_offload.store.tiers import CopyState, Tier
from tiered_offload.store.waits import WaitRules

__all__ = ["TieredStore"]

_MEMORY_TIERS = (Tier.DEVICE, Tier.HOST)


class TieredStore(CopyChains, Prefetching):
    """Tensors kept in device memory, a bounded host pool and a storage backend.

    Args:
        backend: an opened or unopened :class:`StorageBackend`, or a spec string
            (``"posix:/mnt/nvme/run"``, a plain directory path, ``"memory"``). A backend given
            unopened or by spec is opened and closed by the store.
        config: budgets and policies; keyword overrides of its fields may be passed directly
            (``TieredStore("memory", host_budget_bytes="1GiB")``).
    """

    def __init__(self, backend: StorageBackend | str, config: StoreConfig | None = None, **overrides):
        config = config or StoreConfig()
        if overrides:
            config = dataclasses.replace(config, **overrides)
        self.config = config
        self._backend_arg = backend
        self.backend: StorageBackend | None = None
        self._owns_backend = False
        self._records: dict[str, TensorRecord] = {}
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._waits = WaitRules()  # what a thread that finds no room may wait for
        self._arenas: dict[Tier, Arena] = {}
        self._policies: dict[Tier, EvictionPolicy] = {}
        self._spaces: dict[Tier, TierSpace] = {}
        """Per memory tier: its arena, its policy and the victim rule."""
        self._stats = StoreStats()
        self._copier: Copier | None = None
        self._opened = False
        self.disk: DiskTier | None = None
        """The backend with versioned extents, checksums and reservations (once open)."""
        self.tracer = None
        """A :class:`~tiered_offload.trace.Tracer` that records every copy and wait, or None."""
        self.on_disk_written = None
        """With versioned writes: called as ``fn(key, new_extent, crc, old_extent)`` after a new
        disk version has landed (outside the store's lock); it owns deleting ``old_extent``.
        Unset, the store deletes the superseded extent itself."""

    # ---- life cycle ---------------------------------------------------------------------
    def open(self) -> "TieredStore":
        """Resolve the configuration, open the backend, allocate the tier pools."""
        if self._opened:
            return self
        self.config = self.config.resolved()
        cfg = self.config
        self.backend, self._owns_backend = open_backend(self._backend_arg, cfg.io_profile)
        self.disk = DiskTier(self.backend, cfg, self._lock, self._stats)
        self.device: torch.device = cfg.device
        host = Arena("host", cfg.host_budget_bytes, torch.device("cpu"), pin_memory=cfg.pin_host_memory)
        self._arenas = {Tier.DEVICE: Arena("device", cfg.device_budget_bytes, cfg.device), Tier.HOST: host}
        for a in self._arenas.values():
            a.open()
        self._policies = {t: make_policy(cfg.policy) for t in _MEMORY_TIERS}
        self._own_sequence: set[Tier] = set()
        exclusive = cfg.tier_caching == "exclusive"
        self._spaces = {t: TierSpace(t, self._arenas[t], self._policies[t], exclusive=exclusive,
                                     demotes=t == Tier.DEVICE and exclusive and self._arenas[Tier.HOST].capacity > 0)
                        for t in _MEMORY_TIERS}
        self._lookahead = Lookahead(cfg, self._spaces, self.backend.supports_device_buffers)
        self._rewalk = Rewalk(self._prefetch_ahead)
        self._lookahead_held = 0  # (:meth:`Prefetching.lookahead_held`)
        self._copier = Copier(cfg.device)
        self._copier.open()
        self._opened = True
        return self

    def close(self, *, flush: bool = True) -> None:
        """Wait for operations in flight, write dirty tensors back (unless ``flush=False``), release memory."""
        if not self._opened:
            return
        self._rewalk.close()  # (no load starts behind the flush)
        try:
            if flush:
                self.flush()
            else:
                self._wait_idle()
        finally:
            self._copier.close()
            for a in self._arenas.values():
                a.close()
            if self._owns_backend:
                self.backend.close()
            self._opened = False

    def __enter__(self) -> "TieredStore":
        return self.open()

    def __exit__(self, exc_type, *exc) -> None:
        self.close(flush=exc_type is None)

    # ---- introspection ------------------------------------------------------------------
    @property
    def checksum(self) -> str:
        """The checksum algorithm of the disk copies (``"xxh3"`` or ``"crc32"``)."""
        return self.disk.checksum if self.disk is not None else checksum_function(self.config.checksum).__name__

    def use_checksum(self, name: str) -> None:
        """Record and check disk copies with ``name`` from now on (a reopened directory's algorithm).
        Only before any disk copy is written or adopted."""
        fn = checksum_function(name)
        with self._lock:
            if any(r.disk_crc is not None for r in self._records.values()):
                raise TensorStateError("use_checksum() after disk copies were recorded; call it before adopting them")
            if self.disk is None:
                raise TensorStateError("use_checksum() before open(); open the store first")
            self.disk.checksum_fn = fn

    @property
    def compute_tier(self) -> Tier:
        """Where compute should read tensors: DEVICE when the device tier has a budget, else HOST."""
        return Tier.DEVICE if self._arenas[Tier.DEVICE].capacity > 0 else Tier.HOST

    def capacity(self, tier: Tier | str) -> int:
        """Budget in bytes of a memory tier."""
        return self._arenas[Tier.parse(tier)].capacity

    def footprint(self, nbytes: int, tier: Tier | str) -> int:
        """Bytes of ``tier``'s budget a tensor of ``nbytes`` occupies (rounded up to the alignment)."""
        return self._arenas[Tier.parse(tier)].block_size(nbytes)

    def used(self, tier: Tier | str) -> int:
        """Bytes of a memory tier's budget currently allocated."""
        return self._arenas[Tier.parse(tier)].used

    def fits_beside_pinned(self, sizes: Iterable[int], pinned: Iterable[str], tier: Tier | str | None = None) -> bool:
        """Whether tensors of ``sizes`` bytes could all be placed in ``tier`` at once, beside the copies of
        ``pinned`` keys where they are now, once everything else is evicted (:meth:`TierSpace.fits_beside`)."""
        space = self._spaces[self._memory_tier(tier)]
        with self._lock:
            recs = [self._records[k] for k in pinned if k in self._records]
            taken = [(r.slots[space.tier].offset, space.arena.block_size(r.nbytes)) for r in recs if space.tier in r.slots]
        return space.fits_beside(sizes, taken)

    def arena(self, tier: Tier | str) -> Arena:
        """A memory tier's arena (its budget, use and peak; for tests and tools)."""
        return self._arenas[Tier.parse(tier)]

    def place_at_end(self, keys: Iterable[str]) -> None:
        """Copies of ``keys`` (pinned through whole forwards) go to the end of the compute tier, where they are
        pinned (:attr:`TierSpace.at_end`). Their copies in a tier below come and go: those are placed as any."""
        self._spaces[self.compute_tier].at_end.update(keys)

    def keep_twins(self, keys: Iterable[str]) -> None:
        """Until called again: the host tier's copies of ``keys`` rank as any copy, not as the
        device's twins (the first to go, :mod:`~tiered_offload.store.space`), while the device
        holds them too: an update in the host tier reads them soon, and a copy given up now comes
        back down the link then."""
        with self._lock:
            self._spaces[Tier.HOST].kept_twins = set(keys)

    def release_twin(self, key: str) -> None:
        """``key`` leaves :meth:`keep_twins`: its host copy ranks as the device's twin again (the
        update that was to read it has)."""
        with self._lock:
            self._spaces[Tier.HOST].kept_twins.discard(key)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._records)

    def __contains__(self, key: str) -> bool:
        return key in self._records

    def record(self, key: str) -> TensorRecord:
        """The record of ``key`` (read-only use: inspect shape, dtype, nbytes)."""
        return self._rec(key)

    def residency(self, key: str) -> dict[Tier, CopyState]:
        """The state of ``key``'s copy in each tier."""
        with self._lock:
            return {t: self._rec(key).state(t) for t in Tier}

    @property
    def stats(self) -> StoreStats:
        """A snapshot of the counters."""
        with self._lock:
            s = dataclasses.replace(self._stats, **{
                f: dict(getattr(self._stats, f))
                for f in ("bytes_read", "bytes_written", "hits", "misses", "prefetch_waits", "evictions",
                          "bytes_by_route", "unread_writes")})
            s.peak_used = {t: self._arenas[t].peak_used for t in _MEMORY_TIERS}
            return s

    def policy(self, tier: Tier | str) -> EvictionPolicy:
        return self._policies[Tier.parse(tier)]

    # ---- registration -------------------------------------------------------------------
    def register(self, key: str, shape: Iterable[int], dtype: torch.dtype = torch.float32, *,
                 data: torch.Tensor | None = None, scratch: bool = False) -> TensorRecord:
        """Register a tensor. Without ``data`` it starts as zeros (no I/O until first written).

        Refuses, with the numbers, a tensor larger than a memory tier's whole budget, and (with
        ``preallocate``) a tensor whose disk space cannot be reserved. ``scratch``: transient
        bytes (see :attr:`TensorRecord.scratch`).
        """
        self._check_open()
        self._check_key(key)
        shape = tuple(int(s) for s in shape)
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        for tier in _MEMORY_TIERS:
            arena = self._arenas[tier]
            if (arena.capacity > 0 or tier == Tier.HOST) and arena.block_size(nbytes) > arena.capacity:
                raise TierCapacityError(
                    f"tensor {key!r} ({format_size(nbytes)}, shape {list(shape)}, {dtype}) is larger than the whole "
                    f"{tier.name.lower()} tier budget ({format_size(arena.capacity)} = {arena.capacity} bytes); "
                    f"raise the {tier.name.lower()} budget or split the tensor")
        with self._lock:
            if key in self._records:
                raise ValueError(f"tensor {key!r} is already registered")
            rec = TensorRecord(key, shape, dtype, nbytes, scratch=scratch)
            self._records[key] = rec
        try:
            self.disk.reserve(rec)
        except BaseException:
            with self._lock:
                del self._records[key]
            raise
        for p in self._policies.values():
            p.on_register(key)
        if data is not None:
            self.write(key, data)
        return rec

    def adopt(self, key: str, shape: Iterable[int], dtype: torch.dtype = torch.float32, *,
              extent: str | None, crc: int | None, generation: int = 0) -> TensorRecord:
        """Register a tensor whose current bytes already are on disk in ``extent`` (None: all zeros).

        For reopening a storage directory: nothing is read until the tensor is first used, and
        then the bytes are checked against ``crc``.
        """
        self._check_open()
        self._check_key(key)
        if extent is not None:
            validate_key(extent)
        shape = tuple(int(s) for s in shape)
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        with self._lock:
            if key in self._records:
                raise ValueError(f"tensor {key!r} is already registered")
            rec = TensorRecord(key, shape, dtype, nbytes, disk_gen=generation)
            if extent is not None:
                rec.zero = False
                rec.disk_version = 0
                rec.disk_key, rec.disk_crc = extent, crc
            self._records[key] = rec
        for p in self._policies.values():
            p.on_register(key)
        return rec

    def extent(self, key: str) -> tuple[str | None, int | None]:
        """``(extent, crc)`` of the tensor's current disk copy, or ``(None, None)`` if the disk
        does not hold the current version (it is dirty in memory, or all zeros)."""
        with self._lock:
            rec = self._rec(key)
            if rec.zero or not rec.valid(Tier.DISK):
                return None, None
            return rec.disk_key or rec.key, rec.disk_crc

    def create(self, key: str, shape: Iterable[int], dtype: torch.dtype = torch.uint8,
               tier: Tier | str | None = None) -> torch.Tensor:
        """Register a scratch tensor and give it a copy in ``tier`` (default: the compute tier),
        returned pinned, its bytes undefined: fill it, then :meth:`release` it. The copy is the
        tensor's only version (dirty), so the store writes it to disk if it must make room.

        No zero fill and no read: the way to put bytes computed in memory into the store.
        """
        tier = self._memory_tier(tier)
        rec = self.register(key, shape, dtype, scratch=True)
        try:
            with self._lock:
                busy = self._begin(rec, OpKind.CREATE, tier)
            try:
                slot = self._ensure_slot(rec, tier)
                with self._lock:
                    slot.loading = False
                    rec.modified(tier)
                    slot.pins += 1
                    self._stats.bytes_written[tier] += rec.nbytes
            except BaseException as e:
                self._end(rec, busy, error=detached(e))  # (see _run)
                raise
            self._end(rec, busy, result=rec.nbytes)
        except BaseException:
            self.unregister(key)
            raise
        self._accessed(key, tier)
        return slot.data

    def unregister(self, key: str) -> None:
        """Forget a tensor: wait for its operation in flight, free its copies, delete its extent."""
        with self._lock:
            rec = self._rec(key)
            busy = self._begin(rec, OpKind.UNREGISTER, Tier.DISK)
            if any(s.pins for s in rec.slots.values()):
                self._end(rec, busy, error=TensorStateError(f"tensor {key!r} is pinned; release it before unregistering"))
                raise TensorStateError(f"tensor {key!r} is pinned; release it before unregistering")
            for tier in list(rec.slots):
                self._drop_slot(rec, tier)
            del self._records[key]
        try:
            if not (rec.scratch and rec.disk_version < 0):  # a scratch tensor never written has no file
                self.backend.delete(rec.disk_key or key)
        finally:
            for p in self._policies.values():
                p.on_unregister(key)
            self._end(rec, busy, result=0)

    # ---- data access --------------------------------------------------------------------
    def get(self, key: str, tier: Tier | str | None = None) -> torch.Tensor:
        """Wait until ``tier`` (default: :attr:`compute_tier`) holds the current bytes; pin and return them.

        The returned tensor is the tier's own memory: modify it in place, then call
        :meth:`mark_dirty`. Call :meth:`release` when done; a pinned copy is never evicted.
        """
        tier = self._memory_tier(tier)
        first = True
        while True:
            with self._lock:
                rec = self._rec(key)
                if rec.valid(tier):
                    slot = rec.slots[tier]
                    slot.pins += 1
                    self._waits.pinned(key, tier)
                    (self._stats.hits if first else self._stats.misses)[tier] += 1
                    data = slot.data
                    break
                if first and rec.op is not None and rec.op.is_(OpKind.LOAD, tier):
                    self._stats.prefetch_waits[tier] += 1
            first = False
            t0 = time.perf_counter()
            try:
                self.prefetch(key, tier).get()
            finally:
                with self._lock:
                    self._stats.io_wait_seconds += time.perf_counter() - t0
                if self.tracer is not None:
                    self.tracer.complete(f"wait {key}", "wait", t0, tensor=key, tier=tier.name.lower())
        self._accessed(key, tier)
        self._prefetch_ahead()
        return data

    def get_group(self, keys: list[str], tier: Tier | str | None = None) -> list[torch.Tensor]:
        """:meth:`get` every one of ``keys`` (default tier: the compute tier), returned in that order.

        The budget counts bytes, but the copies pinned so far can split the free room into holes too
        small for the next tensor. Then the group lets go, moves its own copies out (written back if
        dirty) and asks again, the lookahead held (its loads landed between them: the sweep's Jamba);
        at last it moves out every unpinned copy of the tier, and the group is placed side by side."""
        memory = self._memory_tier(tier)
        for attempt in range(3):
            got: list[torch.Tensor] = []
            try:
                with self.lookahead_held() if attempt else contextlib.nullcontext():
                    for k in keys:
                        got.append(self.get(k, tier))
                return got
            except TierCapacityError:
                for k in keys[:len(got)]:
                    self.release(k, tier)
                if attempt == 2:
                    raise
                with self._lock:
                    out = self._spaces[memory].unpinned() if attempt else keys
                for k in out:
                    with contextlib.suppress(TensorStateError):  # pinned elsewhere: stays where it is
                        self.evict(k, memory).get()
        raise AssertionError("unreachable")

    def release(self, key: str, tier: Tier | str | None = None) -> None:
        """Unpin a copy taken with :meth:`get`."""
        tier = self._memory_tier(tier)
        with self._lock:
            slot = self._rec(key).slots.get(tier)
            if slot is None or slot.pins <= 0:
                raise TensorStateError(f"release({key!r}, {tier.name}): that copy is not pinned")
            slot.pins -= 1
            self._waits.released(key, tier)
            self._cond.notify_all()

    def brief(self) -> contextlib.AbstractContextManager:
        """``with store.brief():`` another thread that finds no room waits for the pins taken inside (:mod:`.waits`)."""
        return self._waits.brief()

    @contextlib.contextmanager
    def hold(self, key: str, tier: Tier | str | None = None, *, dirty: bool = False) -> Iterator[torch.Tensor]:
        """``with store.hold(key) as t:`` get, yield, (mark dirty if ``dirty``) and release."""
        t = self.get(key, tier)
        try:
            yield t
            if dirty:
                self.mark_dirty(key, tier)
        finally:
            self.release(key, tier)

    def mark_dirty(self, key: str, tier: Tier | str | None = None) -> None:
        """Declare that the (held) copy in ``tier`` was modified: it becomes the only current version."""
        tier = self._memory_tier(tier)
        with self._lock:
            rec = self._rec(key)
            slot = rec.slots.get(tier)
            if slot is None or slot.loading:
                raise TensorStateError(f"mark_dirty({key!r}, {tier.name}): no copy in that tier; get() it first")
            if slot.version != rec.version:
                raise TensorStateError(f"mark_dirty({key!r}, {tier.name}): that copy is stale (a newer version exists "
                                       f"elsewhere); get() it again before modifying it")
            rec.modified(tier)

    def write(self, key: str, data: torch.Tensor, tier: Tier | str = Tier.HOST) -> None:
        """Replace the tensor's bytes with ``data`` (copied into ``tier``, which becomes dirty)."""
        tier = self._memory_tier(tier)
        with self._lock:
            rec = self._rec(key)
        if tuple(data.shape) != rec.shape and data.numel() != math.prod(rec.shape):
            raise ValueError(f"write({key!r}): data has shape {tuple(data.shape)}, tensor is {rec.shape}")
        with self._lock:
            busy = self._begin(rec, OpKind.WRITE, tier)
        try:
            slot = self._ensure_slot(rec, tier)
            slot.data.copy_(data.reshape(rec.shape).to(rec.dtype))
            if slot.data.device.type == "cuda":
                torch.cuda.current_stream(slot.data.device).synchronize()
            with self._lock:
                slot.loading = False
                slot.version = rec.version
                rec.modified(tier)
                self._stats.bytes_written[tier] += rec.nbytes
        except BaseException as e:
            self._end(rec, busy, error=detached(e))  # (see _run)
            raise
        self._end(rec, busy, result=rec.nbytes)
        self._accessed(key, tier)

    def zero(self, key: str) -> None:
        """Reset the tensor to all zeros without any I/O (its copies become stale and are dropped lazily)."""
        with self._lock:
            rec = self._rec(key)
            busy = self._begin(rec, OpKind.ZERO, Tier.HOST)
            if any(s.pins for s in rec.slots.values()):
                error = TensorStateError(f"zero({key!r}): a copy is pinned; release() it first")
                self._end(rec, busy, error=error)
                raise error
            rec.version += 1
            rec.zero = True
            old = None
            if self.config.versioned_writes and rec.disk_key is not None:
                old, rec.disk_key, rec.disk_crc = rec.disk_key, None, None  # superseded by the zeros
        self._end(rec, busy, result=0)
        if old is not None:
            if self.on_disk_written is not None:
                self.on_disk_written(key, None, None, old)
            else:
                self.disk.delete_quietly(old)

    def read(self, key: str) -> torch.Tensor:
        """A CPU copy of the tensor's current bytes, outside the budget (for inspection, tests and
        the engine's fallbacks): through a memory tier, or, where pinned copies leave it no hole
        for them, straight from the disk."""
        while True:
            with self._lock:
                rec = self._rec(key)
                if rec.zero:
                    return torch.zeros(rec.shape, dtype=rec.dtype)
                src = Tier.DEVICE if rec.valid(Tier.DEVICE) and not rec.valid(Tier.HOST) else Tier.HOST
            try:
                with self.hold(key, src) as t:
                    return t.detach().to("cpu", copy=True)
            except TierCapacityError:
                copy = self._read_apart(rec)
                if copy is not None:
                    return copy
                with self._lock:  # loaded meanwhile: read it where it is (else nothing holds it)
                    if not (rec.valid(Tier.HOST) or rec.valid(Tier.DEVICE)):
                        raise

    # ---- moving bytes -------------------------------------------------------------------
    def write_back(self, key: str, to: Tier | str = Tier.DISK) -> IOFuture:
        """Start copying the current bytes down to ``to`` (DISK, or HOST from the device)."""
        to = Tier.parse(to)
        with self._lock:
            rec = self._rec(key)
            if rec.valid(to) or (to == Tier.DISK and rec.zero):
                return completed(0, f"write back {key}")
            busy = self._begin(rec, OpKind.WRITE_BACK, to)
            if rec.valid(to) or (to == Tier.DISK and rec.zero):
                self._end(rec, busy, result=0)
                return busy
        return self._run(rec, busy, lambda: self._start_write_back(rec, to))

    def evict(self, key: str, tier: Tier | str, *, to: Tier | str = Tier.DISK) -> IOFuture:
        """Drop ``tier``'s copy, writing it back first if it is the only current one: to the disk,
        or (``to="host"``, from the device) to the host tier; ``to="below"``: where the store puts
        its own victims from ``tier`` (with ``tier_caching="exclusive"``, a device copy goes to
        the host tier, which passes it on to the disk if it needs the room)."""
        tier = self._memory_tier(tier)
        if to == "below":
            to = Tier.HOST if self._spaces[tier].demotes else Tier.DISK
        to = Tier.parse(to)
        if to.value <= tier.value:
            raise ValueError(f"evict({key!r}, {tier.name}, to={to.name}): write back to a tier below it")
        with self._lock:
            rec = self._rec(key)
            slot = rec.slots.get(tier)
            if slot is None:
                return completed(0, f"evict {key}")
            if slot.pins:
                raise TensorStateError(f"evict({key!r}, {tier.name}): the copy is pinned; release() it first")
        fut = completed(0) if rec.held_elsewhere(tier) else self.write_back(key, to)

        def drop() -> IOFuture:
            with self._lock:
                s = rec.slots.get(tier)
                if s is not None and not s.pins and rec.op is None and rec.held_elsewhere(tier):
                    self._drop_slot(rec, tier)
                    self._stats.evictions[tier] += 1
            return completed(0)
        return chain(fut, drop, f"evict {key}")

    def flush(self) -> None:
        """Write every dirty tensor back to storage and make it durable."""
        self._check_open()
        with self._lock:
            keys = [k for k, r in self._records.items() if not (r.zero or r.scratch or r.valid(Tier.DISK))]
        futures = [self.write_back(k, Tier.DISK) for k in keys]
        gather(futures, "flush").get()
        self._wait_idle()
        self.backend.flush()

    # ---- internals: operation bookkeeping -----------------------------------------------
    def _check_open(self) -> None:
        if not self._opened:
            raise TensorStateError("the store is not open; call open() or use it as a context manager")

    def _check_key(self, key: str) -> None:
        validate_key(key)
        if self.config.versioned_writes and "@" in key:
            raise ValueError(f"tensor key {key!r} contains '@', which names versions of extents when writes are "
                             f"versioned; rename it")

    def _rec(self, key: str) -> TensorRecord:
        try:
            return self._records[key]
        except KeyError:
            raise UnknownTensorError(f"no tensor registered as {key!r}") from None

    def _memory_tier(self, tier: Tier | str | None) -> Tier:
        tier = self.compute_tier if tier is None else Tier.parse(tier)
        if tier == Tier.DISK:
            raise ValueError("this operation needs a memory tier (device or host), not disk")
        if self._arenas[tier].capacity == 0:
            raise TierCapacityError(f"the {tier.name.lower()} tier has no budget (0 bytes); give it one, or use "
                                    f"{self.compute_tier.name.lower()}")
        return tier

    def _begin(self, rec: TensorRecord, kind: OpKind, tier: Tier, *, block: bool = True) -> IOFuture | None:
        """Claim ``rec`` for one operation (call with the lock held). Waits for the one in flight."""
        deadline = time.monotonic() + self.config.wait_timeout_s
        while rec.op is not None:
            if not block:
                return None
            if not self._cond.wait(timeout=max(0.0, deadline - time.monotonic())):
                raise TierCapacityError(f"timed out after {self.config.wait_timeout_s}s waiting for the operation "
                                        f"in flight on {rec.key!r} ({rec.op})")
        rec.op = Operation(kind, tier, IOFuture(Future(), f"{kind.value} {rec.key} -> {tier.name}"))
        return rec.op.future

    def _end(self, rec: TensorRecord, busy: IOFuture, *, result: int = 0, error: BaseException | None = None) -> None:
        """Release ``rec`` from its operation and resolve the operation's future."""
        with self._lock:
            # An operation that ended (failed, or made no room) leaves no half-filled copy behind.
            for tier in [t for t, slot in rec.slots.items() if slot.loading]:
                self._drop_slot(rec, tier)
            if rec.op is not None and rec.op.future is busy:
                rec.op = None
            self._cond.notify_all()
        if error is not None:
            busy._future.set_exception(error)
        else:
            busy._future.set_result(result)

    def _run(self, rec: TensorRecord, busy: IOFuture, start) -> IOFuture:
        """Start an operation's I/O; release ``rec`` when it completes (or fails to start).

        An operation that fails to start raises its error here, and its future (which another
        caller may wait on) fails with a copy without the traceback: the traceback holds the frames
        that hold the future, and through them every caller's locals (a forward's graph). With the
        error itself the future would make a cycle only the garbage collector frees, and a lookahead
        that finds no room (routine) would keep a dropped forward's graph alive until it ran.
        While ``start`` runs, ``rec`` is this thread's to start (:meth:`WaitRules.starting`)."""
        try:
            with self._waits.starting(rec):
                inner = start()
        except BaseException as e:
            self._end(rec, busy, error=detached(e))
            raise
        inner.add_done_callback(lambda f: self._end(rec, busy, result=0 if f.exception() else f.get(),
                                                    error=f.exception()))
        return busy

    def _wait_idle(self) -> None:
        with self._lock:
            while any(r.op is not None for r in self._records.values()):
                self._cond.wait(timeout=1.0)

    # ---- internals: space ---------------------------------------------------------------
    def _ensure_slot(self, rec: TensorRecord, tier: Tier, *, block: bool = True,
                     further_than: float | None = None) -> Slot | None:
        """Give ``rec`` a slot in ``tier`` (reusing a stale one), marked loading."""
        with self._lock:
            slot = rec.slots.get(tier)
            if slot is not None:
                if slot.pins and slot.version != rec.version:
                    raise TensorStateError(f"{rec.key!r}: its stale {tier.name.lower()} copy is still pinned; "
                                           f"release() it before loading the tensor there again")
                slot.loading = True
                return slot
        return self._allocate(tier, rec, block=block, further_than=further_than)

    def _place(self, rec: TensorRecord, tier: Tier, offset: int) -> Slot:
        """Give ``rec`` the block at ``offset`` of ``tier`` (with the store's lock, as it was allocated:
        room taken with no copy in place is neither a victim nor a wait, and others give up)."""
        arena = self._arenas[tier]
        with torch.inference_mode(False):  # a slot outlives a caller's inference mode: never an inference tensor
            raw = arena.view(offset, rec.nbytes)
            data = raw.view(rec.dtype).view(rec.shape) if rec.nbytes else torch.empty(rec.shape, dtype=rec.dtype,
                                                                                       device=arena.device)
        rec.slots[tier] = slot = Slot(offset, data, raw)
        self._spaces[tier].placed(rec)
        return slot

    def _drop_slot(self, rec: TensorRecord, tier: Tier) -> None:
        slot = rec.slots.pop(tier)
        self._spaces[tier].freed(rec)
        if tier == Tier.DEVICE:
            self._copier.freed()  # before the block can be handed out again
        self._arenas[tier].free(slot.offset, rec.nbytes)
        self._cond.notify_all()

    def _allocate(self, tier: Tier, rec: TensorRecord, *, block: bool = True,
                  further_than: float | None = None) -> Slot | None:
        """A slot for ``rec`` in ``tier`` (marked loading), evicting victims as needed.

        ``block=False`` (prefetching) never waits: it only drops copies that need no write-back,
        starts the write-back of a dirty victim without waiting for it, and returns None if no
        room was made. ``further_than`` restricts victims to tensors needed later than that."""
        space = self._spaces[tier]
        deadline = time.monotonic() + self.config.wait_timeout_s
        while True:
            with self._lock:
                offset = space.alloc(rec, further_than)
                if offset is not None:
                    return self._place(rec, tier, offset)
                writes = self._waits.started_elsewhere if time.monotonic() < deadline else None
                victim = space.pick_victim(rec, further_than, writes)
                if victim is None or victim.op is not None:  # none now, or the best one's write is in flight
                    if not block:
                        if victim is not None:  # (its room may start the loads the walk wants)
                            self._walk_again_after(victim.op.future)
                        return None
                    if victim is None and not self._waits.may_wait(self._records.values(), rec, tier):
                        raise space.capacity_error(self._records.values(), rec, "every resident tensor is pinned or in use")
                    if not self._cond.wait(timeout=max(0.0, deadline - time.monotonic())) and victim is None:
                        raise space.capacity_error(self._records.values(), rec, f"waited {self.config.wait_timeout_s}s")
                    continue
                fate = space.fate(victim)
                space.victims_written |= fate == Fate.WRITE_BACK
                if fate == Fate.DROP:
                    self._drop_slot(victim, tier)
                    self._stats.evictions[tier] += 1
                    continue
                demote, clean = fate == Fate.DEMOTE, victim.held_elsewhere(tier)
                # the victim's copy is current and only a lower tier can keep it: move it down first
                vbusy = self._begin(victim, OpKind.WRITE_BACK, Tier.HOST if demote else Tier.DISK, block=False)
            if vbusy is None:
                continue
            try:
                move = ((lambda: self._start_demote(victim, clean=clean, block=block)) if demote else
                        (lambda: self._start_write_back(victim, Tier.DISK, block=block)))
                with self._waits.moving_victim():
                    fut = self._run(victim, vbusy, move)
            except TierCapacityError:
                if not block:
                    return None
                with self._lock:  # no room to move it down, but another thread's brief pins may go
                    if not self._waits.waited_for_brief(self._cond, deadline):
                        raise
                continue
            if not block:
                self._walk_again_after(fut)
                return None
            fut.get()
