"""The weights a fresh training state starts from: read from safetensors (``init_from``),
initialised (a model built on the meta device or with ``empty_init``), or copied from the model,
one unit at a time, each written to its tier and the disk before the next is built."""

from __future__ import annotations

from tiered_offload.checkpoint.safetensors_io import PretrainedReader
from tiered_offload.engine.binding import ModelBinding
from tiered_offload.progress import track

__all__ = ["load_initial_weights"]


def load_initial_weights(store, binding: ModelBinding, placement, state_kinds, init_from=None) -> None:
    """Register every unit's buffers (this process's share of them) and fill its weights."""
    init = binding.initialiser() if binding.on_meta and init_from is None else None
    reader = None
    if init_from is not None:
        reader = PretrainedReader(init_from)
        reader.check_covers([(s.name, s.shape) for _, s in binding.param_order])
    try:
        what = "reading init_from" if reader is not None else "placing the initial weights"
        for unit in track(binding.units, desc=what, unit="unit"):
            placement.register(store, unit, state_kinds, lambda flat, unit=unit: _fill(binding, unit, flat, reader, init))
    finally:
        if reader is not None:
            reader.close()
    binding.release_parameters()  # the model no longer holds the weights: the store does


def _fill(binding: ModelBinding, unit, flat, reader, init) -> None:
    """The unit's initial weights into ``flat``: read, initialised (a meta model) or copied."""
    if reader is not None:
        for slot in unit.params:
            reader.read_into(slot.name, flat[slot.offset:slot.offset + slot.numel].view(slot.shape))
    elif binding.on_meta:
        binding.initialise_unit(unit, flat, init)
    else:
        for slot in unit.params:
            flat[slot.offset:slot.offset + slot.numel].copy_(slot.param.detach().reshape(-1))
