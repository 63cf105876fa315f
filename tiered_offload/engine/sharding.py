"""ZeRO-3 style sharding over ``torch.distributed``: each rank holds a slice of every unit.

With a process group of ``W`` ranks, every unit's flat buffers are cut into ``W`` equal slices of
``C = ceil(numel / W)`` elements; rank ``r`` owns elements ``[r*C, (r+1)*C)`` of the unit's layout
(weights, and the same elements of the gradient and of each optimizer state, where the unit has
them). Its store holds only those: the training state on its disk is the state / ``W``.

* For forward and backward, a unit's weights are all-gathered from the slices into a full buffer
  (a scratch tensor of the compute tier, dropped after use).
* Backward adds the unit's gradients into a full, zeroed scratch buffer; when the unit's backward
  is done it is reduce-scattered with the mean over ranks (what ``DistributedDataParallel``
  computes), and each rank adds its slice into its stored gradient slice (so accumulation over
  micro-batches works as on one process). Which parameters received a gradient is or-ed over
  ranks: an expert that got no tokens on one rank but some on another has a gradient, as it has
  in the single-process run of all the ranks' batches.
* Each rank updates its own slice (the optimizers are elementwise); the clipping norm and the
  non-finite checks are reduced over ranks.

Every collective is issued by the training thread in the order the model's structure dictates,
the same on every rank. One that does not complete within the group's timeout raises
:class:`~offload_core.errors.DistributedError` naming the step and the phase.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

from offload_core.errors import ConfigError, DistributedError
from tiered_offload.engine.schedule import UnitLayout, buffer_shapes

__all__ = ["Sharding", "ShardLayout", "distributed_group"]

_TRACE = bool(os.environ.get("TIERED_OFFLOAD_TRACE_COLLECTIVES"))
"""Print every collective each rank issues, numbered, to stderr (to find ranks that diverge)."""


def distributed_group(process_group) -> object | None:
    """The group to shard over: ``process_group`` if given, else the default group when one is
    initialised with more than one rank; None: train on this process alone."""
    if process_group is not None:
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("process_group= was given but torch.distributed is not initialised; call "
                              "torch.distributed.init_process_group() first")
        return process_group
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


@dataclass
class ShardLayout:
    """One rank's slice of a unit: the element range ``[lo, lo + size)`` of the unit's layout,
    and what of it each buffer covers. Keys are the unit's own; optimizer-state pieces keep the
    unit's piece numbering (a piece outside the slice has no key here)."""

    unit: UnitLayout
    lo: int
    size: int
    """Elements of the slice (``C``; the last rank's weight slice is zero-padded to it)."""
    grad_numel: int = 0
    """Elements of the slice that have a gradient buffer (trainable), from its start."""
    state_numel: int = 0
    """Elements of the slice the optimizer updates (optimizer states), from its start."""
    piece_ranges: list[tuple[int, int, int]] = field(default_factory=list)
    """``(piece index, start, end)`` in slice coordinates of the unit's state pieces that meet the slice."""

    @classmethod
    def of(cls, unit: UnitLayout, rank: int, world: int) -> "ShardLayout":
        size = max(1, math.ceil(unit.numel / world))
        lo = rank * size
        clip = lambda n: max(0, min(size, n - lo))  # noqa: E731 - elements of [lo, lo+size) below n
        layout = cls(unit, lo, size, clip(unit.grad_numel), clip(unit.state_numel))
        for i, (a, b) in enumerate(unit.pieces()):
            a, b = max(a, lo), min(b, lo + layout.state_numel)
            if a < b:
                layout.piece_ranges.append((i, a - lo, b - lo))
        return layout

    @property
    def weight_key(self) -> str:
        return self.unit.weight_key

    @property
    def grad_key(self) -> str | None:
        return self.unit.grad_key if self.grad_numel else None

    def pieces(self) -> list[tuple[int, int]]:
        return [(a, b) for _, a, b in self.piece_ranges]

    def piece_keys(self, kinds: Sequence[str], i: int) -> list[str]:
        return self.unit.piece_keys(kinds, self.piece_ranges[i][0])

    def state_keys(self, kinds: Sequence[str]) -> list[str]:
        return [k for i in range(len(self.piece_ranges)) for k in self.piece_keys(kinds, i)]

    def shapes(self, kinds: Sequence[str]) -> dict[str, int]:
        """``{key: numel}`` of the buffers this rank registers for the unit."""
        return buffer_shapes(self, self.size, kinds)

    def runs(self, runs: list[tuple[int, int, int, int]]) -> list[tuple[int, int, int, int]]:
        """Optimizer runs (unit coordinates) cut to the slice's optimized elements, in slice coordinates."""
        hi = self.lo + self.state_numel
        return [(max(a, self.lo) - self.lo, min(b, hi) - self.lo, g, n) for a, b, g, n in runs if a < hi and b > self.lo]


class Sharding:
    """The process group and the collectives of sharded training."""

    def __init__(self, group, device: torch.device):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.device = device
        self.layouts: dict[str, ShardLayout] = {}
        self._issued = 0  # collectives issued, numbered in TIERED_OFFLOAD_TRACE_COLLECTIVES output
        self.broken: str | None = None
        """Set when an error interrupted this rank between collectives: the ranks are out of step,
        so no further collective is issued (it would pair with a different one on another rank)."""
        self.where = "start"
        """The step and phase, for a collective's error message (set by the engine)."""
        self.bytes = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0, "broadcast": 0}
        """Bytes of the collectives' full buffers so far, per kind (a ring algorithm moves
        (W-1)/W of that in and out of each rank)."""

    def layout(self, unit: UnitLayout) -> ShardLayout:
        got = self.layouts.get(unit.name)
        if got is None:
            got = self.layouts[unit.name] = ShardLayout.of(unit, self.rank, self.world)
        return got

    def wait(self, work, what: str) -> None:
        """Wait for a collective started with ``wait=False``."""
        try:
            work.wait()
        except RuntimeError as e:
            self.broken = f"{what} failed"
            raise DistributedError(
                f"rank {self.rank} of {self.world}: {what} failed during {self.where}: {e}. Another rank probably "
                f"stopped (crashed, was killed, or raised an error: see its log)") from e

    def _call(self, what: str, fn, *args, wait: bool = True, **kwargs):
        if self.broken:
            raise DistributedError(
                f"rank {self.rank} of {self.world}: {what} not attempted during {self.where}: an earlier error on this rank "
                f"({self.broken}) left the ranks out of step. Restart every rank (from the last durable state)")
        if _TRACE:
            self._issued += 1
            print(f"[collective] rank {self.rank} #{self._issued} {self.where}: {what}", file=sys.stderr, flush=True)
        try:
            work = fn(*args, group=self.group, async_op=not wait, **kwargs)
            if wait and work is not None:
                work.wait()
            return work
        except RuntimeError as e:
            self.broken = f"{what} failed"
            raise DistributedError(
                f"rank {self.rank} of {self.world}: {what} failed during {self.where}: {e}. Another rank probably "
                f"stopped (crashed, was killed, or raised an error: see its log) or called the engine differently "
                f"(every rank must run the same forward, backward, clip and step calls)") from e

    def gather(self, full: torch.Tensor, shard: torch.Tensor, what: str, *, wait: bool = True):
        """All-gather every rank's ``shard`` (``C`` elements) into ``full`` (``W*C`` elements);
        ``wait=False``: return the collective in flight (finish it with :meth:`wait`)."""
        work = self._call(f"all-gather of {what}", dist.all_gather_into_tensor, full, shard, wait=wait)
        self.bytes["all_gather"] += full.numel() * full.element_size()
        return work

    def reduce_scatter_mean(self, out: torch.Tensor, full: torch.Tensor, what: str) -> None:
        """``out`` (``C`` elements) = this rank's slice of the mean over ranks of ``full`` (``W*C``)."""
        self._call(f"reduce-scatter of {what}", dist.reduce_scatter_tensor, out, full, op=dist.ReduceOp.AVG)
        self.bytes["reduce_scatter"] += full.numel() * full.element_size()

    def all_reduce(self, t: torch.Tensor, op, what: str) -> torch.Tensor:
        self._call(what, dist.all_reduce, t, op=op)
        self.bytes["all_reduce"] += t.numel() * t.element_size()
        return t

    def barrier(self, what: str) -> None:
        """Wait until every rank got here (an all-reduce, so it fails like the other collectives)."""
        self.all_reduce(torch.zeros(1, device=self.device), dist.ReduceOp.SUM, f"waiting for {what}")

    def broadcast(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """Rank 0's ``t`` on every rank (the weights a run starts from, as DistributedDataParallel does)."""
        self._call(f"broadcast of {what}", dist.broadcast, t, src=dist.get_global_rank(self.group, 0)
                   if self.group is not dist.group.WORLD else 0)
        self.bytes["broadcast"] += t.numel() * t.element_size()
        return t

    def all_gather_object(self, obj) -> list:
        out = [None] * self.world
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except RuntimeError as e:
            raise DistributedError(f"rank {self.rank} of {self.world}: exchanging the configuration failed during "
                                   f"{self.where}: {e}") from e
        return out
