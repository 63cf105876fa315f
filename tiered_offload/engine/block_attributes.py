"""What a block's forward changes besides its parameters and buffers, which a recompute must see
as the forward did and leave as the forward left it.

* **Plain attributes**: numbers and flags (a call counter, a schedule kept as an int) and the
  contents of the block's lists, dicts, sets and deques (a history it appends to, a count per
  key, a hand-written key/value cache). Before a recomputed block's forward they are
  snapshotted (:func:`snapshot_attributes`); what the forward changed (:func:`changed_attributes`)
  is put back for the recompute and, after it, set again as the forward (and anything since)
  left it (:func:`replay_attributes`). Containers are restored in place, so a reference the
  user holds to one stays the same object; the copy is shallow (a list inside a list is one
  entry).
* **Tensors set as attributes** that require a gradient (a layer's aux loss, which the loop adds
  after the forward): found by :func:`tensor_attributes` before and :func:`set_tensors` after,
  they become outputs of the block's node
  (:mod:`~tiered_offload.engine.recorded_outputs`).
* **Modes** (``train()`` / ``eval()``): a recompute runs in the modes its forward ran in
  (:func:`replay_modes`), whatever the loop switched to before the backward: PyTorch's backward
  uses what the forward saved (the dropout masks it drew, or none).
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any, Iterator

import torch
from torch import nn

__all__ = ["snapshot_attributes", "changed_attributes", "replay_attributes", "restore_attributes", "modes_of",
           "replay_modes", "tensor_attributes", "set_tensors"]

_SCALARS = (int, float, bool)
_CONTAINERS = (list, dict, set, collections.deque)
_MODULE_OWN = frozenset(vars(nn.Module()))
"""The attributes every ``nn.Module`` keeps for itself (``_parameters``, ``_forward_hooks``...):
not the block's state."""


class _Contents:
    """A container attribute as a forward found it: the object and a shallow copy of its entries."""

    __slots__ = ("obj", "entries")

    def __init__(self, obj):
        self.obj = obj
        self.entries = _entries(obj)

    def same(self, now) -> bool:
        """Whether ``now`` is this object, holding the same entries (the same objects, in order; an
        equal one that is another object counts as a change, whose replay puts back the same value)."""
        if now is not self.obj:
            return False
        entries = _entries(now)
        return len(entries) == len(self.entries) and all(
            a[0] is b[0] and a[1] is b[1] if isinstance(now, dict) else a is b for a, b in zip(entries, self.entries))

    def put(self, entries: list) -> None:
        """Make the object hold ``entries`` (in place)."""
        obj = self.obj
        obj.clear()
        if isinstance(obj, (dict, set)):
            obj.update(entries)
        else:
            obj.extend(entries)


def _entries(obj) -> list:
    return list(obj.items()) if isinstance(obj, dict) else list(obj)


def _plain(mod: nn.Module) -> Iterator[tuple[str, Any]]:
    return ((name, v) for name, v in vars(mod).items() if name not in _MODULE_OWN or name == "training")


def snapshot_attributes(module: nn.Module | None, outside=()) -> list[tuple[nn.Module, str, Any]]:
    """The block's plain attributes before its forward (``module``'s, None: none; and those of the
    modules ``outside`` it, which a module it is given may change): numbers and flags as they are,
    containers as :class:`_Contents` (see :func:`replay_attributes`)."""
    out = []
    for mod in [*(module.modules() if module is not None else ()), *outside]:
        for name, value in _plain(mod):
            if type(value) in _SCALARS:
                out.append((mod, name, value))
            elif isinstance(value, _CONTAINERS):
                out.append((mod, name, _Contents(value)))
    return out


def changed_attributes(snapshot) -> list[tuple[nn.Module, str, Any]]:
    """Of a snapshot, the attributes the forward changed (rebound, or a container's entries), with
    their old values."""
    out = []
    for mod, name, old in snapshot:
        now = mod.__dict__.get(name, old)
        if isinstance(old, _Contents):
            if not old.same(now):
                out.append((mod, name, old))
        elif now is not old and now != old:
            out.append((mod, name, old))
    return out


@contextlib.contextmanager
def replay_attributes(changed) -> Iterator[None]:
    """A recompute: the attributes its forward changed are as they were before it; afterwards as
    the forward (and whatever ran since) left them: the recompute's own changes are discarded, as
    its buffers' are."""
    now = [(mod, name, mod.__dict__.get(name), _Contents(old.obj) if isinstance(old, _Contents) else None)
           for mod, name, old in changed]
    try:
        for mod, name, old in changed:
            if isinstance(old, _Contents):
                old.put(old.entries)
                old = old.obj
            mod.__dict__[name] = old
        yield
    finally:
        for mod, name, value, contents in now:
            if contents is not None:
                contents.put(contents.entries)
            mod.__dict__[name] = value


def restore_attributes(changed) -> None:
    """Put back what :func:`changed_attributes` found changed, for good (a forward undone)."""
    for mod, name, old in changed:
        if isinstance(old, _Contents):
            old.put(old.entries)
            old = old.obj
        mod.__dict__[name] = old


def modes_of(snapshot) -> list[tuple[nn.Module, bool]]:
    """Of a snapshot taken before a forward, each module's mode then (``training``)."""
    return [(mod, value) for mod, name, value in snapshot if name == "training"]


@contextlib.contextmanager
def replay_modes(modes: list[tuple[nn.Module, bool]]) -> Iterator[None]:
    """A recompute in the modes of its forward (:func:`modes_of`); afterwards the modes as they are now."""
    now = [mod.training for mod, _ in modes]
    try:
        for mod, training in modes:
            mod.training = training
        yield
    finally:
        for (mod, _), training in zip(modes, now):
            mod.training = training


def tensor_attributes(module: nn.Module) -> dict[tuple[int, str], int]:
    """The ids of the tensors the block's modules hold as plain attributes (not parameters or
    buffers) before its forward (see :func:`set_tensors`)."""
    return {(id(mod), name): id(v) for mod in module.modules() for name, v in vars(mod).items()
            if isinstance(v, torch.Tensor)}


def set_tensors(module: nn.Module, before: dict) -> list[tuple[tuple[nn.Module, str], torch.Tensor]]:
    """The tensors requiring a gradient the forward set as attributes since ``before`` (a loss term
    a layer keeps for the loop to add): ``((module, name), tensor)``, which the block's node
    returns as outputs of its own (:mod:`~tiered_offload.engine.recorded_outputs`)."""
    return [((mod, name), v) for mod in module.modules() for name, v in vars(mod).items()
            if isinstance(v, torch.Tensor) and v.requires_grad and before.get((id(mod), name)) != id(v)]
