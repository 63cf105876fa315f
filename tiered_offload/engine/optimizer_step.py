"""One unit's optimizer step on the store: the parameters that have a gradient, in stretches of
one parameter group and one step count, run through a fresh instance of the user's optimizer
class a chunk at a time, with the optimizer states streamed through memory one piece at a time.

An elementwise update (Adam, AdamW, SGD...) runs on slices of the flat buffers: exactly the numbers
a step over whole parameters gives, while the working set stays the unit's weights and gradients
plus one piece of each state. A per-parameter update (Adafactor, Muon) runs on each whole
parameter, with its real shape and its state tensors unpacked from the pieces (which hold whole
parameters for such an optimizer).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from offload_core.errors import TierCapacityError
from tiered_offload.engine.binding import Unit
from tiered_offload.engine.optim_spec import OptimizerSpec
from tiered_offload.engine.schedule import UnitLayout

__all__ = ["UnitUpdater", "update_runs"]


def update_runs(unit: Unit, step_counts: dict[int, int], scalars: dict[int, dict] | None = None) -> list[tuple]:
    """``(start, end, group, step count, scalars)`` of the unit's stretches a step updates:
    adjacent parameters in ``step_counts`` (``{id(slot): step count before}``) with the same group,
    count and scalar state before the step (``scalars``: ``{id(slot): {name: value}}``; in a run,
    sorted ``(name, value)`` pairs), merged."""
    runs: list[list] = []
    for s in unit.params:
        updates = step_counts.get(id(s))
        if updates is None:
            continue
        before = tuple(sorted((scalars or {}).get(id(s), {}).items()))
        if runs and runs[-1][1] == s.offset and runs[-1][2:] == [s.group, updates, before]:
            runs[-1][1] += s.numel
        else:
            runs.append([s.offset, s.offset + s.numel, s.group, updates, before])
    return [tuple(r) for r in runs]


class UnitUpdater:
    """Applies the optimizer to one unit at a time.

    Args:
        store: the tiered store holding the unit's buffers.
        spec: the optimizer (class, per-parameter state kinds, zero-initialised or not).
        chunk_numel: elements per optimizer call (bounds its temporaries).
        tier: the memory tier the update runs in (None: the compute tier; the host tier below a
            device tier: the update where its state lives, see ``EngineConfig.optimizer_device``).
        why: the reason for ``tier`` (:func:`~tiered_offload.engine.preflight.optimizer_tier`).
    """

    def __init__(self, store, spec: OptimizerSpec, chunk_numel: int, tier=None, why: str = ""):
        self.store = store
        self.spec = spec
        self.chunk_numel = chunk_numel
        self.tier = tier
        self.why = why
        """Why the update runs in :attr:`tier` (the plan prints it)."""
        self._disk_reads: dict[str, int] = {}
        """Per optimizer-state key, its disk reads (``TensorRecord.disk_reads``) right after this
        updater last rewrote it: where the count has not moved by the next update, the state
        stayed in memory from one update to the next."""
        self._stays: dict[str, int] = {}
        """Per optimizer-state key, how many updates in a row found it still in memory."""

    STAYS_TO_KEEP = 2
    """Updates in a row a state must have stayed in memory through before it is no longer
    written behind (one: the states at the edge of what memory holds flap, and each one kept
    and then evicted after all is written while a load waits for its room)."""

    def _count_stays(self, keys: list[str]) -> set[str]:
        """Count, for each of ``keys``, whether it stayed in memory since this updater last
        rewrote it (it was not read from the disk since); those that have stayed through the
        last :attr:`STAYS_TO_KEEP` updates."""
        for k in keys:
            stayed = self._disk_reads.get(k, -1) == self.store.record(k).disk_reads
            self._stays[k] = self._stays.get(k, 0) + 1 if stayed else 0
        return {k for k in keys if self._stays[k] >= self.STAYS_TO_KEEP}

    @property
    def in_lower_tier(self) -> bool:
        """Whether the update runs in the host tier below a device tier (ZeRO-Offload's arrangement)."""
        return self.tier is not None and self.tier != self.store.compute_tier

    def device_sequence(self, keys: list[str], stepping: list[UnitLayout]) -> None:
        """The device tier's own access order under an update in the host tier: the forward and
        backward, not cyclic (the step comes between the backward and the next forward). The
        weights and gradients of the units in ``stepping`` are about to be rewritten (zeroed):
        the device's lookahead leaves them alone until then (a copy fetched now would be stale)."""
        self.store.declare_access_sequence(keys, tier=self.store.compute_tier, cyclic=False)
        for u in stepping:
            self.due(u)

    def due(self, unit) -> None:
        """``unit``'s weights and gradients in the device tier are about to be rewritten (zeroed)
        by its update in the host tier: the device's lookahead leaves them alone until then, and
        its copies go as the update reads them (see :meth:`TieredStore.rewrite_due`)."""
        if unit.state_numel:
            self.store.rewrite_due(self._rewritten(unit), self.store.compute_tier)

    def _rewritten(self, unit) -> list[str]:
        """The keys of ``unit`` a step rewrites (weights) or zeroes (gradients), as this store holds them."""
        return [k for k in (unit.weight_key, unit.grad_key) if k and k in self.store]

    def update(self, unit: Unit, hypers: list[dict], scale: torch.Tensor | None, step_counts: dict[int, int], *,
               write_behind: bool, weights_behind: bool = True, keep_resident: bool = False, shard=None,
               scalars: dict | None = None) -> list:
        """Update ``unit``'s parameters in ``step_counts`` (``{id(slot): step count before}``); returns the futures of the write-backs started
        (``write_behind``: start writing each updated piece at once, and the weights too with
        ``weights_behind``, so that when their space is wanted they are clean and can be dropped
        without stalling a caller).
        ``keep_resident`` (nothing needs the states on the disk at each step: no journal): a
        state that stayed in memory through its last :attr:`STAYS_TO_KEEP` updates is not
        written behind. The memory tiers kept it from update to update, so they will likely keep
        it until the next one too, and a write now would be wasted. Where it is evicted after
        all, the eviction writes it (and it is written behind again until it stays twice more).
        ``shard``: this rank's :class:`~tiered_offload.engine.sharding.ShardLayout` of the unit
        (sharded training): only its slice is stored here, and only its slice is updated."""
        runs = update_runs(unit, step_counts, scalars)
        if shard is not None:
            runs, unit = shard.runs(runs), shard
        if not runs:
            if self.in_lower_tier:  # nothing to rewrite after all: the device may fetch it ahead again
                self.store.rewrite_due(self._rewritten(unit), None)
            return []
        with self.store.brief():  # its pins: another thread that finds no room waits for them
            return self._update_held(unit, runs, hypers, scale, step_counts, write_behind, weights_behind,
                                     keep_resident)

    def _update_held(self, unit, runs, hypers, scale, step_counts, write_behind, weights_behind, keep_resident) -> list:
        """:meth:`update` from the first pin to the last release."""
        store, kinds, tier = self.store, self.spec.kinds, self.tier
        track = write_behind and keep_resident  # count the states' stays only where they decide a write
        futures: list = []
        # prologue: the weights and gradients stay pinned for the whole unit
        w, g = store.get_group([unit.weight_key, unit.grad_key], tier)
        held = True
        try:
            # steady state: one piece of every state kind at a time; the store's lookahead (told this
            # order by the access sequence) brings piece i+1 in while piece i is computed, and piece
            # i-1 is being written behind
            for i, (a, b) in enumerate(unit.pieces()):
                if self.spec.per_parameter is not None:  # whole parameters, one at a time
                    mine = [s for s in unit.params if id(s) in step_counts and a <= s.offset < b]
                else:
                    mine = [(max(a, ra), min(b, rb), grp, n, sc) for ra, rb, grp, n, sc in runs if ra < b and rb > a]
                if not mine:
                    continue
                keys = unit.piece_keys(kinds, i)
                try:
                    states = store.get_group(keys, tier)
                except TierCapacityError:
                    # the pinned weights and gradients split the tier into holes too small for the
                    # pieces: let go of them too (the weights updated so far marked as such) and
                    # place the three together
                    if i:
                        store.mark_dirty(unit.weight_key, tier)
                    held = False
                    store.release(unit.grad_key, tier)
                    store.release(unit.weight_key, tier)
                    w, g, *states = store.get_group([unit.weight_key, unit.grad_key, *keys], tier)
                    held = True
                # (after the get: a load the lookahead started has landed, and is counted)
                kept = self._count_stays(keys) if track else set()
                behind = [k for k in keys if k not in kept] if write_behind else []
                try:
                    for m in mine:
                        if self.spec.per_parameter is not None:
                            self.apply_whole(w, g, [s_[m.offset - a:m.offset - a + m.numel] for s_ in states], m,
                                             hypers[m.group], scale, step_counts[id(m)])
                        else:  # (the slots already hold the scalars after: the step predicted them)
                            ra, rb, grp, n, sc = m
                            self.apply(w, g, [s_[ra - a:rb - a] for s_ in states], ra, rb, hypers[grp], scale, n,
                                       dict(sc))
                    for k in keys:
                        store.mark_dirty(k, tier)
                finally:
                    for k in keys:
                        if track:
                            self._disk_reads[k] = store.record(k).disk_reads
                        store.release(k, tier)
                futures += [store.write_back(k) for k in behind]
            # epilogue: the weights
            store.mark_dirty(unit.weight_key, tier)
        finally:
            if held:
                store.release(unit.grad_key, tier)
                store.release(unit.weight_key, tier)
        if write_behind and weights_behind:
            futures.append(store.write_back(unit.weight_key))
        return futures

    def apply(self, w: torch.Tensor, g: torch.Tensor, states: list[torch.Tensor], a: int, b: int,
              hyper: dict, scale: torch.Tensor | None, updates: int, scalars: dict | None = None) -> dict:
        """One optimizer step over elements ``a:b`` of a unit (``states`` already cut to them), a
        chunk at a time; ``updates``: the step count of these parameters before this step,
        ``scalars``: their scalar state before it. Returns the scalar state after it."""
        spec = self.spec
        first = updates == 0 and not spec.zero_init_states
        after = dict(scalars or {})
        for c in range(a, b, self.chunk_numel):
            d = min(b, c + self.chunk_numel)
            wc = w[c:d]
            opt = spec.cls([wc], **hyper)
            # clipping scales the gradient as it goes in (the gradient on disk stays what backward
            # made: a resumed step re-scales the same bytes)
            wc.grad = g[c:d] if scale is None else g[c:d] * scale.to(g.device)
            if not first:
                state: dict[str, Any] = {k: s_[c - a:d - a] for k, s_ in zip(spec.kinds, states)}
                if spec.has_step:
                    state["step"] = torch.tensor(float(updates))
                for k, dtype in spec.scalars.items():
                    state[k] = torch.tensor(scalars[k], dtype=dtype)
                opt.state[wc] = state
            with torch.no_grad():
                opt.step()
            if first:  # the optimizer created its state: keep it in the store
                for k, s_ in zip(spec.kinds, states):
                    s_[c - a:d - a].copy_(opt.state[wc][k])
            after = {k: float(opt.state[wc][k]) for k in spec.scalars}
            wc.grad = None
        return after

    def apply_whole(self, w: torch.Tensor, g: torch.Tensor, slots: list[torch.Tensor], param, hyper: dict,
                    scale: torch.Tensor | None, updates: int) -> None:
        """One optimizer step of the whole parameter ``param`` (a :class:`ParamSlot`) with its real
        shape; ``slots``: its stretch of each packed state buffer, holding its state tensors one
        after another (see :class:`~tiered_offload.engine.optim_spec.PackedState`)."""
        spec, a, b = self.spec, param.offset, param.offset + param.numel
        entries = spec.per_parameter.entries(param.shape)
        packed = slots[0] if len(slots) == 1 else torch.cat(slots)
        wv = w[a:b].view(param.shape)
        opt = spec.cls([wv], **hyper)
        wv.grad = (g[a:b] if scale is None else g[a:b] * scale.to(g.device)).view(param.shape)
        if updates:
            state: dict[str, Any] = {k: packed[i:i + math.prod(shape)].view(shape) for k, shape, i in entries}
            if spec.has_step:
                state["step"] = torch.tensor(float(updates))
            opt.state[wv] = state
        with torch.no_grad():
            opt.step()
        if not updates:  # the optimizer made the state: keep it in the store
            made = {k: v for k, v in opt.state[wv].items() if k != "step"}
            if {k: tuple(v.shape) for k, v in made.items()} != {k: shape for k, shape, _ in entries}:
                raise RuntimeError(f"{spec.cls.__name__} made state {[(k, list(v.shape)) for k, v in made.items()]} for "
                                   f"{param.name}, not the {entries} its probe at construction predicted")
            for k, shape, i in entries:
                packed[i:i + math.prod(shape)].copy_(made[k].reshape(-1))
        if len(slots) > 1:
            for k, s_ in enumerate(slots):
                s_.copy_(packed[k * param.numel:(k + 1) * param.numel])
        wv.grad = None
