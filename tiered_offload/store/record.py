"""What the store knows about each tensor: one :class:`TensorRecord` per key (its copies in each
tier, their versions, the disk copy, the one operation in flight), and the store's counters.
Records are mutated only under the store's lock; the transitions are methods here."""

from __future__ import annotations

import dataclasses
import enum
import itertools
from dataclasses import dataclass, field

import torch

from offload_core.futures import IOFuture
from tiered_offload.store.tiers import CopyState, Tier

_serials = itertools.count()

__all__ = ["Slot", "OpKind", "Operation", "TensorRecord", "StoreStats", "kind_of"]


class OpKind(enum.Enum):
    """What an operation on one tensor does (operations on one tensor are serialised)."""

    CREATE = "create"
    UNREGISTER = "unregister"
    WRITE = "write"
    ZERO = "zero"
    LOAD = "load"
    """A caller's read into a memory tier."""
    LOOKAHEAD = "lookahead"
    """A load the lookahead started ahead of its use."""
    WRITE_BACK = "writeback"


@dataclass(frozen=True)
class Operation:
    """The one operation in flight on a tensor: its kind, the tier it fills or writes, its future."""

    kind: OpKind
    tier: Tier
    future: IOFuture

    def is_(self, kind: OpKind, tier: Tier) -> bool:
        return self.kind == kind and self.tier == tier

    def __str__(self) -> str:
        return f"{self.kind.value} -> {self.tier.name.lower()}"


@dataclass(eq=False)
class Slot:
    """A block of a memory tier's arena holding (or receiving) one tensor's bytes."""

    offset: int
    data: torch.Tensor
    """Typed view with the tensor's shape and dtype."""
    raw: torch.Tensor
    """The same bytes as a flat uint8 tensor, for the backends."""
    version: int = -1
    loading: bool = True
    pins: int = 0


@dataclass(eq=False)
class TensorRecord:
    """Everything the store knows about one tensor. Mutated only under the store's lock."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    version: int = 0
    zero: bool = True
    """The current version is the implicit all-zeros initial value (registered without data)."""
    disk_version: int = -1
    disk_key: str | None = None
    """The extent holding the disk copy (the key itself unless writes are versioned)."""
    disk_crc: int | None = None
    """Checksum (the store's :attr:`~TieredStore.checksum` algorithm) of the disk copy's bytes,
    checked when they are read back."""
    disk_gen: int = 0
    """Generation of the last versioned extent written (``key@gen``)."""
    scratch: bool = False
    """Transient bytes (saved activations): never part of a durable state. Written to disk under
    the key itself (no versioned extents, no :attr:`TieredStore.on_disk_written`), and not
    flushed; :meth:`TieredStore.unregister` deletes the file."""
    rewrite_due: tuple[Tier, int] | None = None
    """``(tier, version)``: the copy of ``version`` will be rewritten before ``tier`` uses it (the
    optimizer step runs in another tier), so ``tier``'s lookahead does not fetch it. A new version
    ends it."""
    slots: dict[Tier, Slot] = field(default_factory=dict)
    serial: int = field(default_factory=_serials.__next__)
    """Order of creation: a tier gives up its stale copies oldest first."""
    disk_reads: int = 0
    """Times its bytes were read from the disk (a caller can tell whether a copy it made stayed
    in memory since: the count has not moved)."""
    disk_unread: bool = False
    """Its last disk write has not been read back yet (see :attr:`StoreStats.unread_writes`)."""
    op: Operation | None = None
    """The one operation in flight on this tensor, if any."""

    # ---- queries ------------------------------------------------------------------------
    def valid(self, tier: Tier) -> bool:
        """Whether ``tier`` holds the current version."""
        if tier == Tier.DISK:
            return self.disk_version == self.version
        slot = self.slots.get(tier)
        return slot is not None and not slot.loading and slot.version == self.version

    def held_elsewhere(self, tier: Tier) -> bool:
        """Whether dropping ``tier``'s copy loses nothing (another tier, or the zero value, has it)."""
        return self.zero or any(self.valid(t) for t in Tier if t != tier)

    def state(self, tier: Tier) -> CopyState:
        """The :class:`CopyState` of this tensor's copy in ``tier``."""
        if tier == Tier.DISK:
            if self.disk_version < 0:
                return CopyState.ABSENT
            return CopyState.CLEAN if self.valid(Tier.DISK) else CopyState.STALE
        slot = self.slots.get(tier)
        if slot is None:
            return CopyState.ABSENT
        if slot.loading:
            return CopyState.LOADING
        if slot.version != self.version:
            return CopyState.STALE
        return CopyState.CLEAN if (self.zero or self.valid(Tier.DISK)) else CopyState.DIRTY

    # ---- transitions --------------------------------------------------------------------
    def modified(self, tier: Tier) -> None:
        """``tier``'s copy now holds new bytes: it becomes the only current version."""
        self.version += 1
        self.zero = False
        self.slots[tier].version = self.version

    def loaded(self, tier: Tier, version: int) -> None:
        """Bytes of ``version`` finished arriving in ``tier``."""
        if tier == Tier.DISK:
            self.disk_version = max(self.disk_version, version)
            return
        slot = self.slots[tier]
        slot.loading = False
        slot.version = version


@dataclass
class StoreStats:
    """Counters since the store was opened (a snapshot: later activity does not change it)."""

    bytes_read: dict[Tier, int] = field(default_factory=lambda: {t: 0 for t in Tier})
    """Bytes copied out of each tier (disk: read from storage)."""
    bytes_written: dict[Tier, int] = field(default_factory=lambda: {t: 0 for t in Tier})
    """Bytes copied into each tier (disk: written to storage)."""
    hits: dict[Tier, int] = field(default_factory=lambda: {t: 0 for t in Tier})
    """``get`` calls that found a valid copy already in the tier."""
    misses: dict[Tier, int] = field(default_factory=lambda: {t: 0 for t in Tier})
    """``get`` calls that had to wait for a copy to arrive."""
    prefetch_waits: dict[Tier, int] = field(default_factory=lambda: {t: 0 for t in Tier})
    """Of the misses, those that found their load already under way (a prefetch not done yet);
    the others had to start it themselves."""
    evictions: dict[Tier, int] = field(default_factory=lambda: {t: 0 for t in Tier})
    """Copies dropped to make room."""
    io_wait_seconds: float = 0.0
    """Time callers spent blocked in ``get`` waiting for bytes."""
    disk_busy_seconds: float = 0.0
    """Time at least one disk read or write was in flight: disk bytes moved / this is the rate
    the disk delivered to this store (no probe needed)."""
    peak_used: dict[Tier, int] = field(default_factory=dict)
    """Highest bytes in use of each memory tier's budget."""
    bytes_by_route: dict[str, int] = field(default_factory=dict)
    """Bytes each route carried, by kind of tensor: ``"host->device:weight"``,
    ``"disk->host:state"``, ``"device->host:grad"``... (the kind: a key's last ``/`` part up to its
    first ``.``, so ``block.3/state.exp_avg.1`` is a ``state``; ``other`` for a key without ``/``)."""

    unread_writes: dict[str, int] = field(default_factory=dict)
    """Bytes written to the disk that were written over before any read used them, by kind of
    tensor (as :attr:`bytes_by_route`), counted when the next write lands. Without a journal
    (``durable=False``) these are writes the step did not need: a victim written out and then
    used from memory after all, or rewritten first. A durable run's commits count here too: they
    write each step's state whether it is read back or not."""

    LINK = ("host->device", "device->host")
    """The routes over the link between the host and device tiers."""

    @property
    def link_bytes(self) -> int:
        """Bytes copied between the host and device tiers, both ways (what crosses PCIe to the GPU;
        a tensor created or written in the device tier, or read from the disk straight into it, is
        not counted)."""
        return sum(self.by_kind(self.LINK).values())

    def by_kind(self, ways: tuple[str, ...], since: "StoreStats | None" = None) -> dict[str, int]:
        """Bytes per kind of tensor over the routes ``ways`` (``("disk->host", "disk->device")``),
        since the snapshot ``since`` (None: since the store opened)."""
        out: dict[str, int] = {}
        for route, n in self.bytes_by_route.items():
            way, kind = route.split(":", 1)
            if way in ways:
                out[kind] = out.get(kind, 0) + n - (since.bytes_by_route.get(route, 0) if since else 0)
        return out

    def as_dict(self) -> dict:
        """JSON-friendly form, tier names as keys."""
        d = dataclasses.asdict(self)
        return {k: ({getattr(t, "name", t).lower(): n for t, n in v.items()} if isinstance(v, dict) else v)
                for k, v in d.items()}


def kind_of(key: str) -> str:
    """The kind of tensor a key names (see :attr:`StoreStats.bytes_by_route`)."""
    return key.rsplit("/", 1)[-1].split(".", 1)[0] if "/" in key else "other"
