"""A unit's full buffers while forward or backward uses it: the store's own, or, sharded, gathered
from the ranks' slices into scratch tensors of the store.

Unsharded, :meth:`FullBuffers.acquire` pins the unit's weight (and gradient) buffers in the
compute tier and :meth:`~FullBuffers.release` unpins them. Sharded, the first user all-gathers
the weights into a full scratch buffer (and registers a zeroed full gradient buffer that backward
adds into and :meth:`BlockStreamer.gradients_done` reduce-scatters into the stored slice of the
gradients, pinned with it so the reduce never waits for room); later users while it is in
use share them; the last one frees them. A gather can start ahead of its block
(:meth:`~FullBuffers.gather_ahead`), asynchronously, and its acquire waits for it.

In ``forward_backward`` (:meth:`~FullBuffers.hold_for_pass`) every micro-batch runs a block in
turn: the pass holds the block's gathered buffers from the first micro-batch's acquire to the last
one's release, so its weights are gathered once per pass (forward, backward) for all of them, as
the unsharded store keeps them cached. The gradient buffer is shared too: each micro-batch's
backward of the block reduces and zeroes it before the next one's adds into it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from offload_core.errors import TierCapacityError
from tiered_offload.engine.binding import ModelBinding, Unit
from tiered_offload.engine.pipeline import UpdatePipeline

__all__ = ["FullBuffers"]


@dataclass
class _Gathered:
    """Sharded: a unit's full buffers while it is in use (scratch tensors of the store)."""

    weights: torch.Tensor
    """All-gathered from the ranks' slices."""
    grads: torch.Tensor | None
    """The full gradient buffer backward adds into (reduce-scattered when the unit is done)."""
    users: int
    """Forwards, backwards, a gather ahead and a pass holding them (freed at zero)."""
    grad_slice: torch.Tensor | None = None
    """This rank's stored slice of the gradients, pinned with ``grads`` (the reduce adds into it)."""


class FullBuffers:
    """The units' full buffers in use (see the module's docstring).

    Args:
        store: the engine's store.
        binding: the model's units.
        pipeline: the optimizer step in flight (a slice is gathered as the step left it).
        device: the compute device (the ranks' agreement flags live there).
    """

    def __init__(self, store, binding: ModelBinding, pipeline: UpdatePipeline, device: torch.device):
        self.store, self.binding, self.pipeline, self.device = store, binding, pipeline, device
        self.sharding = None
        """A :class:`~tiered_offload.engine.sharding.Sharding` when the state is sharded (the engine sets it)."""
        self._full: dict[str, _Gathered] = {}
        """Sharded: per unit in use, its gathered weights and full gradient buffer."""
        self._ahead: dict[str, tuple] = {}  # unit name -> (collective in flight, its slice's key)
        self.gathered_ahead = 0
        """All-gathers started ahead of their block (counted for tests and benchmarks)."""
        self.turns = None
        """In ``forward_backward``, sharded: the micro-batches' turns; the pass holds each block's
        gathered buffers from the first micro-batch's acquire to the last one's release."""
        self._held_for_pass: dict[str, tuple[Unit, bool]] = {}
        """Unit name -> the unit, and whether the pass holds its gradient buffer too."""

    def grads(self, unit: Unit) -> torch.Tensor | None:
        """Sharded, while ``unit`` is in use: its full gradient buffer."""
        return self._full[unit.name].grads

    def grad_slices(self) -> dict[str, torch.Tensor]:
        """Sharded: the stored gradient slices pinned now, by unit name (``zero_grad`` between a
        forward and its backward zeroes them in place)."""
        return {name: e.grad_slice for name, e in self._full.items() if e.grads is not None and e.grad_slice is not None}

    def gather_ahead(self, unit: Unit) -> None:
        """Start the all-gather of ``unit``'s weights now (asynchronously): its :meth:`acquire`
        waits for it instead of gathering. Every rank does this at the same point of the forward,
        so the collectives stay in step."""
        if unit.name in self._full or unit.name in self._ahead:
            return
        self.pipeline.wait(unit.name)  # its slice as the step in flight left it
        sharding, slice_layout = self.sharding, self.sharding.layout(unit)
        wkey = unit.key("weight.full")
        self.store.register(wkey, (slice_layout.size * sharding.world,), scratch=True)
        try:
            shard, full = self.store.get_group([unit.weight_key, wkey])
            placed = True
        except TierCapacityError:  # no room beside what this block pins: gather it when it is needed
            placed = False
        except BaseException:
            self._forget_full(unit)
            raise
        # every rank gathers ahead, or none does (the room differs between ranks)
        flag = torch.tensor([int(placed)], dtype=torch.uint8, device=self.device)
        try:
            sharding.all_reduce(flag, torch.distributed.ReduceOp.MIN, f"room to gather {unit.name}'s weights ahead")
        except BaseException:
            if placed:
                self.store.release(unit.weight_key)
                self.store.release(wkey)
            self._forget_full(unit)
            raise
        if not bool(flag):
            if placed:
                self.store.release(unit.weight_key)
                self.store.release(wkey)
            self._forget_full(unit)
            return
        work = sharding.gather(full, shard, f"{unit.name}'s weights (ahead)", wait=False)
        self._full[unit.name] = _Gathered(full, None, 1)  # the gather ahead is a user until its acquire takes over
        self._ahead[unit.name] = (work, unit.weight_key)
        self.gathered_ahead += 1

    def _finish_ahead(self, unit: Unit) -> None:
        """Wait for the all-gather started ahead of ``unit`` and hand its buffer to the caller."""
        work, shard_key = self._ahead.pop(unit.name)
        try:
            self.sharding.wait(work, f"all-gather of {unit.name}'s weights (ahead)")
            self.store.mark_dirty(unit.key("weight.full"))
        finally:
            self.store.release(shard_key)

    def drain_ahead(self) -> None:
        """Finish and drop gathers started ahead that no block used (a forward that stopped early)."""
        for name in list(self._ahead):
            unit = next(u for u in self.binding.blocks if u.name == name)
            self._finish_ahead(unit)
            self.release(unit, grad=False)

    def acquire(self, unit: Unit, *, grad: bool, extra: list[str] = (), apart: list | None = None) -> tuple:
        """``(weights, gradients or None, [extra tensors])``, pinned together: the unit's full
        buffers. Sharded, the weights are all-gathered into a scratch buffer and the gradients are
        a zeroed scratch buffer that ``BlockStreamer.gradients_done`` reduce-scatters; release with
        :meth:`release` (same ``grad`` and ``extra``). Where the tier has no hole for the extras
        beside the buffers, they are read into buffers of their own instead, not pinned, and their
        keys added to ``apart`` (then release without them)."""
        gk = unit.grad_key if grad else None
        if self.sharding is None:
            got = self._pin([unit.weight_key, *([gk] if gk else [])], extra, apart)
            return got[0], (got[1] if gk else None), got[1 + bool(gk):]
        sharding, slice_layout = self.sharding, self.sharding.layout(unit)
        wkey, gkey, n = unit.key("weight.full"), unit.key("grad.full"), slice_layout.size * sharding.world
        ahead = unit.name in self._ahead
        if ahead:
            self._finish_ahead(unit)
        entry = self._full.get(unit.name)
        if entry is not None:  # a second user of the same unit (two graphs alive): share the buffers
            new_grad = gk and entry.grads is None
            if new_grad:
                self.store.register(gkey, (slice_layout.grad_buffer_numel,), scratch=True)  # zeros
            gkeys = self._grad_keys(unit) if gk else []
            got = self._pin([wkey, *gkeys], extra, apart)
            entry.users += 1
            if new_grad:
                entry.grads = got[1]
            if len(gkeys) == 2:
                entry.grad_slice = got[2]
            full, gfull, extras = entry.weights, entry.grads, got[1 + len(gkeys):]
        else:
            # the slice, the full weights and (zeroed) gradients, the gradients' slice and the
            # extras, placed as one group
            self.store.register(wkey, (n,), scratch=True)
            if gk:
                self.store.register(gkey, (slice_layout.grad_buffer_numel,), scratch=True)
            gkeys = self._grad_keys(unit) if gk else []
            try:
                got = self._pin([unit.weight_key, wkey, *gkeys], extra, apart)
            except BaseException:
                self._forget_full(unit)
                raise
            shard, full = got[0], got[1]
            gfull, extras = (got[2] if gk else None), got[2 + len(gkeys):]
            try:
                sharding.gather(full, shard, f"{unit.name}'s weights")
                self.store.mark_dirty(wkey)
            except BaseException:
                for key in [wkey, *gkeys, *(k for k in extra if k not in (apart or ()))]:
                    self.store.release(key)
                self._forget_full(unit)
                raise
            finally:
                self.store.release(unit.weight_key)
            self._full[unit.name] = _Gathered(full, gfull, 1, got[3] if len(gkeys) == 2 else None)
        self._hold(unit, bool(gk))
        if ahead:  # the gather ahead hands its use over to this caller
            self.release(unit, grad=False, handover=True)
        return full[:unit.numel], (gfull[:unit.grad_numel] if gk else None), extras

    def add_grads(self, unit: Unit) -> torch.Tensor:
        """One process: the gradient buffer of a unit acquired without it, pinned now (release the
        unit with ``grad=True``)."""
        assert self.sharding is None
        return self.store.get_group([unit.grad_key])[0]

    def _pin(self, keys: list[str], extra: list[str], apart: list | None) -> list:
        """``keys`` and ``extra`` pinned as one group. Where what is pinned splits the tier's free
        room into holes too small for the extras beside the buffers (and ``apart`` is given): the
        extras read into buffers of their own first (while the buffers are not pinned yet, so
        their reads have the most room), their keys added to ``apart``, then the buffers pinned
        alone. No collective depends on it: a rank that falls back stays in step with the others."""
        try:
            return self.store.get_group([*keys, *extra])
        except TierCapacityError:
            if not extra or apart is None:
                raise
            copies = [self.store.read(k).to(self.device) for k in extra]  # one block's: the fixed overhead
            apart.extend(extra)
            return [*self.store.get_group(keys), *copies]

    def release(self, unit: Unit, *, grad: bool, extra: list[str] = (), handover: bool = False) -> None:
        """Unpin what :meth:`acquire` pinned (same ``grad`` and ``extra``); sharded, the last user
        frees the full buffers. ``handover``: a gather ahead handing its use to an acquire."""
        gk = unit.grad_key if grad else None
        if self.sharding is None:
            for key in [*([gk] if gk else []), unit.weight_key, *extra]:
                self.store.release(key)
            return
        for key in extra:
            self.store.release(key)
        entry = self._full[unit.name]
        entry.users -= 1
        for key in [unit.key("weight.full"), *(self._grad_keys(unit) if entry.grads is not None and gk else [])]:
            self.store.release(key)
        if entry.users == 0:
            del self._full[unit.name]
            self._forget_full(unit)
        if not handover:
            self._let_go(unit)

    def _grad_keys(self, unit: Unit) -> list[str]:
        """Sharded: the full gradient buffer and this rank's stored slice of the gradients (if it
        has one), pinned together: the reduce at the end of the unit's backward adds into the slice
        without finding room for it then (what the backward pinned since, a gather ahead of the
        next block among them, could have taken or split that room)."""
        grad_slice = self.sharding.layout(unit).grad_key
        return [unit.key("grad.full"), *([grad_slice] if grad_slice else [])]

    def _forget_full(self, unit: Unit) -> None:
        for key in (unit.key("weight.full"), unit.key("grad.full")):
            if key in self.store:
                self.store.unregister(key)

    # ---- forward_backward: one gather per pass -------------------------------------------------
    def hold_for_pass(self, turns) -> None:
        """Sharded, a ``forward_backward`` pass begins (``turns``: its micro-batches' turns)."""
        self.turns = turns if self.sharding is not None else None

    def end_pass(self) -> None:
        """The pass is over: what it still holds is released (a block some micro-batch stopped in)."""
        self.turns = None
        while self._held_for_pass:
            unit, grad = self._held_for_pass.popitem()[1]
            self.release(unit, grad=grad)

    def _hold(self, unit: Unit, grad: bool) -> None:
        """The first micro-batch acquired ``unit`` in this pass: the pass holds it too."""
        if self.turns is None or unit.name in self._held_for_pass or unit is self.binding.rest:
            return
        entry = self._full[unit.name]
        keys = [unit.key("weight.full"), *(self._grad_keys(unit) if grad and entry.grads is not None else [])]
        self.store.get_group(keys)  # pinned once more, for the pass
        entry.users += 1
        self._held_for_pass[unit.name] = (unit, grad and entry.grads is not None)

    def _let_go(self, unit: Unit) -> None:
        """The last micro-batch of the turn released ``unit``: so does the pass."""
        if self.turns is None or unit.name not in self._held_for_pass or not self.turns.is_last():
            return
        self.release(unit, grad=self._held_for_pass.pop(unit.name)[1])
