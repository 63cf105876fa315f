"""``engine.stats()``: the store's counters, and what each training step moves per parameter."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tiered_offload.store.record import StoreStats

__all__ = ["EngineStats"]


@dataclass
class EngineStats:
    """A snapshot: the store's counters since it opened, and the steps measured so far.

    The store's counters are attributes too (``engine.stats().bytes_read[Tier.DISK]``).
    """

    store: StoreStats
    parameters: int
    """Parameters of the model."""
    steps_measured: int
    """Training iterations measured (from one ``step()`` to the next)."""
    step_seconds: float | None
    """Median seconds per iteration spent in the engine's calls (None before two ``step()`` calls)."""
    disk_read_per_step: float | None
    """Median disk bytes read per iteration."""
    disk_written_per_step: float | None
    disk_rate_Bps: float | None
    """Disk bytes moved per second while any transfer was in flight (what the disk delivered)."""
    link_per_step: float | None = None
    """Median bytes copied between the host and device tiers per iteration (0 without a device
    tier); by route and kind of tensor: ``store.bytes_by_route``."""
    floors: dict | None = None
    """What a step cannot avoid moving, beside the measured figures: ``disk_read``,
    ``disk_written``, ``link`` bytes per step (see ``engine.plan``)."""
    forward_backward_loops: dict = dataclasses.field(default_factory=dict)
    """Calls of ``forward_backward`` that ran the micro-batches as the loop (each block's weights
    fetched per micro-batch) instead of one pass, by reason (the first of each is logged with its
    particulars). A shape's first call with dropout is one ("... drew other random numbers than
    none"): it learns the draws the next passes replay."""
    updates_in_backward: int = 0
    """Units updated inside a backward (``step=True``; :mod:`~tiered_offload.engine.step_in_backward`)
    since the engine opened; the others' updates ran after their backward."""

    @property
    def read_bytes_per_param_per_step(self) -> float | None:
        return None if self.disk_read_per_step is None else self.disk_read_per_step / max(1, self.parameters)

    @property
    def written_bytes_per_param_per_step(self) -> float | None:
        return None if self.disk_written_per_step is None else self.disk_written_per_step / max(1, self.parameters)

    @property
    def io_bound_seconds(self) -> float | None:
        """The least time a step's disk traffic takes at :attr:`disk_rate_Bps`: no step can be faster."""
        if self.disk_read_per_step is None or not self.disk_rate_Bps:
            return None
        return (self.disk_read_per_step + self.disk_written_per_step) / self.disk_rate_Bps

    def __getattr__(self, name):  # the store's counters: bytes_read, bytes_written, hits, ...
        if name == "store":
            raise AttributeError(name)
        return getattr(self.store, name)

    def as_dict(self) -> dict:
        out = {k: v for k, v in dataclasses.asdict(self).items() if k != "store"}
        out.update(store=self.store.as_dict(), read_bytes_per_param_per_step=self.read_bytes_per_param_per_step,
                   written_bytes_per_param_per_step=self.written_bytes_per_param_per_step,
                   io_bound_seconds=self.io_bound_seconds)
        return out
