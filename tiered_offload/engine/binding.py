"""Split a model into streamed units: one per block of its block sequence, plus the rest.

A *unit* is what the engine moves through the tiers as one piece: a flat fp32 buffer per kind of
state (weights, gradients, each optimizer state) holding all of the unit's parameters back to
back. Blocks are the members of the model's block sequence (an ``nn.ModuleList`` or
``nn.Sequential``, found as the one holding the most parameters, or named by the user); the
``rest`` unit holds everything around them (embeddings, final norm, head, tied weights).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from offload_core.errors import ModelStructureError
from tiered_offload.engine.schedule import UnitLayout

__all__ = ["ParamSlot", "Unit", "find_block_sequence", "plan_units"]


@dataclass(eq=False)
class ParamSlot:
    """One parameter: where it lives inside its unit's flat buffers, and its training record."""

    name: str
    """Its name in ``model.named_parameters()`` (the first name, for tied weights)."""
    local_name: str
    """Its name relative to the unit's module (what ``functional_call`` needs), for blocks."""
    param: nn.Parameter
    numel: int
    shape: tuple[int, ...]
    offset: int = 0
    """Start in the unit's buffers (weights; gradients and states too, where it has them)."""
    requires_grad: bool = True
    """Trainable: it gets a gradient buffer. Frozen parameters are never modified."""
    group: int | None = None
    """Index of its optimizer parameter group; None: the optimizer does not update it."""
    has_grad: bool = False
    """A backward since the last ``zero_grad()`` gave it a gradient (PyTorch: ``.grad is not None``)."""
    updates: int = 0
    """Optimizer steps applied to it so far (its ``step`` count in Adam's state)."""

    @property
    def optimized(self) -> bool:
        return self.requires_grad and self.group is not None


@dataclass(kw_only=True, eq=False)
class Unit(UnitLayout):
    """A piece of the model streamed as one: a block, or the rest."""

    index: int | None = None
    """Position in the block sequence, None for the rest unit."""
    module: nn.Module | None = None
    """The block module (None for the rest unit, whose parameters stay in the model)."""
    params: list[ParamSlot] = field(default_factory=list)

    def add(self, name: str, local_name: str, param: nn.Parameter) -> None:
        self.params.append(ParamSlot(name, local_name, param, param.numel(), tuple(param.shape),
                                     requires_grad=param.requires_grad))

    def arrange(self, group_of: dict[int, int]) -> None:
        """Assign groups and lay the parameters out: optimized (by group), trainable, then frozen."""
        for s in self.params:
            s.group = group_of.get(id(s.param))
        rank = {id(s): i for i, s in enumerate(self.params)}

        def category(s: ParamSlot):
            if s.optimized:
                return (0, s.group, rank[id(s)])
            return (1 if s.requires_grad else 2, 0, rank[id(s)])
        self.params.sort(key=category)
        offset = 0
        for s in self.params:
            s.offset = offset
            offset += s.numel
        self.numel = offset
        self.grad_numel = sum(s.numel for s in self.params if s.requires_grad)
        self.state_numel = sum(s.numel for s in self.params if s.optimized)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{local_name: view}`` of each parameter inside the weight buffer ``flat``."""
        return {p.local_name: flat[p.offset:p.offset + p.numel].view(p.shape) for p in self.params}

    def trainable(self) -> list[ParamSlot]:
        """The parameters with a gradient buffer, in buffer order."""
        return [p for p in self.params if p.requires_grad]

    def grad_views(self, gflat: torch.Tensor) -> list[torch.Tensor]:
        """Views of each trainable parameter's gradient inside the gradient buffer ``gflat``."""
        return [gflat[p.offset:p.offset + p.numel].view(p.shape) for p in self.trainable()]


def find_block_sequence(model: nn.Module, hint: str | None = None) -> tuple[str, nn.Module]:
    """The dotted name and module of the model's block sequence.

    With ``hint`` (e.g. ``"transformer.h"``), that submodule; otherwise the ``ModuleList`` or
    ``Sequential`` of at least two children that holds the most parameters.
    """
    if hint is not None:
        try:
            seq = model.get_submodule(hint)
        except AttributeError:
            raise ModelStructureError(f"the model has no submodule {hint!r} to use as its block sequence; "
                                      f"pass blocks= with the dotted name of its nn.ModuleList of layers") from None
        if not isinstance(seq, (nn.ModuleList, nn.Sequential)):
            raise ModelStructureError(f"{hint!r} is a {type(seq).__name__}, not an nn.ModuleList or nn.Sequential")
        return hint, seq
    best, best_n = None, 0
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.Sequential)) and len(mod) >= 2 and mod is not model:
            n = sum(p.numel() for p in mod.parameters())
            if n > best_n:
                best, best_n = (name, mod), n
    if best is None:
        raise ModelStructureError(
            f"{type(model).__name__} has no block sequence (an nn.ModuleList or nn.Sequential of two or more "
            f"layers holding parameters); pass blocks='<dotted name>' to say which submodule holds the layers")
    return best


def plan_units(model: nn.Module, hint: str | None = None) -> tuple[str, list[Unit], Unit, list[tuple[Unit, ParamSlot]]]:
    """Units of ``model``: its blocks and the rest, and every parameter in ``model.parameters()`` order.

    Raises :class:`ModelStructureError` if a parameter is shared between a block and anything else.
    """
    seq_name, seq = find_block_sequence(model, hint)
    owner: dict[int, Unit] = {}
    blocks: list[Unit] = []
    for i, block in enumerate(seq):
        unit = Unit(name=f"block.{i}", is_block=True, index=i, module=block)
        for local, p in block.named_parameters():
            if id(p) in owner:
                raise ModelStructureError(f"parameter {seq_name}.{i}.{local} is shared with {owner[id(p)].name}; "
                                          f"weights shared between blocks cannot be streamed")
            owner[id(p)] = unit
            unit.add(f"{seq_name}.{i}.{local}", local, p)
        blocks.append(unit)
    rest = Unit(name="rest")
    order: list[tuple[Unit, ParamSlot]] = []
    block_slots = {id(s.param): (u, s) for u in blocks for s in u.params}
    for name, p in model.named_parameters():
        if id(p) in block_slots:
            order.append(block_slots[id(p)])
            continue
        rest.add(name, name, p)
        order.append((rest, rest.params[-1]))
    # a parameter tied between a block and the rest shows up only once in named_parameters();
    # make sure no rest parameter object is also a block parameter
    for name, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False, remove_duplicate=False):
            full = f"{name}.{pname}" if name else pname
            if id(p) in block_slots and not full.startswith(f"{seq_name}."):
                raise ModelStructureError(f"{full} is the same tensor as {block_slots[id(p)][1].name}: weights tied "
                                          f"between a block and the rest of the model cannot be streamed")
    return seq_name, blocks, rest, order
