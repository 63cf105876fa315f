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
:class:`~offload_core.errors.DistributedError` naming the step and the phase. An error that
leaves a rank between two collectives (:meth:`Sharded.mark_broken`) is published in the group's
store, and the other ranks' waits for a CPU collective (gloo's) stop on it within
:data:`_PEER_POLL_S` instead of at the timeout: the collective the failed rank never issues.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from offload_core.errors import ConfigError, DistributedError
from storage_backends import resolve_storage
from tiered_offload.engine.schedule import UnitLayout, buffer_shapes
from tiered_offload.store.tiers import Tier

__all__ = ["Sharding", "ShardLayout", "distributed_group", "Placement", "Local", "Sharded", "reconcile_resume",
           "rank_storage", "engine_storage"]

log = logging.getLogger("tiered_offload")

_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""The collectives into and from one flat tensor (their ``*_single`` names since torch 2.13, which
deprecates the ``*_tensor`` ones with a warning per process)."""

_PEER_POLL_S = 0.5
"""How often a wait for a CPU collective looks for a peer's published error (gloo's ``wait`` takes
a timeout and can wait again after it; NCCL's does not block the CPU, so it is not polled)."""

_ENGINES_ON: dict[str, int] = {}
"""Engines built so far per process group, in the same order on every rank: each engine's key in
the group's store is its own, so an error of an earlier engine does not stop a later one."""

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
    world: int = 1

    @classmethod
    def of(cls, unit: UnitLayout, rank: int, world: int) -> "ShardLayout":
        size = max(1, math.ceil(unit.numel / world))
        lo = rank * size
        clip = lambda n: max(0, min(size, n - lo))  # noqa: E731 - elements of [lo, lo+size) below n
        layout = cls(unit, lo, size, clip(unit.grad_numel), clip(unit.state_numel), world=world)
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

    @property
    def grad_prefix(self) -> bool:
        """Whether the unit's gradients are reduced as their trainable prefix alone (an all-reduce
        of ``grad_numel`` elements), not reduce-scattered over the whole unit (``W*C``, frozen
        elements included): where the prefix is at most half the unit (LoRA's adapters in a
        frozen block), which moves fewer bytes and needs a buffer of the prefix only."""
        return 2 * self.unit.grad_numel <= self.size * self.world

    @property
    def grad_buffer_numel(self) -> int:
        """Elements of the unit's full gradient buffer (see :attr:`grad_prefix`)."""
        return max(1, self.unit.grad_numel) if self.grad_prefix else self.size * self.world

    def pieces(self) -> list[tuple[int, int]]:
        return [(a, b) for _, a, b in self.piece_ranges]

    def piece_keys(self, kinds: Sequence[str], i: int) -> list[str]:
        return self.unit.piece_keys(kinds, self.piece_ranges[i][0])

    def state_keys(self, kinds: Sequence[str]) -> list[str]:
        return [k for i in range(len(self.piece_ranges)) for k in self.piece_keys(kinds, i)]

    def shapes(self, kinds: Sequence[str]) -> dict[str, int]:
        """``{key: numel}`` of the buffers this rank registers for the unit."""
        return buffer_shapes(self, self.size, kinds)

    def runs(self, runs: list[tuple]) -> list[tuple]:
        """Optimizer runs (unit coordinates) cut to the slice's optimized elements, in slice coordinates."""
        hi = self.lo + self.state_numel
        return [(max(a, self.lo) - self.lo, min(b, hi) - self.lo, *rest) for a, b, *rest in runs
                if a < hi and b > self.lo]


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
        self._store = group.get_group_store() if hasattr(group, "get_group_store") else None
        name = getattr(group, "group_name", "")
        _ENGINES_ON[name] = _ENGINES_ON.get(name, 0) + 1
        self._broken_key = f"tiered_offload/engine-{_ENGINES_ON[name]}/broken"
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
            self._finish(work, what)
        except RuntimeError as e:
            self.broken = f"{what} failed"
            raise DistributedError(
                f"rank {self.rank} of {self.world}: {what} failed during {self.where}: {e}. Another rank probably "
                f"stopped (crashed, was killed, or raised an error: see its log)") from e

    def publish_broken(self, why: str) -> None:
        """Tell the other ranks that this one stopped between two collectives, and ``why`` (their waits
        stop on it). Best effort: a store that cannot be reached leaves them the group's timeout."""
        if self._store is None:
            return
        try:
            self._store.set(self._broken_key, f"rank {self.rank} stopped with {why}")
        except Exception as e:  # noqa: BLE001 - (the store's host may be the rank that died)
            log.warning("rank %d: could not tell the other ranks it stopped: %s", self.rank, e)

    def _finish(self, work, what: str) -> None:
        """``work.wait()``; for a CPU collective, in slices of :data:`_PEER_POLL_S`, between which a
        peer's published error ends the wait (it will never issue the collective)."""
        if self._store is None or self.device.type != "cpu":
            work.wait()
            return
        while True:
            start = time.monotonic()
            try:
                work.wait(timedelta(seconds=_PEER_POLL_S))
                return
            except RuntimeError:
                # the collective itself failed (a peer's connection closed, the group's timeout), or only
                # this wait ran out. gloo's reduce-scatter reports a closed connection at once on each wait
                # but is never marked completed: an error sooner than the wait's time is a failure
                if work.is_completed() or time.monotonic() - start < _PEER_POLL_S / 2:
                    raise
                why = self._peer_broken()
                if why is not None:
                    self.broken = why
                    raise DistributedError(
                        f"rank {self.rank} of {self.world}: {what} stopped during {self.where}: {why.rstrip('.')}; "
                        f"the ranks are out of step (see that rank's log). Restart every rank (from the last durable "
                        f"state)") from None

    def _peer_broken(self) -> str | None:
        """Another rank's published error, if one is."""
        try:
            if self._store.check([self._broken_key]):
                return self._store.get(self._broken_key).decode(errors="replace")
        except Exception:  # noqa: BLE001 - an unreachable store: the collective's own timeout stops the wait
            return None
        return None

    def _call(self, what: str, fn, *args, wait: bool | None = True, **kwargs):
        """Issue one collective (every collective goes through here): refused once this rank is out of
        step, traced when asked, its failure a :class:`DistributedError` naming the step and phase.
        ``wait=None``: a collective without an asynchronous form (it always completes here)."""
        if self.broken:
            raise DistributedError(
                f"rank {self.rank} of {self.world}: {what} not attempted during {self.where}: an earlier error on this rank "
                f"({self.broken}) left the ranks out of step. Restart every rank (from the last durable state)")
        if _TRACE:
            self._issued += 1
            print(f"[collective] rank {self.rank} #{self._issued} {self.where}: {what}", file=sys.stderr, flush=True)
        try:  # (asynchronous even to wait: see _finish)
            work = fn(*args, group=self.group, **({} if wait is None else {"async_op": True}), **kwargs)
            if wait and work is not None:
                self._finish(work, what)
            return work
        except DistributedError:
            raise
        except RuntimeError as e:
            self.broken = f"{what} failed"
            raise DistributedError(
                f"rank {self.rank} of {self.world}: {what} failed during {self.where}: {e}. Another rank probably "
                f"stopped (crashed, was killed, or raised an error: see its log) or called the engine differently "
                f"(every rank must run the same forward, backward, clip and step calls)") from e

    def gather(self, full: torch.Tensor, shard: torch.Tensor, what: str, *, wait: bool = True):
        """All-gather every rank's ``shard`` (``C`` elements) into ``full`` (``W*C`` elements);
        ``wait=False``: return the collective in flight (finish it with :meth:`wait`)."""
        work = self._call(f"all-gather of {what}", _ALL_GATHER, full, shard, wait=wait)
        self.bytes["all_gather"] += full.numel() * full.element_size()
        return work

    def reduce_scatter_mean(self, out: torch.Tensor, full: torch.Tensor, what: str) -> None:
        """``out`` (``C`` elements) = this rank's slice of the mean over ranks of ``full`` (``W*C``)."""
        self._call(f"reduce-scatter of {what}", _REDUCE_SCATTER, out, full, op=dist.ReduceOp.AVG)
        self.bytes["reduce_scatter"] += full.numel() * full.element_size()

    def reduce_gradients(self, unit, gfull: torch.Tensor, store, status) -> None:
        """A unit's backward is done (:meth:`BlockStreamer.gradients_done`, sharded): the mean over
        ranks of its full gradient buffer ``gfull``, this rank's slice of it added into the stored
        slice; ``gfull`` zeroed (a second call for the same buffers adds nothing); which parameters
        have a gradient or-ed over ranks; the slice's finiteness noted in ``status`` (the step
        reduces it over ranks)."""
        slice_layout = self.layout(unit)
        if self.broken:  # an error left the ranks out of step: no more collectives (they would mismatch)
            gfull.zero_()
            return
        if slice_layout.grad_prefix:  # the trainable prefix, averaged whole; this rank's part of it
            self.all_reduce(gfull, dist.ReduceOp.AVG, f"{unit.name}'s gradients")
            out = gfull[slice_layout.lo:slice_layout.lo + slice_layout.grad_numel].clone()
        else:
            out = torch.empty(slice_layout.size, dtype=gfull.dtype, device=gfull.device)
            self.reduce_scatter_mean(out, gfull, f"{unit.name}'s gradients")
        gfull.zero_()
        trainable = unit.trainable()
        flags = torch.tensor([s_.has_grad for s_ in trainable], dtype=torch.uint8, device=gfull.device)
        self.all_reduce(flags, dist.ReduceOp.MAX, f"which of {unit.name}'s parameters have a gradient")
        for s_, f in zip(trainable, flags.tolist()):
            s_.has_grad = bool(f)
        status.norms = None
        if slice_layout.grad_key:
            g = store.get(slice_layout.grad_key)
            try:
                g.add_(out[:slice_layout.grad_numel])
                if not bool(torch.isfinite(g).all()):
                    status.grads_finite = False
                store.mark_dirty(slice_layout.grad_key)
            finally:
                store.release(slice_layout.grad_key)

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

    def all_gather_object(self, obj, what: str = "the configuration") -> list:
        """Every rank's ``obj`` (a JSON-like value), through the same gate as the other collectives."""
        out = [None] * self.world
        self._call(f"exchanging {what}", dist.all_gather_object, out, obj, wait=None)
        return out


# ---- where the training state lives: one process, or sliced over ranks ----------------------------
def reconcile_resume(positions: list, rank: int) -> tuple[int | None, bool, bool]:
    """The step every rank resumes at, from each rank's ``[manifest step, step in flight or None,
    step of the commit before that it keeps or None]`` (None: the rank holds no state). Returns
    ``(target, drop, back)``: ``target`` None when no rank holds a state, or those that do hold
    their first commit alone (step 0, the starting weights: a first start was killed before every
    rank made it; every rank starts fresh, and makes it again); ``drop``: this rank must
    forget its step in flight (not every rank committed it); ``back``: this rank must go back to the
    commit before its manifest's (snapshot commits: not every rank made the newer one).

    Journal: a step is committed on a rank once its intent is in the journal, and no rank updates
    anything before every rank's intent is (a barrier); so if one rank lacks the newest intent, no
    rank updated for it, and the others drop it. Snapshots: a rank forgets the commit before its
    newest only once every rank has made the newest, so the oldest manifest is one every rank
    holds, as its manifest or as the commit before. Pure: tested without ``torch.distributed``.
    """
    if any(p is None for p in positions):
        have = [r for r, p in enumerate(positions) if p is not None]
        if all(positions[r][:2] == [0, None] and (len(positions[r]) < 3 or positions[r][2] is None) for r in have):
            return None, False, False  # (none, or a first start killed between the ranks' first commits: made again)
        raise DistributedError(
            f"rank(s) {have} of {len(positions)} hold a training state and the others none: every rank's directory "
            f"must come from the same run (storage= the same root on every rank, with resume=True)")
    kept = [p[2] if len(p) > 2 else None for p in positions]
    positions = [p[:2] for p in positions]
    if any(k is not None for k in kept):
        target = min(m for m, _ in positions)
        if any(i is not None for _, i in positions) or not all(
                m == target or k == target for (m, _), k in zip(positions, kept)):
            raise DistributedError(f"the ranks' committed steps cannot be reconciled: {positions} ([manifest step, "
                                   f"step in flight] per rank), the commits before kept: {kept}")
        return target, False, positions[rank][0] != target
    target = max(i if i is not None else m for m, i in positions)
    if not all(m == target or i == target for m, i in positions):
        target -= 1
        if not all(m == target or i == target or (i == target + 1 and m == target) for m, i in positions):
            raise DistributedError(f"the ranks' committed steps cannot be reconciled: {positions} "
                                   f"([manifest step, step in flight] per rank)")
    _, in_flight = positions[rank]
    return target, in_flight is not None and in_flight > target, False


def rank_storage(group, spec, durable, resume):
    """Sharded: each rank's own directory inside ``storage`` (``rank-R-of-W``), and the durable flag."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if spec is not None and spec.names_directories:
        root = Path(spec.location.split(",")[0])
        others = sorted(p.name for p in root.glob("rank-*-of-*") if p.name.split("-of-")[-1] != str(world)) \
            if root.is_dir() else []
        if others and resume:
            raise ConfigError(
                f"rank {rank}: {root} holds the state of a run with another number of ranks ({others[0]}, this run "
                f"has {world}); re-sharding is not supported. Resume with the same number of ranks, write the "
                f"weights with export_safetensors(), and start the new run from them with init_from")
        dirs = [str(Path(d) / f"rank-{rank}-of-{world}") for d in spec.location.split(",")]
        spec = dataclasses.replace(spec, location=",".join(dirs))
    elif spec is not None and spec.backend is not None:
        raise ConfigError("sharded training needs storage= a directory (each rank keeps its files in its own "
                          "subdirectory) or None, not a backend object shared by the ranks")
    if durable is None:
        durable = spec is not None and spec.names_directories
    return spec, durable


def engine_storage(storage, group, durable: bool | None, resume, commit_every: int):
    """``(spec, durable, temporary directory or None)`` of an engine's ``storage=``: each rank's own
    directory when sharded, a temporary directory (not durable) when none is given."""
    spec = resolve_storage(storage) if storage is not None else None
    if group is not None:
        spec, durable = rank_storage(group, spec, durable, resume)
    elif spec is not None and spec.names_directories:
        root = Path(spec.location.split(",")[0])
        ranks = sorted(p.name for p in root.glob("rank-*-of-*")) if root.is_dir() else []
        if ranks:
            raise ConfigError(
                f"{root} holds the state of a sharded run ({', '.join(ranks[:4])}); this process is not one of its "
                f"ranks. Resume it with the same number of ranks (torchrun --nproc_per_node N), or write its weights "
                f"with `tiered-offload export {root} OUT` and start from them with init_from")
    if durable is None:
        durable = spec is not None and spec.names_directories
    if resume and not durable:
        raise ConfigError("resume needs durable storage: give storage= a directory (and not durable=False)")
    if commit_every > 1 and not durable:
        raise ConfigError("commit_every needs durable storage: give storage= a directory (and not durable=False)")
    tmpdir = None
    if storage is None:
        tmpdir = tempfile.TemporaryDirectory(prefix="tiered-offload-")
        spec = resolve_storage(tmpdir.name)
    return spec, bool(durable), tmpdir


class Placement:
    """Where this process's share of the training state lives, and what crosses processes.

    :class:`Local` (one process: every collective a no-op) and :class:`Sharded` (a slice of every
    unit per rank, over ``torch.distributed``) answer the same questions, so the engine asks
    without branching on which it has.
    """

    sharding: Sharding | None = None
    """The collectives (None on one process): the streamer and the updater take it."""
    rank = 0
    world = 1

    # ---- what this process stores of a unit ------------------------------------------------
    def layout(self, unit):
        """The unit (one process) or this rank's :class:`ShardLayout` of it."""
        return unit

    def shapes(self, unit, kinds) -> dict[str, int]:
        """``{key: numel}`` of what this process stores of ``unit``."""
        return self.layout(unit).shapes(kinds)

    def durable_keys(self, unit, kinds) -> list[str]:
        """The keys of ``unit``'s committed tensors (weights, optimizer states) this process stores."""
        slice_layout = self.layout(unit)
        return [slice_layout.weight_key, *slice_layout.state_keys(kinds)]

    def grad_key(self, unit) -> str | None:
        """The key of the gradient this process stores for ``unit`` (None: no trainable parameter)."""
        return self.layout(unit).grad_key

    def manifest_entry(self) -> dict | None:
        """What the manifest records of the placement (None: the whole state, one process)."""
        return None

    # ---- agreement between processes -------------------------------------------------------
    def set_phase(self, where: str) -> None:
        """The step and phase, for a collective's error message."""

    def mark_broken(self, error: BaseException) -> None:
        """An error left this rank between two collectives: issue no further one."""

    def all_agree(self, flag: bool, what: str) -> bool:
        """Whether ``flag`` holds on every process (its own value on one process)."""
        return flag

    def all_agree_each(self, flags: list[bool], what: str) -> list[bool]:
        """Elementwise :meth:`all_agree` of a list of flags, in one collective."""
        return list(flags)

    def barrier(self, what: str) -> None:
        """Wait until every process got here."""

    def check_same(self, signature: dict) -> None:
        """Refuse processes that built a different model or optimizer (``signature``: what must agree)."""

    def reconcile(self, recovered, resume, files):
        """The committed state every process resumes from (each rank's own, brought to one step)."""
        return recovered

    def gather_ahead(self, wanted: bool) -> bool:
        """Whether the forward may gather the next block's weights while this one runs."""
        return False

    def collective_bytes(self) -> dict[str, int]:
        """Bytes of the collectives' buffers so far, per kind."""
        return {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0, "broadcast": 0}

    # ---- moving the weights -------------------------------------------------------------------
    def register(self, store, unit, kinds, fill) -> None:
        """Register this process's tensors of ``unit`` and write its initial weights, which
        ``fill(flat)`` puts into a zeroed buffer of the unit's full size."""
        for key, numel in self.shapes(unit, kinds).items():
            store.register(key, (numel,))
        flat = store.get(unit.weight_key, Tier.HOST)
        try:
            fill(flat)
            store.mark_dirty(unit.weight_key, Tier.HOST)
        finally:
            store.release(unit.weight_key, Tier.HOST)
        store.write_back(unit.weight_key).get()
        store.evict(unit.weight_key, Tier.HOST).get()

    def full_weights(self, store, unit) -> torch.Tensor:
        """The unit's whole weight buffer on the CPU (a copy)."""
        with store.hold(unit.weight_key, Tier.HOST) as flat:
            return flat[:unit.numel].clone()

    @contextlib.contextmanager
    def unit_weights(self, store, unit):
        """The unit's weight buffer, readable on the CPU while the block runs (held in the host tier)."""
        with store.hold(unit.weight_key, Tier.HOST) as flat:
            yield flat

    def parameters(self, store, units, param_order):
        """``(name, tensor)`` of every parameter in ``param_order``, one at a time, copied to the CPU."""
        for unit, slot in param_order:
            with self.unit_weights(store, unit) as flat:
                value = flat[slot.offset:slot.offset + slot.numel].view(slot.shape).clone()
            yield slot.name, value

    def writes_exports(self) -> bool:
        """Whether this process writes the exported model (rank 0; the others send their slices)."""
        return True

    def grad_norm(self, store, schedule, param_order, unit_norms, norm_type: float,
                  taken: dict | None = None) -> torch.Tensor | None:
        """The global gradient norm over the parameters that have a gradient (None: none has).
        ``unit_norms(unit, norm_type)``: the norms of a unit's trainable parameters, in order
        (mostly computed by the backward: no pass over the gradients on disk). ``taken``: unit name
        -> :meth:`norm_part` taken before an update forgot its gradient (L2 only)."""
        norms: dict[int, torch.Tensor] = {}
        for unit in schedule.clip_order():
            if unit.grad_key is None:
                continue
            parts = taken[unit.name] if taken and unit.name in taken else unit_norms(unit, norm_type)
            for slot, n in zip(unit.trainable(), parts):
                norms[id(slot)] = n
        ordered = [norms[id(s)] for _, s in param_order if s.has_grad]
        if not ordered:
            return None
        return torch.linalg.vector_norm(torch.stack(ordered), norm_type)

    def norm_part(self, store, unit, unit_norms) -> tuple[object, float]:
        """What :meth:`grad_norm` (L2) needs of ``unit``'s gradient, taken now, and its sum of squares
        (a lower bound's part): here the norm of each of its trainable parameters' gradients."""
        norms = unit_norms(unit, 2.0) if unit.grad_key is not None else []
        return norms, float(torch.stack(norms).double().square().sum()) if norms else 0.0  # (one sync)


class Local(Placement):
    """One process holds the whole training state; collectives are no-ops."""


class Sharded(Placement):
    """Each rank of ``group`` holds a slice of every unit (see the module's docstring)."""

    def __init__(self, group, device: torch.device):
        self.sharding = Sharding(group, device)
        self.rank, self.world, self.device = self.sharding.rank, self.sharding.world, device

    def layout(self, unit) -> ShardLayout:
        return self.sharding.layout(unit)

    def manifest_entry(self) -> dict:
        return {"rank": self.rank, "world_size": self.world}

    def peer_state_dirs(self, own: Path) -> list[Path] | None:
        """The other ranks' state directories beside this rank's ``own`` (``ROOT/rank-R-of-W/...``,
        :func:`rank_storage`); None where ``own`` is not laid out so."""
        if own.parent.name != f"rank-{self.rank}-of-{self.world}":
            return None
        return [own.parent.parent / f"rank-{q}-of-{self.world}" / own.name for q in range(self.world) if q != self.rank]

    @property
    def out_of_step(self) -> bool:
        """Whether this rank saw the ranks fall out of step (a collective failed, an error here or
        published by another rank): the other ranks' next commits may never come."""
        return self.sharding.broken is not None

    def set_phase(self, where: str) -> None:
        self.sharding.where = where

    def mark_broken(self, error: BaseException) -> None:
        if self.sharding.broken is None:
            text = str(error)
            end = text.find(". ")  # (its first sentence, where that is short: the rest is advice for this rank)
            text = text[:end + 1] if 0 < end < 300 else text[:300] + ("..." if len(text) > 300 else "")
            self.sharding.broken = f"{type(error).__name__}: {text}"
            self.sharding.publish_broken(self.sharding.broken)

    def all_agree(self, flag: bool, what: str) -> bool:
        return self.all_agree_each([flag], what)[0]

    def all_agree_each(self, flags: list[bool], what: str) -> list[bool]:
        t = torch.tensor([int(f) for f in flags], dtype=torch.uint8, device=self.device)
        self.sharding.all_reduce(t, dist.ReduceOp.MIN, what)
        return [bool(x) for x in t.tolist()]

    def barrier(self, what: str) -> None:
        self.sharding.barrier(what)

    def check_same(self, signature: dict) -> None:
        sigs = self.sharding.all_gather_object(signature, "the model and optimizer each rank built")
        differ = [r for r, other in enumerate(sigs) if other != sigs[0]]
        if differ:
            what = [k for k in signature if any(sigs[r][k] != sigs[0][k] for r in differ)]
            raise DistributedError(
                f"rank(s) {differ} built a different {' and '.join(what)} than rank 0; every rank must build the "
                f"same model (same parameters, trainable and frozen alike) and the same optimizer and groups")

    def reconcile(self, recovered, resume, files):
        def position(state):
            if state is None:
                return None
            return [state.manifest["step"], state.intent["step"] if state.intent is not None else None,
                    state.previous["step"] if state.previous is not None else None]
        self.set_phase("resume")
        positions = self.sharding.all_gather_object(position(recovered), "each rank's committed step")
        target, drop, back = reconcile_resume(positions, self.rank)
        if target is None and recovered is not None:
            log.warning("rank %d forgets its first commit (step 0, the starting weights): not every rank made it, so "
                        "every rank starts fresh and makes it again", self.rank)
            files.forget_first_commit()
            return None
        if drop:  # not every rank committed it: nothing of it was updated
            log.warning("rank %d: dropping step %d's intent (not every rank had committed it); resuming at step %d",
                        self.rank, recovered.intent["step"], target)
            recovered.intent, recovered.recorded = None, {}
            files.reset_journal()
        if back:  # not every rank made its last commit: back to the one before, which every rank has
            log.warning("rank %d: going back from step %d to step %d, the last step every rank committed",
                        self.rank, recovered.manifest["step"], target)
            files.restore_previous()
            recovered.manifest, recovered.previous = recovered.previous, None
        return recovered

    def gather_ahead(self, wanted: bool) -> bool:
        return self.all_agree(wanted, "whether to gather ahead")

    def collective_bytes(self) -> dict[str, int]:
        return dict(self.sharding.bytes)

    def register(self, store, unit, kinds, fill) -> None:
        """The full unit is built (read, initialised or copied) and rank 0's broadcast, as
        DistributedDataParallel starts every rank from rank 0's weights; each rank keeps its slice."""
        slice_layout = self.layout(unit)
        full = torch.zeros(slice_layout.size * self.world, dtype=torch.float32, device=self.device)
        fill(full[:unit.numel])
        self.sharding.broadcast(full, f"{unit.name}'s initial weights")
        super().register(store, unit, kinds, lambda flat: flat.copy_(full[slice_layout.lo:slice_layout.lo + slice_layout.size]))

    def full_weights(self, store, unit) -> torch.Tensor:
        """Gathered from the ranks' slices (every rank must call it, in the same order)."""
        slice_layout = self.layout(unit)
        full = torch.empty(slice_layout.size * self.world, dtype=torch.float32, device=self.device)
        with store.hold(unit.weight_key) as shard:
            self.sharding.gather(full, shard.to(self.device), f"{unit.name}'s weights")
        return full[:unit.numel].cpu()

    @contextlib.contextmanager
    def unit_weights(self, store, unit):
        yield self.full_weights(store, unit)

    def parameters(self, store, units, param_order):
        """Every rank takes part in each unit's gather, in the same order, before the first is yielded."""
        gathered = {}
        for unit in units:
            full = self.full_weights(store, unit)
            for slot in unit.params:
                gathered[slot.name] = full[slot.offset:slot.offset + slot.numel].view(slot.shape).clone()
        for _, slot in param_order:
            yield slot.name, gathered[slot.name]

    def writes_exports(self) -> bool:
        return self.rank == 0

    def grad_norm(self, store, schedule, param_order, unit_norms, norm_type: float,
                  taken: dict | None = None) -> torch.Tensor | None:
        """The global L2 norm from every rank's gradient slices (sum of squares, reduced over ranks)."""
        if norm_type != 2.0:
            raise ConfigError(f"sharded training clips by the L2 norm only (norm_type=2.0), got {norm_type}")
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        for unit in schedule.units:
            if taken and unit.name in taken:
                total += taken[unit.name]
            elif self.layout(unit).grad_key is not None:
                total += self._squares(store, unit)
        self.sharding.all_reduce(total, dist.ReduceOp.SUM, "the gradient norm")
        if not any(s.has_grad for _, s in param_order):
            return None
        return total.sqrt().float().reshape(())

    def norm_part(self, store, unit, unit_norms) -> tuple[object, float]:
        """This rank's sum of squares of ``unit``'s gradient slice (zero: it holds none)."""
        part = self._squares(store, unit)
        return part, float(part)

    def _squares(self, store, unit) -> torch.Tensor:
        key = self.layout(unit).grad_key
        if key is None:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        with store.hold(key) as g:
            return g.double().square().sum().to(self.device)
