"""The lookahead: which tensors the store loads ahead of their use, into which tier, how far ahead.

After every ``get`` the store walks the policy's upcoming keys for each memory tier and starts
loads of those this part wants, as long as free space, or space held by tensors needed later,
allows (the store's allocator decides that). Below a device tier, the host tier prefetches only a
short window (``host_prefetch_share`` of its budget): reaching further ahead evicted what the step
needed before that, which was then read again (measured: 2.6x the disk reads with 16 keys ahead;
docs/STEP_TIME.md).
"""

from __future__ import annotations

import math
from typing import Iterator

from tiered_offload.store.record import TensorRecord
from tiered_offload.store.tiers import Tier

__all__ = ["Lookahead"]


class Lookahead:
    """Prefetch decisions for a store (numbers and records only; the store moves the bytes).

    Args:
        config: the store's :class:`StoreConfig` (``prefetch_depth``, ``host_prefetch_share``).
        spaces: the store's :class:`~tiered_offload.store.space.TierSpace` per memory tier.
        device_buffers: whether the backend reads straight into device memory (GPUDirect).
    """

    def __init__(self, config, spaces: dict, device_buffers: bool):
        self.config = config
        self.spaces = spaces
        self.device_buffers = device_buffers

    def tiers(self) -> Iterator[tuple[Tier, object, float]]:
        """``(tier, policy, window in bytes)`` of each tier that prefetches, host first."""
        depth = self.config.prefetch_depth
        for tier in (Tier.HOST, Tier.DEVICE):
            space = self.spaces[tier]
            if not space.policy.prefetches or space.arena.capacity == 0 or depth == 0:
                continue
            below_device = tier == Tier.HOST and self.spaces[Tier.DEVICE].arena.capacity > 0
            window = self.config.host_prefetch_share * space.arena.capacity if below_device else math.inf
            yield tier, space.policy, window

    def wants(self, rec: TensorRecord, tier: Tier) -> bool:
        """Whether to start loading ``rec`` into ``tier`` now (call with the store's lock)."""
        if rec.valid(tier) or rec.op is not None:
            return False
        if tier == Tier.HOST and rec.valid(Tier.DEVICE):
            return False  # the tiers cache different tensors: the device copy serves
        if tier == Tier.DEVICE and not (rec.zero or rec.valid(Tier.HOST) or self.device_buffers):
            return False  # the host pass brings it up first
        return True

    @staticmethod
    def within(ahead: int, nbytes: int, window: float) -> bool:
        """Whether a tensor of ``nbytes`` that brings the bytes walked so far to ``ahead`` is still in
        the window (the nearest tensor always is)."""
        return ahead <= window or ahead <= nbytes
