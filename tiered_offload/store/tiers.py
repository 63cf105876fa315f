"""The three tiers and the states a tensor's copy in one of them can be in."""

from __future__ import annotations

import enum

__all__ = ["Tier", "CopyState"]


class Tier(enum.IntEnum):
    """Where a copy of a tensor's bytes can live, fastest first."""

    DEVICE = 0
    """Accelerator memory (CUDA HBM); CPU memory with its own budget where there is no GPU."""
    HOST = 1
    """The bounded pool of host memory (pinned on CUDA machines)."""
    DISK = 2
    """The storage backend (NVMe files, a zarr store...)."""

    @classmethod
    def parse(cls, value: "Tier | str | int") -> "Tier":
        """Accept a Tier, its name in any case (``"host"``) or its number."""
        if isinstance(value, Tier):
            return value
        if isinstance(value, str):
            try:
                return cls[value.upper()]
            except KeyError:
                raise ValueError(f"unknown tier {value!r}; use device, host or disk") from None
        return cls(value)


class CopyState(enum.Enum):
    """The state of one tier's copy of a tensor, as reported by ``TieredStore.residency``."""

    ABSENT = "absent"
    """No bytes in this tier."""
    LOADING = "loading"
    """Space is reserved and bytes are arriving."""
    CLEAN = "clean"
    """Holds the current version, which the disk tier (or the implicit zero value) also has."""
    DIRTY = "dirty"
    """Holds the current version, which the disk tier does not have yet."""
    STALE = "stale"
    """Holds an older version; free to drop."""
