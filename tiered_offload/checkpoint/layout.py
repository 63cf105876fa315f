"""What a storage directory's manifest says about the model: the one place that knows the on-disk
description of a training state besides :mod:`.durable` (files, records, the commit protocol).

* :func:`extent_name` / :func:`parse_extent`: a tensor's versioned extent, ``key@generation``,
  built and read in this one place (the store writes them, the session collects garbage by them,
  a resume reads generations from them, the offline tools list them).
* :class:`StateLayout`: the manifest's model-side content (units, parameters and where each lives
  in its unit's flat buffer, the optimizer and its groups, a rank's slice), checked against the
  model a resume builds, and the whole manifest of a committed step.

Changing the on-disk format means changing this file and ``durable.py`` (``FORMAT``).
"""

from __future__ import annotations

from typing import Callable, Sequence

from offload_core.errors import CheckpointError

from .durable import FORMAT, CommittedState

__all__ = ["extent_name", "parse_extent", "StateLayout"]

FP32_BYTES = 4


def extent_name(key: str, generation: int) -> str:
    """The extent that holds version ``generation`` of tensor ``key`` (durable, versioned writes)."""
    return f"{key}@{generation}"


def parse_extent(extent: str) -> tuple[str, int | None]:
    """``(key, generation)`` of a versioned extent name; ``(extent, None)`` for an unversioned one."""
    key, at, generation = extent.rpartition("@")
    if at and generation.isdigit():
        return key, int(generation)
    return extent, None


def generation_of(ref) -> int:
    """The generation of a manifest reference ``(extent, crc)`` (0: none, all zeros)."""
    if not ref:
        return 0
    return parse_extent(ref[0])[1] or 0


class StateLayout:
    """How a training state's tensors map to the model and the optimizer.

    Args:
        units: the model's units (their names, sizes and keys).
        param_order: ``(unit, slot)`` of every parameter, in ``model.named_parameters()`` order.
        optimizer: the optimizer's qualified class name.
        state_kinds: the optimizer's per-parameter state names (``exp_avg``...).
        group_count: how many parameter groups the optimizer has.
        placement: the engine's :class:`~tiered_offload.engine.sharding.Placement` (which keys this
            process stores of a unit: all of it, or its rank's slice).
    """

    def __init__(self, units: Sequence, param_order: Sequence, optimizer: str, state_kinds: Sequence[str],
                 group_count: int, placement):
        self.units = list(units)
        self.param_order = list(param_order)
        self.optimizer = optimizer
        self.state_kinds = tuple(state_kinds)
        self.group_count = group_count
        self.placement = placement

    # ---- the model side of the manifest ----------------------------------------------------------
    def describe(self) -> dict:
        """The manifest's ``units``, ``params``, ``optimizer`` (and ``sharding``) entries."""
        units = []
        for u in self.units:
            entry = {"name": u.name, "numel": u.numel}
            if u.grad_numel != u.numel or u.state_numel != u.numel:  # frozen or unoptimized parameters
                entry.update(grad_numel=u.grad_numel, state_numel=u.state_numel)
            if len(u.pieces()) > 1:
                entry["piece_numel"] = u.piece_numel
                if u.whole_pieces:  # pieces of whole parameters (a per-parameter optimizer)
                    entry["pieces"] = [b for _, b in u.whole_pieces]
            units.append(entry)
        optimizer = {"class": self.optimizer, "states": list(self.state_kinds)}
        members = self.group_members()
        if len(members) != 1 or len(members[0]) != len(self.param_order):
            optimizer["groups"] = members
        layout = {
            "units": units,
            "params": [{"name": s.name, "tensor": u.weight_key, "offset": s.offset, "shape": list(s.shape)}
                       for u, s in self.param_order],
            "optimizer": optimizer,
        }
        sharding = self.placement.manifest_entry()
        if sharding is not None:  # this directory holds one rank's slices
            layout["sharding"] = sharding
        return layout

    def group_members(self) -> list[list[str]]:
        """The parameter names of each optimizer group, in the optimizer's order."""
        return [[s.name for _, s in self.param_order if s.group == i] for i in range(self.group_count)]

    def check(self, manifest: dict, manifest_path) -> None:
        """Refuse a manifest written for another model, optimizer, grouping or rank, naming what differs."""
        mine = self.describe()
        if manifest.get("sharding") != mine.get("sharding"):
            theirs = manifest.get("sharding") or {"rank": 0, "world_size": 1}
            ours = mine.get("sharding") or {"rank": 0, "world_size": 1}
            raise CheckpointError(
                f"{manifest_path} holds rank {theirs['rank']} of {theirs['world_size']}'s slices, and this process is "
                f"rank {ours['rank']} of {ours['world_size']}; re-sharding is not supported. Resume with the same number "
                f"of ranks (then write the weights with export_safetensors() and start a new run from them with "
                f"init_from)")
        for what in ("units", "params", "optimizer"):
            if what == "optimizer":  # the same model: then the grouping, then the rest of the optimizer
                self._check_groups(manifest, mine, manifest_path)
            if manifest.get(what) != mine[what]:
                theirs = manifest.get(what) or []
                if isinstance(theirs, list):
                    diff = next((f"{a} != {b}" for a, b in zip(theirs, mine[what]) if a != b),
                                f"{len(theirs)} entries != {len(mine[what])}")
                else:
                    diff = f"{theirs} != {mine[what]}"
                raise CheckpointError(
                    f"{manifest_path} was written for another model or optimizer: its {what} differ (saved vs. this "
                    f"run: {diff}). Build the same model and optimizer, or use another directory")

    def _check_groups(self, manifest: dict, mine: dict, manifest_path) -> None:
        saved_groups = (manifest.get("optimizer") or {}).get("groups")
        if saved_groups != mine["optimizer"].get("groups"):
            everything = [[s.name for _, s in self.param_order]]
            theirs, ours = saved_groups or everything, mine["optimizer"].get("groups") or everything
            raise CheckpointError(
                f"{manifest_path} was trained with other optimizer parameter groups: {_group_difference(theirs, ours)}. "
                f"Build the optimizer's groups as before (or resume with Engine.resume(...) and no optimizer=, which "
                f"rebuilds them)")

    # ---- the whole manifest ------------------------------------------------------------------------
    def manifest(self, step: int, committed: dict, meta: dict, *, checksum: str, backend, model_config,
                 peft: dict | None = None) -> dict:
        """The manifest of the committed state after ``step``: every durable tensor's extent and
        checksum (``committed``: key -> ``(extent, crc)`` or None), the step's meta, the storage, the
        model's config and (a PEFT model) what makes its adapter (``checkpoint/adapter.py``)."""
        tensors = {}
        for unit in self.units:
            shapes = self.placement.shapes(unit, self.state_kinds)
            for key in self.placement.durable_keys(unit, self.state_kinds):
                ref = committed.get(key)
                tensors[key] = {"extent": ref and ref[0], "crc": ref and ref[1], "dtype": "float32",
                                "shape": [shapes[key]], "nbytes": shapes[key] * FP32_BYTES, "offset": 0}
        return {"format": FORMAT, "checksum": checksum, "step": step, "tensors": tensors, "meta": meta,
                "model_config": model_config, **({"peft": peft} if peft is not None else {}),
                "storage": {"backend": backend.name, "directories": [str(d) for d in backend.directories],
                            "stripe_bytes": backend.stripe_bytes,
                            **({"stripe_weights": backend.stripe_weights} if backend.stripe_weights else {})},
                **self.describe()}

    def describer(self, store, model_config, peft: dict | None = None) -> Callable[[int, dict, dict], dict]:
        """``fn(step, committed, meta) -> manifest`` for the commit protocol, over ``store``'s backend."""
        return lambda step, committed, meta: self.manifest(step, committed, meta, checksum=store.checksum,
                                                           backend=store.backend, model_config=model_config, peft=peft)

    # ---- adopting a committed state -------------------------------------------------------------------
    def keys(self) -> set[str]:
        """Every key this process stores (a resume collects garbage among their extents only)."""
        return {k for u in self.units for k in self.placement.shapes(u, self.state_kinds)}

    def durable_keys(self) -> dict[str, list[str]]:
        """Unit name -> the keys of its committed tensors this process stores (weights, states)."""
        return {u.name: self.placement.durable_keys(u, self.state_kinds) for u in self.units}

    def grad_keys(self) -> dict[str, str]:
        """Unit name -> the key of the gradient this process stores for it (units with one)."""
        return {u.name: k for u in self.units if (k := self.placement.grad_key(u))}

    def delete_stale_activations(self, backend) -> None:
        """Delete the saved activations a process that died left on disk (``block.3/activations[.N]``);
        call it only while this process holds the directory."""
        names = {u.key("activations") for u in self.units}
        for extent in backend.keys():
            base, _, n = extent.partition("/activations")
            if f"{base}/activations" in names and (not n or (n[0] == "." and n[1:].isdigit())):
                backend.delete(extent)

    def adopt(self, store, state: CommittedState) -> None:
        """Register every tensor of the committed state (and of the step in flight) without reading it."""
        tensors, grads = state.tensors(), state.grads()
        for unit in self.units:
            grad_key = self.placement.grad_key(unit)
            for key, numel in self.placement.shapes(unit, self.state_kinds).items():
                ref = grads.get(key) if key == grad_key else tensors.get(key)
                store.adopt(key, (numel,), extent=ref and ref[0], crc=ref and ref[1], generation=generation_of(ref))


def _group_difference(theirs: list[list[str]], ours: list[list[str]]) -> str:
    """The first way two groupings of parameter names differ, in words."""
    for i, (a, b) in enumerate(zip(theirs, ours)):
        if a != b:
            only_a = [n for n in a if n not in b]
            only_b = [n for n in b if n not in a]
            if only_a:
                return f"group {i} holds {only_a[0]!r} in the saved state but not now"
            if only_b:
                return f"group {i} holds {only_b[0]!r} now but not in the saved state"
            return f"group {i} lists its parameters in another order"
    return f"{len(theirs)} group(s) saved, {len(ours)} now"
